"""The RAM bank over the SSD tier (memory/store.py) and the fast-tier arena (memory/fast.py)."""
import random

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from helpers import tiny_checkpoint
from moetier.memory.fast import FastTier, expert_math
from moetier.memory.layout import build_layout
from moetier.memory.store import RamBank, SsdReader
from moetier.models.layers import DenseExperts, swiglu
from moetier.weights.loader import load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("store_moe")
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=16, num_experts_per_tok=2, max_position_embeddings=64)
    tiny_checkpoint(path, Qwen3MoeForCausalLM, cfg)
    dense, _, ckpt = load_model(path)
    experts = [m for m in dense.modules() if isinstance(m, DenseExperts)]
    return dense, ckpt, experts


def same(layout, buf, mod, e) -> bool:
    w = layout.unpack(buf)
    return torch.equal(w["gate_up_proj"], mod.gate_up_proj[e]) and torch.equal(w["down_proj"], mod.down_proj[e])


@pytest.mark.parametrize("direct", [False, True])
def test_reader_gives_the_checkpoint_bytes(model, direct):
    dense, ckpt, experts = model
    layout = build_layout(dense, ckpt)
    reader = SsdReader(layout, threads=2, direct=direct)
    buf = torch.zeros(layout.expert_bytes, dtype=torch.uint8)
    for li, mod in enumerate(experts):
        for e in range(16):
            reader.read(li, e, buf)
            assert same(layout, buf, mod, e)
    assert reader.reads == 48 and reader.bytes == 48 * layout.raw_bytes
    reader.close()


@pytest.mark.parametrize("capacity,scratch", [(0, 1), (3, 2), (10, 4)])
def test_bank_fetch_is_right_under_churn(model, capacity, scratch):
    dense, ckpt, experts = model
    layout = build_layout(dense, ckpt)
    reader = SsdReader(layout, threads=3)
    bank = RamBank(layout, capacity, reader, pin=False, scratch=scratch, disk_layers={2})
    rng = random.Random(0)
    for step in range(300):
        li = rng.randrange(3)
        es = sorted(rng.sample(range(16), rng.randint(1, 8)))
        if rng.random() < 0.2:
            bank.prefetch(li, rng.randrange(16))
        got = []
        stop = rng.randint(1, len(es)) if rng.random() < 0.1 else len(es)   # consumers may stop early
        for e, buf, tier, handle in bank.fetch(li, es, admit=rng.random() < 0.5, depth=3):
            assert same(layout, buf, experts[li], e), f"step {step}: wrong bytes for layer {li} expert {e}"
            got.append(e)
            if len(got) == stop:
                break
        assert got == es[:stop]
        assert len(bank.free_scratch) == scratch, "a scratch buffer leaked"
        assert (bank.where >= 0).sum() <= capacity and not (bank.where[2] >= 0).any()   # disk layer never kept
        assert len(bank.lru) == (bank.where >= 0).sum()
    reader.close()


def test_bank_holds_everything_when_it_fits(model):
    dense, ckpt, experts = model
    layout = build_layout(dense, ckpt)
    bank = RamBank(layout, 48, SsdReader(layout), pin=False, scratch=1)
    bank.preload([(li, e) for li in range(3) for e in range(16)])
    assert bank.all_resident
    tiers = [t for _, _, t, _ in bank.fetch(1, list(range(16)), admit=True)]
    assert tiers == ["ram"] * 16 and bank.reader.reads == 48


def test_grouped_hits_match_the_loop(model):
    """The one-GEMM-per-projection hit path (CUDA bf16 uses it) agrees with the per-expert loop."""
    dense, ckpt, experts = model
    layout = build_layout(dense, ckpt)
    bank = RamBank(layout, 16, SsdReader(layout), pin=False, scratch=1)
    fast = FastTier(layout, 16, 0, "cpu", torch.bfloat16)
    for e, buf, _, _ in bank.fetch(0, list(range(16)), admit=True):
        fast.load(e, buf)
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(20, 32, generator=g).to(torch.bfloat16)
    hits = [(3, 0, 4), (7, 4, 1), (8, 5, 10), (15, 15, 5)]
    loop, grouped = torch.empty_like(xs), torch.empty_like(xs)
    fast.run(hits, xs, loop, swiglu)
    fast.grouped = True
    fast.run(hits, xs, grouped, swiglu, (0, 16))
    torch.testing.assert_close(grouped.float(), loop.float(), rtol=2e-2, atol=2e-3)
    want = expert_math({"gate_up_proj": experts[0].gate_up_proj[8].bfloat16(),
                        "down_proj": experts[0].down_proj[8].bfloat16()}, xs[5:15], swiglu)
    torch.testing.assert_close(loop[5:15], want)
