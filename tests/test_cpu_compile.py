"""The AOT-compiled CPU decode step (runtime/cpu_compile.py) against eager decode, and its background build."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
import warnings

import pytest
import torch
from helpers import max_rel_err

from moetier import EngineConfig, SamplingParams
from moetier.models.layers import DenseExperts, grouped_experts
from moetier.runtime import cpu_build, cpu_compile
from moetier.runtime.engine import Engine


@pytest.mark.parametrize("t", [1, 3])
def test_fused_gather_experts_matches_grouped(t):
    """The graph-friendly expert twin equals the eager grouped path on random inputs."""
    g = torch.Generator().manual_seed(0)
    ex = DenseExperts(8, 48, 32)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.2)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.2)
        x = torch.randn(t, 48, generator=g)
        ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)])
        w = torch.softmax(torch.randn(t, 2, generator=g), -1)
        ours = cpu_compile.fused_gather_experts(x, ids, w, ex)
        ref = grouped_experts(x, ids, w, 8, ex.expert)
    assert max_rel_err(ours, ref) < 1e-5


def test_wanted_modes(tiny_model_dir):
    eng = Engine.load(tiny_model_dir, EngineConfig(device="cpu", progress=False, max_context=64))
    cache = eng.new_session().cache
    assert cpu_compile.wanted("on", "cpu", None, cache)
    assert cpu_compile.wanted("auto", "cpu", None, cache)   # auto: used when built, else built in the background
    assert not cpu_compile.wanted("off", "cpu", None, cache)
    assert not cpu_compile.wanted("on", "cuda", None, cache)
    with pytest.raises(ValueError, match="auto, on or off"):
        cpu_compile.wanted("yes", "cpu", None, cache)


def _compare(path, prompt, n):
    """Greedy tokens through the Engine (compiled vs eager), then per-step logits on one cache each."""
    kw = {"prompt_ids": prompt, "max_tokens": n, "params": SamplingParams(temperature=0), "ignore_eos": True}
    toks = {}
    for mode in ("off", "on"):
        eng = Engine.load(path, EngineConfig(device="cpu", progress=False, max_context=256, cpu_compile=mode))
        toks[mode] = [e.token_id for e in eng.generate(**kw) if hasattr(e, "token_id") and e.token_id >= 0]
    assert toks["on"] == toks["off"] and len(toks["on"]) == n
    step = eng._cpu_decode                       # compiled already by the run above
    assert step, "the compiled step could not be built (see the warning) and the engine decoded eagerly"
    eager, fast = eng.new_session().cache, eng.new_session().cache
    with torch.inference_mode():
        eng.model(torch.tensor(prompt), eager)
        eng.model(torch.tensor(prompt), fast)
        for tok in toks["off"][:-1]:             # crosses a BUCKET boundary when prompt + n > 128
            ref = eng.model(torch.tensor([tok]), eager)
            assert max_rel_err(step(fast, tok), ref) < 1e-5
    assert fast.length == eager.length
    return eng


@pytest.mark.slow
def test_compiled_decode_matches_eager_tiny(tiny_model_dir):
    t0 = time.perf_counter()
    _compare(tiny_model_dir, list(range(3, 123)), 24)
    assert time.perf_counter() - t0 < 120, "compiling the tiny model's decode step took over 2 minutes"


@pytest.mark.slow
def test_compiled_decode_matches_eager_default():
    eng = _compare(None, [(i * 7919) % 8000 + 100 for i in range(120)], 24)
    # a bf16 checkpoint: both steps multiply on its BF16 copies (linears, and the experts in one moetier::moe_tokens)
    experts = [m for m in eng.model.modules() if type(m).__name__ == "DenseExperts"]
    assert experts and all(m._half[0] == 30 for m in experts) and eng.model.lm_head._quant_copies == {"weight": 30}


# ---- background builds under --cpu-compile auto (the real build is mocked: it takes 15-25 s) ----

class _FakeProc:
    pid, returncode = 4242, None

    def poll(self):
        return self.returncode


@pytest.fixture
def background(tmp_path, monkeypatch):
    """Background builds allowed, into tmp_path; `spawned` lists the specs a real run would have built."""
    monkeypatch.delenv(cpu_build.NO_BACKGROUND_ENV, raising=False)
    monkeypatch.setattr(cpu_compile, "CACHE_DIR", tmp_path)
    spawned = []
    monkeypatch.setattr(cpu_build, "_spawn", lambda spec, log_path: spawned.append(spec) or _FakeProc())
    return spawned


def _engine(path, mode="auto"):
    return Engine.load(path, EngineConfig(device="cpu", progress=False, max_context=64, cpu_compile=mode))


def _decode_path(eng):
    done = eng.complete(prompt_ids=[3, 4, 5], max_tokens=3, params=SamplingParams(temperature=0), ignore_eos=True)
    assert len(done.token_ids) == 3
    return done.stats["decode_path"]


def test_background_build_started_in_auto_and_picked_up(tiny_model_dir, background, monkeypatch):
    """auto without a package: eager now, one build started (for this model and thread count); once the
    package lands the same engine decodes with it from the next request."""
    eng = _engine(tiny_model_dir)
    assert _decode_path(eng) == "eager" and len(background) == 1
    spec = background[0]
    assert spec["model"] == str(tiny_model_dir) and spec["config"]["threads"] == torch.get_num_threads()
    path = cpu_compile.package_path(eng.model)
    assert spec["path"] == str(path)
    assert _decode_path(eng) == "eager" and len(background) == 1       # still building: not started again
    path.write_bytes(b"package")                                        # the build lands
    model = eng.model
    monkeypatch.setattr(cpu_compile.CpuDecode, "get", classmethod(
        lambda cls, m, build: (lambda cache, tok: model(torch.tensor([tok]), cache))))
    assert _decode_path(eng) == "cpu-compiled"


@pytest.mark.parametrize("why", ["off", "env", "cached", "failed", "building"])
def test_background_build_not_started(tiny_model_dir, background, monkeypatch, caplog, why):
    eng = _engine(tiny_model_dir, "off" if why == "off" else "auto")
    path = cpu_compile.package_path(eng.model)
    cpu_compile._drop_quantized_copies(eng.model)
    if why == "env":
        monkeypatch.setenv(cpu_build.NO_BACKGROUND_ENV, "1")
    elif why == "cached":   # a package that does not load (as if from another torch): warned, never rebuilt
        path.write_bytes(b"not a package")
    elif why == "failed":
        cpu_build._record_failure(path, RuntimeError("no compiler"))
    with contextlib.ExitStack() as stack:
        if why == "building":   # another process holds the lock: watch for its package, start nothing
            assert stack.enter_context(cpu_build.locked(path, wait=False))
        with caplog.at_level(logging.WARNING), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert _decode_path(eng) == "eager"
            assert _decode_path(eng) == "eager"
            assert _decode_path(_engine(tiny_model_dir, "off" if why == "off" else "auto")) == "eager"  # next run
        assert background == []
        assert (getattr(eng, "cpu_build", None) is not None) == (why == "building")
    if why == "failed":     # said once, then remembered as said (another process stays quiet too)
        assert sum("step failed (RuntimeError: no compiler" in r.getMessage() for r in caplog.records) == 1
        assert json.loads(path.with_suffix(".failed").read_text())["reported"]
    if why == "building":   # the other process gave up without a package: stop watching
        assert not eng.cpu_build.landed()
    if why == "off":
        assert not list(background) and not any(p.suffix in (".lock", ".log") for p in path.parent.iterdir())


def _spec(eng, tiny_model_dir, path):
    cfg = eng.config.replace(device="cpu", threads=torch.get_num_threads(), progress=False)
    return {"model": str(tiny_model_dir), "config": dataclasses.asdict(cfg), "path": str(path)}


def test_build_process_lock_partial_and_failure(tiny_model_dir, tmp_path, monkeypatch):
    """build_from_spec (the build process's body): nothing while another holds the lock; a half-written
    package of a killed build is never loaded and is cleared; a failure is recorded, not raised."""
    monkeypatch.setattr(cpu_compile, "CACHE_DIR", tmp_path)
    eng = _engine(tiny_model_dir)
    path = cpu_compile.package_path(eng.model)
    cpu_compile._drop_quantized_copies(eng.model)
    spec = _spec(eng, tiny_model_dir, path)
    built = []

    def fake_build(model, p):
        built.append(p)
        p.with_suffix(".1.tmp.pt2").write_bytes(b"half")    # as the real one: a temporary file, then a rename
        p.with_suffix(".1.tmp.pt2").replace(p)
    monkeypatch.setattr(cpu_compile, "_build", fake_build)
    partial = path.with_suffix(".999.tmp.pt2")
    partial.write_bytes(b"half a package")                  # left by a build that was killed
    assert cpu_compile.CpuDecode.get(eng.model, build=False) is None
    with cpu_build.locked(path, wait=False):              # a second build waits its turn: none here
        assert cpu_build.build_from_spec(spec) == 0 and built == []
    assert cpu_build.build_from_spec(spec) == 0 and built == [path] and not partial.exists()
    assert cpu_build.build_from_spec(spec) == 0 and built == [path]   # built: not again
    path.unlink()
    monkeypatch.setattr(cpu_compile, "_build", lambda model, p: 1 / 0)
    assert cpu_build.build_from_spec(spec) == 1
    assert "ZeroDivisionError" in json.loads(path.with_suffix(".failed").read_text())["error"]
    assert not path.exists()


def test_build_process_detached_and_failure_recorded(tiny_model_dir, tmp_path, monkeypatch):
    """The real spawn: its own session (it outlives a short `moetier run`); a model path that cannot load
    ends it quickly with a failure record (the real build is not run here: 15-25 s)."""
    monkeypatch.setattr(cpu_compile, "CACHE_DIR", tmp_path)
    eng = _engine(tiny_model_dir)
    path = cpu_compile.package_path(eng.model)
    cpu_compile._drop_quantized_copies(eng.model)
    spec = _spec(eng, tmp_path / "no-such-model", path)
    proc = cpu_build._spawn(spec, path.with_suffix(".log"))
    build = cpu_build.BackgroundBuild(path, proc)
    assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
    assert proc.wait(timeout=120) == 1
    assert not build.landed() and not path.exists()
    assert "no-such-model" in json.loads(path.with_suffix(".failed").read_text())["error"]
    assert "no such model" in path.with_suffix(".log").read_text()


def test_run_note_names_the_background_build(tiny_model_dir, background, capsys):
    from moetier.cli import main
    assert main(["run", str(tiny_model_dir), "--prompt-ids", "3,4,5", "-n", "2", "--device", "cpu", "-v"]) == 0
    err = capsys.readouterr().err
    assert "being built in the background (pid 4242" in err and str(cpu_compile.CACHE_DIR) in err


# ---- a package that kills the process that loads it (torch 2.11 on the H200 box): found by a child first ----

def test_loads_safely_records_a_crash_and_a_load(tmp_path, monkeypatch):
    pkg = tmp_path / "m.pt2"
    pkg.write_bytes(b"not a package")
    monkeypatch.setattr(cpu_compile, "_LOAD_CHECK", "import os\nos.abort()\n")
    with pytest.raises(RuntimeError, match="crashed a test process"):
        cpu_compile.loads_safely(pkg)
    assert pkg.with_suffix(".crashes").read_text().startswith("exit status -6")
    monkeypatch.setattr(cpu_compile.subprocess, "run", lambda *a, **k: pytest.fail("checked twice"))
    with pytest.raises(RuntimeError, match="crashed"):
        cpu_compile.loads_safely(pkg)                       # the record answers
    monkeypatch.undo()
    pkg.with_suffix(".crashes").unlink()
    monkeypatch.setattr(cpu_compile, "_LOAD_CHECK", "raise SystemExit(3)\n")
    cpu_compile.loads_safely(pkg)                           # an error, not a crash: the load in-process tells
    assert not pkg.with_suffix(".crashes").exists() and not pkg.with_suffix(".loads").exists()
    monkeypatch.setattr(cpu_compile, "_LOAD_CHECK", "import sys\nassert sys.argv[1].endswith('m.pt2')\n")
    cpu_compile.loads_safely(pkg)
    assert pkg.with_suffix(".loads").exists()
    monkeypatch.setattr(cpu_compile.subprocess, "run", lambda *a, **k: pytest.fail("checked twice"))
    cpu_compile.loads_safely(pkg)


def test_a_package_that_crashes_its_loader_leaves_the_engine_eager(tiny_model_dir, tmp_path, monkeypatch):
    pkg = tmp_path / "m.pt2"
    pkg.write_bytes(b"not a package")
    monkeypatch.setattr(cpu_compile, "package_path", lambda model: pkg)
    monkeypatch.setattr(cpu_compile, "_LOAD_CHECK", "import os\nos.abort()\n")
    monkeypatch.setattr(cpu_compile.torch._inductor, "aoti_load_package",
                        lambda p: pytest.fail("loaded in the engine's process"))
    eng = _engine(tiny_model_dir, "on")
    with pytest.warns(UserWarning, match="crashed a test process"):
        assert _decode_path(eng) == "eager"


@pytest.mark.parametrize("blocks", [True, False])
def test_traced_step_calls_the_block_ops(tmp_path, monkeypatch, blocks):
    """The exported CPU step of a GGUF file calls a decoder block's two C calls as ops (moetier::attn_block /
    moe_block, each once a layer) instead of the modules' pieces; TRACE_BLOCKS off: none of them."""
    from moetier.commands.quantize import quantize
    from test_gguf import build_qwen3_moe
    path = quantize(build_qwen3_moe(tmp_path / "model"), "Q4_0", tmp_path / "m.gguf")
    eng = Engine.load(path, EngineConfig(device="cpu", threads=1, progress=False, max_context=64, cpu_compile="off"))
    eng.complete(prompt_ids=[5, 6, 7], max_tokens=2, params=SamplingParams(temperature=0), ignore_eos=True)
    monkeypatch.setattr(cpu_compile, "TRACE_BLOCKS", blocks)
    ep = cpu_compile.export_step(eng.model)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    layers = len(eng.model.model.layers)
    for op in ("moetier.attn_block", "moetier.moe_block"):
        assert sum(op in t for t in targets) == (layers if blocks else 0), (op, targets)
