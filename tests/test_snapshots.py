"""Cache snapshots: a recurrent (Qwen3-Next) session resumes from the state saved at the end of a
earlier prompt's prefill, with the same tokens and logits as recomputing from scratch."""
import pytest
import torch
from transformers import Qwen3NextForCausalLM

from helpers import tiny_checkpoint
from moetier import EngineConfig, SamplingParams
from moetier.runtime.engine import Engine, Session
from moetier.runtime.generate import Done
from test_arch_qwen3_next import VOCAB, next_config, slow_decay

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_next")
    tiny_checkpoint(path, Qwen3NextForCausalLM, next_config(), scale=4.0, init=slow_decay)
    return Engine.load(path, EngineConfig(device="cpu", max_context=256, progress=False))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, prompt, session=None, n=6) -> Done:
    """Greedy generation; the chosen tokens' logprobs are kept in done.stats["logprobs"]."""
    *events, done = engine.generate(prompt_ids=prompt, max_tokens=n, params=GREEDY, session=session,
                                    logprobs=0, ignore_eos=True)
    done.stats["logprobs"] = torch.tensor([ev.logprob for ev in events if ev.token_id >= 0])
    return done


def same_as_fresh(engine, prompt, done: Done, n=6):
    """Tokens identical to a run on a new session, and the same logprobs to float precision."""
    fresh = run(engine, prompt, n=n)
    assert fresh.stats["cached_tokens"] == 0
    assert done.token_ids == fresh.token_ids
    torch.testing.assert_close(done.stats["logprobs"], fresh.stats["logprobs"], rtol=0, atol=1e-5)


def test_resume_from_snapshot_matches_scratch(engine):
    s = engine.new_session()
    p1 = ids(30, 1)
    d1 = run(engine, p1, s)
    assert d1.stats["cached_tokens"] == 0 and [len(t) for t, _ in s.snapshots] == [30]
    # the next prompt keeps p1 but not the generated tokens (as a chat template re-rendering the
    # answer would): the cache holds p1 + 5 generated tokens and cannot be cut back to 30
    p2 = p1 + [(d1.token_ids[0] + 1) % VOCAB] + ids(12, 2)
    assert s.cache.length == 35 and not s.cache.can_truncate
    d2 = run(engine, p2, s)
    assert d2.stats["cached_tokens"] == 30
    same_as_fresh(engine, p2, d2)
    # continuing the same conversation needs no snapshot: everything cached is kept
    p3 = p2 + d2.token_ids + ids(5, 3)
    d3 = run(engine, p3, s)
    assert d3.stats["cached_tokens"] == len(p2) + len(d2.token_ids) - 1
    same_as_fresh(engine, p3, d3)
    assert [len(t) for t, _ in s.snapshots] == [30, len(p2), len(p3)]
    # back to an earlier turn boundary (a regenerated answer): resumes from the p2 snapshot
    p4 = p2 + ids(4, 4)
    d4 = run(engine, p4, s)
    assert d4.stats["cached_tokens"] == len(p2)
    same_as_fresh(engine, p4, d4)
    # diverging inside the first prompt: nothing to resume from
    p5 = p1[:10] + ids(8, 5)
    d5 = run(engine, p5, s)
    assert d5.stats["cached_tokens"] == 0
    same_as_fresh(engine, p5, d5)


def test_snapshot_beyond_the_common_prefix_is_not_used(engine):
    """A snapshot of another branch is longer than what the live KV cache still holds: restoring it
    would pair its recurrent state with overwritten KV positions. The shorter one is used."""
    s = engine.new_session()
    p1 = ids(20, 6)
    run(engine, p1, s)
    branch_a = p1 + ids(10, 7)
    run(engine, branch_a, s)                       # snapshot at 30, tokens branch_a
    branch_b = p1 + ids(10, 8)
    assert run(engine, branch_b, s).stats["cached_tokens"] == 20   # KV 20..29 now hold branch b
    back = branch_a + ids(3, 9)
    d = run(engine, back, s)
    assert d.stats["cached_tokens"] == 20
    same_as_fresh(engine, back, d)


def test_a_shared_prefix_snapshot_outlives_many_follow_ups(engine):
    """The same long prompt with a different tail, more times than snapshots are kept: each one
    resumes from the prompt's snapshot (used snapshots are kept first), never from 0."""
    s = engine.new_session()
    p = ids(40, 11)
    run(engine, p, s, n=2)
    for i in range(Session.MAX_SNAPSHOTS + 3):
        q = p + ids(3 + i, 100 + i)
        d = run(engine, q, s, n=2)
        assert d.stats["cached_tokens"] == len(p), f"follow-up {i} resumed from {d.stats['cached_tokens']}"
    same_as_fresh(engine, q, d, n=2)


def test_restored_logits_are_bit_identical(engine):
    """Cache.snapshot / restore: prefill a, snapshot, run something else, restore, continue with b:
    the same logits as a + b on a fresh cache, bit for bit (on the CPU)."""
    model = engine.model
    a, b, other = torch.tensor(ids(21, 10)), torch.tensor(ids(9, 11)), torch.tensor(ids(15, 12))
    with torch.no_grad():
        cache = model.make_cache(64, torch.float32, "cpu")
        model(a, cache)
        snap = cache.snapshot()
        model(other, cache)
        cache.restore(snap)
        got = model(b, cache)
        fresh = model.make_cache(64, torch.float32, "cpu")
        model(a, fresh)
        want = model(b, fresh)
    assert torch.equal(got, want)


def test_truncate_to_zero_restarts_the_recurrent_state(engine):
    model = engine.model
    x = torch.tensor(ids(12, 13))
    with torch.no_grad():
        cache = model.make_cache(32, torch.float32, "cpu")
        first = model(x, cache)
        with pytest.raises(ValueError, match="snapshot"):
            cache.truncate(5)
        cache.truncate(0)          # the recurrent entries still hold the old state: position 0 ignores it
        assert torch.equal(model(x, cache), first)


def test_snapshot_store_is_small(engine):
    s = engine.new_session()
    prompt = ids(8, 14)
    for turn in range(7):
        prompt = prompt + ids(3, 20 + turn)
        run(engine, prompt, s, n=2)
    assert len(s.snapshots) == Session.MAX_SNAPSHOTS
    assert [len(t) for t, _ in s.snapshots] == [len(prompt) - 3 * i for i in (3, 2, 1, 0)]
    # only the recurrent entries are copied: KV positions are rolled back by truncation
    per = sum(e.nbytes for e in s.cache.layers if not hasattr(e, "k"))
    assert s.nbytes == s.cache.nbytes + Session.MAX_SNAPSHOTS * per


def test_attention_only_sessions_truncate_without_snapshots(tiny_model_dir):
    engine = Engine.load(tiny_model_dir, EngineConfig(device="cpu", max_context=128, progress=False))
    s = engine.new_session()
    p1 = ids(20, 15)
    d1 = run(engine, p1, s)
    p2 = p1 + [(d1.token_ids[0] + 1) % 300] + ids(5, 16)
    d2 = run(engine, p2, s)
    assert d2.stats["cached_tokens"] == 20 and s.snapshots == []
    same_as_fresh(engine, p2, d2)
