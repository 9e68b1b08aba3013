"""`moetier imatrix MODEL -f TEXT [-o imatrix.gguf]`: the importance matrix llama-imatrix computes, for
`moetier quantize --imatrix` (and llama-quantize): per weight matrix, the sum over calibration tokens of each
input column's squared activation, and the token count; for expert tensors one row per expert, over the
tokens routed to it.

The model runs on the CPU in float (a copy of every weight: the tool is for models that fit in RAM), chunk
by chunk of --chunk tokens, each chunk a fresh context as llama-imatrix's. Every float matmul of a weight goes
through torch.nn.functional.linear; while the tool runs, that function also adds its input's squares to the
weight's entry (an expert's slice of the stacked experts to that expert's row). Written in llama.cpp's GGUF
imatrix form: `<tensor>.in_sum2` [matrices, K] and `<tensor>.counts` [matrices, 1], F32.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .common import positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("imatrix", help="compute an importance matrix for low-bit quantization (llama-imatrix's)",
                       description="Run MODEL over a calibration text and write the importance matrix that "
                                   "`moetier quantize --imatrix` and llama-quantize read (IQ1_S / IQ2_XXS / IQ2_XS "
                                   "need one; every K- and i-quant gets better with one).")
    p.add_argument("model", metavar="MODEL", help="model directory (config.json + *.safetensors) or .gguf file")
    p.add_argument("--file", "-f", required=True, metavar="TEXT", help="calibration text file (UTF-8)")
    p.add_argument("--out", "-o", default=None, metavar="FILE.gguf", help="output (default: MODEL's name + "
                                                                            "-imatrix.gguf beside it)")
    p.add_argument("--chunk", type=positive_int, default=512, metavar="N", help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=positive_int, default=None, metavar="N", help="at most N chunks (default: all)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N", help="CPU threads (default: torch's)")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    text = Path(args.file).expanduser()
    if not text.is_file():
        raise UserError(f"--file {text}: no such file")
    out = compute(args.model, text.read_text(encoding="utf-8", errors="replace"), args.out, args.chunk,
                  args.chunks, progress=True)
    print(out)
    return 0


def compute(model_path: str | Path, text: str, out: str | Path | None = None, chunk: int = 512,
            max_chunks: int | None = None, progress: bool = False) -> Path:
    """Write MODEL's importance matrix over `text` to `out`; -> the path."""
    from ..weights.loader import load_model
    src = Path(model_path).expanduser()
    if not src.exists():
        raise UserError(f"{src}: no such model directory or GGUF file")
    model, margs, ckpt = load_model(src)
    tokens = _tokenizer(src, ckpt).encode(text, add_special=False)
    n = len(tokens) // chunk if max_chunks is None else min(max_chunks, len(tokens) // chunk)
    if n < 1:
        raise UserError(f"the calibration text gives {len(tokens)} tokens, fewer than one chunk of {chunk}: "
                        f"give more text or a smaller --chunk")
    stats = Collector(model, margs)
    from tqdm import tqdm
    bar = tqdm(total=n, desc="imatrix", unit="chunk", leave=False, disable=not (progress and sys.stderr.isatty()))
    with stats.active(), torch.inference_mode():
        for c in range(n):
            ids = torch.tensor(tokens[c * chunk:(c + 1) * chunk])
            model(ids, model.make_cache(chunk, torch.float32, "cpu"))
            bar.update(1)
    bar.close()
    out = Path(out) if out else src.with_name(f"{src.stem if src.is_file() else src.name}-imatrix.gguf")
    stats.write(out, n, chunk, dataset=str(model_path))
    return out


def _tokenizer(src: Path, ckpt):
    if src.suffix == ".gguf":
        from ..weights.gguf_tokenizer import tokenizer_from_gguf
        if not ckpt.metadata.get("tokenizer.ggml.tokens"):
            raise UserError(f"{src} holds no tokenizer (tokenizer.ggml.*): cannot read the calibration text")
        return tokenizer_from_gguf(ckpt.metadata)
    from ..weights.tokenizer import Tokenizer
    if not (src / "tokenizer.json").exists():
        raise UserError(f"{src} has no tokenizer.json: cannot read the calibration text")
    return Tokenizer.from_dir(src)


class Collector:
    """GGUF tensor name -> (squared-input sums float64 [matrices, K], token counts [matrices]), filled by the
    F.linear calls of `model`'s weights while `active`."""

    def __init__(self, model, margs):
        from ..weights.gguf_arch import BY_MODEL_TYPE, gguf_tensors
        arch = BY_MODEL_TYPE.get(margs.model_type)
        if arch is None:
            raise UserError(f"model_type {margs.model_type!r} has no GGUF architecture in moetier")
        self.dense: dict[int, list[str]] = {}            # weight data_ptr -> its GGUF names
        self.experts: list[tuple[int, int, int, list[str]]] = []   # (data_ptr, bytes per expert, E, GGUF names)
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        for pname, p in model.named_parameters():
            found = gguf_tensors(pname, arch) if p.dim() >= 2 else None
            if found is None or pname == "model.embed_tokens.weight":
                continue
            if found[0] == "experts":
                if not pname.endswith(("gate_up_proj", "down_proj")):
                    continue
                self.experts.append((p.data_ptr(), p[0].numel() * p.element_size(), p.shape[0], found[1]))
                for g in found[1]:
                    self._entry(g, p.shape[0], p.shape[-1])
                continue
            spec, prefix = found
            with torch.device("meta"):
                parts = spec.write(torch.empty(p.shape, device="meta"), margs)
            names = [prefix + n for n, t in zip(spec.names, parts) if t.dim() >= 2 and t.shape[-1] == p.shape[-1]]
            if names:
                self.dense[p.data_ptr()] = names
                for g in names:
                    self._entry(g, 1, p.shape[-1])

    def _entry(self, name: str, mats: int, k: int) -> None:
        self.sums[name] = torch.zeros(mats, k, dtype=torch.float64)
        self.counts[name] = torch.zeros(mats, dtype=torch.float64)

    def add(self, x: torch.Tensor, w: torch.Tensor) -> None:
        ptr = w.data_ptr()
        names, row = self.dense.get(ptr), 0
        if names is None:
            for base, step, e, enames in self.experts:
                if base <= ptr < base + step * e:
                    names, row = enames, (ptr - base) // step
                    break
        if names is None:
            return
        x2 = x.detach().reshape(-1, x.shape[-1]).double()
        sq = (x2 * x2).sum(0)
        for g in names:
            self.sums[g][row] += sq
            self.counts[g][row] += x2.shape[0]

    @contextlib.contextmanager
    def active(self):
        import torch.nn.functional as F
        linear = F.linear

        def tracked(x, weight, bias=None):
            self.add(x, weight)
            return linear(x, weight, bias)
        F.linear = tracked
        try:
            yield self
        finally:
            F.linear = linear

    def write(self, out: Path, chunks: int, chunk: int, dataset: str) -> None:
        import gguf

        class Writer(gguf.GGUFWriter):
            def add_architecture(self) -> None:      # imatrix files name no architecture
                pass
        w = Writer(out, "")
        w.add_type("imatrix")
        w.add_array("imatrix.datasets", [dataset])
        w.add_uint32("imatrix.chunk_count", chunks)
        w.add_uint32("imatrix.chunk_size", chunk)
        for name in sorted(self.sums):
            if not self.counts[name].any():
                continue                              # never reached (an expert no token chose still has a row)
            w.add_tensor(name + ".in_sum2", self.sums[name].float().numpy())
            w.add_tensor(name + ".counts", self.counts[name].float().numpy()[:, None].copy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
