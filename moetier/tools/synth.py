"""`moetier synth`: write a real checkpoint (safetensors directory or GGUF file) with random weights
and the exact shapes of a big MoE model, then check that its routing is spread like a trained one.

    report = synth("qwen3-30b-a3b", "BF16", "out/q30", layers=24, skew=0.5)

Weights are generated tensor by tensor (row chunks) with seeded generators, on the GPU when there is
one, and written as they come: memory stays at one chunk whatever the model size.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from ..errors import UserError
from . import synth_quant as q
from .synth_router import Structure, check_routing, format_report, seed_of, topic_stream
from .synth_shapes import (GGUF_ARCH, TOKENIZER_PRE, Spec, base_config, gguf_metadata, gguf_tensors,
                           hf_tensors, shrink, special_ids)
from .synth_tokenizer import gguf_tokenizer_metadata, write_tokenizer_files
from .synth_write import GGUFRows, Progress, gguf_type, st_nbytes, write_gguf, write_safetensors

QUANTS = ("BF16", "Q8_0", "Q4_0", "Q4_K")
CHUNK_ELEMENTS = 1 << 25          # 32M values (128 MB of float32) generated at a time
META_KEY = "moetier_synth"        # config.json key / GGUF sidecar that describes the construction


def pick_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class Weights:
    """Values of every tensor, generated on demand in dim-0 row chunks."""

    def __init__(self, st: Structure, num_layers: int, device: str, seed: int):
        self.st, self.device, self.seed = st, device, seed
        self.out_scale = 0.5 / math.sqrt(max(1, num_layers))   # residual branches stay small

    def chunks(self, spec: Spec):
        rows = spec.shape[0]
        per_row = max(1, math.prod(spec.shape[1:]))
        step = max(1, CHUNK_ELEMENTS // per_row)
        key = {"embed": "embed", "lm_head": "lm_head", "router": f"router{spec.layer}"}.get(spec.init, spec.name)
        gen = torch.Generator(device=self.device).manual_seed(seed_of(self.seed, key))
        for r0 in range(0, rows, step):
            yield self._rows(spec, r0, min(rows, r0 + step), gen)

    def _rows(self, spec: Spec, r0: int, r1: int, gen) -> torch.Tensor:
        shape, dev = (r1 - r0, *spec.shape[1:]), self.device
        if spec.init == "embed":
            return self.st.embed_rows(r0, r1, gen, dev)
        if spec.init == "lm_head":
            return self.st.lm_head_rows(r0, r1, gen, dev)
        if spec.init == "router":
            return self.st.router_rows(spec.layer, r0, r1, gen, dev)
        if spec.init == "ones":
            return torch.ones(shape, device=dev)
        if spec.init == "zeros":
            return torch.zeros(shape, device=dev)
        if spec.init == "neg_ones":
            return -torch.ones(shape, device=dev)
        std = {"w": 1 / math.sqrt(spec.fan_in), "out": self.out_scale / math.sqrt(spec.fan_in), "bias": 0.02}[spec.init]
        return torch.randn(shape, generator=gen, device=dev) * std


def _check_space(out: Path, need: int, cfg: dict) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need + (1 << 30) > free:
        per_layer = need / max(1, cfg["num_hidden_layers"])
        fit = max(1, int((free - (2 << 30)) // per_layer))
        raise UserError(f"{out}: needs {need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB are free; "
                        f"free space, write elsewhere, or keep fewer layers (--layers {fit} would fit)")


def _hf_names(cfg: dict):
    def names(i):
        if i is None:
            return {"embed": "model.embed_tokens.weight"}
        p = f"model.layers.{i}."
        if cfg["model_type"] == "gpt_oss":
            return {"norm": p + "post_attention_layernorm.weight", "router": p + "mlp.router.weight",
                    "router_bias": p + "mlp.router.bias"}
        ds = cfg["model_type"] in ("deepseek_v3", "glm4_moe")
        return {"norm": p + "post_attention_layernorm.weight", "router": p + "mlp.gate.weight",
                "choice_bias": p + "mlp.gate.e_score_correction_bias" if ds else None}
    return names


def _gguf_names(cfg: dict):
    mt = cfg["model_type"]

    def names(i):
        if i is None:
            return {"embed": "token_embd.weight"}
        p = f"blk.{i}."
        norm = p + ("post_attention_norm.weight" if mt in ("gpt_oss", "glm4_moe", "qwen3_next") else "ffn_norm.weight")
        return {"norm": norm, "router": p + "ffn_gate_inp.weight",
                "router_bias": p + "ffn_gate_inp.bias" if mt == "gpt_oss" else None,
                "choice_bias": p + "exp_probs_b.bias" if mt in ("deepseek_v3", "glm4_moe") else None}
    return names


def synth(name: str, quant: str = "BF16", out: str | Path = "synth", layers: int | None = None,
          skew: float = 0.0, seed: int = 0, scale: float | str | None = None, fmt: str = "auto",
          locality: float = 0.5, topics: int = 64, topic_run: int = 64, device: str = "auto",
          shard_bytes: int = 4 << 30, check_tokens: int = 512, check_layers: int = 4,
          progress: bool = True, log=print) -> dict:
    """Write the checkpoint; -> {"path", "format", "bytes", "config", "routing": check report}."""
    quant = quant.upper()
    if quant not in QUANTS:
        raise UserError(f"--quant {quant}: choose one of {', '.join(QUANTS)}")
    fmt = ("safetensors" if quant == "BF16" else "gguf") if fmt == "auto" else fmt
    if fmt == "safetensors" and quant != "BF16":
        raise UserError(f"safetensors checkpoints are written in BF16; {quant} needs --format gguf")
    if not 0 <= skew < 5:
        raise UserError(f"--skew {skew}: use 0 (uniform) to ~1 (very skewed)")
    cfg = shrink(base_config(name), layers, scale)
    device = pick_device(device)
    st = Structure(cfg, skew=skew, locality=locality, topics=topics, topic_run=topic_run, seed=seed)
    job = dict(name=name, cfg=cfg, weights=Weights(st, cfg["num_hidden_layers"], device, seed), device=device,
               meta={"shape": name, "quant": quant, "layers": cfg["num_hidden_layers"], "scale": scale,
                     **st.meta(), "locality": locality},
               progress=progress, log=log)
    if fmt == "safetensors":
        path, total, reader = _write_dir(Path(out), shard_bytes, **job)
    else:
        path, total, reader = _write_gguf_file(Path(out), quant, **job)
    report = check_routing(cfg, st, *reader, check_tokens, check_layers)
    log(format_report(report))
    return {"path": str(path), "format": fmt, "bytes": total, "config": cfg, "routing": report}


def _write_dir(out: Path, shard_bytes: int, name, cfg, weights, device, meta, progress, log):
    """config.json (+ construction), generation_config.json, tokenizer, shards + index."""
    specs = hf_tensors(cfg)
    total = sum(st_nbytes(s) for s in specs)
    _check_space(out, total, cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**cfg, META_KEY: meta}, indent=1))
    gen_cfg = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"), "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in gen_cfg.items() if v is not None}))
    write_tokenizer_files(out, cfg, special_ids(cfg))
    log(f"writing {name} ({cfg['num_hidden_layers']} layers) as BF16 safetensors to {out}: "
        f"{len(specs)} tensors, {total / 2**30:.2f} GiB, generated on {device}")
    bar = Progress(total, "synth", progress and total > 256 << 20)
    write_safetensors(out, specs, weights.chunks, shard_bytes, bar)
    bar.close()
    from ..weights.safetensors import Checkpoint
    ck = Checkpoint(out)
    shift = 1.0 if cfg["model_type"] == "qwen3_next" else 0.0   # zero-centred norms: x * (1 + w)
    full = (lambda n: ck.tensor(n).float() + (shift if n.endswith("layernorm.weight") else 0.0))
    return out, total, ((lambda n, ids: ck.tensor(n)[ids].float()), full, _hf_names(cfg))


def _write_gguf_file(out: Path, quant: str, name, cfg, weights, device, meta, progress, log):
    """One GGUF file (a directory gets NAME-QUANT.gguf) and a NAME.gguf.synth.json sidecar."""
    if out.suffix != ".gguf":
        out = out / f"{name}-{quant}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    specs = gguf_tensors(cfg)
    types = {s.name: gguf_type(s, q.BY_NAME[quant]) for s in specs}
    total = sum(q.nbytes(types[s.name], s.shape) for s in specs)
    _check_space(out.parent, total, cfg)
    fallback = sorted({q.NAMES[types[s.name]] for s in specs
                       if len(s.shape) > 1 and types[s.name] not in (q.BY_NAME[quant], q.F32)})
    if fallback:
        log(f"note: tensors whose rows are not whole {quant} blocks are stored as {', '.join(fallback)}")
    metadata = {**gguf_metadata(cfg, name), "general.file_type": FILE_TYPE[quant], "general.quantization_version": 2,
                **gguf_tokenizer_metadata(cfg, special_ids(cfg), TOKENIZER_PRE[cfg["model_type"]]),
                "moetier.synth": json.dumps(meta)}
    log(f"writing {name} ({cfg['num_hidden_layers']} layers) as {quant} GGUF ({GGUF_ARCH[cfg['model_type']]}) "
        f"to {out}: {len(specs)} tensors, {total / 2**30:.2f} GiB, generated on {device}")
    bar = Progress(total, "synth", progress and total > 256 << 20)
    table = write_gguf(out, metadata, specs, types, weights.chunks, bar)
    bar.close()
    (out.parent / (out.name + ".synth.json")).write_text(json.dumps({**meta, "config": cfg}, indent=1))
    reader = GGUFRows(out, table)
    return out, total, (reader.rows, reader.full, _gguf_names(cfg))


# llama.cpp's general.file_type (LLAMA_FTYPE_MOSTLY_*)
FILE_TYPE = {"BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_K": 15}


def read_meta(model: str | Path) -> dict | None:
    """The construction of a synthetic checkpoint (topics, skew...) or None for a real one."""
    p = Path(model)
    try:
        if p.is_dir() and (p / "config.json").exists():
            return json.loads((p / "config.json").read_text()).get(META_KEY)
        side = p.parent / (p.name + ".synth.json")
        if side.exists():
            return json.loads(side.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return None


def stream_for(model: str | Path, vocab_size: int, n: int, seed: int = 0) -> list[int]:
    """Prompt ids for a benchmark: topic-local like the synth check when `model` is synthetic,
    otherwise uniform random ids."""
    meta = read_meta(model)
    g = torch.Generator().manual_seed(seed)
    if not meta or meta.get("topic_block") is None:
        return torch.randint(0, vocab_size, (n,), generator=g).tolist()
    return topic_stream(n, meta["topics"], meta["topic_block"], meta["topic_run"], vocab_size, g)
