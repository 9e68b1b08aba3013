"""Cache snapshots on disk (`--prompt-cache DIR`), so a new session or process resumes a prompt
from the longest saved prefix instead of from 0.

One file per snapshot: `{length:08d}-{sha256(tokens)[:40]}.pt` holds {"model", "tokens", "snapshot"},
the snapshot a full `Cache.snapshot(kv=True)` on the CPU. `model` names the checkpoint, dtype and KV
storage: a file written by another model is never restored. The directory stays within `budget`
bytes; the least recently used files (oldest mtime) go first.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import threading
import warnings
from pathlib import Path

import torch

from ..errors import UserError


def tokens_hash(tokens: list[int]) -> str:
    return hashlib.sha256(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()).hexdigest()[:40]


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (tuple, list)):
        return type(x)(_to_cpu(t) for t in x)
    return x


class PromptCache:
    def __init__(self, directory: str | Path, model_key: str, budget: int):
        self.dir = Path(directory).expanduser()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"--prompt-cache {directory}: cannot create the directory ({e}); "
                            "give a writable directory") from None
        self.model_key, self.budget = model_key, budget

    def path(self, tokens: list[int]) -> Path:
        return self.dir / f"{len(tokens):08d}-{tokens_hash(tokens)}.pt"

    def save(self, tokens: list[int], snapshot: dict) -> None:
        """Write the snapshot of `tokens` (skipped when that file exists: it is only touched)."""
        path = self.path(tokens)
        if path.exists():
            os.utime(path)
            return
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        try:
            torch.save({"model": self.model_key, "tokens": list(tokens), "snapshot": _to_cpu(snapshot)}, tmp)
            os.replace(tmp, path)   # readers never see half a file
        except OSError as e:        # a full or read-only disk costs the cache, not the generation
            tmp.unlink(missing_ok=True)
            warnings.warn(f"--prompt-cache: could not write {path}: {e}", stacklevel=2)
            return
        self.evict()

    def lengths(self) -> list[int]:
        """Token counts of the files present, longest first."""
        out = set()
        for p in self.dir.glob("*.pt"):
            head = p.name.split("-", 1)[0]
            if head.isdigit():
                out.add(int(head))
        return sorted(out, reverse=True)

    def load(self, prompt: list[int], above: int, limit: int) -> dict | None:
        """The snapshot of the longest prefix of `prompt` with above < length <= limit, written by this
        model; None if there is none."""
        for n in self.lengths():
            if not above < n <= limit:
                continue
            path = self.path(prompt[:n])
            if not path.exists():
                continue
            try:
                data = torch.load(path, map_location="cpu", weights_only=True)
            except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):   # evicted or torn: a miss
                continue
            if data.get("model") == self.model_key and data.get("tokens") == prompt[:n]:
                os.utime(path)
                return data["snapshot"]
        return None

    def evict(self) -> None:
        files = []
        for p in self.dir.glob("*.pt"):
            try:
                st = p.stat()
            except OSError:   # removed by another process meanwhile
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.budget:
                break
            total -= size
            p.unlink(missing_ok=True)
