"""`moetier bench`: decode and prefill speed of one or more budget configurations, next to the
byte-budget bound of each (what the tiers' bandwidths allow)."""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import shlex
import sys
import time

from ..errors import UserError
from .common import add_model_args, engine_config


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="measure decode / prefill speed against the byte-budget bound",
        description="Load MODEL, warm up, then for each prompt length prefill random token ids (topic-local "
                    "ones for `moetier synth` checkpoints) and decode greedily with EOS ignored. Prints decode "
                    "and prefill tok/s, TTFT, peak VRAM and RSS, hits per tier, the per-token time split and "
                    "the achieved fraction of the byte-budget bound. --compare runs more budget "
                    "configurations in the same process (the engine is reloaded for each).")
    add_model_args(p)
    p.add_argument("--prompt-len", default="512,4096,32768", metavar="N,N",
                   help="prompt lengths in tokens (default 512,4096,32768); decode is reported at the first")
    p.add_argument("--gen", type=int, default=128, metavar="N", help="tokens decoded per prompt (default 128)")
    p.add_argument("--warmup", type=int, default=2, metavar="N",
                   help="short warm-up requests first (default 2: the second captures the prefill graph of prompts "
                        "up to 512 tokens where the engine has them)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="decode at the first prompt length N times and report the median (every run is in "
                        "the JSON as decode_tok_s_runs; default 1)")
    p.add_argument("--compare", action="append", default=[], metavar="'LABEL:FLAGS'",
                   help="another configuration, e.g. 'offload:--gpu-mem 8GiB' (repeatable); FLAGS are engine "
                        "flags added to the ones given here, and MOETIER_NAME=VALUE switches set for this "
                        "configuration only (A/B runs in one process, e.g. 'noq8:MOETIER_RING_Q8=0')")
    p.add_argument("--decode", choices=("auto", "greedy", "stream", "sample"), default="auto",
                   help="decoded tokens: greedy = the model's argmax; stream = forced topic-local ids (the model "
                        "still runs every step) so random-weight models do not loop on one token; sample = drawn "
                        "with the checkpoint's generation_config (else temperature 0.7, top-k 20, top-p 0.8: a "
                        "chat's cost of sampling included); auto = stream for moetier synth checkpoints, greedy "
                        "otherwise")
    p.add_argument("--remeasure", action="store_true", help="measure bandwidths again instead of using the cache")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(func=main)


def parse_lengths(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--prompt-len must be comma-separated token counts like 512,4096 (got {text!r})") from None
    if not lens or min(lens) < 1:
        raise UserError(f"--prompt-len needs positive token counts (got {text!r})")
    return lens


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(message)


ENV_SWITCH = re.compile(r"MOETIER_[A-Z0-9_]+=")     # a --compare word that sets an environment switch


def config_namespaces(args) -> list[tuple[str, str, argparse.Namespace]]:
    """(label, flags, namespace) of the base configuration and each --compare one; a namespace's `env` holds the
    MOETIER_* switches its FLAGS set (the base's: none)."""
    args.env = {}
    out = [("base", "", args)]
    parser = _RaisingParser(prog="moetier bench --compare", add_help=False)
    add_model_args(parser)
    for spec in args.compare:
        label, sep, flags = spec.partition(":")
        if not sep or not label.strip():
            raise UserError(f"--compare {spec!r}: write it as 'LABEL:FLAGS', e.g. 'offload:--gpu-mem 8GiB'")
        ns = copy.deepcopy(args)
        words = shlex.split(flags)
        env = [w for w in words if ENV_SWITCH.match(w)]
        ns.env = dict(w.split("=", 1) for w in env)
        try:
            parser.parse_args([str(args.model or "default")] + [w for w in words if w not in env], namespace=ns)
        except UserError as e:
            raise UserError(f"--compare {spec!r}: {e} (only engine flags and MOETIER_NAME=VALUE switches; see "
                            "moetier bench --help)") from None
        ns.model = args.model
        out.append((label.strip(), flags, ns))
    return out


@contextlib.contextmanager
def switches(env: dict):
    """The environment with `env` set (a --compare configuration's MOETIER_* switches), as it was afterwards."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(args) -> int:
    from ..runtime.engine import resolve_model_path
    from ..tools.bench_core import decode_mode
    lens = parse_lengths(args.prompt_len)
    if args.gen < 2:
        raise UserError(f"--gen must be >= 2 to measure decode speed (got {args.gen})")
    if args.repeat < 1:
        raise UserError(f"--repeat must be >= 1 (got {args.repeat})")
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))   # stdout carries only the table or the JSON
    path = resolve_model_path(args.model)
    configs = config_namespaces(args)
    mode = decode_mode(args.decode, path)
    results, bw, failed = [], None, []
    for label, flags, ns in configs:
        try:
            with switches(ns.env):
                bw = _one_config(args, path, label, flags, ns, lens, mode, bw, results, log)
        except (UserError, RuntimeError, MemoryError) as e:
            if len(configs) == 1:
                raise
            log(f"[{label}] failed: {e}")     # the other configurations still run
            failed.append({"label": label, "flags": flags, "error": str(e)})
    if not results:
        raise UserError("every configuration failed: " + "; ".join(f"{f['label']}: {f['error']}" for f in failed))
    report = {"model": str(path), "prompt_lens": lens, "gen": args.gen, "warmup": args.warmup,
              "bandwidths": bw, **{k: v for k, v in results[0].items() if k != "runs"}, "configs": results,
              "failed": failed}
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(format_table(report))
    return 0


def _one_config(args, path, label, flags, ns, lens, mode, bw, results, log):
    """Load and bench one configuration; its result goes to `results`. -> the bandwidths (measured once)."""
    from ..runtime.engine import Engine
    from ..tools.bench_core import bench_config, measure_bandwidths, release, reset_peaks
    cfg = engine_config(ns)
    if cfg.max_context is None:
        cfg = cfg.replace(max_context=max(lens) + args.gen + 8)
    cfg = cfg.replace(progress=not args.json)
    reset_peaks(cfg.resolved_device())
    log(f"[{label}] loading {path} {flags}".rstrip())
    t0 = time.perf_counter()
    engine = Engine.load(path, cfg)
    load_s = time.perf_counter() - t0
    fit = [n for n in lens if n + args.gen < engine.max_context]
    if len(fit) < len(lens):
        log(f"[{label}] skipping prompt lengths {sorted(set(lens) - set(fit))}: the context holds "
            f"{engine.max_context} tokens")
    if not fit:
        raise UserError(f"no prompt length fits the context of {engine.max_context} tokens; lower --prompt-len")
    if bw is None:
        log("measuring bandwidths (cached in ~/.cache/moetier/bandwidth.json) ...")
        bw = measure_bandwidths(engine.device, path, use_cache=not args.remeasure)
    r = bench_config(engine, path, fit, args.gen, args.warmup, bw, mode, log, repeat=args.repeat)
    results.append({"label": label, "flags": flags, "env": dict(ns.env), "load_s": round(load_s, 3), **r})
    log(f"[{label}] " + summary_line(results[-1]))   # a run cut short still shows the finished configs
    release(engine)
    engine = None
    return bw


RAM_SPREAD_WARN = 0.1      # the RAM rate moved this much during a configuration's runs: said in its summary line


def summary_line(c: dict) -> str:
    """One configuration's result in one line (stderr, as soon as it is measured)."""
    from ..tools.bench_core import hit_summary
    t = c["time_split"]
    pre = ", ".join(f"{n}: {v:.0f}" for n, v in c["prefill_tok_s"].items())
    frac = f" ({c['fraction_of_bound']:.0%} of {c['bound_tok_s']:.1f})" if c["fraction_of_bound"] is not None else ""
    runs = c.get("decode_tok_s_runs") or []
    if len(runs) > 1:
        frac += f" [median of {len(runs)}: {min(runs):.1f}-{max(runs):.1f}]"
    ram = c.get("ram_gbs_check")
    if ram and ram["spread"] > RAM_SPREAD_WARN:
        low = min([ram["before"]] + [r for p in ram.get("runs", []) for r in p] + [ram.get("after", ram["before"])])
        frac += (f" [RAM read {low:.0f}-{ram['fastest']:.0f} GB/s: the bound uses {ram['run_gbs']:.0f}, "
                 f"the runs' rate; {c['fraction_of_fastest_bound']:.0%} of {c['fastest_bound_tok_s']:.1f} at the "
                 "fastest reading]")
    return (f"decode {c['decode_tok_s']:.2f} tok/s{frac}; prefill tok/s {pre}; hits {hit_summary(c['memory'])}; "
            f"ms/token gpu {t['gpu_ms']:.2f} cpu {t['cpu_ms']:.2f} copy {t['copy_ms']:.2f} other {t['idle_ms']:.2f}; "
            f"peak VRAM {_gib(c['peak_vram_bytes'])}" + _over(c))


def _over(c: dict) -> str:
    """A warning when the peak passed the GPU budget (a bug in the plan's accounting: please report it)."""
    b = c.get("gpu_budget_bytes")
    return f" OVER the GPU budget of {_gib(b)} by {(c['peak_vram_bytes'] - b) / 2**20:.0f} MiB" \
        if b and c["peak_vram_bytes"] > b else ""


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n else "-"


def format_table(rep: dict) -> str:
    from ..tools.bench_core import hit_summary
    bw = rep["bandwidths"] or {}
    lens = [str(n) for n in rep["prompt_lens"]]
    src = bw.get("source") if isinstance(bw.get("source"), dict) else {}
    head = (f"moetier bench {rep['model']} on {rep['device']} ({rep['dtype']}); decode {rep['gen']} tokens "
            f"({rep['decode_mode']}); "
            f"bandwidths GB/s: " + ", ".join(
                f"{k.removesuffix('_gbs')} {bw[k]:g}" + (" (assumed)" if src.get(k) == "assumed" else "")
                for k in ("hbm_gbs", "ram_gbs", "pcie_gbs", "ssd_gbs") if k in bw))
    cols = ["config", "decode tok/s"] + [f"prefill@{n}" for n in lens] + \
        ["TTFT s", "peak VRAM", "peak RSS", "hits", "bound tok/s", "of bound"]
    rows = []
    for c in rep["configs"]:
        rows.append([c["label"], f"{c['decode_tok_s']:.2f}"] +
                    [f"{c['prefill_tok_s'][n]:.1f}" if n in c["prefill_tok_s"] else "-" for n in lens] +
                    [f"{c['ttft_s']:.3f}", _gib(c["peak_vram_bytes"]), _gib(c["peak_rss_bytes"]),
                     hit_summary(c["memory"]), f"{c['bound_tok_s']:.1f}",
                     f"{c['fraction_of_bound']:.1%}" if c["fraction_of_bound"] is not None else "-"])
    width = [max(len(r[i]) for r in [cols] + rows) for i in range(len(cols))]
    lines = [head, "  ".join(h.rjust(w) for h, w in zip(cols, width))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, width)) for r in rows]
    lines.append("per decode token (ms): " + "; ".join(
        f"{c['label']}: total {t['total_ms']:.2f} = gpu {t['gpu_ms']:.2f} + cpu {t['cpu_ms']:.2f} + copy "
        f"{t['copy_ms']:.2f} + ssd wait {t['ssd_wait_ms']:.2f} + other {t['idle_ms']:.2f}"
        for c in rep["configs"] for t in [c["time_split"]]))
    lines.append("bound: " + "; ".join(f"{c['label']}: {c['bound']['source']}" for c in rep["configs"]))
    lines += [f"failed [{f['label']}]: {f['error']}" for f in rep.get("failed", [])]
    for c in rep["configs"]:
        if c["distinct_token_frac"] < 0.5:
            lines.append(f"warning [{c['label']}]: greedy decode repeats itself ({c['distinct_token_frac']:.0%} "
                         "distinct tokens), so decode hit rates are optimistic")
    return "\n".join(lines)
