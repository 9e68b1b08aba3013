"""The server under bad input, overload and clients that hang up: every error has OpenAI's shape and
the right status, nothing crashes it, and the engine is freed at once."""
from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_server_support import ALIAS, API_KEY, start_server  # noqa: E402

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "--queue-size", "1")
    yield srv
    srv.stop()


def request(server, method, path, body=None, headers=None, key=API_KEY):
    """-> (status, headers, parsed JSON or text). body: dict (sent as JSON), str or bytes (sent raw)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    data = json.dumps(body) if isinstance(body, (dict, list)) else body
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    raw = r.read().decode("utf-8", "replace")
    conn.close()
    try:
        return r.status, r.headers, json.loads(raw)
    except json.JSONDecodeError:
        return r.status, r.headers, raw


def chat_body(**kw):
    return {"model": ALIAS, "messages": HI, "max_tokens": 4, **kw}


NESTED = '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"

# (name, method, path, body, expected status, expected param or None, text the message must contain)
BAD = [
    ("malformed json", "POST", CHAT, '{"messages": [', 400, None, "not valid JSON"),
    ("empty body", "POST", CHAT, "", 400, None, ""),
    ("body is a list", "POST", CHAT, "[1, 2]", 400, None, "JSON object"),
    ("deep nesting", "POST", CHAT, NESTED, 400, None, ""),
    ("NaN temperature", "POST", CHAT, '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     400, "temperature", ""),
    ("messages missing", "POST", CHAT, {"model": ALIAS}, 400, "messages", ""),
    ("messages empty", "POST", CHAT, {"messages": []}, 400, "messages", ""),
    ("messages a string", "POST", CHAT, {"messages": "hi"}, 400, "messages", ""),
    ("unknown role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", ""),
    ("content a number", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content", ""),
    ("user without content", "POST", CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0", "content"),
    ("image part", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "messages", "image_url"),
    ("temperature a string", "POST", CHAT, chat_body(temperature="hot"), 400, "temperature", "number"),
    ("temperature negative", "POST", CHAT, chat_body(temperature=-1), 400, "temperature", ""),
    ("top_p above one", "POST", CHAT, chat_body(top_p=1.5), 400, "top_p", ""),
    ("max_tokens zero", "POST", CHAT, chat_body(max_tokens=0), 400, "max_tokens", ""),
    ("max_tokens a string", "POST", CHAT, chat_body(max_tokens="10"), 400, "max_tokens", ""),
    ("max_tokens huge", "POST", CHAT, chat_body(max_tokens=10 ** 40), 400, "max_tokens", ""),
    ("max_tokens past context", "POST", CHAT, chat_body(max_tokens=100000), 400, "messages",
     "maximum context length is 512 tokens"),
    ("prompt past context", "POST", CHAT, chat_body(messages=[{"role": "user", "content": "tier " * 600}]),
     400, "messages", "maximum context length is 512"),
    ("n two", "POST", CHAT, chat_body(n=2), 400, "n", "n=1"),
    ("too many stops", "POST", CHAT, chat_body(stop=[str(i) for i in range(17)]), 400, "stop", ""),
    ("stop a number", "POST", CHAT, chat_body(stop=5), 400, "stop", ""),
    ("top_logprobs without logprobs", "POST", CHAT, chat_body(top_logprobs=2), 400, "top_logprobs", ""),
    ("top_logprobs too many", "POST", CHAT, chat_body(logprobs=True, top_logprobs=50), 400, "top_logprobs", ""),
    ("logprobs a string", "POST", CHAT, chat_body(logprobs="yes"), 400, "logprobs", ""),
    ("seed too large", "POST", CHAT, chat_body(seed=2 ** 70), 400, "seed", ""),
    ("stream_options without stream", "POST", CHAT, chat_body(stream_options={"include_usage": True}), 400,
     "stream_options", ""),
    ("bad response_format", "POST", CHAT, chat_body(response_format={"type": "yaml"}), 400, "response_format.type",
     ""),
    ("template kwargs not an object", "POST", CHAT, chat_body(chat_template_kwargs=[1]), 400,
     "chat_template_kwargs", ""),
    ("unknown model", "POST", CHAT, chat_body(model="gpt-4"), 404, "model", "gpt-4"),
    ("tools", "POST", CHAT, chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools",
     "function calling is not supported"),
    ("tools required", "POST", CHAT, chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
                                               tool_choice="required"), 400, "tools", "tool_choice"),
    ("legacy functions", "POST", CHAT, chat_body(functions=[{"name": "f"}]), 400, "functions", "function_call"),
    ("tools not a list", "POST", CHAT, chat_body(tools={"type": "function"}), 400, "tools", ""),
    ("completion without prompt", "POST", TEXT, {"max_tokens": 3}, 400, "prompt", ""),
    ("completion prompt a number", "POST", TEXT, {"prompt": 5}, 400, "prompt", ""),
    ("completion empty prompt", "POST", TEXT, {"prompt": ""}, 400, "prompt", "empty"),
    ("completion token outside vocab", "POST", TEXT, {"prompt": [1, 2, 999999]}, 400, "prompt", "vocabulary"),
    ("completion batch", "POST", TEXT, {"prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    ("completion suffix", "POST", TEXT, {"prompt": "a", "suffix": "b"}, 400, "suffix", ""),
    ("completion best_of", "POST", TEXT, {"prompt": "a", "best_of": 3}, 400, "best_of", ""),
    ("completion logprobs too many", "POST", TEXT, {"prompt": "a", "logprobs": 99}, 400, "logprobs", ""),
    ("unknown route", "GET", "/v1/nothing-here", None, 404, None, "/v1/nothing-here"),
    ("wrong method", "GET", CHAT, None, 405, None, ""),
    ("unknown model id", "GET", "/v1/models/other", None, 404, "model", ""),
]


@pytest.mark.parametrize("name,method,path,body,status,param,text", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_shaped_errors(server, name, method, path, body, status, param, text):
    got, _, data = request(server, method, path, body)
    assert got == status, data
    assert isinstance(data, dict) and set(data) == {"error"}, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert text in err["message"]


def test_context_error_gives_the_numbers(server):
    _, _, data = request(server, "POST", CHAT, chat_body(max_tokens=1000))
    msg = data["error"]["message"]
    assert data["error"]["code"] == "context_length_exceeded"
    n_prompt = int(msg.split("(")[1].split(" in the messages")[0])
    assert f"you requested {n_prompt + 1000} tokens ({n_prompt} in the messages, 1000 in the completion)" in msg


def test_auth_body_limit_and_odd_but_valid_input(server):
    assert request(server, "GET", "/v1/models", key=None)[0] == 401
    status, headers, data = request(server, "GET", "/v1/models", key="nope")
    assert status == 401 and data["error"]["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
    status, _, data = request(server, "POST", CHAT, b"x" * (17 * 1024 * 1024))
    assert status == 413 and data["error"]["code"] == "request_too_large"
    # unknown fields are ignored; content parts, surrogates and control characters are just text
    ok = [chat_body(foo={"bar": 1}, user="u1", tools=None),
          chat_body(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none"),   # not to call
          chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                          "text": "b"}]}]),
          chat_body(messages=[{"role": "user", "content": "\x00\x01 \ud800 \U0001f600"}], stop=["\ud83d"]),
          chat_body(top_k=-1, top_p=0, seed=-5, max_completion_tokens=3, temperature=2)]
    for body in ok:
        status, _, data = request(server, "POST", CHAT, json.dumps(body, ensure_ascii=True))
        assert status in (200, 400), data
        assert "error" not in data or data["error"]["type"] == "invalid_request_error"
    status, _, data = request(server, "POST", CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}",
                              headers={"Content-Type": "text/plain"})
    assert status == 200, data   # a body labelled as something else is still read as JSON


def healthy(server):
    status, _, data = request(server, "GET", "/health", key=None)
    assert status == 200 and data["status"] == "ok"
    status, _, data = request(server, "POST", CHAT, chat_body(max_tokens=3))
    assert status == 200 and data["choices"][0]["message"]["role"] == "assistant"


def test_healthy_after_bad_input(server):
    healthy(server)


def open_stream(server, body: dict) -> socket.socket:
    """Send a streaming request on a raw socket; -> the socket, for the test to read and drop."""
    data = json.dumps({**body, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST " + body.pop("_path", CHAT).encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_until(s: socket.socket, marker: bytes, count: int = 1) -> bytes:
    buf = b""
    while buf.count(marker) < count:
        part = s.recv(65536)
        if not part:
            break
        buf += part
    return buf


def hang_up(s: socket.socket) -> None:
    s.shutdown(socket.SHUT_RDWR)
    s.close()


def wait_idle(server, timeout=10.0) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        _, _, stats = request(server, "GET", "/v1/moetier/stats")
        if not stats["queue"]["running"] and not stats["queue"]["waiting"]:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"the engine is still busy after {timeout} s: {stats['queue']}")


def test_disconnect_mid_stream_frees_the_engine(server):
    s = open_stream(server, chat_body(max_tokens=480, temperature=1.0, seed=1))
    head = read_until(s, b"data: ", 4)
    assert b"200 OK" in head
    hang_up(s)
    stats = wait_idle(server)
    last = stats["last"]
    assert last["finish_reason"] == "cancelled" and last["generated_tokens"] < 480
    # from the cancel flag to the engine being free: one decode step, well under 0.5 s
    assert last["cancel_to_free_s"] < 0.5, last
    healthy(server)


def test_disconnect_of_a_non_streaming_request(server):
    data = json.dumps(chat_body(max_tokens=480, temperature=1.0, seed=2)).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
              f"{API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    t0 = time.time()
    while time.time() - t0 < 5:            # wait until it runs, then hang up
        _, _, stats = request(server, "GET", "/v1/moetier/stats")
        if stats["queue"]["running"]:
            break
        time.sleep(0.002)
    hang_up(s)
    stats = wait_idle(server)
    assert stats["last"]["finish_reason"] in ("cancelled", "length")   # "length" if it won the race
    healthy(server)


def test_queue_position_and_overload(server):
    a = open_stream(server, chat_body(max_tokens=480, temperature=1.0, seed=3))
    read_until(a, b"data: ", 2)                      # A runs
    b = open_stream(server, chat_body(max_tokens=8))
    head = read_until(b, b": queue position")        # B waits and is told where it stands
    assert b"x-queue-position: 1" in head.lower() and b": queue position 1" in head
    status, headers, data = request(server, "POST", CHAT, chat_body(max_tokens=2))
    assert status == 429 and data["error"]["type"] == "rate_limit_error" and headers["retry-after"] == "1"
    assert data["error"]["code"] == "queue_full"
    hang_up(b)                                       # leaving while queued takes B off the queue
    queue_is(server, waiting=0, running=True)
    c = socket.create_connection(("127.0.0.1", server.port), timeout=30)   # a non-streaming request waits...
    data = json.dumps(chat_body(max_tokens=8)).encode()
    c.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
              f"{API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    queue_is(server, waiting=1, running=True)
    hang_up(c)                                       # ...and leaves: off the queue too, A still runs
    queue_is(server, waiting=0, running=True)
    hang_up(a)
    wait_idle(server)
    healthy(server)


def queue_is(server, waiting: int, running: bool, timeout: float = 5.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        q = request(server, "GET", "/health", key=None)[2]["queue"]
        if q == {"waiting": waiting, "running": running}:
            return
        time.sleep(0.005)
    raise AssertionError(f"queue is {q}, expected waiting={waiting} running={running}")
