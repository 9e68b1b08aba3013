"""moetier bench on a tiny synthetic model: one JSON object with every field, --compare, the table."""
import json

import pytest
import torch

import moetier.tools.bench_core as bench_core
from moetier.cli import main as cli
from moetier.commands.bench import config_namespaces, parse_lengths
from moetier.errors import UserError
from moetier.tools.bench_core import time_split
from moetier.tools.synth import synth

BW = {"ram_gbs": 10.0, "hbm_gbs": 1000.0, "pcie_gbs": 10.0, "ssd_gbs": 1.0, "source": {}}
FIELDS = ("decode_tok_s", "prefill_tok_s", "ttft_s", "peak_vram_bytes", "peak_rss_bytes", "memory", "time_split",
          "bound_tok_s", "fraction_of_bound", "bound", "bandwidths", "configs", "device", "dtype", "load_s",
          "decode_tok_s_by_length", "ttft_s_by_length", "distinct_token_frac", "gpu_budget_bytes", "ram_gbs_check",
          "hbm_gbs_check")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "q"
    synth("qwen3-30b-a3b", "BF16", path, layers=2, scale="tiny", skew=0.3, log=lambda *a: None)
    return path


@pytest.fixture(autouse=True)
def fixed_bandwidths(monkeypatch):
    monkeypatch.setattr(bench_core, "measure_bandwidths", lambda device, path, use_cache=True: dict(BW))
    monkeypatch.setattr("moetier.memory.bandwidth.measure_ram", lambda nbytes=None: 12.5)   # the re-check after runs


def run_json(capsys, argv):
    assert cli(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out)                      # exactly one JSON object, nothing else on stdout


def test_bench_json_has_every_field(model, capsys):
    rep = run_json(capsys, ["bench", str(model), "--device", "cpu", "--prompt-len", "16,40", "--gen", "6",
                            "--warmup", "1", "--json"])
    for f in FIELDS:
        assert f in rep, f
    assert rep["decode_tok_s"] > 0 and rep["ttft_s"] > 0
    assert set(rep["prefill_tok_s"]) == {"16", "40"} and all(v > 0 for v in rep["prefill_tok_s"].values())
    assert rep["peak_vram_bytes"] == 0 and rep["peak_rss_bytes"] > 10 << 20
    assert rep["memory"]["tiers"]["ram"]["experts"] > 0
    split = rep["time_split"]
    assert {"total_ms", "gpu_ms", "cpu_ms", "copy_ms", "ssd_wait_ms", "idle_ms"} <= set(split)
    assert split["total_ms"] == pytest.approx(1e3 / rep["decode_tok_s"], rel=1e-2)
    assert rep["bound_tok_s"] > 0 and rep["fraction_of_bound"] == pytest.approx(
        rep["decode_tok_s"] / rep["bound_tok_s"], rel=1e-2)
    b = rep["bound"]["bytes_per_token"]
    assert b["dense_bytes"] > 0 and b["experts_bytes"] > 0 and b["kv_bytes"] > 0
    assert len(rep["configs"]) == 1 and rep["configs"][0]["label"] == "base"
    assert [r["generated_tokens"] for r in rep["configs"][0]["runs"]] == [6, 6]
    assert rep["decode_mode"] == "stream" and rep["distinct_token_frac"] > 0.5


def test_bench_repeat_reports_the_median_decode(model, capsys):
    rep = run_json(capsys, ["bench", str(model), "--device", "cpu", "--prompt-len", "16", "--gen", "4",
                            "--warmup", "0", "--repeat", "3", "--json"])
    runs = rep["decode_tok_s_runs"]
    assert len(runs) == 3 and all(v > 0 for v in runs)
    assert rep["decode_tok_s"] == pytest.approx(sorted(runs)[1])
    assert rep["fraction_of_bound"] == pytest.approx(rep["decode_tok_s"] / rep["bound_tok_s"], rel=1e-2)
    assert cli(["bench", str(model), "--device", "cpu", "--repeat", "0"]) == 1     # a clear error, no crash


