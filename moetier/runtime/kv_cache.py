"""Per-sequence caches: one entry per layer (a KV cache, or later a recurrent state).

A `Cache` knows how many positions it holds (`length`). Rolling back (speculative decoding,
prefix reuse) is `truncate(n)`: attention caches just forget the tail; layers with recurrent
state must restore a snapshot instead (see `Cache.can_truncate`).
"""
from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values of one attention layer: k [max_len, *k_shape], v [max_len, *v_shape]."""

    def __init__(self, max_len: int, k_shape: tuple, v_shape: tuple, dtype, device):
        self.k = torch.empty((max_len, *k_shape), dtype=dtype, device=device)
        self.v = torch.empty((max_len, *v_shape), dtype=dtype, device=device)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write T new positions at `start`; return views of all positions [0, start + T)."""
        end = start + k.shape[0]
        self.k[start:end] = k
        self.v[start:end] = v
        return self.k[:end], self.v[:end]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def snapshot(self, length: int):
        return (self.k[:length].clone(), self.v[:length].clone())

    def restore(self, snap) -> None:
        k, v = snap
        self.k[: k.shape[0]] = k
        self.v[: v.shape[0]] = v


class Cache:
    """The state of one sequence across all layers."""

    def __init__(self, layers: list, max_len: int):
        self.layers = layers
        self.max_len = max_len
        self.length = 0

    def __getitem__(self, i: int):
        return self.layers[i]

    @property
    def can_truncate(self) -> bool:
        return all(layer is None or isinstance(layer, KVCache) for layer in self.layers)

    def truncate(self, n: int) -> None:
        if n > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {n}")
        if n < self.length and not self.can_truncate:
            raise ValueError("this model keeps recurrent state: roll back by restoring a snapshot")
        self.length = n

    def advance(self, n: int) -> None:
        self.length += n

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers if layer is not None)

    def snapshot(self) -> dict:
        return {"length": self.length,
                "layers": [None if layer is None else layer.snapshot(self.length) for layer in self.layers]}

    def restore(self, snap: dict) -> None:
        for layer, s in zip(self.layers, snap["layers"]):
            if layer is not None:
                layer.restore(s)
        self.length = snap["length"]
