"""Engine: streaming events, detokenisation, stop strings, EOS, sessions (prefix reuse), limits."""
import pytest
import torch

from moetier import EngineConfig, SamplingParams
from moetier.errors import ContextOverflow, UserError
from moetier.runtime.engine import Engine
from moetier.runtime.generate import Done, StopMatcher, TokenEvent, greedy_tokens
from moetier.weights.tokenizer import Detokenizer, Tokenizer


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.load(tiny_model_dir, EngineConfig(device="cpu", max_context=256, progress=False))


def run(engine, **kw):
    events = list(engine.generate(**kw))
    assert isinstance(events[-1], Done) and all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


def test_stream_deltas_add_up_to_the_text(engine):
    toks, done = run(engine, prompt="The quick brown", max_tokens=24, params=SamplingParams(temperature=1.0, seed=3),
                     ignore_eos=True)
    assert "".join(e.text for e in toks) == done.text
    assert done.text == engine.tokenizer.decode(done.token_ids)
    assert len(done.token_ids) == 24 and done.finish_reason == "length"
    s = done.stats
    assert s["prompt_tokens"] == len(engine.tokenizer.encode("The quick brown")) and s["generated_tokens"] == 24
    assert s["decode_tok_s"] > 0 and s["ttft_s"] > 0
    assert s["decode_path"] in ("eager", "cpu-compiled") and s["device"] == "cpu"


def test_greedy_engine_matches_plain_loop(engine):
    ids = engine.tokenizer.encode("Python is a programming")
    _, done = run(engine, prompt_ids=ids, max_tokens=16, params=SamplingParams(temperature=0), ignore_eos=True)
    assert done.token_ids == greedy_tokens(engine.model, ids, 16)


def test_seed_reproducible(engine):
    p = SamplingParams(temperature=1.2, top_p=0.9, seed=11)
    a = run(engine, prompt="Numbers", max_tokens=20, params=p, ignore_eos=True)[1].token_ids
    b = run(engine, prompt="Numbers", max_tokens=20, params=p, ignore_eos=True)[1].token_ids
    assert a == b


def test_eos_stops(engine):
    ids = engine.tokenizer.encode("The quick")
    free = greedy_tokens(engine.model, ids, 8)
    engine_eos = engine.eos_ids
    engine.eos_ids = {free[3]}
    try:
        _, done = run(engine, prompt_ids=ids, max_tokens=8, params=SamplingParams(temperature=0))
    finally:
        engine.eos_ids = engine_eos
    assert done.finish_reason == "stop" and done.token_ids == free[:free.index(free[3])]


def test_stop_string_cuts_and_is_never_streamed(engine):
    ids = engine.tokenizer.encode("The quick")
    full = engine.tokenizer.decode(greedy_tokens(engine.model, ids, 30))
    stop = full[10:13]
    assert stop
    toks, done = run(engine, prompt_ids=ids, max_tokens=30, params=SamplingParams(temperature=0), stop=[stop],
                     ignore_eos=True)
    assert done.finish_reason == "stop"
    assert done.text == full[:full.index(stop)]
    assert "".join(e.text for e in toks) == done.text


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["STOP", "<end>"])
    out = [m.feed(d) for d in ["hello S", "TO", "x and <e", "nd> tail"]]
    assert out[0] == ("hello ", False)
    assert out[1] == ("", False)
    assert out[2] == ("STOx and ", False)
    assert out[3] == ("", True)
    assert m.text == "hello STOx and "


def test_session_reuses_prefix_and_matches_fresh(engine):
    p = SamplingParams(temperature=0)
    session = engine.new_session()
    first = engine.tokenizer.encode("The quick brown fox")
    _, d1 = run(engine, prompt_ids=first, max_tokens=6, params=p, session=session, ignore_eos=True)
    second = first + d1.token_ids + engine.tokenizer.encode(" jumps over")
    _, d2 = run(engine, prompt_ids=second, max_tokens=6, params=p, session=session, ignore_eos=True)
    assert d2.stats["cached_tokens"] == len(first) + len(d1.token_ids) - 1
    _, fresh = run(engine, prompt_ids=second, max_tokens=6, params=p, ignore_eos=True)
    assert fresh.stats["cached_tokens"] == 0 and fresh.token_ids == d2.token_ids
    # a diverging prompt keeps only the common part
    third = first[:2] + engine.tokenizer.encode(" lazy dog")
    _, d3 = run(engine, prompt_ids=third, max_tokens=4, params=p, session=session, ignore_eos=True)
    assert d3.stats["cached_tokens"] == 2
    assert d3.token_ids == run(engine, prompt_ids=third, max_tokens=4, params=p, ignore_eos=True)[1].token_ids


def test_chat_messages_use_the_template(engine):
    msgs = [{"role": "user", "content": "Hi there"}]
    ids = engine.encode(messages=msgs)
    assert engine.tokenizer.decode(ids, skip_special=False) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


def test_context_overflow_and_bad_input(engine):
    with pytest.raises(ContextOverflow, match="300 tokens but the context holds 256"):
        engine.generate(prompt_ids=[5] * 300, max_tokens=4)
    with pytest.raises(UserError, match="max_tokens"):
        engine.generate(prompt="hi", max_tokens=-1)
    with pytest.raises(UserError, match="outside the vocabulary"):
        engine.generate(prompt_ids=[1, 99999])
    with pytest.raises(UserError, match="empty"):
        engine.generate(prompt_ids=[])


def test_generation_stops_at_the_end_of_the_context(engine):
    session = engine.new_session(max_context=20)
    _, done = run(engine, prompt_ids=list(range(10, 25)), max_tokens=100, params=SamplingParams(temperature=0),
                  session=session, ignore_eos=True)
    assert done.finish_reason == "length" and 15 + len(done.token_ids) <= 21


def test_detokenizer_never_emits_broken_utf8(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    text = "Déjà vu: naïve café, 東京, emoji 🙂 and ₿. " * 2
    ids = tok.encode(text)
    rng = torch.Generator().manual_seed(0)
    ids = ids + torch.randint(3, tok.vocab_size, (40,), generator=rng).tolist()  # arbitrary byte tokens too
    n_text = len(tok.encode(text))
    d = Detokenizer(tok)
    parts = [d.add(i) for i in ids] + [d.flush()]
    # valid text: no replacement character ever leaks out of a partial multi-byte character
    assert all("\ufffd" not in p for p in parts[:n_text])
    assert "".join(parts[:n_text]) == text
    # arbitrary bytes: the stream still adds up to a plain decode
    assert "".join(parts) == tok.decode(ids)


def test_eos_releases_text_held_for_a_possible_stop_string(engine):
    for prompt in ["The quick", "Python is a programming", "Numbers 12345", "def f(x):"]:
        ids = engine.tokenizer.encode(prompt)
        free = greedy_tokens(engine.model, ids, 12)
        cut = next((i for i in range(2, 12) if free[i] not in free[:i]), None)
        if cut is not None and engine.tokenizer.decode(free[:cut]):
            break
    assert cut is not None, "the tiny model repeats itself on every prompt"
    text = engine.tokenizer.decode(free[:cut])
    stop = text[-1] + "\u2603never"  # its first char matches the end of the text, the rest never comes
    saved, engine.eos_ids = engine.eos_ids, {free[cut]}
    try:
        toks, done = run(engine, prompt_ids=ids, max_tokens=12, params=SamplingParams(temperature=0), stop=[stop])
    finally:
        engine.eos_ids = saved
    assert done.finish_reason == "stop" and done.text == text
    assert "".join(e.text for e in toks) == text
