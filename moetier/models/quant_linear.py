"""Dense linear layers kept in their GGUF block format on the GPU (attention, lm_head, dense MLPs).

Why: a Q4_0 file's attention and lm_head weights, dequantized to bf16 as before, were 3.1 GB of a Qwen3-30B-A3B's
GPU memory and ~1.8 GB read per decode token; in their blocks they are 0.9 GB. At `--gpu-mem 8GiB` the freed
memory holds ~660 more cached experts, and all on the GPU a token reads 3.5x fewer dense bytes. llama.cpp
computes on the same blocks.

`QuantLinear(planes, fmt, in_features, out_features, bias)` replaces an nn.Linear: forward(x) -> x @ W^T (+ b)
through kernels.ops.qlinear (decode rows: int8 activations and dp4a, one GEMV launch after the activation
quantizer; more rows: the weight dequantized in row chunks, then cuBLAS). The planes are quant.repack's, with
a leading slot dimension of 1 (the kernels' arena layout).

Which weights: `QUANT_DENSE` names (q/k/v/o projections of softmax attention, dense MLP and shared-expert
projections, lm_head) stored as one GGUF tensor in a format the GEMV reads (`GPU_FORMATS`), on CUDA, unless
--dequantize-dense. Embeddings stay float (one row a token: a gather, not a GEMV).
"""
from __future__ import annotations

import re

import torch
from torch import nn

QUANT_DENSE = re.compile(r"(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj|shared_experts?\.(?:gate|up|down)_proj"
                         r"|^lm_head)\.weight$")
