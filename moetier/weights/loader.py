"""Build a model from a Hugging Face directory: config -> ModelArgs -> module (on meta) -> tensors.

Each architecture's `Model.CHECKPOINT` table says how checkpoint names differ from ours:
  "renames":  [(regex, replacement), ...] applied to checkpoint names (e.g. Mixtral's
              block_sparse_moe -> mlp),
  "experts":  {our stacked param: [per-expert names with {e}, concatenated on dim 0]},
  "fused":    {our stacked param: (checkpoint suffix, transform)} for fused layouts that need
              reshaping (GPT-OSS's interleaved [E, D, 2I] gate/up).
A fused tensor already in our layout (transformers 5's `experts.gate_up_proj`) loads by name.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from torch import nn

from ..config import ModelArgs
from ..errors import CheckpointError, UserError
from ..models import model_class
from .gguf import is_gguf, open_checkpoint
from .safetensors import Checkpoint

EXPERT_PARAM = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<name>[A-Za-z_]+)$")


def read_config(directory: Path) -> ModelArgs:
    path = directory / "config.json"
    if not directory.exists():
        raise UserError(f"{directory}: no such model directory or file")
    if not path.exists():
        raise CheckpointError(f"{path}: missing; a model directory needs config.json next to its *.safetensors")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if "model_type" not in cfg:
        raise CheckpointError(f"{path}: has no model_type; cannot tell which architecture this is")
    return ModelArgs.from_hf(cfg)


class ExpertSource:
    """Per-expert weights of one MoE layer, read lazily from the checkpoint in our layout:
    get(e) -> {"gate_up_proj": [2I, D], "down_proj": [D, I], ...biases}."""

    def __init__(self, ckpt: "NamedCheckpoint", prefix: str, names: list[str]):
        self.ckpt, self.prefix, self.names = ckpt, prefix, names

    def get(self, e: int) -> dict[str, torch.Tensor]:
        return {n: self.ckpt.expert_tensor(self.prefix, n, e) for n in self.names}

    def stacked(self, name: str, num_experts: int) -> torch.Tensor:
        fused = self.ckpt.fused_tensor(self.prefix, name)
        if fused is not None:
            return fused
        return torch.stack([self.ckpt.expert_tensor(self.prefix, name, e) for e in range(num_experts)])


class NamedCheckpoint:
    """A checkpoint seen through an architecture's name table."""

    def __init__(self, ckpt: Checkpoint, table: dict):
        self.ckpt, self.table = ckpt, table
        self.names: dict[str, str] = {}
        rules = [(re.compile(a), b) for a, b in table.get("renames", [])]
        for k in ckpt.keys():
            ours = k
            for rx, rep in rules:
                ours = rx.sub(rep, ours)
            self.names[ours] = k

    def has(self, name: str) -> bool:
        return name in self.names

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(f"{self.ckpt.dir}: tensor {name} not found in the checkpoint")
        return self.ckpt.tensor(self.names[name])

    def fused_tensor(self, prefix: str, name: str) -> torch.Tensor | None:
        full = f"{prefix}.experts.{name}"
        if full in self.names:
            return self.tensor(full)
        spec = self.table.get("fused", {}).get(name)
        if spec is not None and f"{prefix}.experts.{spec[0]}" in self.names:
            return spec[1](self.tensor(f"{prefix}.experts.{spec[0]}"))
        return None

    def expert_tensor(self, prefix: str, name: str, e: int) -> torch.Tensor:
        fused = self.fused_tensor(prefix, name)
        if fused is not None:
            return fused[e]
        parts = self.table.get("experts", {}).get(name)
        if parts is None:
            raise CheckpointError(f"{self.ckpt.dir}: no tensor for {prefix}.experts.{name} "
                                  "(neither fused nor per-expert names found)")
        ts = [self.tensor(f"{prefix}.{p.format(e=e)}") for p in parts]
        return ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)