def test_bench_compare_reloads_each_configuration(model, capsys):
    rep = run_json(capsys, ["bench", str(model), "--device", "cpu", "--prompt-len", "24", "--gen", "4",
                            "--warmup", "0", "--json", "--compare", "tiers:--ram-mem 64MiB --cache-policy lru"])
    labels = [c["label"] for c in rep["configs"]]
    assert labels == ["base", "tiers"]
    tiered = rep["configs"][1]
    assert tiered["flags"] == "--ram-mem 64MiB --cache-policy lru"
    assert tiered["decode_tok_s"] > 0 and tiered["bound_tok_s"] > 0
    assert rep["configs"][0]["ram_gbs_check"] is None         # no tiers: the bound does not rest on a RAM reading
    ram = tiered["ram_gbs_check"]                               # tiers: the RAM read next to the run
    if bench_core.RunReadings.make() is not None:
        assert ram == {"before": 10.0, "runs": [[12.5, 12.5]], "run_gbs": 12.5, "fastest": 12.5, "spread": 0.25}
    else:                                                       # no peak-RSS reset here: one reading after the runs
        assert ram == {"before": 10.0, "after": 12.5, "run_gbs": 12.5, "fastest": 12.5, "spread": 0.25}
    # the reading of the runs is the bound's: 12.5 GB/s, not the 10 measured before
    assert tiered["bound"]["ms"]["ram"] == pytest.approx(tiered["bound"]["bytes_per_token"]["ram"] / 12.5e6, rel=1e-6)
    assert tiered["fraction_of_fastest_bound"] == pytest.approx(tiered["fraction_of_bound"], rel=1e-3)
    from moetier.commands.bench import summary_line
    assert "RAM read 10-12 GB/s: the bound uses 12, the runs' rate" in summary_line(tiered)   # moved > 10%: said
    assert tiered["decode_memory"] is not None            # tier counters of the decode phase
    assert tiered["time_split"]["source"].startswith("memory tiers")


def test_the_bound_takes_the_ram_rate_next_to_each_run(model, capsys, monkeypatch):
    """Where the bound rests on the RAM rate, each decode run has a reading on each side; the bound takes the median
    over the runs of the faster of a run's two, and the JSON keeps the bound at the fastest reading beside it."""
    if bench_core.RunReadings.make() is None:
        pytest.skip("the kernel refuses to reset the peak RSS here (/proc/self/clear_refs)")
    readings = iter([8.0, 9.0, 20.0, 21.0, 10.0, 11.0])     # run 1: 9, run 2: 21, run 3: 11 -> 11
    monkeypatch.setattr("moetier.memory.bandwidth.measure_ram", lambda nbytes=None: next(readings))
    rep = run_json(capsys, ["bench", str(model), "--device", "cpu", "--prompt-len", "24", "--gen", "4",
                            "--warmup", "0", "--repeat", "3", "--json", "--ram-mem", "64MiB"])
    ram = rep["ram_gbs_check"]
    assert ram == {"before": 10.0, "runs": [[8.0, 9.0], [20.0, 21.0], [10.0, 11.0]], "run_gbs": 11.0,
                   "fastest": 21.0, "spread": 1.625}
    b = rep["bound"]
    assert b["ms"]["ram"] == pytest.approx(b["bytes_per_token"]["ram"] / 11e6, rel=1e-6)
    assert rep["fastest_bound_tok_s"] > rep["bound_tok_s"]
    assert rep["fraction_of_fastest_bound"] == pytest.approx(rep["decode_tok_s"] / rep["fastest_bound_tok_s"],
                                                             rel=1e-2)


def test_ram_readings_stay_out_of_the_peak_rss(monkeypatch):
    """A reading's fresh buffer (measure_ram: 1 GiB) does not count in the configuration's peak RSS."""
    watch = bench_core.RunReadings.make()
    if watch is None:
        pytest.skip("the kernel refuses to reset the peak RSS here (/proc/self/clear_refs)")

    def reading(nbytes=None):
        buf = torch.ones(96 << 20)         # 384 MiB, touched
        return float(buf[::4096].sum())
    monkeypatch.setattr("moetier.memory.bandwidth.measure_ram", reading)
    base = bench_core.peak_rss()
    watch.around(lambda: None)
    assert watch.peak_rss() < base + (128 << 20)


