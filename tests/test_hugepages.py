"""memory/hugepages.py: the CPU step's copies on 2 MiB pages hold the same bytes as plain ones."""
from __future__ import annotations

import pytest
import torch

from moetier import EngineConfig
from moetier.commands.quantize import quantize
from moetier.kernels import cpu
from moetier.memory import hugepages
from moetier.models.quant_experts import QuantExperts
from moetier.quant.formats import get_format
from moetier.runtime import cpu_compile
from moetier.runtime.engine import Engine
from test_gguf import build_qwen3_moe

needs_thp = pytest.mark.skipif(not hugepages.ENABLED, reason="no MADV_HUGEPAGE here (or MOETIER_THP=0)")


@needs_thp
@pytest.mark.parametrize("dtype,shape", [(torch.uint8, (5 << 20,)), (torch.float32, (3, 1 << 19)),
                                         (torch.int16, (1 << 20, 3))])
def test_copy_keeps_values_on_aligned_pages(dtype, shape):
    g = torch.Generator().manual_seed(3)
    t = torch.randint(-100, 100, shape, generator=g).to(dtype) if dtype != torch.float32 else \
        torch.randn(shape, generator=g)
    ref = t.t() if t.dim() == 2 else t                      # a transposed view: copied contiguous
    before = ref.clone()
    c = hugepages.copy(ref)
    assert c.is_contiguous() and c.dtype == dtype and c.shape == ref.shape and torch.equal(c, before)
    assert c.data_ptr() % hugepages.HUGE == 0 and c.data_ptr() != t.data_ptr()
    c.add_(1)                                               # its own memory: t unchanged
    assert torch.equal(ref, before) and not torch.equal(c, before)


def test_small_or_disabled_copies_are_the_tensor_itself(monkeypatch):
    small = torch.randn(1000)
    assert hugepages.copy(small) is small
    monkeypatch.setattr(hugepages, "ENABLED", False)
    big = torch.randn(2 << 20)
    assert hugepages.copy(big) is big
    e = hugepages.empty(3 << 20)
    assert e.dtype == torch.uint8 and e.numel() == 3 << 20


@needs_thp
@pytest.mark.skipif(cpu.backend() != "c", reason="the C kernels did not build")
def test_x8_expert_copies_on_huge_pages_are_the_interleaved_rows(tmp_path, monkeypatch):
    """eager_blocks' x8 copies of packed experts (now on hugepages.empty) are interleave_rows of the file's rows, and
    the dense GGML copies above MIN_BYTES (lowered here) are the loader's blocks, on aligned pages."""
    monkeypatch.setattr(hugepages, "MIN_BYTES", 4096)
    path = quantize(build_qwen3_moe(tmp_path / "model"), "Q4_0", tmp_path / "m-Q4_0.gguf")
    eng = Engine.load(path, EngineConfig(device="cpu", threads=1, progress=False, max_context=64, cpu_compile="off"))
    cpu_compile.eager_blocks(eng.model)
    experts = [m for m in eng.model.modules() if isinstance(m, QuantExperts) and getattr(m, "_x8_types", None)]
    assert experts
    for m in experts:
        for name, f in (("gate", m.fmt), ("up", m.fmt), ("down", m.down_fmt)):
            raw, x8 = getattr(m, f"{name}_raw"), getattr(m, f"{name}_x8")
            want = cpu.interleave_rows(raw.contiguous().view(-1, raw.shape[-1]), get_format(f).type_id)
            assert x8.data_ptr() % hugepages.HUGE == 0 and torch.equal(x8.view(-1, raw.shape[-1]), want)
    copies = [getattr(m, f"{a}_q") for m in eng.model.modules() for a in getattr(m, "_quant_copies", {})]
    big = [c for c in copies if c.nbytes >= hugepages.MIN_BYTES]
    assert big and all(c.data_ptr() % hugepages.HUGE == 0 for c in big)
