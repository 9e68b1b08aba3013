"""`moetier quantize SRC --type Q8_0 [--out FILE.gguf]`: an HF directory or a GGUF -> a GGUF that
llama.cpp loads (its tensor names, metadata and tokenizer keys).

Tensors stream one at a time (read lazily, quantized, written), so memory stays near one layer's
experts. Legacy types (Q8_0, Q4_0, F16, BF16) use gguf-py's numpy quantizers; K/i-quant mixes
(Q4_K_M ...) use the `libgguf` package (ggml's reference quantizers) and llama.cpp's mix rules.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, UserError

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "IQ4_XS"]
FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18,
             "IQ4_XS": 30, "BF16": 32}   # llama_ftype
MIX_DEFAULT = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "IQ4_XS": "IQ4_XS"}
# a 256-block type on rows it does not divide -> llama.cpp's fallback (then F16 if that fails too)
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write a GGUF (F32/F16/BF16/Q8_0/Q4_0/Q4_K_M ...) from a model",
                       description="Convert SRC (a Hugging Face model directory or a GGUF file) into a GGUF file "
                                   "of the chosen type that both moetier and llama.cpp load. Norms, routers and "
                                   "biases stay F32, as llama.cpp keeps them. K-quant mixes need `pip install libgguf`.")
    p.add_argument("src", metavar="SRC", help="model directory (config.json + *.safetensors) or .gguf file")
    p.add_argument("--type", "-t", dest="qtype", default="Q8_0", type=str.upper, choices=TYPES,
                   help="storage type (default Q8_0); Q4_K_M etc. are llama.cpp's per-tensor mixes")
    p.add_argument("--out", "-o", default=None, metavar="FILE.gguf", help="output file (default: next to SRC)")
    p.add_argument("--split-max-tensors", type=int, default=0, metavar="N",
                   help="write a split set (-00001-of-0000N.gguf) with at most N tensors per file")
    p.set_defaults(func=main)


def main(args) -> int:
    out = quantize(args.src, args.qtype, args.out, split_max_tensors=args.split_max_tensors, progress=True)
    print(out)
    return 0


def _gtype(name: str):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType[name]


def use_more_bits(layer: int, n_layer: int) -> bool:
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def tensor_type(name: str, shape: tuple, ftype: str, n_layer: int, n_expert: int) -> str:
    """The storage type of one GGUF tensor, following llama.cpp (convert_hf_to_gguf.py for plain
    types, llama-quant.cpp's llama_tensor_get_type for the K mixes)."""
    keep_f32 = ("_norm.weight", "ffn_gate_inp.", "exp_probs_b", "attn_sinks")
    if len(shape) < 2 or not name.endswith(".weight") or any(k in name for k in keep_f32):
        return "F32"
    t = MIX_DEFAULT.get(ftype, ftype)
    if ftype in MIX_DEFAULT:
        m = re.match(r"^blk\.(\d+)\.", name)
        layer = int(m[1]) if m else None
        more = layer is not None and use_more_bits(layer, n_layer)
        if name == "output.weight":
            t = "Q6_K"
        elif "attn_v.weight" in name:
            if n_expert == 8:
                t = "Q8_0"
            elif ftype in ("Q4_K_M", "Q5_K_M") and more:
                t = "Q6_K"
            elif ftype == "Q4_K_S" and layer < 4:
                t = "Q5_K"
        elif "attn_k.weight" in name and n_expert == 8:
            t = "Q8_0"
        elif "ffn_down" in name:
            if ftype in ("Q4_K_M", "Q5_K_M") and more:
                t = "Q6_K"
            elif ftype in ("Q4_K_S", "IQ4_XS") and layer < n_layer // 8:
                t = "Q5_K"
        elif "attn_output.weight" in name and n_expert == 8 and ftype in ("Q4_K_M", "Q4_K_S", "IQ4_XS"):
            t = "Q5_K"
    from gguf import GGML_QUANT_SIZES
    if shape[-1] % GGML_QUANT_SIZES[_gtype(t)][0]:
        t = FALLBACK.get(t, t)
        if shape[-1] % GGML_QUANT_SIZES[_gtype(t)][0]:
            t = "F16"
    return t


def encode(t: torch.Tensor, qtype: str) -> np.ndarray:
    """float tensor -> the stored array (float32 / float16, or uint8 [..., bytes per row])."""
    a = t.detach().float().contiguous().numpy()
    if qtype == "F32":
        return a
    if qtype == "F16":
        return a.astype(np.float16)
    from gguf.quants import quantize
    try:
        return quantize(a, _gtype(qtype))
    except NotImplementedError:
        pass
    try:
        import libgguf
    except ImportError:
        raise UserError(f"quantizing to {qtype} needs ggml's quantizers: pip install libgguf") from None
    return libgguf.quantize_rows(a, int(_gtype(qtype)))


# ---------------------------------------------------------------- sources: (metadata, tensor groups)
# A group is (GGUF names, torch shapes, produce() -> float tensors): one of our parameters may
# become several GGUF tensors (gate_up_proj -> ffn_gate_exps + ffn_up_exps).


def _hf_source(directory: Path):
    from ..models import model_class
    from ..weights.gguf_arch import BY_MODEL_TYPE, gguf_metadata, gguf_tensors
    from ..weights.gguf_tokenizer import gguf_tokenizer_fields
    from ..weights.loader import NamedCheckpoint, _fetch, read_config
    from ..weights.safetensors import Checkpoint
    args = read_config(directory)
    arch = BY_MODEL_TYPE.get(args.model_type)
    if arch is None:
        raise UserError(f"{directory}: model_type {args.model_type!r} has no GGUF architecture in moetier "
                        f"(known: {', '.join(sorted(BY_MODEL_TYPE))})")
    cls = model_class(args.model_type)
    ckpt = NamedCheckpoint(Checkpoint(directory), cls.CHECKPOINT)
    with torch.device("meta"):
        model = cls(args)
    meta = {"general.architecture": arch.gguf, "general.name": directory.name, **gguf_metadata(args, arch),
            **gguf_tokenizer_fields(directory, args.vocab_size)}
    groups = []
    for pname, p in model.named_parameters():
        if pname == "lm_head.weight" and (args.tie_word_embeddings or not ckpt.has(pname)):
            continue  # llama.cpp reuses token_embd when output.weight is absent
        found = gguf_tensors(pname, arch)
        if found is None:
            raise CheckpointError(f"{pname} has no GGUF name for architecture {arch.gguf}")
        fetch = (lambda n=pname: _fetch(ckpt, args, n).float())
        if found[0] == "experts":
            names = found[1]
            split = (lambda t, k=len(names): list(t.chunk(k, dim=1)))
            shapes = [tuple(s.shape) for s in split(p)]
            groups.append((names, shapes, lambda f=fetch, s=split: s(f())))
        else:
            spec, prefix = found
            shapes = [tuple(s.shape) for s in spec.write(p, args)]
            groups.append(([prefix + n for n in spec.names], shapes,
                           lambda f=fetch, s=spec: s.write(f(), args)))
    return meta, None, groups, args.num_hidden_layers, args.num_experts


def _gguf_source(path: Path):
    from ..weights.gguf import GGUFFile
    g = GGUFFile(path)
    arch = g.metadata.get("general.architecture")
    groups = [([n], [g.shape(n)], lambda n=n: [g.tensor(n).float()]) for n in g.keys()]
    types = {k: f.types for r in g.readers[:1] for k, f in r.fields.items()}
    meta = {k: v for k, v in g.metadata.items() if not k.startswith("split.")}
    n_layer = meta.get(f"{arch}.block_count", 0)
    return meta, types, groups, n_layer, meta.get(f"{arch}.expert_count", 0) or 0


def _add_kv(w, key: str, value, types=None) -> None:
    from gguf import GGUFValueType as V
    if types:                                   # copied from a GGUF: keep its exact types
        w.add_key_value(key, value, types[0], sub_type=types[-1] if types[0] == V.ARRAY else None)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list) and value:
        w.add_array(key, value)


