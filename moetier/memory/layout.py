"""Where each expert's bytes are in the checkpoint, and how one expert packs into one buffer.

An expert of layer `li` is all its stacked params' slices (gate_up_proj [2I, D], down_proj [D, I],
optional biases) packed back to back, each at a 64-byte aligned offset, in the checkpoint's
storage dtype. The tiers move experts as these flat byte buffers; `unpack` gives tensor views.
Reads go straight to file offsets (os.preadv), never through the checkpoint's mmap.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError
from ..weights.loader import NamedCheckpoint

ALIGN = 64          # param offsets inside an expert buffer (SIMD loads, dtype views)
EXPERT_ALIGN = 4096  # expert buffer size (O_DIRECT reads land on page boundaries)
EXPERT_PARAM = re.compile(r"\.experts\.[A-Za-z_]+$")


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class ParamSpec:
    name: str            # our stacked param name: gate_up_proj, down_proj, gate_up_bias, down_bias
    shape: tuple         # per expert
    dtype: torch.dtype   # storage dtype in the checkpoint
    offset: int          # inside the expert buffer
    nbytes: int


@dataclass
class Part:
    """One contiguous piece of a param of one expert in a checkpoint file."""
    path: str
    file_offset: int     # absolute offset of expert 0's piece (fused) or of this expert's tensor
    stride: int          # bytes between experts inside a fused tensor (0: per-expert tensor)
    nbytes: int
    buf_offset: int      # where it lands in the expert buffer


@dataclass
class ExpertLayout:
    layers: list[int]                    # model layer index of each MoE layer (li -> layer)
    prefixes: list[str]                  # module path of each layer's experts' parent, e.g. model.layers.3.mlp
    num_experts: int
    params: list[ParamSpec]
    expert_bytes: int                    # packed, rounded up to EXPERT_ALIGN
    raw_bytes: int                       # sum of params' bytes (what is read from disk)
    # per layer, per param: parts with {e} resolved lazily (see parts())
    _parts: list[list[list[tuple]]] = field(default_factory=list, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def parts(self, li: int, e: int) -> list[Part]:
        """The file pieces of expert e of MoE layer li."""
        out = []
        for spec_parts in self._parts[li]:
            for kind, path, off, stride, nbytes, buf_off, names in spec_parts:
                if kind == "fused":
                    out.append(Part(path, off + e * stride, stride, nbytes, buf_off))
                else:  # per-expert tensors: names[e] -> (path, offset)
                    p, o = names(e)
                    out.append(Part(p, o, 0, nbytes, buf_off))
        return out

    def unpack(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """uint8 [expert_bytes] -> {name: tensor view in the storage dtype}."""
        return {p.name: buf[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.params}

    def fast_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert converted to the compute dtype (its size in the fast tier)."""
        return sum(round_up(int(torch.Size(p.shape).numel()) * dtype.itemsize, ALIGN) for p in self.params)


def expert_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """(parent module path, experts module) of every MoE block, in layer order."""
    from ..models.layers import DenseExperts
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, DenseExperts) or type(mod).__name__ == "TieredExperts":
            out.append((name.rpartition(".")[0], mod))
    return out


def layer_index(prefix: str) -> int:
    m = re.search(r"layers\.(\d+)\.", prefix + ".")
    return int(m.group(1)) if m else -1


def build_layout(model, ckpt: NamedCheckpoint) -> ExpertLayout:
    """Read the checkpoint's header to find every expert's bytes. `model` may live on meta."""
    mods = expert_modules(model)
    if not mods:
        raise CheckpointError("this model has no MoE layers: memory tiers need experts to place")
    first = mods[0][1]
    names = [n for n, p in first.named_parameters(recurse=False) if p is not None]
    specs, off = [], 0
    for n in names:
        p = getattr(first, n)
        shape = tuple(p.shape[1:])
        dtype = _storage_dtype(ckpt, mods[0][0], n)
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        specs.append(ParamSpec(n, shape, dtype, off, nbytes))
        off = round_up(off + nbytes, ALIGN)
    layout = ExpertLayout([layer_index(p) for p, _ in mods], [p for p, _ in mods], first.num_experts, specs,
                          round_up(off, EXPERT_ALIGN), sum(s.nbytes for s in specs))
    for prefix, _ in mods:
        layout._parts.append([_param_parts(ckpt, prefix, s, first.num_experts) for s in specs])
    return layout


def _storage_dtype(ckpt: NamedCheckpoint, prefix: str, name: str) -> torch.dtype:
    fused = f"{prefix}.experts.{name}"
    if ckpt.has(fused):
        raw = ckpt.names[fused]
        return ckpt.ckpt.file_of(raw).dtype(raw)
    parts = ckpt.table.get("experts", {}).get(name)
    if parts:
        raw = ckpt.names.get(f"{prefix}.{parts[0].format(e=0)}")
        if raw is not None:
            return ckpt.ckpt.file_of(raw).dtype(raw)
    raise CheckpointError(f"{ckpt.ckpt.dir}: cannot find {prefix}.experts.{name} for direct expert reads "
                          "(memory tiers read fused [E, ...] tensors or per-expert tensors; "
                          "this layout needs a transform; run without --gpu-mem/--ram-mem)")


def _param_parts(ckpt: NamedCheckpoint, prefix: str, spec: ParamSpec, num_experts: int) -> list[tuple]:
    fused = f"{prefix}.experts.{spec.name}"
    if ckpt.has(fused):
        raw = ckpt.names[fused]
        f = ckpt.ckpt.file_of(raw)
        shape = f.shape(raw)
        if shape[0] != num_experts or f.nbytes(raw) != spec.nbytes * num_experts:
            raise CheckpointError(f"{f.path}: {raw} has shape {shape}; expected [{num_experts}, "
                                  f"{', '.join(map(str, spec.shape))}]")
        return [("fused", str(f.path), f.offset(raw), spec.nbytes, spec.nbytes, spec.offset, None)]
    parts = ckpt.table["experts"][spec.name]
    out, buf_off = [], spec.offset
    for j, pattern in enumerate(parts):
        raw0 = ckpt.names.get(f"{prefix}.{pattern.format(e=0)}")
        if raw0 is None:
            raise CheckpointError(f"{ckpt.ckpt.dir}: tensor {prefix}.{pattern.format(e=0)} not found")
        f0 = ckpt.ckpt.file_of(raw0)
        if f0.dtype(raw0) != spec.dtype:
            raise CheckpointError(f"{f0.path}: {raw0} is {f0.dtype(raw0)} but its sibling parts are {spec.dtype}")
        nbytes = f0.nbytes(raw0)

        def where(e, pattern=pattern, nbytes=nbytes):
            raw = ckpt.names.get(f"{prefix}.{pattern.format(e=e)}")
            if raw is None:
                raise CheckpointError(f"{ckpt.ckpt.dir}: tensor {prefix}.{pattern.format(e=e)} not found")
            f = ckpt.ckpt.file_of(raw)
            if f.nbytes(raw) != nbytes:
                raise CheckpointError(f"{f.path}: {raw} has {f.nbytes(raw)} bytes, expected {nbytes}")
            return str(f.path), f.offset(raw)
        out.append(("per_expert", None, 0, 0, nbytes, buf_off, where))
        buf_off += nbytes
    if buf_off - spec.offset != spec.nbytes:
        raise CheckpointError(f"{ckpt.ckpt.dir}: {prefix} experts' {spec.name} pieces add up to "
                              f"{buf_off - spec.offset} bytes, expected {spec.nbytes}")
    return out
