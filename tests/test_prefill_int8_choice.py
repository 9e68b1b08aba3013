"""Which packed-expert formats prefill with int8 activations (runtime/cpu_compile.prefill_int8): fixed for the
K-quants, timed once per machine for Q4_0 (memory/bandwidth.prefill_int8_wins, cached), forced by
MOETIER_PREFILL_INT8 (tests set it: the outcome of a timing never decides a test)."""
from __future__ import annotations

import json

import pytest
import torch

from moetier.errors import UserError
from moetier.kernels import cpu
from moetier.memory import bandwidth
from moetier.models.quant_experts import QuantExperts
from moetier.quant.pack import quantize
from moetier.runtime import cpu_compile

needs_c = pytest.mark.skipif(cpu.backend() != "c", reason="the C kernels did not build")


def experts(qtype, e=6, d=96, i=160, seed=0) -> QuantExperts:
    gq, dq = qtype if isinstance(qtype, tuple) else (qtype, qtype)
    g = torch.Generator().manual_seed(seed)
    gate, up = (quantize(torch.randn(e, i, d, generator=g) * 0.1, gq) for _ in range(2))
    return QuantExperts(qtype, gate, up, quantize(torch.randn(e, d, i, generator=g) * 0.1, dq))


@needs_c
@pytest.mark.parametrize("mode", ["on", "off"])
def test_forced_choice_sets_q8_act_and_stays_close(mode, monkeypatch):
    monkeypatch.setattr(cpu_compile, "PREFILL_INT8", mode)
    monkeypatch.setattr(bandwidth, "measure_prefill_int8", lambda fmt: pytest.fail("forced: nothing is timed"))
    layers = torch.nn.ModuleList([experts("Q4_0"), experts(("Q4_0", "Q8_0"), seed=1), experts(("Q4_0", "MXFP4"), seed=3)])
    cpu_compile.prefill_int8_experts(layers)
    tile = cpu.grouped_int8_tile("Q4_0") and cpu.grouped_int8_tile("Q8_0")
    assert layers[0].q8_act == layers[1].q8_act == (mode == "on" and tile)     # Q8_0 is timed too
    assert not layers[2].q8_act              # MXFP4 is neither timed nor fixed: float activations
    g = torch.Generator().manual_seed(2)
    x, ids = torch.randn(40, 96, generator=g), torch.randint(0, 6, (40, 2), generator=g)
    w = torch.rand(40, 2, generator=g)
    got, want = layers[0](x, ids, w), layers[0].forward_native(x, ids, w)
    assert (got - want).norm() / want.norm() < (0.03 if layers[0].q8_act else 1e-5)


def test_fixed_and_untimed_formats_ignore_the_setting(monkeypatch):
    monkeypatch.setattr(cpu_compile, "PREFILL_INT8", "off")
    assert cpu_compile.prefill_int8("Q4_K") and cpu_compile.prefill_int8("Q6_K")
    monkeypatch.setattr(cpu_compile, "PREFILL_INT8", "on")
    assert cpu_compile.prefill_int8("Q8_0") and not cpu_compile.prefill_int8("MXFP4")
    monkeypatch.setattr(cpu_compile, "PREFILL_INT8", "yes")
    with pytest.raises(UserError, match="auto, on or off"):
        cpu_compile.prefill_int8("Q4_0")


@needs_c
def test_auto_times_once_per_build_and_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(cpu_compile, "PREFILL_INT8", "auto")
    outcome, timed = {"float_ms": 2.0, "int8_ms": 1.0}, []

    def measure(fmt):
        timed.append(fmt)
        return dict(outcome)
    monkeypatch.setattr(bandwidth, "measure_prefill_int8", measure)
    assert cpu_compile.prefill_int8("Q4_0") and cpu_compile.prefill_int8("Q4_0") and timed == ["Q4_0"]
    saved = json.loads(bandwidth.cache_path().read_text())["prefill_int8"]
    assert saved["build"] == cpu.build_library().stem and saved["Q4_0"]["int8"] is True
    outcome = {"float_ms": 1.0, "int8_ms": 2.0}       # another build of the kernels: timed again
    monkeypatch.setattr(cpu, "build_library", lambda: tmp_path / "cpu_kernels_other.so")
    assert not cpu_compile.prefill_int8("Q4_0") and timed == ["Q4_0", "Q4_0"]


@needs_c
def test_measure_prefill_int8_times_both_tiles():
    got = bandwidth.measure_prefill_int8("Q4_0")
    assert set(got) == {"float_ms", "int8_ms"} and got["float_ms"] > 0 and got["int8_ms"] > 0


@needs_c
def test_int8_tile_takes_many_pairs_per_expert(monkeypatch):
    """Q8_0's pairs-per-expert limit (past it: dequantize + F.linear) was measured with float activations; with the
    int8 tile the grouped kernel takes every prefill chunk, and stays close to the float twin."""
    layer = experts("Q8_0")
    g = torch.Generator().manual_seed(4)
    x, ids = torch.randn(200, 96, generator=g), torch.randint(0, 6, (200, 2), generator=g)     # ~67 pairs an expert
    w = torch.rand(200, 2, generator=g)
    calls = []
    grouped = QuantExperts.forward_grouped
    monkeypatch.setattr(QuantExperts, "forward_grouped", lambda self, *a, **k: calls.append(1) or grouped(self, *a, **k))
    want = layer.forward_native(x, ids, w)
    layer(x, ids, w)
    assert not calls
    layer.q8_act = True
    got = layer(x, ids, w)
    assert calls == [1] and (got - want).norm() / want.norm() < 0.03
