"""Where each expert's bytes are in the checkpoint, and how one expert packs into one buffer.

An expert of layer `li` is all its stacked params' slices (gate_up_proj [2I, D], down_proj [D, I],
optional biases) packed back to back, each at a 64-byte aligned offset, in the checkpoint's
storage dtype. The tiers move experts as these flat byte buffers; `unpack` gives tensor views.
Reads go straight to file offsets (os.preadv), never through the checkpoint's mmap.

GGUF files (`build_gguf_layout`): llama.cpp's blk.N.ffn_{gate,up,down}_exps [E, rows, cols] keep
each expert's rows contiguous, so an expert is 3 pieces (gate rows, up rows, down rows). Block
formats stay as stored: gate_up_proj is the raw GGML rows uint8 [2I, row_bytes(D)] (gate then up),
down_proj [D, row_bytes(I)], and the ParamSpec carries the GGML type (`qtype`), per param: gate_up
and down may differ, and a param's type may vary by layer (llama.cpp's Q4_K_M: Q4_K gate/up, down
Q6_K in some layers and Q4_K in others): then `layer_params[li]` are layer li's specs, every
expert buffer is expert_bytes (the largest layer's), and unpack / specs take the layer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError, UserError
from ..weights.loader import NamedCheckpoint

ALIGN = 64          # param offsets inside an expert buffer (SIMD loads, dtype views)
EXPERT_ALIGN = 4096  # expert buffer size (O_DIRECT reads land on page boundaries)
EXPERT_PARAM = re.compile(r"\.experts\.[A-Za-z_]+$")


def gguf_expert_types() -> tuple[str, ...]:
    """Expert formats the tiers keep as stored: the floats, and the formats with both GPU (kernels.ops.KERNEL_FORMATS)
    and CPU (kernels.cpu.FAST_TYPES) kernels."""
    from ..kernels import cpu, ops
    return ("F32", "F16", "BF16", *(f for f in ops.KERNEL_FORMATS if f in cpu.FAST_TYPES))


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class ParamSpec:
    name: str            # our stacked param name: gate_up_proj, down_proj, gate_up_bias, down_bias
    shape: tuple         # per expert, as stored (GGML blocks: uint8 [rows, row_bytes])
    dtype: torch.dtype   # storage dtype in the checkpoint (uint8 for GGML blocks)
    offset: int          # inside the expert buffer
    nbytes: int
    qtype: str | None = None     # GGML block format ("Q4_0"), None for float params
    cols: int | None = None      # values per row of a block format (the K of [rows, K])

    @property
    def logical_shape(self) -> tuple:
        """The float shape this param stands for ([2I, D] for gate_up_proj, either storage)."""
        return self.shape if self.qtype is None else (self.shape[0], self.cols)


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
    layer_params: list[list[ParamSpec]] = field(default_factory=list)   # per layer, when formats vary by layer

    @property
    def varies_by_layer(self) -> bool:
        """Whether some layer stores a param in another format than layer 0 (Q4_K_M's down)."""
        return any(ps != self.params for ps in self.layer_params)

    def specs(self, li: int | None = None) -> list[ParamSpec]:
        """Layer li's param specs (None: layer 0's, allowed only when no format varies by layer)."""
        if li is None:
            if self.varies_by_layer:
                raise ValueError("the expert formats vary by layer: pass the layer (li)")
            return self.params
        return self.layer_params[li] if self.layer_params else self.params

    def layer_qtypes(self, li: int | None = None) -> tuple[str, str] | None:
        """(gate_up format, down format) of layer li's GGML experts, None for float experts."""
        spec = {p.name: p.qtype for p in self.specs(li)}
        return None if self.qtype is None else (spec["gate_up_proj"], spec["down_proj"])

    def param_variants(self, name: str) -> list[ParamSpec]:
        """One spec per distinct storage format of param `name` over the layers (layer 0's first)."""
        out: dict = {}
        for ps in self.layer_params or [self.params]:
            p = next(p for p in ps if p.name == name)
            out.setdefault((p.qtype, p.dtype), p)
        return list(out.values())

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

    def unpack(self, buf: torch.Tensor, li: int | None = None) -> dict[str, torch.Tensor]:
        """uint8 [expert_bytes] of an expert of layer li -> {name: tensor view in the storage dtype}."""
        return {p.name: buf[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in self.specs(li)}

    @property
    def qtype(self) -> str | None:
        """The GGML format of the expert weights (gate_up's when down differs: see qtypes), None for
        float experts."""
        return next((p.qtype for p in self.params if p.qtype), None)

    @property
    def qtypes(self) -> tuple[str, str] | None:
        """(gate_up format, down format) of GGML experts (layer 0's), None for float experts."""
        spec = {p.name: p.qtype for p in self.params}
        return None if self.qtype is None else (spec["gate_up_proj"], spec["down_proj"])

    def fast_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert in the fast tier: float params in the compute dtype, block formats as
        the planes quant.repack makes of them (a param whose format varies by layer: every format's
        planes, as fast.FastTier keeps them in every slot)."""
        return sum(plane_bytes(p) if p.qtype else round_up(int(torch.Size(p.shape).numel()) * dtype.itemsize, ALIGN)
                   for q in self.params for p in self.param_variants(q.name))


def plane_bytes(spec: ParamSpec) -> int:
    """Bytes of one expert's `repack` planes of a block-format param (one row repacked to measure)."""
    from ..quant.repack import repack
    planes = repack(spec.qtype, torch.zeros(1, spec.shape[1], dtype=torch.uint8))
    return spec.shape[0] * sum(t.numel() * t.element_size() for t in planes.values())


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
    if hasattr(ckpt, "arch"):       # weights.gguf.GGUFCheckpoint
        return build_gguf_layout(model, ckpt)
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


# ---------------------------------------------------------------- GGUF
def build_gguf_layout(model, ckpt) -> ExpertLayout:
    """The expert layout of a GGUF file (one file or a split set) from its tensor infos alone:
    blk.N.ffn_gate_exps / ffn_up_exps [E, I, D] and ffn_down_exps [E, D, I] (+ biases) hold each
    expert's rows contiguously, so expert e of a tensor is bytes [e * n, (e + 1) * n) of it."""
    g = ckpt.ckpt                                   # weights.gguf.GGUFFile
    path_of = {t.name: str(p) for p, r in zip(g.parts, g.readers) for t in r.tensors}
    mods = expert_modules(model)
    if not mods:
        raise CheckpointError("this model has no MoE layers: memory tiers need experts to place")
    first = mods[0][1]
    E = first.num_experts
    names = [n for n, p in first.named_parameters(recurse=False) if p is not None]
    tensors = [[_gguf_names(ckpt, prefix, n) for n in names] for prefix, _ in mods]
    specs, off = [], 0
    for j, n in enumerate(names):
        spec = _gguf_spec(g, n, tensors[0][j], tuple(getattr(first, n).shape[1:]), E, off)
        specs.append(spec)
        off = round_up(off + spec.nbytes, ALIGN)
    weights = [s for s in specs if not s.name.endswith("_bias")]
    if any(s.qtype for s in weights) and not all(s.qtype for s in weights):   # GGML and float: no kernel
        raise UserError(f"{g.path}: the experts' gate/up and down tensors are stored as "
                        f"{' and '.join(s.qtype or str(s.dtype) for s in weights)}; memory tiers need both "
                        "quantized or both float: re-quantize (moetier quantize FILE --type Q8_0|Q4_0|Q4_K_S) "
                        "or run without tier flags")
    layer_specs = [specs]
    for li, row in enumerate(tensors[1:], 1):    # a layer may store a param in another GGML format (Q4_K_M)
        ls, off = [], 0
        for spec, names_j in zip(specs, row):
            other = _gguf_spec(g, spec.name, names_j, spec.logical_shape, E, off)
            if (other.qtype is None) != (spec.qtype is None) or (spec.qtype is None and other != spec):
                raise UserError(f"{g.path}: {names_j[0]} is stored as {other.qtype or other.dtype} but "
                                f"{tensors[0][specs.index(spec)][0]} as {spec.qtype or spec.dtype}; memory "
                                "tiers need every layer's experts quantized, or every layer's in one float "
                                "type: re-quantize (--type Q8_0|Q4_0|Q4_K_M) or run without tier flags")
            ls.append(other)
            off = round_up(off + other.nbytes, ALIGN)
        layer_specs.append(ls)
    size = max(round_up(ls[-1].offset + ls[-1].nbytes, ALIGN) for ls in layer_specs)
    varies = any(ls != specs for ls in layer_specs)
    layout = ExpertLayout([layer_index(p) for p, _ in mods], [p for p, _ in mods], E, specs,
                          round_up(size, EXPERT_ALIGN), max(sum(s.nbytes for s in ls) for ls in layer_specs),
                          layer_params=layer_specs if varies else [])
    for li, row in enumerate(tensors):
        parts = []
        for spec, names_j in zip(layer_specs[li], row):
            buf_off, pieces = spec.offset, []
            for t in names_j:       # absolute file offset of expert 0's rows; experts `per` bytes apart
                info = g.tensors[t]
                per = int(info.n_bytes) // E
                pieces.append(("fused", path_of[t], int(info.data_offset), per, per, buf_off, None))
                buf_off += per
            parts.append(pieces)
        layout._parts.append(parts)
    return layout


def _gguf_names(ckpt, prefix: str, name: str) -> list[str]:
    """llama.cpp's tensors for our stacked param `name` of the experts under `prefix`."""
    parts = ckpt.arch.experts.get(name)
    names = [f"blk.{layer_index(prefix)}.{p}" for p in parts or ()]
    missing = [n for n in names if n not in ckpt.ckpt]
    if not names or missing:
        raise CheckpointError(f"{ckpt.ckpt.path}: no GGUF expert tensors for {prefix}.experts.{name} "
                              f"(missing {', '.join(missing) or 'a name mapping'}; architecture {ckpt.arch.gguf})")
    return names


def _gguf_spec(g, name: str, tensors: list[str], want: tuple, E: int, offset: int) -> ParamSpec:
    """One stacked param of one expert from its GGUF tensors (gate_up_proj: gate + up rows)."""
    from ..quant.formats import get_format
    from ..weights.gguf import FLOAT_TYPES, qtype_name
    qtypes = {g.qtype(t) for t in tensors}
    if len(qtypes) > 1:
        raise UserError(f"{g.path}: {' and '.join(tensors)} are stored as different types "
                        f"({', '.join(qtype_name(q) for q in qtypes)}); memory tiers keep them as one param. "
                        "Re-quantize with one type or run without tier flags")
    q = qtypes.pop()
    try:
        fmt = get_format(q).name
    except ValueError:
        fmt = qtype_name(q)
    if fmt not in (kept := gguf_expert_types()):
        raise UserError(f"{g.path}: experts stored as {fmt} ({tensors[0]}); memory tiers keep experts "
                        f"quantized and read {', '.join(kept)}. Re-quantize "
                        "(moetier quantize FILE --type Q4_K_S|Q4_0|Q8_0) or run without tier flags")
    shapes = [g.shape(t) for t in tensors]
    rows = sum(s[1] for s in shapes)
    logical = (rows, *shapes[0][2:])
    if any(s[0] != E or s[2:] != shapes[0][2:] for s in shapes) or logical != tuple(want):
        raise CheckpointError(f"{g.path}: {', '.join(tensors)} have shapes {shapes}; expected [{E}, ...] "
                              f"making {list(want)} per expert")
    nbytes = sum(int(g.tensors[t].n_bytes) // E for t in tensors)
    if q in FLOAT_TYPES:
        return ParamSpec(name, logical, FLOAT_TYPES[q], offset, nbytes)
    if len(logical) != 2:
        raise CheckpointError(f"{g.path}: {tensors[0]} is a {fmt} tensor of shape {shapes[0]}; expected [E, rows, cols]")
    return ParamSpec(name, (rows, nbytes // rows), torch.uint8, offset, nbytes, fmt, logical[1])
