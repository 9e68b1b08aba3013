"""Per-sequence caches: one entry per layer (a KV cache, or a recurrent state).

A `Cache` knows how many positions it holds (`length`). Rolling back (speculative decoding,
prefix reuse) is `truncate(n)`: attention caches just forget the tail; layers with recurrent
state must restore a snapshot instead (see `Cache.can_truncate`), except back to 0: a
recurrent layer starts from zeros whenever it is called at position 0.
"""
from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values of one attention layer: k [max_len, *k_shape], v [max_len, *v_shape]."""

    def __init__(self, max_len: int, k_shape: tuple, v_shape: tuple, dtype, device):
        # zeros, not empty: graph decode attends over the whole buffer under a mask, and a masked
        # NaN from uninitialised memory would still poison the output (0 * NaN = NaN)
        self.k = torch.zeros((max_len, *k_shape), dtype=dtype, device=device)
        self.v = torch.zeros((max_len, *v_shape), dtype=dtype, device=device)

    def update(self, start, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write T new positions at `start`; return views of all positions [0, start + T).
        With `start` a device tensor (CUDA-graph decode) the write is an index_copy and the whole
        buffer comes back: the attention mask hides positions past start + T."""
        if isinstance(start, torch.Tensor):
            idx = start + torch.arange(k.shape[0], device=k.device)
            self.k.index_copy_(0, idx, k.to(self.k.dtype))
            self.v.index_copy_(0, idx, v.to(self.v.dtype))
            return self.k, self.v
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


class RecurrentState:
    """Fixed-size state of one recurrent layer (gated DeltaNet, Mamba-like): the last K-1 inputs of
    its causal conv, conv [K-1, C] (model dtype), and the recurrent matrix ssm [*ssm_shape] (float32,
    as it accumulates over the whole sequence). Updated in place; it cannot be truncated."""

    def __init__(self, conv_shape: tuple, ssm_shape: tuple, dtype, device):
        self.conv = torch.zeros(conv_shape, dtype=dtype, device=device)
        self.ssm = torch.zeros(ssm_shape, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()

    def snapshot(self, length: int):
        return (self.conv.clone(), self.ssm.clone())

    def restore(self, snap) -> None:
        self.conv.copy_(snap[0])
        self.ssm.copy_(snap[1])


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
        if 0 < n < self.length and not self.can_truncate:
            raise ValueError("this model keeps recurrent state: roll back by restoring a snapshot")
        self.length = n

    def advance(self, n: int) -> None:
        self.length += n

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers if layer is not None)

    def snapshot(self, kv: bool = True) -> dict:
        """A copy of the state at `length`. kv=False keeps only what cannot be truncated (recurrent
        states; KV entries are None): restoring it is valid while the KV positions [0, length) have
        not been overwritten since (the caller checks, e.g. with the tokens they hold)."""
        return {"length": self.length,
                "layers": [None if layer is None or (not kv and isinstance(layer, KVCache))
                           else layer.snapshot(self.length) for layer in self.layers]}

    def restore(self, snap: dict) -> None:
        for layer, s in zip(self.layers, snap["layers"]):
            if layer is not None and s is not None:
                layer.restore(s)
        self.length = snap["length"]
