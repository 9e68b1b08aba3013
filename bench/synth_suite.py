"""Benchmark one checkpoint (typically a `moetier synth` one) under several GPU budgets and write
the `moetier bench --json` report, with the machine and the command, to a JSON file.

    python bench/synth_suite.py /data/q30-bf16 --budgets 8GiB,16GiB --prompt-len 512,4096 --out q30.json

The first configuration keeps every weight on the device (no tiers); each budget adds one
`--compare "gpu-<budget>:--gpu-mem <budget>"`. Extra engine flags after `--` go to every configuration.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--budgets", default="", help="comma-separated --gpu-mem values to compare, e.g. 8GiB,16GiB")
    p.add_argument("--prompt-len", default="512,4096")
    p.add_argument("--gen", default="128")
    p.add_argument("--warmup", default="1")
    p.add_argument("--out", required=True, help="JSON file to write")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a, extra = p.parse_args(argv[:cut]), argv[cut + 1:]   # after --: engine flags for every configuration
    cmd = [sys.executable, "-m", "moetier", "bench", a.model, "--prompt-len", a.prompt_len, "--gen", a.gen,
           "--warmup", a.warmup, "--json", *extra]
    for b in filter(None, a.budgets.split(",")):
        cmd += ["--compare", f"gpu-{b}:--gpu-mem {b}"]
    t0 = time.time()
    res = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, text=True)
    if res.returncode:
        print(f"moetier bench failed with exit code {res.returncode}", file=sys.stderr)
        return res.returncode
    report = json.loads(res.stdout)
    gpu = None
    try:
        import torch
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "gpu": gpu,
           "command": cmd[1:], "wall_s": round(time.time() - t0, 1), "report": report}
    Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    for c in report["configs"]:
        print(f"{c['label']:>14}: decode {c['decode_tok_s']:.2f} tok/s ({c['fraction_of_bound']:.1%} of "
              f"{c['bound_tok_s']:.1f}), prefill {c['prefill_tok_s']}, ttft {c['ttft_s']:.3f} s")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