ALIGN = 64     # bytes: torch's CPU allocator's alignment


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """value becomes the parameter; a CPU tensor that starts off a 64-byte line (a view of a mmapped file:
    safetensors aligns data to 8 bytes, GGUF to 32) is copied to one that does not. torch's CPU kernels pick their
    summation order by the operands' alignment, so a weight read in place gave other last bits than the same weight
    copied into the memory tiers' buffers (5.96e-07 apart on a tiny Qwen3-MoE): with every weight aligned, placement
    changes nothing, whatever the file's header length."""
    if value.device.type == "cpu" and value.data_ptr() % ALIGN:
        value = value.clone()
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    setattr(mod, attr, nn.Parameter(value, requires_grad=False))


def load_model(directory: str | Path, device: str = "cpu", dtype=torch.float32, progress: bool = False,
               skip: re.Pattern | None = None, quant_dense: bool = False, host_embed: bool = False,
               release_dense: bool = False):
    """-> (model, args, NamedCheckpoint or GGUFCheckpoint). `directory` is a model directory or a
    .gguf file. Params whose names match `skip` stay on meta (the memory tiers load experts themselves).
    quant_dense (GGUF on CUDA): the dense linear layers models.quant_linear picks load as QuantLinear on their
    file blocks (no float copy). host_embed (CUDA): the token embeddings stay in pinned RAM
    (models.host_embedding), rows gathered over PCIe. release_dense (GGUF on the CPU, float32, the C kernels): a
    Linear's weight stored in a format the C kernels read is never dequantized: it loads as
    models.quant_linear.released_weight (its blocks kept, no values); the caller must give those linears their
    blocks (runtime.cpu_compile.dense_copies) before any forward."""
    directory = Path(directory)
    if is_gguf(directory):  # a .gguf file (or one part of a split set): GGUFCheckpoint, same interface
        ckpt = open_checkpoint(directory)
        args = ckpt.args
    else:
        args = read_config(directory)
    try:
        cls = model_class(args.model_type)
    except UserError as e:
        raise CheckpointError(f"{directory if is_gguf(directory) else directory / 'config.json'}: {e}") from None
    if not is_gguf(directory):
        ckpt = NamedCheckpoint(Checkpoint(directory), cls.CHECKPOINT)
    with torch.device("meta"):
        model = cls(args)
    params = list(model.named_parameters())
    from ..models import quant_linear
    quant = quant_linear.gpu_blocks(ckpt, [n for n, _ in params], device) if quant_dense else {}
    from ..kernels.cpu import backend, dequantize_rows
    cpu_gguf = is_gguf(directory) and str(device) == "cpu"
    c_float32 = cpu_gguf and dtype == torch.float32 and backend() == "c"
    release = release_dense and c_float32
    bar = _progress(len(params), f"loading {directory.name}", progress)
    for name, p in params:
        if (skip is not None and skip.search(name)) or name in quant:
            bar.update(1)
            continue
        blocks = _cpu_fast_blocks(ckpt, name, p.shape[0]) if cpu_gguf and p.dim() == 2 else None
        if release and blocks is not None and releasable(model, name):
            _release(model, name, tuple(p.shape), blocks)
            bar.update(1)
            continue
        # the C dequantizer where it reads the format: bit-exact with the torch one, without its temporaries (the
        # load's peak RSS was ~2x a float32 lm_head above the end's)
        t = dequantize_rows(blocks[1], blocks[0]) if c_float32 and blocks is not None else _fetch(ckpt, args, name)
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{directory}: tensor {name} has shape {tuple(t.shape)}, "
                                  f"but config.json implies {tuple(p.shape)}; the config and weights disagree")
        if host_embed and name == EMBED:
            _host_embedding(model, t.to(dtype), pin=str(device).startswith("cuda"))
            bar.update(1)
            continue
        t = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        _set_param(model, name, t.contiguous())
        if blocks is not None and name.endswith("weight"):
            _keep_blocks(model.get_parameter(name), blocks)
        bar.update(1)
    bar.close()
    quant_linear.install(model, quant, device)
    for mod in model.modules():  # buffers were computed on the CPU at construction
        for bname, buf in list(mod._buffers.items()):
            if buf is not None:
                mod._buffers[bname] = buf.to(device)
    model.eval()
    return model, args, ckpt


EMBED = "model.embed_tokens.weight"


