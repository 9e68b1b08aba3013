"""GET /metrics: the stats snapshot in Prometheus' text format (version 0.0.4)."""
from __future__ import annotations

import os


def process_memory(device: str) -> dict:
    """Bytes of RAM (resident set) and VRAM (allocated by torch) this process uses now."""
    out = {"ram_bytes": 0, "vram_bytes": 0, "vram_reserved_bytes": 0}
    try:
        with open("/proc/self/statm") as f:
            out["ram_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        out["ram_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device.startswith("cuda"):
        import torch
        out["vram_bytes"] = int(torch.cuda.memory_allocated())
        out["vram_reserved_bytes"] = int(torch.cuda.memory_reserved())
    return out


HELP = {
    "experts": "experts resident in the tier",
    "slots": "expert slots of the tier",
    "hits": "expert uses served from the tier",
    "bytes": "bytes the tier holds",
    "budget": "byte budget of the tier",
    "bytes_read": "bytes read from the tier by expert computations",
    "bytes_copied": "bytes copied into the tier",
    "reads": "reads from the tier",
    "ms": "milliseconds of expert compute in the tier",
}


class Writer:
    def __init__(self):
        self.lines: list[str] = []
        self.declared: set[str] = set()

    def add(self, name: str, value, help: str, kind: str = "gauge", labels: dict | None = None) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            return                      # only numbers (no NaN) become samples
        name = "moetier_" + name
        if name not in self.declared:
            self.declared.add(name)
            self.lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
        lab = "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}" if labels else ""
        self.lines.append(f"{name}{lab} {value}")


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(snap: dict) -> str:
    w = Writer()
    t, last = snap["totals"], snap.get("last") or {}
    w.add("requests_total", t["requests"], "generations finished (any finish reason)", "counter")
    w.add("requests_cancelled_total", t["cancelled"], "generations stopped because the client left", "counter")
    w.add("prompt_tokens_total", t["prompt_tokens"], "prompt tokens received", "counter")
    w.add("cached_tokens_total", t["cached_tokens"], "prompt tokens served from a reused KV cache", "counter")
    w.add("generated_tokens_total", t["generated_tokens"], "tokens generated", "counter")
    w.add("decode_seconds_total", round(t["decode_s"], 6), "seconds spent decoding", "counter")
    w.add("prefill_seconds_total", round(t["prefill_s"], 6), "seconds spent in prefill", "counter")
    avg = t["generated_tokens"] / t["decode_s"] if t["decode_s"] > 0 else 0.0
    w.add("decode_tokens_per_second_avg", round(avg, 3), "generated tokens over decode seconds, all requests")
    w.add("decode_tokens_per_second", last.get("decode_tok_s", 0.0), "decode speed of the last request")
    w.add("prefill_tokens_per_second", last.get("prefill_tok_s", 0.0), "prefill speed of the last request")
    w.add("ttft_seconds", last.get("ttft_s", 0.0), "time to first token of the last request")
    q = snap["queue"]
    w.add("queue_waiting", q["waiting"], "requests waiting for the engine")
    w.add("queue_running", int(q["running"]), "requests running (0 or 1)")
    w.add("queue_size", q["queue_size"], "waiting requests allowed before 429")
    s = snap["sessions"]
    w.add("sessions", s["count"], "KV-cache sessions kept for prefix reuse")
    w.add("session_cache_bytes", s["bytes"], "bytes of KV cache held by those sessions")
    p = snap["process"]
    w.add("ram_bytes_in_use", p["ram_bytes"], "resident memory of the server process")
    w.add("vram_bytes_in_use", p["vram_bytes"], "GPU memory allocated by torch")
    w.add("vram_bytes_reserved", p["vram_reserved_bytes"], "GPU memory reserved by torch's allocator")
    mem = snap.get("memory") or {}
    for tier, vals in (mem.get("tiers") or {}).items():
        for k, v in (vals or {}).items():
            w.add(f"tier_{_name(k)}", v, HELP.get(k, f"{k} per memory tier"), labels={"tier": tier})
    w.add("expert_hit_rate", mem.get("hit_rate"), "share of expert uses served from the fast tier")
    for layer in mem.get("layers") or []:
        w.add("layer_hit_rate", layer.get("hit_rate"), "fast-tier hit rate per MoE layer",
              labels={"layer": layer.get("layer", "?")})
    return "\n".join(w.lines) + "\n"


def _name(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in str(key)).lower()
