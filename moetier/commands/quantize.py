"""`moetier quantize SRC --type Q8_0 [--out FILE.gguf]`: an HF directory or a GGUF -> a GGUF that
llama.cpp loads (its tensor names, metadata and tokenizer keys).

Tensors stream one at a time (read lazily, quantized, written), so memory stays near one layer's
experts. Which tensor takes which type follows llama-quantize's mixes (quant/mixes.py). Q8_0, Q4_0, F16
and BF16 rows use gguf-py's numpy quantizers; the K- and i-quants, and any rows with an importance matrix
(--imatrix), the `libgguf` package (ggml's quantizers).
"""
from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, UserError
from ..quant.mixes import FILE_TYPES, Mix

TYPES = list(FILE_TYPES)
log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write a GGUF (F32/F16/BF16/Q8_0/Q4_0/Q4_K_M/IQ3_XXS ...) from a model",
                       description="Convert SRC (a Hugging Face model directory or a GGUF file) into a GGUF file "
                                   "of the chosen type that both moetier and llama.cpp load, with llama-quantize's "
                                   "per-tensor mixes. Norms, routers and biases stay F32, as llama.cpp keeps them. "
                                   "K- and i-quants need `pip install libgguf`.")
    p.add_argument("src", metavar="SRC", help="model directory (config.json + *.safetensors) or .gguf file")
    p.add_argument("--type", "-t", dest="qtype", default="Q8_0", type=str.upper, choices=TYPES,
                   help="file type, as llama-quantize names them (default Q8_0): " + ", ".join(TYPES))
    p.add_argument("--imatrix", default=None, metavar="FILE",
                   help="importance matrix (llama-imatrix's .gguf or legacy .dat): better low-bit quants; required "
                        "for IQ1_S, IQ2_XXS, IQ2_XS")
    p.add_argument("--pure", action="store_true",
                   help="every quantized tensor in the type's default format, no per-tensor mix "
                        "(llama-quantize --pure)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="threads for ggml's quantizers (default: every CPU)")
    p.add_argument("--out", "-o", default=None, metavar="FILE.gguf", help="output file (default: next to SRC)")
    p.add_argument("--split-max-tensors", type=int, default=0, metavar="N",
                   help="write a split set (-00001-of-0000N.gguf) with at most N tensors per file")
    p.set_defaults(func=main)


def main(args) -> int:
    out = quantize(args.src, args.qtype, args.out, split_max_tensors=args.split_max_tensors, progress=True,
                   imatrix=args.imatrix, pure=args.pure, threads=args.threads)
    print(out)
    return 0


def _gtype(name: str):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType[name]


def encode(t: torch.Tensor, qtype: str, importance: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """float tensor -> the stored array (float32 / float16, or uint8 [..., bytes per row]). `importance`: the
    tensor's imatrix entry ([K], or [E * K] for experts [E, N, K]: one K-slice per expert, as llama-quantize).
    ggml's quantizers run on `threads` threads (row chunks; libgguf releases the GIL)."""
    a = t.detach().float().contiguous().numpy()
    if qtype == "F32":
        return a
    if qtype == "F16":
        return a.astype(np.float16)
    from gguf.quants import quantize
    if importance is None or qtype == "BF16":
        try:
            return quantize(a, _gtype(qtype))
        except NotImplementedError:
            pass
    try:
        import libgguf
    except ImportError:
        raise UserError(f"quantizing to {qtype} needs ggml's quantizers: pip install libgguf") from None
    tid, k = int(_gtype(qtype)), a.shape[-1]
    if tid not in _WARM:            # ggml builds an i-quant's search tables on first use: once, before any thread
        libgguf.quantize_rows(np.ascontiguousarray(a.reshape(-1, k)[:1]), tid,
                              imatrix=None if importance is None else importance[:k])
        _WARM.add(tid)
    mats = a.reshape(-1, *a.shape[-2:]) if a.ndim == 3 else a[None]
    jobs = []                                           # (rows [n, K], importance [K] or None)
    for i, m in enumerate(mats):
        imp = None if importance is None else importance[i * k:(i + 1) * k] if importance.size > k else importance
        step = max(1, -(-m.shape[0] // max(1, threads // len(mats))))
        jobs += [(m[r:r + step], imp) for r in range(0, m.shape[0], step)]
    run = (lambda job: libgguf.quantize_rows(np.ascontiguousarray(job[0]), tid, imatrix=job[1]))
    if threads > 1 and len(jobs) > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(min(threads, len(jobs))) as pool:
            parts = list(pool.map(run, jobs))
    else:
        parts = [run(j) for j in jobs]
    return np.concatenate(parts).reshape(*a.shape[:-1], -1)


_WARM: set[int] = set()


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
             progress: bool = False, imatrix: str | Path | None = None, pure: bool = False,
             threads: int | None = None) -> Path:
    """Write SRC as a GGUF of file type `qtype` (FILE_TYPES: llama-quantize's names and mixes; `pure`: no mix);
    `imatrix`: llama-imatrix's file; `threads`: ggml's quantizers' threads (default: every CPU).
    -> the output path (the first part of a split set)."""
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
    importance = load_imatrix(imatrix) if imatrix else None
    threads = threads or os.cpu_count() or 1
    mix = Mix(qtype, n_layer, n_expert, _n_gqa(meta, arch), [n for names, _, _ in groups for n in names],
              has_imatrix=importance is not None)
    plan, warnings = [], []
    for names, shapes, produce in groups:
        kinds = [mix.tensor_type(n, s, pure) for n, s in zip(names, shapes)]
        warnings += [_check_importance(mix, n, s, k, importance) for n, s, k in zip(names, shapes, kinds)]
        plan.append((names, shapes, produce, kinds))
    if (first := next((w for w in warnings if w), None)) is not None:
        log.warning(first)
    w = GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    for key, value in meta.items():
        if key not in ("general.architecture", "general.file_type", "general.quantization_version",
                       "general.alignment"):
            _add_kv(w, key, value, (types or {}).get(key))
    w.add_file_type(FILE_TYPES[qtype][0])
    w.add_quantization_version(GGML_QUANT_VERSION)
    for names, shapes, _, kinds in plan:
        for n, s, k in zip(names, shapes, kinds):
            w.add_tensor_info(n, s, np.dtype(np.float32), _nbytes(s, k), raw_dtype=_gtype(k))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = _bar(len(plan), f"quantizing to {qtype}", progress)
    for names, _, produce, kinds in plan:
        for n, t, k in zip(names, produce(), kinds):
            w.write_tensor_data(encode(t, k, importance.get(n) if importance else None, threads))
        bar.update(1)
    bar.close()
    w.close()
    return w.format_shard_names(out)[0] if split_max_tensors else out


def _n_gqa(meta: dict, arch: str) -> int:
    """Query heads per KV head (llama.cpp's n_gqa; per-layer lists: the first layer's)."""
    first = (lambda v: (v[0] if v else 0) if isinstance(v, (list, tuple)) else (v or 0))
    heads, kv = first(meta.get(f"{arch}.attention.head_count")), first(meta.get(f"{arch}.attention.head_count_kv"))
    return heads // kv if heads and kv else 1


def load_imatrix(path: str | Path) -> dict[str, np.ndarray]:
    """llama-imatrix's file (GGUF or the legacy .dat) -> {GGUF tensor name: mean squared activation per input
    column, [K] or, for experts, [E * K]}."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"--imatrix {path}: no such file")
    try:
        import libgguf
    except ImportError:
        raise UserError("reading an importance matrix needs ggml's quantizers: pip install libgguf") from None
    try:
        data = libgguf.load_imatrix(path)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"--imatrix {path}: not an importance matrix llama.cpp writes ({e})") from None
    for name, v in data.items():
        if not np.isfinite(v).all():
            raise UserError(f"--imatrix {path}: {name} holds non-finite values; compute the matrix again")
    return data


def _check_importance(mix: Mix, name: str, shape: tuple, qtype: str, importance: dict | None) -> str | None:
    """llama-quantize's rules: a matrix entry must match the tensor's K (x experts); a type that needs one and
    has none is an error (ggml's IQ1_S / IQ2_XXS / IQ2_XS quantizers cannot run without it) or a warning
    (llama.cpp refuses IQ3_XXS / IQ2_S / IQ1_M and Q2_K_S's Q2_K without one; ggml's quantizers run): -> its text."""
    v = importance.get(name) if importance else None
    want = shape[-1] * (shape[0] if len(shape) == 3 else 1)
    if v is not None and v.size != want and name != "token_embd.weight":
        raise UserError(f"the importance matrix has {v.size} values for {name}, which needs {want} "
                        f"({shape[-1]} columns x {want // shape[-1]} matrices): it was computed for another model")
    if v is None and mix.requires_imatrix(name, qtype):
        msg = f"{name} as {qtype} needs an importance matrix (--imatrix FILE from llama-imatrix)"
        if qtype in ("IQ1_S", "IQ2_XXS", "IQ2_XS"):
            raise UserError(f"{msg}: ggml cannot quantize to {qtype} without one")
        return f"{msg}; quantizing without one, as llama.cpp would refuse to: expect lower quality"
    return None


def _nbytes(shape: tuple, qtype: str) -> int:
    from gguf import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[_gtype(qtype)]
    return int(np.prod(shape)) // block * size


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="tensor", leave=False, disable=not (enabled and sys.stderr.isatty()))
