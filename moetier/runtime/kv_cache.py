"""Per-sequence caches: one entry per layer (a KV cache, or a recurrent state).

A `Cache` knows how many positions it holds (`length`). Rolling back (speculative decoding,
prefix reuse) is `truncate(n)`: attention caches just forget the tail; layers with recurrent
state must restore a snapshot instead (see `Cache.can_truncate`), except back to 0: a
recurrent layer starts from zeros whenever it is called at position 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UserError


class KVCache:
    """Preallocated keys and values of one attention layer: k [max_len, *k_shape], v [max_len, *v_shape]."""

    def __init__(self, max_len: int, k_shape: tuple, v_shape: tuple, dtype, device):
        # zeros, not empty: graph decode attends over the whole buffer under a mask, and a masked
        # NaN from uninitialised memory would still poison the output (0 * NaN = NaN)
        self.k = torch.zeros((max_len, *k_shape), dtype=dtype, device=device)
        self.v = torch.zeros((max_len, *v_shape), dtype=dtype, device=device)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """A KVCache over existing buffers (e.g. the first L positions of a longer cache: a view with static
        shapes for a CUDA graph)."""
        kv = cls.__new__(cls)
        kv.k, kv.v = k, v
        return kv

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


# ---------------------------------------------------------------- KV stored in another form
KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KV_CHOICES = ("auto", *KV_DTYPES, "int8")
INT8_GROUP = 32


def quantize_int8(x: torch.Tensor, group: int = INT8_GROUP, scale_dtype=torch.float16):
    """Symmetric int8, one scale per `group` contiguous values of the last dim (a remainder makes a
    smaller last group). x [..., D] -> q int8 [..., D], scale [..., ceil(D/group)] in scale_dtype.
    The scale is rounded before dividing, so |x - q * scale| <= scale / 2 with the stored scale."""
    d = x.shape[-1]
    g = -(-d // group)
    xf = x.float()
    xf = F.pad(xf, (0, g * group - d)) if d % group else xf   # zeros leave each group's max alone
    xf = xf.reshape(*x.shape[:-1], g, group)
    fi = torch.finfo(scale_dtype)
    # never 0 (an all-zero group stays 0), never inf
    scale = (xf.abs().amax(-1) / 127).clamp(fi.tiny, fi.max).to(scale_dtype)   # [..., G]
    q = torch.round(xf / scale.float()[..., None]).clamp_(-127, 127).to(torch.int8).flatten(-2)
    return (q[..., :d] if d % group else q), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype, group: int = INT8_GROUP) -> torch.Tensor:
    """q int8 [..., D], scale [..., G] -> [..., D] in dtype. The pure-torch twin of the later fast path,
    a dequant-in-attention kernel that reads int8 + scales directly."""
    d, g = q.shape[-1], scale.shape[-1]
    qp = F.pad(q, (0, g * group - d)) if d % group else q
    x = (qp.reshape(*q.shape[:-1], g, group).float() * scale.float()[..., None]).flatten(-2).to(dtype)
    return x[..., :d] if d % group else x


def _zeros(shape, dtype, device, pin: bool) -> torch.Tensor:
    # zeros for the reason KVCache gives; pinned host memory for offloaded KV (fast async copy-in)
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)


class CastKVCache(KVCache):
    """K/V stored as `dtype` (e.g. fp16 for a bf16 model), returned in the dtype they are written in.
    Subclasses store another form: `encode(x)` -> the stored parts of x, `decode(parts, dtype)`.
    `buffers` are k's parts then v's, each [max_len, ...]; everything else is generic."""

    def __init__(self, max_len: int, k_shape: tuple, v_shape: tuple, dtype, device, pin: bool = False):
        self.k = _zeros((max_len, *k_shape), dtype, device, pin)
        self.v = _zeros((max_len, *v_shape), dtype, device, pin)

    @property
    def buffers(self) -> tuple:
        return (self.k, self.v)

    def encode(self, x: torch.Tensor) -> tuple:
        return (x.to(self.k.dtype),)

    def decode(self, parts: tuple, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = parts
        return k.to(dtype), v.to(dtype)

    def write(self, start, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store T new positions at `start` (an int, or a device tensor: index_copy, graph-safe)."""
        new = self.encode(k) + self.encode(v)
        if isinstance(start, torch.Tensor):
            idx = start + torch.arange(k.shape[0], device=start.device)
            for buf, x in zip(self.buffers, new):
                buf.index_copy_(0, idx, x)
        else:
            for buf, x in zip(self.buffers, new):
                buf[start:start + k.shape[0]] = x   # also copies across devices (offload)

    def parts(self, end: int | None) -> tuple:
        """The stored parts of positions [0, end) (all of them when end is None)."""
        return tuple(self.buffers) if end is None else tuple(b[:end] for b in self.buffers)

    def update(self, start, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KVCache.update's contract; the returned K/V are decoded copies in k's dtype.
        For now the whole range [0, end) is decoded every step (the whole buffer in graph mode)."""
        self.write(start, k, v)
        return self.decode(self.parts(None if isinstance(start, torch.Tensor) else start + k.shape[0]), k.dtype)

    def update_stored(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """update's write, and K / V of [0, end) as stored (views, no copy): for an attention that computes in the
        stored dtype (models.layers.attend_in_bf16). A plain cast's store only (int8 parts are not K / V)."""
        self.write(start, k, v)
        return self.k[:start + k.shape[0]], self.v[:start + k.shape[0]]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def snapshot(self, length: int):
        return tuple(b[:length].clone() for b in self.buffers)

    def restore(self, snap) -> None:
        for b, s in zip(self.buffers, snap):
            b[: s.shape[0]] = s


class Int8KVCache(CastKVCache):
    """K/V as int8 with one scale (`dtype`, fp16 by default) per `group` values along the last dim:
    k [max_len, *k_shape] int8 + k_scale [max_len, *k_shape[:-1], G] (and v alike). 1.0625 bytes per
    value with fp16 scales and groups of 32. Quantized on write, on the device the new K/V are on."""

    def __init__(self, max_len: int, k_shape: tuple, v_shape: tuple, dtype=torch.float16, device="cpu",
                 pin: bool = False, group: int = INT8_GROUP):
        self.group = group

        def alloc(shape):
            g = -(-shape[-1] // group)
            return (_zeros((max_len, *shape), torch.int8, device, pin),
                    _zeros((max_len, *shape[:-1], g), dtype, device, pin))
        self.k, self.k_scale = alloc(tuple(k_shape))
        self.v, self.v_scale = alloc(tuple(v_shape))

    @property
    def buffers(self) -> tuple:
        return (self.k, self.k_scale, self.v, self.v_scale)

    def encode(self, x: torch.Tensor) -> tuple:
        return quantize_int8(x, self.group, self.k_scale.dtype)

    def decode(self, parts: tuple, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k, ks, v, vs = parts
        return dequantize_int8(k, ks, dtype, self.group), dequantize_int8(v, vs, dtype, self.group)


class OffloadKVCache(KVCache):
    """K/V kept in host memory by `store` (a CastKVCache or Int8KVCache on "cpu", pinned when CUDA is
    present), for contexts whose KV does not fit beside the experts. Each step writes the new
    positions to the host and copies all of [0, end) in stored form (int8 + scales for int8) to
    `device`, where they are decoded: correct, and costs end x bytes-per-position of PCIe per layer."""

    def __init__(self, store: CastKVCache, device):
        self.store, self.device = store, torch.device(device)

    @property
    def k(self) -> torch.Tensor:   # the stored form, as the other caches expose it
        return self.store.k

    @property
    def v(self) -> torch.Tensor:
        return self.store.v

    def update(self, start, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(start, torch.Tensor):
            raise NotImplementedError("offloaded KV cannot be captured in a CUDA graph; decode eagerly "
                                      "(--no-cuda-graph)")
        self.store.write(start, k, v)
        # copy=True: a real copy even when `device` is the host itself (the CPU stand-in in tests)
        parts = tuple(p.to(self.device, non_blocking=True, copy=True) for p in self.store.parts(start + k.shape[0]))
        return self.store.decode(parts, k.dtype)

    @property
    def nbytes(self) -> int:   # host bytes; the device holds only each step's transient copy
        return self.store.nbytes

    def snapshot(self, length: int):
        return self.store.snapshot(length)

    def restore(self, snap) -> None:
        self.store.restore(snap)


def kv_layer(max_len: int, k_shape: tuple, v_shape: tuple, dtype, device, kv_dtype: str = "auto",
             offload: bool = False) -> KVCache:
    """One attention layer's cache. `dtype` is what attention computes in; `kv_dtype` how K/V are
    stored: auto (as dtype), bf16 | fp16 | fp32, or int8 (+ an fp16 scale per 32 values);
    `offload` keeps them in host memory and copies them to `device` each step."""
    if kv_dtype not in KV_CHOICES:
        raise UserError(f"unknown KV dtype {kv_dtype!r}: use {', '.join(KV_CHOICES)}")
    host, pin = ("cpu", torch.cuda.is_available()) if offload else (device, False)
    if kv_dtype == "int8":
        store = Int8KVCache(max_len, k_shape, v_shape, torch.float16, host, pin)
    elif offload or KV_DTYPES.get(kv_dtype, dtype) != dtype:
        store = CastKVCache(max_len, k_shape, v_shape, KV_DTYPES.get(kv_dtype, dtype), host, pin)
    else:
        return KVCache(max_len, k_shape, v_shape, dtype, device)
    return OffloadKVCache(store, device) if offload else store


def session_cache(model, max_len: int, dtype, device, kv_dtype: str = "auto", offload: bool = False) -> Cache:
    """model.make_cache with every attention layer's K/V stored as `kv_dtype` (see kv_layer).
    `offload` applies to CUDA devices only (on the CPU the KV is in host memory already).
    Models need no change: their own cache at one position gives each layer's kind and shapes,
    and full-size recurrent states."""
    offload = offload and torch.device(device).type == "cuda"
    if kv_dtype == "auto" and not offload:
        return model.make_cache(max_len, dtype, device)
    base = model.make_cache(1, dtype, device)
    layers = []
    for entry in base.layers:
        if isinstance(entry, KVCache):
            if type(entry) is not KVCache:
                raise UserError(f"--kv-dtype/--kv-offload cannot re-store a {type(entry).__name__}; "
                                "use --kv-dtype auto without --kv-offload for this model")
            entry = kv_layer(max_len, tuple(entry.k.shape[1:]), tuple(entry.v.shape[1:]), dtype, device,
                             kv_dtype, offload)
        layers.append(entry)
    return Cache(layers, max_len)