def default_out(src: Path, qtype: str) -> Path:
    if src.is_dir():
        return src.parent / f"{src.name}-{qtype}.gguf"
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", src.stem)
    return src.with_name(f"{stem}-{qtype}.gguf")


def quantize(src: str | Path, qtype: str = "Q8_0", out: str | Path | None = None, split_max_tensors: int = 0,
             progress: bool = False) -> Path:
    """Write SRC as a GGUF of `qtype`; -> the output path (the first part of a split set)."""
    from gguf import GGML_QUANT_VERSION, GGUFWriter
    from ..weights.gguf import is_gguf
    src = Path(src).expanduser()
    qtype = qtype.upper()
    if qtype not in TYPES:
        raise UserError(f"unknown --type {qtype}; choose one of {', '.join(TYPES)}")
    if not src.exists():
        raise UserError(f"{src}: no such model directory or GGUF file")
    meta, types, groups, n_layer, n_expert = _gguf_source(src) if is_gguf(src) else _hf_source(src)
    out = Path(out) if out else default_out(src, qtype)
    if out.resolve() == src.resolve():
        raise UserError(f"--out {out} is the source file; choose another name")
    arch = meta["general.architecture"]
    w = GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    for key, value in meta.items():
        if key not in ("general.architecture", "general.file_type", "general.quantization_version",
                       "general.alignment"):
            _add_kv(w, key, value, (types or {}).get(key))
    w.add_file_type(FILE_TYPE[qtype])
    w.add_quantization_version(GGML_QUANT_VERSION)
    plan = []
    for names, shapes, produce in groups:
        kinds = [tensor_type(n, s, qtype, n_layer, n_expert) for n, s in zip(names, shapes)]
        for n, s, k in zip(names, shapes, kinds):
            w.add_tensor_info(n, s, np.dtype(np.float32), _nbytes(s, k), raw_dtype=_gtype(k))
        plan.append((produce, kinds))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = _bar(len(plan), f"quantizing to {qtype}", progress)
    for produce, kinds in plan:
        for t, k in zip(produce(), kinds):
            w.write_tensor_data(encode(t, k))
        bar.update(1)
    bar.close()
    w.close()
    return w.format_shard_names(out)[0] if split_max_tensors else out


def _nbytes(shape: tuple, qtype: str) -> int:
    from gguf import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[_gtype(qtype)]
    return int(np.prod(shape)) // block * size


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="tensor", leave=False, disable=not (enabled and sys.stderr.isatty()))
