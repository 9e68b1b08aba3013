"""Placement never changes results: on CPU the tiered model gives bit-identical logits and the same
greedy tokens as the dense model, wherever the experts are (fast tier, RAM bank, SSD)."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from helpers import ours_logits, tiny_checkpoint
from moetier.config import EngineConfig
from moetier.memory.plan import make_placement
from moetier.memory.profile import Recorder
from moetier.runtime.engine import Engine
from moetier.runtime.generate import greedy_tokens
from moetier.weights.loader import load_model

CTX = 96
PROMPT, SPLIT, N_GREEDY = 40, 24, 16     # prefill 24 tokens (> decode size), then decode one by one


def config(**kw):
    base = dict(vocab_size=131, hidden_size=48, intermediate_size=72, moe_intermediate_size=24,
                num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
                max_position_embeddings=256, rope_theta=1000.0)
    base.update(kw)
    return Qwen3MoeConfig(**base)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe")
    tiny_checkpoint(path, Qwen3MoeForCausalLM, config(), scale=4.0)
    dense, _, _ = load_model(path)
    tokens = torch.randint(0, 131, (PROMPT,), generator=torch.Generator().manual_seed(3))
    return path, dense, tokens, logits(dense, tokens), greedy_tokens(dense, tokens[:SPLIT].tolist(), N_GREEDY)


def logits(model, tokens):
    return ours_logits(model, tokens, SPLIT, CTX)


def sizes(path, **kw):
    """(fixed RAM bytes of a CPU load: dense + KV + workspace + read buffers, bytes per expert in RAM,
    bytes per expert in the fast tier)."""
    pl = make_placement(path, EngineConfig(max_context=CTX, ram_mem=1 << 34, **kw), "cpu", torch.float32, CTX)
    fixed = pl.dense_bytes + pl.embed_bytes + pl.kv_bytes + pl.workspace_bytes + pl.scratch * pl.expert_bytes
    return fixed, pl.expert_bytes, pl.expert_fast_bytes


def check(path, want_logits, want_tokens, tokens, **kw) -> Engine:
    eng = Engine.load(path, EngineConfig(progress=False, max_context=CTX, **kw))
    got = logits(eng.model, tokens)
    assert torch.equal(got, want_logits), f"logits differ under {kw}: max abs {(got - want_logits).abs().max():.3e}"
    toks = greedy_tokens(eng.model, tokens[:SPLIT].tolist(), N_GREEDY)
    assert toks == want_tokens, f"greedy tokens differ under {kw}"
    eng.tiers.cache.check()
    return eng


def test_all_resident(tiny):
    path, _, tokens, want, want_toks = tiny
    eng = check(path, want, want_toks, tokens, gpu_mem=1 << 30, ram_mem=1 << 30)
    st = eng.memory_stats()
    assert st["hit_rate"] == 1.0 and st["tiers"]["gpu"]["experts"] == 4 * 16
    assert st["cumulative"]["hits"]["ram"] == st["cumulative"]["hits"]["ssd"] == 0


def test_tiered_experts_know_the_next_blocks_input(tiny):
    """install: each TieredExperts holds the next decoder block's (input norm, attention), whose norm its graphed
    wait_add may make (memory.doorbell GraphTiers._next_norm); the last block's: None. Held in a tuple: the model's
    modules and state dict do not change."""
    from moetier.memory.experts import TieredExperts
    path = tiny[0]
    eng = Engine.load(path, EngineConfig(progress=False, max_context=CTX, ram_mem=1 << 30))
    blocks = eng.model.model.layers
    seen = 0
    for i, blk in enumerate(blocks):
        ex = getattr(blk.mlp, "experts", None)
        if isinstance(ex, TieredExperts):
            seen += 1
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            want = None if nxt is None else (nxt.input_layernorm, nxt.self_attn)
            assert ex.next_input == want, i          # (modules compare by identity)
    assert seen == 4
    assert not any(".experts." in n for n in [*eng.model.state_dict(), *(n for n, _ in eng.model.named_modules())])


def test_ram_bank_only(tiny):
    path, _, tokens, want, want_toks = tiny
    eng = check(path, want, want_toks, tokens, ram_mem=1 << 30)
    st = eng.memory_stats()
    assert st["tiers"]["ram"]["all_experts"] and st["hit_rate"] == 0.0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_few_fast_slots(tiny, policy):
    path, _, tokens, want, want_toks = tiny
    _, _, fb = sizes(path)
    eng = check(path, want, want_toks, tokens, gpu_mem=10 * fb, ram_mem=1 << 30, cache_policy=policy)
    st = eng.memory_stats()
    assert sum(x["slots"] for x in st["layers"]) == 10
    c = st["cumulative"]
    assert c["hits"]["gpu"] > 0 and c["hits"]["ram"] > 0
    assert 0 < st["hit_rate"] < 1


@pytest.mark.parametrize("direct", [False, True])
def test_streaming_from_ssd(tiny, direct):
    path, _, tokens, want, want_toks = tiny
    fixed, eb, _ = sizes(path)
    eng = check(path, want, want_toks, tokens, ram_mem=fixed + 2 * eb, direct_io=direct)
    st = eng.memory_stats()
    assert st["tiers"]["ram"]["slots"] == 2
    c = st["cumulative"]
    assert c["hits"]["ssd"] > 0.9 * (c["hits"]["ram"] + c["hits"]["ssd"]), c["hits"]
    assert c["bytes_read"]["ssd"] > 0 and c["ssd_reads"] > 0


def test_streaming_with_fast_slots_and_prefill_copies(tiny):
    path, _, tokens, want, want_toks = tiny
    fixed, eb, fb = sizes(path)
    eng = check(path, want, want_toks, tokens, gpu_mem=8 * fb, ram_mem=fixed + 12 * fb + 3 * eb,
                prefill_copy_tokens=2)
    c = eng.memory_stats()["cumulative"]
    assert c["staged_prefill_experts"] > 0 and c["admissions"] > 0


def test_prefetch(tiny):
    path, _, tokens, want, want_toks = tiny
    fixed, eb, fb = sizes(path)
    eng = check(path, want, want_toks, tokens, gpu_mem=6 * fb, ram_mem=fixed + 6 * fb + 8 * eb, prefetch="on")
    p = eng.memory_stats()["cumulative"]["prefetch"]
    assert p["recall"] is not None and 0 <= p["recall"] <= 1
    assert p["reads"] + p["copies"] > 0


@pytest.mark.parametrize("policy", ["static", "mix", "lru"])
def test_profile(tiny, tmp_path, policy):
    path, dense, tokens, want, want_toks = tiny
    rec = Recorder(dense)
    greedy_tokens(dense, tokens[:SPLIT].tolist(), 8)
    rec.remove()
    prof = tmp_path / "profile.json"
    rec.profile.save(prof)
    _, _, fb = sizes(path)
    eng = check(path, want, want_toks, tokens, gpu_mem=12 * fb, ram_mem=1 << 30, expert_profile=str(prof),
                cache_policy=policy, save_profile=str(tmp_path / "learned.json"))
    pl = eng.tiers.pl
    ranking = rec.profile.ranking()
    if policy != "lru":
        pinned = {(li, e) for li, es in enumerate(pl.pinned) for e in es}
        n_pin = 12 if policy == "static" else int(12 * 0.75)
        assert pinned == set(ranking[:n_pin])
        assert all(eng.tiers.cache.slot_of[li, e] >= 0 for li, e in pinned)
    assert sum(pl.fast_slots) == 12
    eng.tiers.close()
    learned = (tmp_path / "learned.json").read_text()
    assert '"decode_tokens"' in learned


def test_n_cpu_moe_and_overrides(tiny):
    path, _, tokens, want, want_toks = tiny
    fixed, eb, fb = sizes(path)
    # layers 0 and 2..4 have experts; n_cpu_moe=3 forces layers 0 and 2 to RAM
    eng = check(path, want, want_toks, tokens, gpu_mem=1 << 30, ram_mem=1 << 30, n_cpu_moe=3)
    assert eng.tiers.pl.layer_tiers == ["cpu", "cpu", "auto", "auto"]
    assert eng.tiers.pl.fast_slots[:2] == [0, 0]
    rules = ((r"layers\.3\.mlp\.experts", "disk"), (r"blk\.4\.ffn_.*_exps", "gpu"), (r"experts", "cpu"))
    eng = check(path, want, want_toks, tokens, gpu_mem=20 * fb, ram_mem=fixed + 40 * eb, override_tensor=rules)
    pl = eng.tiers.pl
    assert pl.layer_tiers == ["cpu", "cpu", "disk", "gpu"]          # first matching rule wins
    assert pl.fast_slots == [0, 0, 0, 16] and len(pl.pinned[3]) == 16
    st = eng.memory_stats()
    assert st["layers"][2]["ram"] == 0 and st["layers"][2]["hit_rate"] == 0.0
    assert st["layers"][3]["hit_rate"] == 1.0
    # a layer whose gate/up and down params land on different tiers goes to the slower one
    rules = ((r"blk\.4\.ffn_up_exps", "gpu"), (r"experts", "disk"))
    eng = check(path, want, want_toks, tokens, gpu_mem=20 * fb, ram_mem=fixed + 40 * eb, override_tensor=rules)
    assert eng.tiers.pl.layer_tiers == ["disk"] * 4


def test_fused_checkpoint(tmp_path):
    ref = tiny_checkpoint(tmp_path, Qwen3MoeForCausalLM, config(), fused=True, scale=4.0, seed=5)
    del ref
    dense, _, _ = load_model(tmp_path)
    tokens = torch.randint(0, 131, (PROMPT,), generator=torch.Generator().manual_seed(4))
    fixed, eb, fb = sizes(tmp_path)
    check(tmp_path, logits(dense, tokens), greedy_tokens(dense, tokens[:SPLIT].tolist(), N_GREEDY), tokens,
          gpu_mem=5 * fb, ram_mem=fixed + 5 * fb + 3 * eb)


def test_loaded_weights_are_aligned_whatever_the_file_offsets(tmp_path):
    """Every CPU weight load_model returns starts on a 64-byte line, although safetensors only aligns data to 8
    bytes: torch's kernels sum in an order that follows alignment, and the placement tests above compare the
    weights read from the file with the tiers' copies bit for bit. A view off a line is copied, values equal."""
    from torch import nn

    from moetier.weights.loader import ALIGN, _set_param
    tiny_checkpoint(tmp_path, Qwen3MoeForCausalLM, config(), scale=4.0, seed=6)
    model, _, _ = load_model(tmp_path)
    assert all(p.data_ptr() % ALIGN == 0 for p in model.parameters())
    buf = torch.randn(4 * 65 + 2, generator=torch.Generator().manual_seed(7))
    view = buf[2:].view(4, 65)                   # 8 bytes past an aligned start
    assert view.data_ptr() % ALIGN
    holder = nn.Module()
    _set_param(holder, "w", view)
    assert holder.w.data_ptr() % ALIGN == 0 and torch.equal(holder.w, view)


