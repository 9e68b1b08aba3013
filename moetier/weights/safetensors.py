"""Lazy, mmap-backed reading of (sharded) safetensors checkpoints.

Tensors are zero-copy views of a private (copy-on-write) file mapping: nothing is read from
disk until a page is touched, so a 100 GB checkpoint opens instantly and an expert can be
pulled out of a fused [E, ...] tensor without reading its neighbours.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import torch

from ..errors import CheckpointError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES["F8_E4M3"] = torch.float8_e4m3fn
    DTYPES["F8_E5M2"] = torch.float8_e5m2


class SafetensorsFile:
    """One .safetensors file: header parsed and checked against the file size, data mmapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: file is {size} bytes, too short to be safetensors")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8 or n > 100_000_000:
                    raise CheckpointError(f"{self.path}: header length {n} exceeds the file ({size} bytes); "
                                          "the file is truncated or not safetensors")
                header = json.loads(f.read(n))
        except OSError as e:
            raise CheckpointError(f"cannot read {self.path}: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{self.path}: header is not valid JSON; the file is corrupt") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.base = 8 + n
        self.entries = header
        data_end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self.base + data_end > size:
            raise CheckpointError(
                f"{self.path}: truncated: tensors need {self.base + data_end} bytes but the file has {size}; "
                "download or copy it again")
        for name, e in header.items():
            if e["dtype"] not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {e['dtype']}")
        self._mm = None

    def _map(self):
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if os.path.getsize(self.path) else b""
        return self._mm

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.entries[name]["dtype"]]

    def nbytes(self, name: str) -> int:
        a, b = self.entries[name]["data_offsets"]
        return b - a

    def offset(self, name: str) -> int:
        """Absolute byte offset of the tensor's data in the file (for direct reads)."""
        return self.base + self.entries[name]["data_offsets"][0]

    def tensor(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        a, b = e["data_offsets"]
        dtype = DTYPES[e["dtype"]]
        if b == a:
            return torch.empty(e["shape"], dtype=dtype)
        t = torch.frombuffer(self._map(), dtype=dtype, count=(b - a) // dtype.itemsize, offset=self.base + a)
        return t.view(e["shape"])


class Checkpoint:
    """All tensors of a model directory (one file or an index of shards), by name."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError):
                raise CheckpointError(f"{index}: not a valid safetensors index (needs a weight_map)") from None
            for shard in sorted(set(weight_map.values())):
                p = self.dir / shard
                if not p.exists():
                    raise CheckpointError(f"{p}: shard listed in {index.name} is missing")
                self.files[shard] = SafetensorsFile(p)
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.dir}: no *.safetensors files (and no model.safetensors.index.json)")
            for p in shards:
                self.files[p.name] = SafetensorsFile(p)
        for f in self.files.values():
            for k in f.keys():
                self.where[k] = f

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def keys(self):
        return self.where.keys()

    def shape(self, name: str) -> tuple:
        return self.where[name].shape(name)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"{self.dir}: tensor {name} not found in the checkpoint")
        return self.where[name].tensor(name)

    def file_of(self, name: str) -> SafetensorsFile:
        return self.where[name]