def test_compare_sets_its_switches_for_its_own_run_only(model, capsys, monkeypatch):
    """--compare 'LABEL:FLAGS' takes MOETIER_NAME=VALUE words beside the engine flags: set while that configuration
    loads and runs (A/B of an environment switch in one process), put back after; the JSON names them."""
    import os

    from moetier.commands import bench
    monkeypatch.setenv("MOETIER_PIPELINE", "1")
    monkeypatch.delenv("MOETIER_RING_Q8", raising=False)
    seen = []
    one = bench._one_config
    monkeypatch.setattr(bench, "_one_config", lambda *a: seen.append(
        (a[2], os.environ.get("MOETIER_PIPELINE"), os.environ.get("MOETIER_RING_Q8"))) or one(*a))
    rep = run_json(capsys, ["bench", str(model), "--device", "cpu", "--prompt-len", "16", "--gen", "3",
                            "--warmup", "0", "--json", "--compare", "ab:MOETIER_PIPELINE=0 MOETIER_RING_Q8=0 "
                            "--ram-mem 64MiB", "--compare", "again:"])
    assert seen == [("base", "1", None), ("ab", "0", "0"), ("again", "1", None)]
    assert [c["env"] for c in rep["configs"]] == [{}, {"MOETIER_PIPELINE": "0", "MOETIER_RING_Q8": "0"}, {}]
    assert rep["configs"][0]["decode_memory"] is None and rep["configs"][1]["decode_memory"] is not None  # tiers
    assert os.environ["MOETIER_PIPELINE"] == "1" and "MOETIER_RING_Q8" not in os.environ