def test_run_json_stats_and_budget_errors(tiny):
    path, *_ = tiny
    fixed, eb, fb = sizes(path)
    eng = Engine.load(path, EngineConfig(progress=False, max_context=CTX, gpu_mem=4 * fb, ram_mem=fixed + 4 * fb + 6 * eb))
    done = eng.complete(prompt_ids=list(range(1, 30)), max_tokens=6, ignore_eos=True)
    mem = done.stats["memory"]
    assert mem["decode_tokens"] >= 5 and mem["prefill_tokens"] == 29
    assert set(mem["hits"]) == {"gpu", "ram", "ssd"} and "per_token" in mem and "prefetch" in mem
    assert sum(mem["hits"].values()) == 4 * 4 * (29 + mem["decode_tokens"])     # k routes x MoE layers x tokens
    st = eng.memory_stats()
    assert set(st["tiers"]) == {"gpu", "ram", "ssd"} and len(st["layers"]) == 4
    assert {"layer", "gpu", "ram", "ssd", "hit_rate"} <= set(st["layers"][0])
    from moetier.errors import UserError
    with pytest.raises(UserError, match="dense weights"):
        Engine.load(path, EngineConfig(progress=False, max_context=CTX, ram_mem=fixed // 2))


def test_deferred_counters_fold_like_the_per_layer_path(tiny):
    """Tiers._fold (the counters of prefill layers run without a host sync on CUDA) adds exactly what the
    per-layer path counts for the same routing: routes and experts served from RAM, staged experts, RAM
    hits and the cache's misses. Device counts stand in for a staged layer's (CPU tensors here)."""
    path, *_ = tiny
    eng = Engine.load(path, EngineConfig(progress=False, max_context=CTX, ram_mem=1 << 30, cpu_moe=True))
    t = eng.tiers
    before = t.snapshot()
    counts = torch.tensor([0, 5, 0, 3, 1, 0, 0, 7, 0, 0, 2, 0, 0, 0, 4, 0])     # rows per expert of layer 2
    t.stats.phase = "decode"            # folding happens later, whatever phase runs then
    t._deferred.append((2, counts))
    misses0, ram0 = int(t.cache.misses[2]), t.bank.stats["ram_hits"]
    after = t.snapshot()                # folds
    assert not t._deferred and t.stats.phase == "decode"
    p0, p1 = before["prefill"], after["prefill"]
    assert p1["routes"]["ram"] - p0["routes"]["ram"] == int(counts.sum())
    assert p1["experts"]["ram"] - p0["experts"]["ram"] == int((counts > 0).sum())
    assert p1["staged"] - p0["staged"] == int((counts > 0).sum())
    assert int(t.cache.misses[2]) - misses0 == int(counts.sum())
    assert t.bank.stats["ram_hits"] - ram0 == int((counts > 0).sum())
    assert int(t.stats.layer_routes[2].sum()) >= int(counts.sum())
    t.close()
