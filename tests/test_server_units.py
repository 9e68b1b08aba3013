"""Server pieces without HTTP: the JSON constraint, the reasoning splitter, the session pool, metrics."""
from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("fastapi")

from moetier.server import json_mode, reasoning  # noqa: E402
from moetier.server.json_mode import INITIAL, JsonConstraint, JsonGrammar, closing_suffix, complete, walk  # noqa: E402

VALID = ['{"a": [1, 2.5e-3, -0.0, "x\\u00e9\\n", true, false, null, {"b": {}}], "c": -12E+2}', "{}",
         '{"k":"v"}', '{ "nested": [[[]], [{}]], "s": "\\"quoted\\" \\\\ /" }']
INVALID = ['{"a":01}', "[1]", '{"a":tru}', '{"a\n":1}', '{"a":1,}', '{"a" 1}', '{"a":.5}', '{"a":1}}', '"s"',
           '{"a":[1,]}', '{"a":-}', '{"a":1e}']


@pytest.mark.parametrize("text", VALID)
def test_every_prefix_of_valid_json_completes_to_valid_json(text):
    assert walk(INITIAL, text.encode())[0] == json_mode.DONE
    for i in range(len(text) + 1):
        fixed = complete(text[:i])
        assert fixed.startswith(text[:i]) or text[:i].strip() == "", (text[:i], fixed)
        json.loads(fixed)


@pytest.mark.parametrize("text", INVALID)
def test_invalid_json_is_refused(text):
    state = walk(INITIAL, text.encode())
    assert state is None or state[0] != json_mode.DONE


def test_closing_suffix_examples():
    assert closing_suffix(walk(INITIAL, b'{"a": [1, "x')) == '"]}'
    assert closing_suffix(walk(INITIAL, b'{"a')) == '":null}'
    assert closing_suffix(walk(INITIAL, b'{"a": tr')) == "ue}"
    assert closing_suffix(walk(INITIAL, b"")) == "{}"
    assert complete("not json") == "{}"


