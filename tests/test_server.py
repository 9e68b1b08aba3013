"""The OpenAI-compatible server, end to end: a real `moetier serve` subprocess on a free loopback
port, a tiny random qwen3_moe model with a tiny BPE tokenizer, and the official openai client."""
from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_server_support import ALIAS, API_KEY, start_server  # noqa: E402

GREEDY = dict(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, text, **kw):
    return client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": text}], **kw)


def get(server, path, key=API_KEY):
    req = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def test_models_and_api_key(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    status, _, body = get(server, "/v1/models", key=None)
    assert status == 401 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert get(server, "/health", key=None)[0] == 200          # health, metrics and the page need no key


def test_chat_non_streaming(client):
    r = chat(client, "Hello there", **GREEDY)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.model == ALIAS and r.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert c.finish_reason == "stop" or u.completion_tokens == 24


def test_chat_streaming_matches_non_streaming(client):
    whole = chat(client, "Tell me about experts", **GREEDY)
    chunks = list(chat(client, "Tell me about experts", stream=True, stream_options={"include_usage": True},
                       **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions(client):
    r = client.completions.create(model=ALIAS, prompt="The quick brown fox", **GREEDY)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=ALIAS, prompt="The quick brown fox", stream=True, **GREEDY) if ch.choices)
    assert streamed == r.choices[0].text
    echo = client.completions.create(model=ALIAS, prompt="The quick brown fox", echo=True, **GREEDY)
    assert echo.choices[0].text == "The quick brown fox" + r.choices[0].text
    ids = client.completions.create(model=ALIAS, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_stop_strings(client):
    text = chat(client, "Stop me somewhere", temperature=0, max_tokens=40).choices[0].message.content
    m = re.search(r"[A-Za-z]{2,}", text[3:])
    assert m, f"no word in the greedy output {text!r}"
    stop = m.group(0)[:2]
    want = text[:text.index(stop)]
    for stream in (False, True):
        r = chat(client, "Stop me somewhere", temperature=0, max_tokens=40, stop=[stop, "never-seen"],
                 stream=stream)
        if stream:
            chunks = [ch for ch in r if ch.choices]
            got = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert (got, finish) == (want, "stop")
    one = chat(client, "Stop me somewhere", temperature=0, max_tokens=40, stop=stop)   # a plain string works too
    assert one.choices[0].message.content == want


def test_seed_reproducibility(client):
    kw = dict(temperature=1.0, max_tokens=20)
    a = chat(client, "Roll the dice", seed=1234, **kw).choices[0].message.content
    b = chat(client, "Roll the dice", seed=1234, **kw).choices[0].message.content
    assert a == b
    others = {chat(client, "Roll the dice", seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {a}) > 1


def test_logprobs(client):
    r = chat(client, "Give me logprobs", temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)     # greedy: the chosen one is the top one
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == r.choices[0].message.content
    t = client.completions.create(model=ALIAS, prompt="Logprobs please", temperature=0, max_tokens=6, logprobs=2)
    lp = t.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)   # keyed by text: byte tokens may collide


def test_cached_tokens_on_second_turn(client):
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a tier."}]
    r1 = client.chat.completions.create(model=ALIAS, messages=first, temperature=0, max_tokens=16)
    reply = r1.choices[0].message.content
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And another?"}]
    r2 = client.chat.completions.create(model=ALIAS, messages=second, temperature=0, max_tokens=16)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens
    # the same prompt again: everything but the last token comes from the cache
    r3 = client.chat.completions.create(model=ALIAS, messages=second, temperature=0, max_tokens=16)
    assert r3.usage.prompt_tokens_details.cached_tokens == r3.usage.prompt_tokens - 1
    assert r3.choices[0].message.content == r2.choices[0].message.content


def test_json_mode_output_parses(client):
    for seed in range(4):
        r = chat(client, "Answer in JSON", response_format={"type": "json_object"}, temperature=1.0, seed=seed,
                 max_tokens=60)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    short = chat(client, "Answer in JSON", response_format={"type": "json_object"}, max_tokens=3, seed=0)
    assert short.choices[0].finish_reason == "length"
    assert isinstance(json.loads(short.choices[0].message.content), dict)   # closed for the client
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chat(
        client, "Answer in JSON", response_format={"type": "json_object"}, max_tokens=8, seed=5, stream=True)
        if ch.choices)
    assert isinstance(json.loads(streamed), dict)


def test_reasoning_content(client):
    kw = dict(temperature=0, max_tokens=20, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    r = chat(client, "Think first", **kw)
    msg = r.choices[0].message
    reasoning = msg.model_extra.get("reasoning_content")
    assert reasoning, "the template opened <think>: the output up to </think> is reasoning"
    chunks = [ch for ch in chat(client, "Think first", stream=True, **kw) if ch.choices]
    streamed = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks)
    assert streamed == reasoning
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == msg.content


def test_eight_concurrent_clients(server, client):
    prompts = [f"Client number {i} asks about tier {i % 3}" for i in range(8)]
    want = [chat(client, p, temperature=0, max_tokens=16).choices[0].message.content for p in prompts]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i):
        try:
            c = server.client()
            if i % 2:
                got[i] = "".join(ch.choices[0].delta.content or "" for ch in chat(
                    c, prompts[i], temperature=0, max_tokens=16, stream=True) if ch.choices)
            else:
                got[i] = chat(c, prompts[i], temperature=0, max_tokens=16).choices[0].message.content
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [got[i] for i in range(8)] == want


def test_metrics_stats_and_page(server):
    status, headers, text = get(server, "/metrics", key=None)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("moetier_generated_tokens_total", "moetier_decode_tokens_per_second", "moetier_queue_waiting",
                 'moetier_tier_experts{tier="ram"}', "moetier_ram_bytes_in_use", "moetier_vram_bytes_in_use"):
        assert name in text
    assert re.search(r"^moetier_generated_tokens_total [1-9]", text, re.M)
    status, _, body = get(server, "/v1/moetier/stats")
    stats = json.loads(body)
    assert status == 200 and stats["model"] == ALIAS
    assert stats["memory"]["tiers"]["ram"]["experts"] > 0 and stats["last"]["generated_tokens"] > 0
    status, headers, html = get(server, "/", key=None)
    assert status == 200 and "/static/app.js" in html and headers["content-type"].startswith("text/html")
    for asset in ("/static/app.js", "/static/style.css"):
        assert get(server, asset, key=None)[0] == 200
    assert "http" not in re.sub(r"http://www\.w3\.org/2000/svg", "", html + get(server, "/static/app.js")[2]), \
        "the page must work offline: no external URLs"