def _host_embedding(model: nn.Module, table: torch.Tensor, pin: bool) -> None:
    """model.model.embed_tokens -> a HostEmbedding of `table` (a copy in pinned memory on CUDA machines)."""
    from ..models.host_embedding import HostEmbedding
    table = table.contiguous()
    model.model.embed_tokens = HostEmbedding(table.pin_memory() if pin else table.clone())


def _cpu_fast_blocks(ckpt, name: str, rows: int):
    """(blocks as the C kernels read them, type id) of the 2-D GGUF weight `name` (a tied lm_head: the embeddings')
    when its format is one the C kernels multiply on (kernels.cpu.FAST_TYPES, or convert to exactly), else None."""
    from ..kernels.cpu import FAST_TYPES
    from .gguf import CPU_EXACT_AS, cpu_blocks, qtype_name
    found = ckpt.blocks(name)
    if found is None and name == "lm_head.weight" and (ckpt.args.tie_word_embeddings or not ckpt.has(name)):
        found = ckpt.blocks(EMBED)                        # tied: _fetch reads the embeddings
    if found is None or found[0].shape[0] != rows \
            or CPU_EXACT_AS.get(qtype_name(found[1]), qtype_name(found[1])) not in FAST_TYPES:
        return None
    return cpu_blocks(*found)


def releasable(model: nn.Module, name: str) -> bool:
    """Whether param `name` of `model` loads without float values when its GGUF blocks are a C-kernel format
    (release_dense): a Linear's weight, or the token embeddings (a QuantEmbedding)."""
    mod_name, _, attr = name.rpartition(".")
    return name == EMBED and isinstance(model.model.embed_tokens, nn.Embedding) \
        or attr == "weight" and isinstance(model.get_submodule(mod_name), nn.Linear)


def _release(model: nn.Module, name: str, shape: tuple, blocks: tuple) -> None:
    """Param `name` (releasable) on its blocks: the embeddings a QuantEmbedding, a Linear's weight a released_weight."""
    from ..models.quant_linear import QuantEmbedding, released_weight
    if name == EMBED:
        model.model.embed_tokens = QuantEmbedding(*blocks, shape[1])
        return
    mod_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(mod_name), attr, released_weight(shape, blocks, param=True))


def _keep_blocks(p: nn.Parameter, blocks: tuple) -> None:
    """A dense 2-D GGUF weight stored in a format the C kernels multiply on (kernels.cpu.FAST_TYPES), or convert to
    exactly (gguf.CPU_EXACT_AS: Q5_0 as Q8_0), keeps its blocks beside the float copy: `param.ggml_blocks = (uint8
    [rows, bytes/row], type id, param._version)`; the compiled CPU decode step reads those
    (runtime.cpu_compile.dense_copies). Blocks in a FAST_TYPES format are views of the mmapped file: no copy."""
    p.ggml_blocks = (*blocks, p._version)


def _fetch(ckpt: NamedCheckpoint, args: ModelArgs, name: str) -> torch.Tensor:
    if ckpt.has(name):
        return ckpt.tensor(name)
    m = EXPERT_PARAM.match(name)
    if m and any(k.startswith(f"{m['prefix']}.experts.") and k.endswith("_blocks")
                 for k in getattr(ckpt, "names", ())):
        raise CheckpointError(f"{ckpt.ckpt.dir}: the experts are stored as MXFP4 (*_blocks/*_scales, as in the "
                              "official gpt-oss release), which moetier cannot read from safetensors yet; "
                              "use a BF16 checkpoint or a GGUF file of the model")
    if m:
        return ExpertSource(ckpt, m["prefix"], [m["name"]]).stacked(m["name"], args.num_experts)
    if name == "lm_head.weight" and (args.tie_word_embeddings or not ckpt.has(name)) \
            and ckpt.has("model.embed_tokens.weight"):
        return ckpt.tensor("model.embed_tokens.weight")
    raise CheckpointError(f"{ckpt.ckpt.dir}: tensor {name} not found; expected for model_type "
                          f"{args.model_type!r}. Is the checkpoint complete?")


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, desc: str, enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="tensor", leave=False)
