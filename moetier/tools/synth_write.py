"""Streaming writers: sharded safetensors and GGUF v3, one tensor (and one row chunk) at a time, so
a checkpoint far larger than RAM can be written. No gguf-py needed (the GPU machine may lack it);
the tests read the files back with gguf-py's GGUFReader.
"""
from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path
from collections.abc import Callable, Iterable

import numpy as np
import torch

from . import synth_quant as q
from .synth_shapes import Spec

# chunks(spec) -> float32 tensors of consecutive dim-0 rows of the tensor, on any device
Chunks = Callable[[Spec], Iterable[torch.Tensor]]


class Progress:
    """tqdm on a terminal; elsewhere (CI, the device runner) a line every ~10%."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.done, self.t0, self.next_pct = total, desc, 0, time.time(), 10
        self.bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and self.total and self.done * 100 >= self.next_pct * self.total:
            dt = max(1e-9, time.time() - self.t0)
            print(f"{self.desc}: {self.done * 100 // self.total}% ({self.done / 2**30:.1f} GiB, "
                  f"{self.done / dt / 2**30:.2f} GiB/s)", file=sys.stderr, flush=True)
            self.next_pct = self.done * 100 // self.total // 10 * 10 + 10

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _write(f, t: torch.Tensor) -> int:
    a = t.contiguous().cpu().view(torch.uint8).numpy()
    f.write(memoryview(a).cast("B"))
    return a.size


# ---------------------------------------------------------------- safetensors
def st_dtype(spec: Spec) -> tuple[str, torch.dtype]:
    return ("F32", torch.float32) if spec.f32 else ("BF16", torch.bfloat16)


def st_nbytes(spec: Spec) -> int:
    return int(np.prod(spec.shape)) * st_dtype(spec)[1].itemsize


def plan_shards(specs: list[Spec], shard_bytes: int) -> list[list[Spec]]:
    shards, cur, size = [], [], 0
    for s in specs:
        n = st_nbytes(s)
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += n
    return shards + [cur] if cur else shards


def write_safetensors(out: Path, specs: list[Spec], chunks: Chunks, shard_bytes: int, progress: Progress) -> list[Path]:
    """model-0000i-of-0000N.safetensors + model.safetensors.index.json, tensors in `specs` order."""
    shards = plan_shards(specs, shard_bytes)
    weight_map, files = {}, []
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for s in shard:
            n = st_nbytes(s)
            header[s.name] = {"dtype": st_dtype(s)[0], "shape": list(s.shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[s.name] = fname
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for s in shard:
                dt = st_dtype(s)[1]
                written = sum(_write(f, c.to(dt)) for c in chunks(s))
                assert written == st_nbytes(s), f"{s.name}: wrote {written} bytes, expected {st_nbytes(s)}"
                progress.update(written)
        files.append(out / fname)
    total = sum(st_nbytes(s) for s in specs)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return files


# ---------------------------------------------------------------- GGUF
GGUF_MAGIC, GGUF_VERSION, ALIGN = b"GGUF", 3, 32
UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64 = 4, 5, 6, 7, 8, 9, 10


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v) -> tuple[int, bytes]:
    if isinstance(v, bool):
        return BOOL, struct.pack("<?", v)
    if isinstance(v, int):
        if v < 0:
            return INT32, struct.pack("<i", v)
        return (UINT32, struct.pack("<I", v)) if v < 2 ** 32 else (UINT64, struct.pack("<Q", v))
    if isinstance(v, float):
        return FLOAT32, struct.pack("<f", v)
    if isinstance(v, str):
        return STRING, _str(v)
    if isinstance(v, (list, tuple)):
        if v and isinstance(v[0], str):
            return ARRAY, struct.pack("<IQ", STRING, len(v)) + b"".join(_str(x) for x in v)
        if v and isinstance(v[0], float):
            return ARRAY, struct.pack("<IQ", FLOAT32, len(v)) + np.asarray(v, "<f4").tobytes()
        return ARRAY, struct.pack("<IQ", INT32, len(v)) + np.asarray(v, "<i4").tobytes()
    raise TypeError(f"cannot store {type(v).__name__} in GGUF metadata")


def gguf_type(spec: Spec, quant: int) -> int:
    """llama.cpp's choice: 1-D tensors and routers stay F32, the rest take `quant` (or a fallback
    when a row is not a whole number of its blocks)."""
    if len(spec.shape) == 1 or "ffn_gate_inp" in spec.name:
        return q.F32
    return q.pick_type(quant, spec.shape[-1])


def write_gguf(path: Path, metadata: dict, specs: list[Spec], types: dict[str, int], chunks: Chunks,
               progress: Progress) -> dict[str, tuple[int, int, tuple]]:
    """-> {name: (absolute data offset, ggml type, torch shape)} of what was written."""
    infos, off = [], 0
    for s in specs:
        n = q.nbytes(types[s.name], s.shape)
        infos.append((s, off, n))
        off += n + (-n % ALIGN)
    head = GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(specs), len(metadata) + 1)
    kv = [_str("general.alignment") + struct.pack("<II", UINT32, ALIGN)]
    for key, v in metadata.items():
        t, b = _value(v)
        kv.append(_str(key) + struct.pack("<I", t) + b)
    ti = [_str(s.name) + struct.pack("<I", len(s.shape)) + struct.pack(f"<{len(s.shape)}Q", *reversed(s.shape))
          + struct.pack("<IQ", types[s.name], o) for s, o, _ in infos]
    blob = head + b"".join(kv) + b"".join(ti)
    blob += b"\0" * (-len(blob) % ALIGN)
    base = len(blob)
    table = {}
    with open(path, "wb") as f:
        f.write(blob)
        for s, o, n in infos:
            assert f.tell() == base + o
            qt, cols = types[s.name], s.shape[-1]
            written = sum(_write(f, q.quantize(c.reshape(-1, cols), qt)) for c in chunks(s))
            assert written == n, f"{s.name}: wrote {written} bytes, expected {n}"
            f.write(b"\0" * (-n % ALIGN))
            progress.update(n)
            table[s.name] = (base + o, qt, tuple(s.shape))
    return table


class GGUFRows:
    """Reads back tensors this module wrote (rows or whole), dequantized to float32."""

    def __init__(self, path: Path, table: dict):
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.table = table

    def _raw(self, name: str) -> tuple[np.ndarray, int, tuple]:
        off, qt, shape = self.table[name]
        rows = shape[0] if len(shape) > 1 else 1
        n = q.nbytes(qt, shape)
        return self.mm[off:off + n].reshape(rows, n // rows), qt, shape

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        raw, qt, shape = self._raw(name)
        sel = torch.from_numpy(np.array(raw[ids.numpy()]))
        return q.dequantize(sel, qt, (len(ids), *shape[1:]))

    def full(self, name: str) -> torch.Tensor:
        raw, qt, shape = self._raw(name)
        return q.dequantize(torch.from_numpy(np.array(raw)), qt, shape)
