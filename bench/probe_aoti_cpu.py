"""Which CPU AOTInductor packages this torch can load: a diagnosis for the compiled CPU decode step's crash on the
H200 box (torch 2.11, docs/perf-log.md sessions 23-24: `aoti_load_package` ends the process with SIGSEGV).

Builds tiny packages of a Linear + ReLU, each way the question needs, and loads each in a fresh child process
(a segfault cannot be caught in this one): the weights inside the package's .so (torch's default), outside it
(`aot_inductor.package_constants_in_so=False`, what runtime.cpu_compile builds, then bound with
load_constants), and the latter again with moetier's native ops loaded first. Prints one JSON object: each
variant's exit status (0 loaded and ran; -11 a segfault) and the last line of its stderr.

--package PATH: also a built package (e.g. ~/.cache/moetier/cpu_decode/*.pt2), loaded both ways: by the package
loader, and its .so alone by AOTIModelContainerRunnerCpu (the runner the package loader wraps).

    python bench/probe_aoti_cpu.py [--dir DIR] [--package PATH ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_CHILD = """
import sys, torch
if sys.argv[3] == "native":
    from moetier.kernels import cpu
    cpu.load_native_ops()
runner = torch._inductor.aoti_load_package(sys.argv[1])
if sys.argv[2] == "outside":
    w = torch.load(sys.argv[1] + ".weights")
    runner.load_constants(w, check_full_update=True, user_managed=True)
y = runner(torch.randn(3, 64))
print("ran", tuple(y.shape))
"""


_SO_CHILD = """
import sys, zipfile, tempfile, torch
from moetier.kernels import cpu
cpu.load_native_ops()
if sys.argv[2] == "package":
    torch._inductor.aoti_load_package(sys.argv[1])
    print("package loaded")
else:
    z = zipfile.ZipFile(sys.argv[1])
    so = [n for n in z.namelist() if n.endswith(".so")][0]
    d = tempfile.mkdtemp()
    path = z.extract(so, d)
    r = torch._C._aoti.AOTIModelContainerRunnerCpu(path, 1)
    print("runner loaded;", len(r.get_constant_names_to_original_fqns()), "constants")
"""


def child(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, *args], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                       str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))})
    lines = [ln for ln in (r.stdout + r.stderr).strip().splitlines() if not ln.startswith("W")]
    return {"status": r.returncode, "last": lines[-3:]}


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 32)

    def forward(self, x):
        return torch.relu(self.lin(x))


def build(d: Path, inside: bool) -> Path:
    torch.manual_seed(0)
    m = Tiny().eval()
    ep = torch.export.export(m, (torch.randn(3, 64),))
    path = d / f"tiny-{'inside' if inside else 'outside'}.pt2"
    configs = {} if inside else {"aot_inductor.package_constants_in_so": False}
    torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs)
    torch.save({k: v.detach().clone() for k, v in m.named_parameters()}, str(path) + ".weights")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--package", nargs="*", default=[])
    a = ap.parse_args()
    d = Path(a.dir or tempfile.mkdtemp(prefix="aoti-probe-"))
    d.mkdir(parents=True, exist_ok=True)
    out = {"torch": torch.__version__, "results": {}}
    for inside in (True, False):
        path = build(d, inside)
        for native in (("plain", "native") if not inside else ("plain",)):
            name = f"{'inside' if inside else 'outside'}-{native}"
            out["results"][name] = child(_CHILD, str(path), "inside" if inside else "outside", native)
            print(name, out["results"][name], file=sys.stderr)
    for pkg in a.package:
        for how in ("package", "so"):
            out["results"][f"{Path(pkg).name}:{how}"] = child(_SO_CHILD, pkg, how)
            print(pkg, how, out["results"][f"{Path(pkg).name}:{how}"], file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