def test_bench_table_for_people(model, capsys):
    assert cli(["bench", str(model), "--device", "cpu", "--prompt-len", "12", "--gen", "3", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "of bound" in out and "per decode token (ms)" in out


def test_bench_flag_errors(model):
    with pytest.raises(UserError, match="comma-separated"):
        parse_lengths("512,lots")

    class A:
        model, compare = str(model), ["no-colon"]
    with pytest.raises(UserError, match="LABEL:FLAGS"):
        config_namespaces(A)
    assert cli(["bench", str(model), "--device", "cpu", "--prompt-len", "9000", "--gen", "4", "--ctx", "64"]) == 1


def test_time_split_without_tiers_is_all_device():
    s = time_split("cpu", 50.0, None)
    assert s["cpu_ms"] == s["total_ms"] == 20.0 and s["gpu_ms"] == 0.0
    view = {"per_token": {"ms": {"gpu": 5.0, "cpu": 3.0, "copy": 1.0, "ssd_wait": 0.5}}}
    s = time_split("cuda", 50.0, view)
    assert s["idle_ms"] == pytest.approx(10.5) and s["gpu_ms"] == 5.0


def test_stream_decode_forces_topic_local_tokens(model):
    from moetier import EngineConfig
    from moetier.runtime.engine import Engine
    from moetier.tools.bench_core import GREEDY, Forcing, decode_mode
    from moetier.tools.synth import stream_for
    assert decode_mode("auto", model) == "stream" and decode_mode("greedy", model) == "greedy"
    engine = Engine.load(model, EngineConfig(device="cpu", progress=False))
    ids = stream_for(model, engine.args.vocab_size, 20, seed=4)
    done = engine.complete(prompt_ids=ids[:12], max_tokens=8, params=GREEDY, ignore_eos=True,
                           logits_processor=Forcing(ids[12:]))
    assert done.token_ids == ids[12:]


def test_a_failing_compare_configuration_is_reported_and_the_rest_run(model, capsys):
    """One bad --compare entry (static policy without a profile) must not lose the other measurements."""
    rep = run_json(capsys, ["bench", str(model), "--device", "cpu", "--prompt-len", "16", "--gen", "3",
                            "--warmup", "0", "--json", "--compare", "bad:--cache-policy static",
                            "--compare", "tiers:--ram-mem 64MiB"])
    assert [c["label"] for c in rep["configs"]] == ["base", "tiers"]
    assert [f["label"] for f in rep["failed"]] == ["bad"] and "--expert-profile" in rep["failed"][0]["error"]
    assert cli(["bench", str(model), "--device", "cpu", "--prompt-len", "12", "--gen", "3", "--warmup", "0",
                "--compare", "bad:--cache-policy static"]) == 0
    assert "failed [bad]" in capsys.readouterr().out


def test_live_at_peak_names_the_blocks_live_at_the_peak():
    """tools.vram replays an allocator trace: the peak, and what was live then by allocating site."""
    from moetier.tools.vram import live_at_peak

    def alloc(addr, size, name):
        return {"action": "alloc", "addr": addr, "size": size,
                "frames": [{"filename": f"/x/moetier/{name}.py", "line": 7, "name": name}]}
    trace = [alloc(1, 10, "a"), alloc(2, 30, "b"), {"action": "free_requested", "addr": 1},
             {"action": "free_completed", "addr": 1}, alloc(3, 5, "a"), {"action": "free_requested", "addr": 2},
             alloc(4, 20, "c")]
    assert live_at_peak({"device_traces": [trace]}) == (40, {"b.py:7 b": 30, "a.py:7 a": 10})


def test_bytes_per_token_counts_packed_gguf_experts(tmp_path):
    """A GGUF model's experts are packed buffers (QuantExperts), not parameters: the all-on-device bound still
    reads k of them per MoE layer (the H200 all-GPU bound once counted 0 expert bytes: 5,043 tok/s)."""
    from types import SimpleNamespace

    from moetier.models.quant_experts import QuantExperts
    from moetier.runtime.kv_cache import session_cache
    from moetier.tools.bench_core import bytes_per_token
    from moetier.tools.synth import synth
    from moetier.memory import EXPERT_PARAM
    from moetier.weights.gguf import pack_experts
    from moetier.weights.loader import load_model
    path = tmp_path / "q.gguf"
    synth("qwen3-30b-a3b", "Q4_0", path, layers=2, scale="tiny", log=lambda *a: None, progress=False)
    model, args, ckpt = load_model(path, skip=EXPERT_PARAM)       # as the engine loads a GGUF without tiers
    pack_experts(model, ckpt, "cpu", torch.float32)
    packed = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(packed) == 2
    total = sum(b.numel() * b.element_size() for m in packed for b in m.buffers())
    eng = SimpleNamespace(model=model, args=args, new_session=lambda max_context: SimpleNamespace(
        cache=session_cache(model, max_context, torch.float32, "cpu")))
    b = bytes_per_token(eng, 64)
    assert b["experts"] == total // args.num_experts * args.num_experts_per_tok > 0
    assert b["dense"] > 0 and b["kv"] > 0


def test_sample_decode_draws_with_the_sampling_defaults(model, capsys, monkeypatch):
    """--decode sample: the tokens drawn (seeded: two runs the same), with the checkpoint's generation_config, else
    SAMPLE_DEFAULTS."""
    from moetier.tools.bench_core import SAMPLE_DEFAULTS, SamplingParams, sample_params
    drawn = []
    real = bench_core.run_prompt

    def spy(engine, prompt, gen, forced=None, params=bench_core.GREEDY):
        drawn.append(params)
        return real(engine, prompt, gen, forced, params)
    monkeypatch.setattr(bench_core, "run_prompt", spy)
    rep = run_json(capsys, ["bench", str(model), "--device", "cpu", "--prompt-len", "16", "--gen", "6",
                            "--warmup", "0", "--repeat", "2", "--decode", "sample", "--json"])
    assert rep["decode_mode"] == "sample" and all(r["generated_tokens"] == 6 for r in rep["configs"][0]["runs"])
    assert drawn and all(p == SamplingParams(**SAMPLE_DEFAULTS, seed=0) for p in drawn)

    class Eng:
        def __init__(self, g):
            self.sampling_defaults = lambda: g
    assert sample_params(Eng({"temperature": 0.6, "top_p": 0.95})) == SamplingParams(temperature=0.6, top_p=0.95,
                                                                                      seed=0)
    assert sample_params(Eng({"temperature": 0.0})).temperature == SAMPLE_DEFAULTS["temperature"]