GPU_FORMATS = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")      # kernels.triton_qlinear's GEMV (int8 activations, dp4a)


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias), W [out_features, in_features] in GGML planes (fmt). No float copy of W exists."""

    def __init__(self, planes: dict[str, torch.Tensor], fmt: str, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.names = tuple(planes)
        for k, v in planes.items():
            self.register_buffer(f"plane_{k}", v, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def planes(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, f"plane_{k}") for k in self.names}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planes.values())

    def forward(self, x: torch.Tensor, pre: tuple | None = None) -> torch.Tensor:
        """pre: x already quantized (int8 q, dx, xs per 32-block: triton_decode_q8.quantize of x), from the
        kernel that produced x; used by the GEMV, ignored by the other paths."""
        from ..kernels import ops
        return ops.qlinear(x, self.planes, self.fmt, self.bias, pre=pre)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, " \
               f"bias={self.bias is not None}"

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, qtype, bias, device) -> QuantLinear:
        """GGUF blocks uint8 [rows, bytes per row] (any device; e.g. a view of the mmapped file) -> planes
        on `device`."""
        from ..quant.formats import get_format
        from ..quant.repack import repack
        fmt = get_format(qtype)
        planes = {k: v.unsqueeze(0).to(device) for k, v in repack(fmt.name, blocks.contiguous()).items()}
        bias = None if bias is None else bias.to(device)
        return cls(planes, fmt.name, blocks.shape[1] // fmt.type_size * fmt.block_size, blocks.shape[0], bias)

    @classmethod
    def stack(cls, parts: list[QuantLinear]) -> QuantLinear:
        """Row-wise join of layers with one format and input size (fused q/k/v): one GEMV."""
        planes = {k: torch.cat([p.planes[k] for p in parts], dim=1) for k in parts[0].names}
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        return cls(planes, parts[0].fmt, parts[0].in_features, sum(p.out_features for p in parts), bias)


class QuantEmbedding(nn.Module):
    """nn.Embedding whose table stays in its GGUF blocks on the CPU, as llama.cpp keeps token_embd: forward(tokens
    [...]) -> [..., D] float32, the rows dequantized in C (torch op moetier::embed_rows: bit for bit the float32 table
    the loader made before; the compiled CPU step's trace keeps the table a uint8 buffer). A token reads one row. Why:
    the float32 table is 4 bytes a value beside the file's blocks (Qwen3-235B-A22B: 2.5 GB; DeepSeek-V3: 3.7 GB)."""

    def __init__(self, blocks: torch.Tensor, qtype: int, dim: int):
        super().__init__()
        self.register_buffer("blocks", blocks, persistent=False)
        self.qtype, self.num_embeddings, self.embedding_dim = qtype, blocks.shape[0], dim

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from ..kernels import cpu  # noqa: F401  (defines the op)
        rows = torch.ops.moetier.embed_rows(tokens.reshape(-1), self.blocks, self.qtype, self.embedding_dim)
        return rows.view(*tokens.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        from ..quant.formats import get_format
        return f"{self.num_embeddings}, {self.embedding_dim}, {get_format(self.qtype).name} blocks"


def gpu_blocks(ckpt, names, device: str) -> dict[str, tuple[torch.Tensor, int]]:
    """The params of `names` that load as QuantLinear on `device`: {name: (blocks, GGML type)} for QUANT_DENSE
    names stored as one GGUF tensor in a GPU_FORMATS format with whole blocks per row; {} off CUDA or for a
    checkpoint without blocks (safetensors)."""
    from ..weights.gguf import qtype_name
    if not str(device).startswith("cuda") or not hasattr(ckpt, "blocks"):
        return {}
    found = {}
    for n in names:
        if QUANT_DENSE.search(n):
            b = ckpt.blocks(n)
            if b is not None and qtype_name(b[1]) in GPU_FORMATS:
                found[n] = b
    return found


def install(model: nn.Module, found: dict[str, tuple[torch.Tensor, int]], device) -> None:
    """Replace the nn.Linear of each `<module>.weight` in `found` (its weight left on meta by the loader, its bias
    loaded) with a QuantLinear on `device`."""
    for name, (blocks, qtype) in found.items():
        mod_name = name.rpartition(".")[0]
        parent_name, _, attr = mod_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if not isinstance(old, nn.Linear):
            raise TypeError(f"{mod_name} is a {type(old).__name__}, not nn.Linear: cannot keep it quantized")
        bias = None if old.bias is None else old.bias.detach()
        new = QuantLinear.from_blocks(blocks, qtype, bias, device)
        if (new.out_features, new.in_features) != (old.out_features, old.in_features):
            raise ValueError(f"{name}: blocks hold [{new.out_features}, {new.in_features}], the model expects "
                             f"[{old.out_features}, {old.in_features}]")
        setattr(parent, attr, new)


# bytes of one block as quant.repack's planes (Q4_K's 6-bit scales and mins unpacked to a byte each: 148 of 144)
REPACKED_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_K": 148, "Q6_K": 210}


def gpu_bytes(ckpt, names, device: str) -> dict[str, int]:
    """{name: bytes on the GPU} of the params that would load as QuantLinear (for the memory plan): the repacked
    planes, not the file's blocks."""
    from ..quant.formats import get_format
    out = {}
    for n, (b, qtype) in gpu_blocks(ckpt, names, device).items():
        fmt = get_format(qtype)
        out[n] = b.numel() // fmt.type_size * REPACKED_BLOCK_BYTES[fmt.name]
    return out


def cpu_bytes(ckpt, model: nn.Module, dtype) -> dict[str, int]:
    """{name: bytes in RAM} of the dense params a CPU run keeps in their GGUF blocks instead of float (for the memory
    plan; weights.loader release_dense): Linear weights and the token embeddings in a format the C kernels read, with
    the rows-in-lanes copy the decode reads for the formats that have one (runtime.cpu_compile.dense_copies). {} for
    other checkpoints, dtypes, without the C kernels or under MOETIER_FLOAT_COPIES=1."""
    from ..kernels import cpu
    from ..runtime.cpu_compile import KEEP_FLOATS
    from ..weights.loader import EMBED, _cpu_fast_blocks, releasable
    if not hasattr(ckpt, "blocks") or dtype != torch.float32 or cpu.backend() != "c" or KEEP_FLOATS:
        return {}
    out = {}
    for n, p in model.named_parameters():
        if p.dim() != 2 or not releasable(model, n):
            continue
        found = _cpu_fast_blocks(ckpt, n, p.shape[0])
        if found is not None:
            lanes = n != EMBED and found[1] in cpu.INTERLEAVED and p.shape[0] % 8 == 0
            out[n] = found[0].numel() * (2 if lanes else 1)
    return out


def released_weight(shape: tuple, blocks: tuple | None = None, param: bool = False) -> torch.Tensor:
    """A float32 weight of `shape` without values (an nn.Parameter if `param`): every element views one NaN (views of
    it stay one storage; a reader that was missed computes NaN, not plausible numbers). `.released` is True; blocks:
    its GGUF (uint8 rows, type id), kept as `.ggml_blocks` (weights.loader._keep_blocks). The CPU multiplies such
    weights on their blocks (runtime.cpu_compile.dense_copies); runtime.cpu_compile._restore_floats dequantizes them
    back."""
    w = torch.full((1, 1), float("nan")).expand(shape)
    if param:
        w = nn.Parameter(w, requires_grad=False)
    w.released = True
    if blocks is not None:
        w.ggml_blocks = (*blocks, w._version)
    return w
