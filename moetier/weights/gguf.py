"""GGUF checkpoints (llama.cpp's format): one file or a `-00001-of-0000N.gguf` split set, mmapped.

`GGUFFile` is the raw view (metadata, tensors by GGUF name, storage bytes); `GGUFCheckpoint` shows
it through an architecture's table (gguf_arch.py) with NamedCheckpoint's interface, so the loader
treats both formats alike. Nothing is read until a tensor is asked for; quantized tensors are
dequantized then, and `expert_raw` hands one expert's storage bytes to the memory tiers.
`pack_experts` keeps a model's expert tensors in their GGML format instead (models.quant_experts).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch

from ..config import ModelArgs
from ..errors import CheckpointError
from .gguf_arch import GLOBAL, Arch, Tensor, arch_of

log = logging.getLogger(__name__)
SPLIT = re.compile(r"^(?P<base>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # F32, F16, BF16: read as is
INT_TYPES = {24: torch.int8, 25: torch.int16, 26: torch.int32, 27: torch.int64, 28: torch.float64}


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    return p.suffix == ".gguf" and not p.is_dir()


def qtype_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


# GGML types the CPU kernels read after an exact conversion at load: llama.cpp's K-quant mixes store rows whose length
# is not a multiple of 256 as Q5_0 (the default model's experts, attention q and embeddings in Q4_K_M); as Q8_0 they
# take the int8 kernels instead of being dequantized to float32 (4.6x the bytes; decode at 0.22x llama.cpp's speed
# on the Zen 4 dev box, session 13)
CPU_EXACT_AS = {"Q5_0": "Q8_0"}


def cpu_blocks(raw: torch.Tensor, qtype: int) -> tuple[torch.Tensor, int]:
    """(blocks, type id) as the CPU kernels read them: CPU_EXACT_AS types converted (new memory), others as they are."""
    from gguf import GGMLQuantizationType
    name = qtype_name(qtype)
    if name not in CPU_EXACT_AS:
        return raw, qtype
    from ..quant.legacy import q5_0_as_q8_0
    return q5_0_as_q8_0(raw), int(GGMLQuantizationType[CPU_EXACT_AS[name]])


def dequantize(raw: torch.Tensor, qtype: int, shape: tuple) -> torch.Tensor:
    """Storage bytes (uint8) -> float32 of `shape`. moetier.quant's torch reference when it reads
    the type, else gguf-py's numpy reference."""
    try:
        from ..quant.formats import dequantize as torch_dequantize
        return torch_dequantize(raw, qtype, shape)
    except (ImportError, ValueError):
        pass
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as np_dequantize
    out = np_dequantize(raw.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


class GGUFFile:
    """All tensors of a GGUF model (one file or every part of a split set), by GGUF name."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader
        self.path = self.dir = Path(path)   # `dir` names the checkpoint in messages, like Checkpoint.dir
        if not self.path.exists():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        self.parts = split_parts(self.path)
        self.readers = []
        for p in self.parts:
            try:
                self.readers.append(GGUFReader(p, "c"))   # copy-on-write mmap: zero-copy, writable views
            except ValueError as e:
                raise CheckpointError(f"{p}: cannot read as GGUF ({e}); if it names an unknown tensor type, "
                                      "the file is newer than the installed gguf package: pip install -U gguf") from None
            except OSError as e:
                raise CheckpointError(f"cannot read {p}: {e.strerror}") from None
        self.metadata = {name: _value(f) for name, f in self.readers[0].fields.items()
                         if not name.startswith("GGUF.")}
        self.tensors = {t.name: t for r in self.readers for t in r.tensors}
        want = self.metadata.get("split.tensors.count")
        if want is not None and want != len(self.tensors):
            raise CheckpointError(f"{self.path}: the split set should hold {want} tensors but its "
                                  f"{len(self.parts)} parts hold {len(self.tensors)}; a part is truncated or stale")

    def keys(self):
        return self.tensors.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """Torch order (GGUF lists dims fastest-first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def qtype(self, name: str) -> int:
        return int(self.tensors[name].tensor_type)

    def raw(self, name: str) -> torch.Tensor:
        """The stored bytes as a zero-copy tensor: uint8 [..., bytes per row] for block formats,
        the element dtype for F32/F16/I32... (BF16 comes as uint8 [..., 2 * K])."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {name} not found in the GGUF file")
        return torch.from_numpy(self.tensors[name].data)

    def tensor(self, name: str) -> torch.Tensor:
        """Float tensor in torch order: F32/F16/BF16 as stored (zero-copy), block formats dequantized."""
        raw, qtype, shape = self.raw(name), self.qtype(name), self.shape(name)
        return to_float(raw, qtype, shape, f"{self.path}: tensor {name}")


def _value(field):
    """A metadata value in Python; FLOAT32 scalars as the shortest decimal that round-trips
    (1e-06, not 9.99999997e-07), as config.json would say it."""
    from gguf import GGUFValueType
    v = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        v = float(str(np.float32(v)))
    return v


def to_float(raw: torch.Tensor, qtype: int, shape: tuple, what: str) -> torch.Tensor:
    if qtype in FLOAT_TYPES or qtype in INT_TYPES:    # stored as is: reinterpret the bytes
        return raw.view({**FLOAT_TYPES, **INT_TYPES}[qtype]).reshape(shape)
    try:
        return dequantize(raw, qtype, shape)
    except (NotImplementedError, ValueError) as e:
        raise CheckpointError(f"{what} is stored as {qtype_name(qtype)}, which moetier cannot dequantize "
                              f"({e}); re-quantize the model, e.g. moetier quantize FILE --type Q8_0") from None


def split_parts(path: Path) -> list[Path]:
    """`model-00001-of-00003.gguf` (any part) -> every part, in order; else [path]."""
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['base']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF set of {count} files lacks {', '.join(missing)}; "
                              "download every part into the same directory")
    return parts


LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class GGUFCheckpoint:
    """A GGUF file seen through its architecture's table: our parameter names -> tensors.
    Same interface as loader.NamedCheckpoint (has / tensor / fused_tensor / expert_tensor)."""

    def __init__(self, gguf: GGUFFile):
        self.ckpt = gguf
        self.metadata = gguf.metadata
        self.arch: Arch = arch_of(gguf.metadata.get("general.architecture"), str(gguf.path))
        shapes = {n: gguf.shape(n) for n in gguf.keys()}
        self.args = ModelArgs.from_gguf(gguf.metadata, shapes)

    # -- our name -> the GGUF tensors it is made of
    def _spec(self, name: str) -> tuple[Tensor, str] | None:
        if name in GLOBAL:
            spec, prefix = GLOBAL[name], ""
        else:
            m = LAYER.match(name)
            if not m or m[2] not in self.arch.layer:
                return None
            spec, prefix = self.arch.layer[m[2]], f"blk.{m[1]}."
        for alt in spec if isinstance(spec, list) else [spec]:
            if all(prefix + n in self.ckpt for n in alt.names):
                return alt, prefix
        return None

    def has(self, name: str) -> bool:
        return self._spec(name) is not None

    def tensor(self, name: str) -> torch.Tensor:
        found = self._spec(name)
        if found is None:
            raise CheckpointError(f"{self.ckpt.path}: no GGUF tensor for {name} "
                                  f"(architecture {self.arch.gguf}); is the file complete?")
        spec, prefix = found
        return spec.read([self.ckpt.tensor(prefix + n) for n in spec.names], self.args)

    def blocks(self, name: str) -> tuple[torch.Tensor, int] | None:
        """Our 2-D weight `name` in its stored block format: (uint8 [rows, bytes per row], a zero-copy
        view of the mmap; GGML type id), when it is one GGUF tensor read as is (no permute or join)
        and not F32/F16/BF16; else None."""
        found = self._spec(name)
        if found is None or found[0].to_ours is not None or len(found[0].names) != 1:
            return None
        gname = found[1] + found[0].names[0]
        qtype, shape = self.ckpt.qtype(gname), self.ckpt.shape(gname)
        if qtype in FLOAT_TYPES or qtype in INT_TYPES or len(shape) != 2:
            return None
        return self.ckpt.raw(gname).view(torch.uint8).reshape(shape[0], -1), qtype

    # -- experts: blk.N.ffn_{gate,up,down}_exps [E, rows, cols] hold every expert of a layer
    def _expert_names(self, prefix: str, name: str) -> list[str] | None:
        m = re.match(r"^model\.layers\.(\d+)\." + re.escape(self.arch.experts_prefix) + "$", prefix)
        parts = self.arch.experts.get(name)
        if not m or parts is None:
            return None
        names = [f"blk.{m[1]}.{p}" for p in parts]
        return names if all(n in self.ckpt for n in names) else None

    def fused_tensor(self, prefix: str, name: str) -> torch.Tensor | None:
        names = self._expert_names(prefix, name)
        if names is None:
            return None
        ts = [self.ckpt.tensor(n) for n in names]
        return ts[0] if len(ts) == 1 else torch.cat([t.float() for t in ts], dim=1)

    def expert_tensor(self, prefix: str, name: str, e: int) -> torch.Tensor:
        """One expert's [rows, cols] (or bias [rows]), dequantizing only its slice."""
        ts = [to_float(raw, qtype, shape, f"{self.ckpt.path}: {prefix}.experts.{name}")
              for raw, qtype, shape in self.expert_raw_parts(prefix, name, e)]
        return ts[0] if len(ts) == 1 else torch.cat([t.float() for t in ts], dim=0)

    def expert_raw_parts(self, prefix: str, name: str, e: int) -> list[tuple[torch.Tensor, int, tuple]]:
        """Expert e's storage bytes per GGUF tensor: [(uint8 view [rows, bytes/row], qtype, shape)].
        gate_up_proj has two parts (gate, up), down_proj one. Zero-copy views of the mmap."""
        names = self._expert_names(prefix, name)
        if names is None:
            raise CheckpointError(f"{self.ckpt.path}: no GGUF expert tensors for {prefix}.experts.{name} "
                                  f"(architecture {self.arch.gguf})")
        out = []
        for n in names:
            raw = self.ckpt.raw(n)[e]
            out.append((raw.view(torch.uint8) if raw.dtype != torch.uint8 else raw, self.ckpt.qtype(n),
                        self.ckpt.shape(n)[1:]))
        return out

    def expert_raw(self, prefix: str, name: str, e: int) -> tuple[torch.Tensor, int, tuple]:
        """Expert e of our stacked param `name` in storage format: (uint8 [rows, bytes/row], qtype,
        shape). gate_up_proj's gate and up rows are joined (blocks never straddle rows, so the
        bytes of [2I, D] are the gate bytes then the up bytes); they must share a qtype."""
        parts = self.expert_raw_parts(prefix, name, e)
        if len(parts) == 1:
            return parts[0]
        qtypes = {q for _, q, _ in parts}
        if len(qtypes) > 1:
            raise CheckpointError(f"{self.ckpt.path}: {prefix}.experts.{name} mixes storage types "
                                  f"{', '.join(qtype_name(q) for q in qtypes)}; use expert_raw_parts")
        shape = (sum(s[0] for _, _, s in parts), *parts[0][2][1:])
        return torch.cat([r.reshape(s[0], -1) for r, _, s in parts]), qtypes.pop(), shape


def pack_experts(model, ckpt: GGUFCheckpoint, device: str, dtype) -> dict[str, int]:
    """Fill every DenseExperts whose params are still on meta (load_model skipped them): a layer
    whose gate/up share a format and gate/up and down (that one may differ: Q4_K_M's Q6_K down) have
    kernels on `device` becomes a QuantExperts holding the
    stored blocks (CPU: zero-copy views of the mmap; CUDA: repacked planes on the device); any other
    layer is dequantized as before. -> {"packed": layers, "dequantized": layers}."""
    from ..kernels import ops
    from ..models.layers import DenseExperts
    from ..models.quant_experts import QuantExperts, cpu_formats, cuda_formats
    from .loader import _fetch, _set_param
    cuda = str(device).startswith("cuda")
    formats = cuda_formats() if cuda else cpu_formats()
    counts, why = {"packed": 0, "dequantized": 0}, set()
    for name, mod in list(model.named_modules()):
        if type(mod) is not DenseExperts or not mod.gate_up_proj.is_meta:
            continue
        prefix, _, attr = name.rpartition(".")
        names = (ckpt._expert_names(prefix, "gate_up_proj") or []) + (ckpt._expert_names(prefix, "down_proj") or [])
        kinds = [qtype_name(ckpt.ckpt.qtype(n)) for n in names]      # gate, up, down
        if not cuda:                                                  # Q5_0 -> Q8_0 (exact), as the C kernels read
            kinds = [CPU_EXACT_AS.get(k, k) if CPU_EXACT_AS.get(k) in formats else k for k in kinds]
        fmt = (kinds[0], kinds[2]) if len(names) == 3 and kinds[0] == kinds[1] else None
        if fmt and set(fmt) <= formats and not (cuda and ops.as_act(mod.act) is None):
            gate, up, down = (ckpt.ckpt.raw(n) if cuda else cpu_blocks(ckpt.ckpt.raw(n), ckpt.ckpt.qtype(n))[0]
                              for n in names)
            biases = None
            if mod.gate_up_bias is not None:
                biases = tuple(ckpt.fused_tensor(prefix, b).to(device=device, dtype=dtype).contiguous()
                               for b in ("gate_up_bias", "down_bias"))
            packed = QuantExperts(fmt, gate, up, down, biases, mod.act, "planes" if cuda else "raw", device)
            setattr(model.get_submodule(prefix), attr, packed)
            counts["packed"] += 1
            continue
        why.add("/".join(sorted(set(kinds))) or "no fused GGUF expert tensors")
        for pname, p in list(mod.named_parameters()):
            full = f"{name}.{pname}"
            t = _fetch(ckpt, ckpt.args, full)
            _set_param(model, full, t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype).contiguous())
        counts["dequantized"] += 1
    if counts["dequantized"]:
        log.info("GGUF experts: %d layers computed on their stored format, %d dequantized at load (%s: no %s "
                 "kernel for that format or mix)", counts["packed"], counts["dequantized"], ", ".join(sorted(why)),
                 "CUDA" if cuda else "CPU")
    return counts


def open_checkpoint(path: str | Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(GGUFFile(path))