def random_vocab(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    alphabet = b'{}[]:,"\\ \n\t0123456789.-+eEtrufalsn abcxyz\x01\xc3\xa9'
    vocab = [bytes([b]) for b in alphabet]
    while len(vocab) < n:
        vocab.append(bytes(rng.choice(alphabet) for _ in range(rng.randint(2, 5))))
    return vocab


def test_constrained_sampling_always_yields_json():
    """Random logits through the mask: every sampled sequence is a viable JSON prefix, and those that
    finish (EOS allowed only at the end) parse."""
    vocab = random_vocab(300)
    eos = len(vocab)
    grammar = JsonGrammar(vocab + [None], set())
    g = torch.Generator().manual_seed(0)
    finished = 0
    for trial in range(40):
        proc = JsonConstraint(grammar, vocab + [None], {eos})
        out: list[int] = []
        for _ in range(60):
            logits = proc(out, torch.randn(len(vocab) + 1, generator=g) * 3)
            assert torch.isfinite(logits).any()
            tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
            if tok == eos:
                finished += 1
                break
            out.append(tok)
        text = b"".join(vocab[t] for t in out).decode("utf-8", errors="replace")
        assert walk(INITIAL, b"".join(vocab[t] for t in out)) is not None, text
        assert isinstance(json.loads(complete(text)), dict)
        if out and tok == eos:
            assert isinstance(json.loads(text), dict), text
    assert finished > 0


def test_mask_is_exact():
    """A token is allowed iff its bytes keep the prefix viable (checked against the plain walk)."""
    vocab = random_vocab(200, seed=1)
    grammar = JsonGrammar(vocab, set())
    for prefix in [b"", b"{", b'{"a', b'{"a":', b'{"a": [1', b'{"a": "x\\', b'{"a": tr', b'{"a": 1}']:
        state = walk(INITIAL, prefix)
        allowed = set(grammar.allowed_ids(state))
        assert set(torch.nonzero(grammar.allowed(state)).flatten().tolist()) == allowed
        want = {i for i, t in enumerate(vocab) if walk(state, t) is not None}
        assert allowed == want, prefix


def test_reasoning_split_stream_equals_whole():
    cases = [("<think>plan it</think>\n\nthe answer", False, "plan it", "the answer"),
             ("  <think>\nhmm\n</think>ok", False, "hmm\n", "ok"),
             ("no thinking here <think>x</think>", False, None, "no thinking here <think>x</think>"),
             ("still thinking</think>\nanswer", True, "still thinking", "answer"),
             ("thinking that never ends", True, "thinking that never ends", ""),
             ("<thi", False, None, "<thi")]
    rng = random.Random(0)
    for text, thinking, want_r, want_c in cases:
        assert reasoning.split(text, thinking) == (want_r, want_c), text
        for _ in range(20):
            s = reasoning.ReasoningSplitter(thinking)
            parts, i = [], 0
            while i < len(text):
                j = i + rng.randint(1, 4)
                parts += s.feed(text[i:j])
                i = j
            parts += s.flush()
            assert "".join(t for k, t in parts if k == "content") == want_c
            assert "".join(t for k, t in parts if k == "reasoning") == (want_r or "")


def test_opens_in_prompt():
    assert reasoning.opens_in_prompt("<|im_start|>assistant\n<think>\n")
    assert not reasoning.opens_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")


class FakeCache:
    nbytes = 100

    def __init__(self):
        self.length = 0


class FakeSession:
    def __init__(self):
        self.cache, self.tokens = FakeCache(), []


class FakeEngine:
    def new_session(self):
        return FakeSession()


def test_session_pool_prefers_longest_prefix_and_keeps_budget():
    from moetier.server.worker import SessionPool
    pool = SessionPool(FakeEngine(), budget_bytes=300, max_sessions=8)
    a = pool.acquire([1, 2, 3])
    a.tokens = [1, 2, 3, 9]
    b = pool.acquire([5, 6])                 # no shared prefix: a new session while the budget allows
    b.tokens = [5, 6, 7]
    assert a is not b
    assert pool.acquire([1, 2, 3, 9, 4]) is a          # a continuation goes to its own conversation
    c = pool.acquire([1, 2, 8])              # diverges from a: new session rather than cutting a back
    assert c not in (a, b) and len(pool.sessions) == 3
    c.tokens = [1, 2, 8]
    d = pool.acquire([7, 7])                 # budget full (3 x 100 bytes): the least recently used is reused
    assert d is b and len(pool.sessions) == 3
    a.tokens = list(range(10, 30))
    # a conversation that continues differs in the tail of the last reply: cut back and reused
    assert pool.acquire(list(range(10, 27)) + [99, 98]) is a
    a.tokens = list(range(10, 27)) + [99, 98] + list(range(50, 80))      # that prompt plus a long reply
    assert pool.acquire(list(range(10, 27)) + [99, 98, 50, 1, 2]) is a   # the reply came back re-tokenized


def test_metrics_render_is_prometheus_text():
    from moetier.server.metrics import render
    snap = {"totals": {"requests": 2, "cancelled": 0, "prompt_tokens": 10, "cached_tokens": 4,
                       "generated_tokens": 20, "decode_s": 0.5, "prefill_s": 0.1},
            "last": {"decode_tok_s": 40.0, "prefill_tok_s": 100.0, "ttft_s": 0.01},
            "queue": {"waiting": 1, "running": True, "queue_size": 16},
            "sessions": {"count": 1, "bytes": 1024},
            "process": {"ram_bytes": 1, "vram_bytes": 0, "vram_reserved_bytes": 0},
            "memory": {"tiers": {"gpu": {"experts": 3, "hits": 7, "bytes": 99}, "ram": {"experts": 5}},
                       "layers": [{"layer": 0, "hit_rate": 0.5}], "hit_rate": 0.5}}
    text = render(snap)
    assert 'moetier_tier_hits{tier="gpu"} 7' in text
    assert 'moetier_tier_bytes{tier="gpu"} 99' in text
    assert "moetier_decode_tokens_per_second_avg 40.0" in text
    assert 'moetier_layer_hit_rate{layer="0"} 0.5' in text
    for line in text.splitlines():
        assert line.startswith("# ") or line.split()[0].startswith("moetier_")
