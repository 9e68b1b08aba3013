"""Free memory of the machine, for `auto` budgets, and byte formatting."""
from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20


def fmt_bytes(n: float | int | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def ram_info() -> tuple[int, int]:
    """(available, total) bytes of system RAM: psutil if installed, else /proc/meminfo."""
    try:
        import psutil
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:
        pass
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                fields[k] = int(v.split()[0]) * 1024
    except OSError:
        return 0, 0
    total = fields.get("MemTotal", 0)
    return fields.get("MemAvailable", fields.get("MemFree", 0)), total


def gpu_info(device: str = "cuda") -> tuple[int, int]:
    """(free, total) bytes of the CUDA device (0, 0 without CUDA)."""
    import torch
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return 0, 0
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def default_gpu_reserve(total: int) -> int:
    """VRAM left free under --gpu-mem auto: max(1 GiB, 5%) (LESSONS.md: a reserve under 1 GB was slower,
    and a card filled to the byte collapsed)."""
    return max(GiB, total // 20)


def default_ram_reserve(total: int) -> int:
    """RAM left to the OS and the rest of the process under --ram-mem auto: max(2 GiB, 10%)."""
    return max(2 * GiB, total // 10)


def rss_bytes() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process from /proc/self/status (0, 0 if unavailable)."""
    cur = peak = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    cur = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
    except OSError:
        pass
    return cur, peak
