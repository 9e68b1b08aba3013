"""/v1/chat/completions and /v1/completions: request -> token ids + sampling -> Job -> JSON or SSE.

`prepare_*` turn a validated request into a `Plan` (prompt ids, Engine.generate arguments and
how to format the answer); `respond` queues it and returns the JSON body or the event stream.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import UserError
from ..runtime.generate import Done, TokenEvent
from ..runtime.sampling import SamplingParams
from . import json_mode, reasoning
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, SamplingFields, check_common,
                       message_text, stop_list)
from .worker import Job

OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
RESERVED_TEMPLATE_KEYS = {"messages", "add_generation_prompt", "tools", "documents"}


@dataclass
class Plan:
    kind: str                         # "chat" | "text"
    ids: list[int]
    kwargs: dict                      # Engine.generate keyword arguments
    model: str
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    thinking: bool | None = None      # None: no reasoning split; else: the prompt opened <think>
    json: bool = False
    echo: str = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def sampling_params(engine, req: SamplingFields) -> SamplingParams:
    """Request values over the checkpoint's generation_config.json over OpenAI's defaults."""
    v = {**OPENAI_DEFAULTS, **engine.sampling_defaults()}
    for k in OPENAI_DEFAULTS:
        if getattr(req, k) is not None:
            v[k] = getattr(req, k)
    v["top_k"] = max(0, int(v["top_k"]))           # -1 means off, as in vLLM
    if v["top_p"] == 0:                            # "top_p 0" is asked for as greedy
        v["temperature"], v["top_p"] = 0.0, 1.0
    try:
        return SamplingParams(**v, presence_penalty=req.presence_penalty or 0.0,
                              frequency_penalty=req.frequency_penalty or 0.0, seed=req.seed).check()
    except UserError as e:
        raise APIError(400, str(e), code="invalid_value") from None


def budget(engine, n_prompt: int, max_tokens: int | None, param: str) -> int:
    """max_tokens that fit the context, or a 400 with the numbers."""
    ctx = engine.max_context
    want = max_tokens if max_tokens is not None else max(ctx - n_prompt, 1)
    if n_prompt + want > ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                            f"{n_prompt + want} tokens ({n_prompt} in the {param}, {want} in the completion). "
                            f"Please reduce the length of the {param} or completion.",
                       param=param, code="context_length_exceeded")
    return want


async def prepare_chat(st, req: ChatCompletionRequest) -> Plan:
    check_common(req)
    model = st.check_model(req.model)
    tok = st.engine.tokenizer
    if tok is None or not tok.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions with a plain prompt",
                       param="messages", code="unsupported_value")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: only allowed when logprobs is true", param="top_logprobs")
    for field, choice in (("tools", "tool_choice"), ("functions", "function_call")):
        if getattr(req, field) and getattr(req, choice) != "none":
            raise APIError(400, f"{field}: function calling is not supported (the model's reply is not parsed for "
                                f"tool calls); send the request without {field}, or with {choice} \"none\"",
                           param=field, code="unsupported_value")
    messages = []
    for i, m in enumerate(req.messages):
        d = {"role": m.role, "content": message_text(m)}
        if d["content"] is None and m.role != "assistant":
            raise APIError(400, f"messages.{i}.content: a {m.role} message needs content", param=f"messages.{i}")
        for k in ("name", "reasoning_content", "tool_call_id"):
            if getattr(m, k) is not None:
                d[k] = getattr(m, k)
        messages.append(d)
    extra = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KEYS}

    def render():
        text = tok.apply_chat_template(messages, True, **extra)
        return text, tok.encode(text, add_special=False)
    try:
        text, ids = await run_in_threadpool(render)
    except UserError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # the template's own raise_exception, bad values, unencodable text
        raise APIError(400, f"messages: the chat template could not render this conversation "
                            f"({type(e).__name__}: {str(e)[:300]})", param="messages") from None
    if not ids:
        raise APIError(400, "messages: the conversation renders to an empty prompt", param="messages")
    json_out = wants_json(req)
    kwargs = await generate_kwargs(st, req, req.max_completion_tokens or req.max_tokens, len(ids), "messages")
    kwargs["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    if req.logprobs:
        await run_in_threadpool(st.tokens)       # built once (a 150k vocabulary takes a second)
    thinking = None if (json_out or not st.reasoning_model) else reasoning.opens_in_prompt(text)
    return Plan("chat", ids, kwargs, model, bool(req.stream), include_usage(req), bool(req.logprobs),
                thinking, json_out)


async def prepare_completion(st, req: CompletionRequest) -> Plan:
    check_common(req)
    model = st.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix: insertion (fill-in-the-middle) is not supported", param="suffix",
                       code="unsupported_value")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: one prompt per request is supported (got {len(prompt)})",
                           param="prompt", code="unsupported_value")
        prompt = prompt[0]
    try:
        if isinstance(prompt, str):
            if st.engine.tokenizer is None:
                raise UserError("this model has no tokenizer: send the prompt as token ids")
            ids = await run_in_threadpool(st.engine.tokenizer.encode, prompt)
        else:
            ids = st.engine.encode(prompt_ids=prompt)
    except UserError as e:
        raise APIError(400, f"prompt: {e}", param="prompt") from None
    except Exception as e:
        raise APIError(400, f"prompt: cannot be tokenized ({type(e).__name__})", param="prompt") from None
    if not ids:
        raise APIError(400, "prompt: is empty; give at least one token of text", param="prompt")
    kwargs = await generate_kwargs(st, req, req.max_tokens, len(ids), "prompt")
    kwargs["logprobs"] = req.logprobs
    if req.logprobs is not None:
        await run_in_threadpool(st.tokens)
    echo = ""
    if req.echo:
        echo = prompt if isinstance(prompt, str) else st.engine.tokenizer.decode(ids) if st.engine.tokenizer else ""
    return Plan("text", ids, kwargs, model, bool(req.stream), include_usage(req), req.logprobs is not None,
                json=wants_json(req), echo=echo)


def wants_json(req: SamplingFields) -> bool:
    return req.response_format is not None and req.response_format.type != "text"


async def generate_kwargs(st, req: SamplingFields, max_tokens: int | None, n_prompt: int, param: str) -> dict:
    kwargs = {"max_tokens": budget(st.engine, n_prompt, max_tokens, param),
              "params": sampling_params(st.engine, req), "stop": stop_list(req.stop)}
    if wants_json(req):
        kwargs["logits_processor"] = await run_in_threadpool(st.json_constraint)
    return kwargs


def include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ---- answers ---------------------------------------------------------------------------------

def usage(done: Done) -> dict:
    p, c = len(done.prompt_token_ids), len(done.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": done.stats.get("cached_tokens", 0)}}


def chat_logprob(st, ev: TokenEvent) -> dict:
    table = st.tokens()
    top = [{"token": table.text(i), "logprob": lp, "bytes": table.byte_list(i)} for i, lp in ev.top_logprobs or []]
    return {"token": table.text(ev.token_id), "logprob": ev.logprob, "bytes": table.byte_list(ev.token_id),
            "top_logprobs": top}


def text_logprobs(st, events: list[TokenEvent], offset: int) -> dict:
    table = st.tokens()
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in events:
        t = table.text(ev.token_id)
        out["tokens"].append(t)
        out["token_logprobs"].append(ev.logprob)
        out["top_logprobs"].append({table.text(i): lp for i, lp in ev.top_logprobs or []} or None)
        out["text_offset"].append(offset)
        offset += len(t)
    return out


async def respond(st, plan: Plan, request):
    loop = asyncio.get_running_loop()
    job = Job(plan.ids, plan.kwargs, loop, kind=plan.kind)
    position = st.scheduler.submit(job)
    headers = {"X-Queue-Position": str(position), "X-Request-Id": plan.id}
    if plan.stream:
        return StreamingResponse(stream(st, plan, job, position), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(watch_disconnect(st, job, request))
    try:
        events, done = [], None
        while done is None:
            ev = await job.events.get()
            if isinstance(ev, APIError):
                raise ev
            if isinstance(ev, Done):
                done = ev
            elif ev.token_id >= 0 and ev.logprob is not None:
                events.append(ev)
    finally:
        watcher.cancel()
        st.scheduler.cancel(job)          # no-op when finished; frees the engine when we were interrupted
    return JSONResponse(whole_answer(st, plan, done, events), headers=headers)


async def watch_disconnect(st, job: Job, request) -> None:
    """Cancel the job as soon as the client hangs up (the body was read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            st.scheduler.cancel(job)
            return


def whole_answer(st, plan: Plan, done: Done, events: list[TokenEvent]) -> dict:
    text = json_mode.complete(done.text) if plan.json else done.text
    finish = "length" if done.finish_reason == "length" else "stop"
    base = {"id": ("chatcmpl-" if plan.kind == "chat" else "cmpl-") + plan.id, "created": plan.created,
            "model": plan.model, "system_fingerprint": st.fingerprint, "usage": usage(done)}
    if plan.kind == "text":
        lp = text_logprobs(st, events, len(plan.echo)) if plan.logprobs else None
        return {**base, "object": "text_completion",
                "choices": [{"index": 0, "text": plan.echo + text, "logprobs": lp, "finish_reason": finish}]}
    message = {"role": "assistant", "content": text}
    if plan.thinking is not None:
        thought, content = reasoning.split(text, plan.thinking)
        message["content"] = content
        if thought is not None:
            message["reasoning_content"] = thought
    lp = {"content": [chat_logprob(st, ev) for ev in events]} if plan.logprobs else None
    return {**base, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}]}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class Chunks:
    """Turns text deltas into SSE chunks of one answer (chat or text), with reasoning split off
    and logprob entries attached to the chunk that carries their text."""

    def __init__(self, st, plan: Plan):
        self.st, self.plan, self.chat = st, plan, plan.kind == "chat"
        self.base = {"id": ("chatcmpl-" if self.chat else "cmpl-") + plan.id,
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": plan.created, "model": plan.model, "system_fingerprint": st.fingerprint}
        if plan.include_usage:
            self.base["usage"] = None
        self.splitter = reasoning.ReasoningSplitter(plan.thinking) if plan.thinking is not None else None
        self.sent = ""                       # text released so far
        self.pending: list[TokenEvent] = []  # logprob entries not sent yet

    def chunk(self, delta: dict | str, finish=None, logprobs=None) -> bytes:
        c = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
        c.update({"delta": delta} if self.chat else {"text": delta})
        return sse({**self.base, "choices": [c]})

    def first(self) -> list[bytes]:
        if self.chat:
            return [self.chunk({"role": "assistant", "content": ""})]
        return [self.chunk(self.plan.echo)] if self.plan.echo else []

    def token(self, ev: TokenEvent) -> list[bytes]:
        if ev.token_id >= 0 and ev.logprob is not None:
            self.pending.append(ev)
        return self.emit(ev.text) if ev.text else []

    def done(self, done: Done) -> list[bytes]:
        tail = done.text[len(self.sent):] if done.text.startswith(self.sent) else ""   # held back at EOS
        if self.plan.json:
            full = json_mode.complete(done.text)
            tail += full[len(done.text):] if full.startswith(done.text) else ""
        out = self.emit(tail, "length" if done.finish_reason == "length" else "stop")
        if self.plan.include_usage:
            out.append(sse({**self.base, "choices": [], "usage": usage(done)}))
        return out

    def emit(self, text: str, finish: str | None = None) -> list[bytes]:
        self.sent += text
        lp = None
        if self.plan.logprobs and (self.pending or finish):
            lp = {"content": [chat_logprob(self.st, e) for e in self.pending]} if self.chat else \
                text_logprobs(self.st, self.pending, len(self.plan.echo) + len(self.sent) - len(text))
            self.pending = []
        if not self.chat:
            return [self.chunk(text, finish, lp)] if text or finish or lp else []
        parts = self.splitter.feed(text) if self.splitter else ([("content", text)] if text else [])
        if finish and self.splitter:
            parts += self.splitter.flush()
        out = [self.chunk({"reasoning_content" if k == "reasoning" else "content": t}, None, lp if i == 0 else None)
               for i, (k, t) in enumerate(parts)]
        if lp is not None and not parts:
            out.append(self.chunk({}, None, lp))
        if finish:
            out.append(self.chunk({}, finish))
        return out


async def stream(st, plan: Plan, job: Job, position: int):
    """The SSE body: queue comments while waiting, one chunk per text delta, then [DONE]."""
    chunks = Chunks(st, plan)
    try:
        if position > 0:
            yield f": queue position {position}\n\n".encode()
        for b in chunks.first():
            yield b
        while True:
            try:
                ev = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                now = st.scheduler.position(job)
                if now != position:
                    position = now
                    yield (f": queue position {now}\n\n" if now else ": running\n\n").encode()
                continue
            if isinstance(ev, APIError):
                yield sse(ev.body())
                break
            for b in (chunks.token(ev) if isinstance(ev, TokenEvent) else chunks.done(ev)):
                yield b
            if isinstance(ev, Done):
                break
        yield b"data: [DONE]\n\n"
    finally:
        st.scheduler.cancel(job)          # client gone or stream finished: never leave it running
