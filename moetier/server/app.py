"""The OpenAI-compatible HTTP server: FastAPI routes around one engine thread.

    app = create_app(engine, ServerConfig(api_key="..."))   # then uvicorn.run(app, ...)

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /v1/moetier/stats,
GET /health, GET /metrics, GET / (the chat page). The server only translates HTTP/JSON <-> token
ids and sampling parameters; the engine does the rest.
"""
from __future__ import annotations

import hmac
import json
import logging
import math
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from . import completions, metrics
from .json_mode import JsonConstraint, JsonGrammar
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, ServerConfig, validation_error
from .reasoning import CLOSE, OPEN
from .vocab import TokenTable
from .worker import Scheduler

STATIC = Path(__file__).resolve().parent / "static"
log = logging.getLogger("moetier.server")


class State:
    """What the routes share: the engine, its thread, names, lazily built token tables, stats."""

    def __init__(self, engine, config: ServerConfig, model_names: tuple[str, ...] = ()):
        self.engine, self.config = engine, config
        self.model_id = config.model_alias or engine.name
        self.names = {self.model_id, engine.name, *model_names}
        self.fingerprint = f"moetier-{__version__}"
        self.started = int(time.time())
        tok = engine.tokenizer
        self.reasoning_model = tok is not None and tok.token_to_id(OPEN) is not None \
            and tok.token_to_id(CLOSE) is not None
        self._lock = threading.Lock()         # stats
        self._build = threading.Lock()        # the token table and JSON grammar, built on first use
        self._tokens: TokenTable | None = None
        self._grammar: JsonGrammar | None = None
        self.last: dict | None = None
        self.memory: dict = {}            # engine.memory_stats() as of the last request or idle moment
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                       "decode_s": 0.0, "prefill_s": 0.0, "cancelled": 0}
        self.scheduler = Scheduler(engine, config.queue_size, config.session_mem, config.max_sessions,
                                   on_done=self.record)

    def check_model(self, name: str | None) -> str:
        if name and name not in self.names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}' "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        return self.model_id

    def tokens(self) -> TokenTable:
        with self._build:
            if self._tokens is None:
                self._tokens = TokenTable(self.engine.tokenizer, self.engine.args.vocab_size)
            return self._tokens

    def json_constraint(self) -> JsonConstraint:
        if self.engine.tokenizer is None:
            raise APIError(400, "response_format: JSON mode needs the model's tokenizer", param="response_format")
        table = self.tokens()
        with self._build:
            if self._grammar is None:
                self._grammar = JsonGrammar(table.bytes_of, table.special)
        return JsonConstraint(self._grammar, table.bytes_of, self.engine.eos_ids)

    def record(self, job, done) -> None:
        """Engine thread: remember the last request's numbers and add up the totals."""
        self.memory = self._memory_stats()
        if done is None:
            return
        s = done.stats
        with self._lock:
            t = self.totals
            t["requests"] += 1
            t["prompt_tokens"] += s.get("prompt_tokens", 0)
            t["cached_tokens"] += s.get("cached_tokens", 0)
            t["generated_tokens"] += s.get("generated_tokens", 0)
            t["prefill_s"] += s.get("prefill_s", 0.0)
            t["decode_s"] += max(0.0, s.get("total_s", 0.0) - s.get("prefill_s", 0.0))
            t["cancelled"] += done.finish_reason == "cancelled"
            self.last = {**s, "finish_reason": done.finish_reason, "kind": job.kind, "finished": time.time()}

    def _memory_stats(self) -> dict:
        try:
            return self.engine.memory_stats()
        except Exception as ex:  # a stats bug must not take the page down
            log.exception("memory_stats failed")
            return {"error": f"{type(ex).__name__}: {ex}"}

    def snapshot(self) -> dict:
        """GET /v1/moetier/stats: the tier picture and the live numbers."""
        e, sch = self.engine, self.scheduler
        memory = self.memory
        if sch.busy.acquire(blocking=False):   # never read the tiers while the engine thread works on them
            try:
                memory = self.memory = self._memory_stats()
            finally:
                sch.busy.release()
        with self._lock:
            last, totals = (dict(self.last) if self.last else None), dict(self.totals)
        return {"model": self.model_id, "device": e.device, "dtype": str(e.dtype).removeprefix("torch."),
                "max_context": e.max_context, "memory": memory, "last": last, "totals": totals,
                "queue": {"waiting": sch.waiting, "running": sch.running is not None,
                          "queue_size": self.config.queue_size},
                "sessions": {"count": len(sch.pool.sessions), "bytes": sch.pool.nbytes,
                             "budget_bytes": self.config.session_mem},
                "process": metrics.process_memory(e.device)}


class Gate:
    """Pure ASGI middleware: API key on /v1 routes, and a cap on request body size."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = self.config.api_key
        if key and scope["path"].startswith("/v1"):
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                msg = ("Incorrect API key provided." if given else
                       "You didn't provide an API key; send it as 'Authorization: Bearer KEY'.")
                return await _send_error(send, APIError(401, msg, code="invalid_api_key"))
        limit = self.config.max_body_bytes
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            return await _send_error(send, APIError(413, f"the request body has {length} bytes; the limit is "
                                                         f"{limit}", code="request_too_large"))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if scope["path"].startswith("/v1") and "json" not in headers.get("content-type", ""):
            # the body is JSON whatever the client labelled it (curl -d sends form-urlencoded)
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                         + [(b"content-type", b"application/json")])
        chunks, size = [], 0        # read the body here (bounded), then replay it to the app
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await _send_error(send, APIError(413, f"the request body is over the limit of {limit} "
                                                             "bytes", code="request_too_large"))
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return await self.app(scope, replay, send)


async def _send_error(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(engine, config: ServerConfig = ServerConfig(), model_names: tuple[str, ...] = ()) -> FastAPI:
    state = State(engine, config, model_names)

    @asynccontextmanager
    async def lifespan(app):
        yield
        state.scheduler.stop()

    app = FastAPI(title="moetier", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of moetier (see docs/api.md).")
    app.state.moetier = state
    app.add_middleware(Gate, config=config)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            msg += "; the routes are listed in docs/api.md and at /docs"
        return error_response(APIError(exc.status_code, msg, code=code))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal server error ({type(exc).__name__}); see the server log",
                                       type="server_error", code="internal_error"))

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        state.check_model(model_id)
        return model_card(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await completions.respond(state, await completions.prepare_chat(state, body), request)

    @app.post("/v1/completions")
    async def text_completions(body: CompletionRequest, request: Request):
        return await completions.respond(state, await completions.prepare_completion(state, body), request)

    @app.get("/v1/moetier/stats")
    async def stats():
        return JSONResponse(plain(await run_in_threadpool(state.snapshot)))

    @app.get("/health")
    async def health():
        ok = state.scheduler.alive
        body = {"status": "ok" if ok else "engine thread stopped", "model": state.model_id,
                "queue": {"waiting": state.scheduler.waiting, "running": state.scheduler.running is not None}}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(metrics.render(await run_in_threadpool(state.snapshot)),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.openapi = lambda: openapi_schema(app, state)
    return app


def openapi_schema(app: FastAPI, state: State) -> dict:
    """FastAPI's schema plus what it cannot know: the served model names and the bearer key."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schema.get("components", {}).get("schemas", {}).get(name, {}).get("properties", {})
        if "model" in props:
            props["model"]["anyOf"] = [{"type": "string", "enum": sorted(state.names)}, {"type": "null"}]
    if state.config.api_key:
        schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in schema.get("paths", {}).items():
            if path.startswith("/v1"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    app.openapi_schema = schema
    return schema


def plain(x):
    """Make stats JSON-safe: NaN/inf -> null, tensors and numpy scalars -> numbers, the rest -> str."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if hasattr(x, "tolist"):
        return plain(x.tolist())
    return str(x)


def model_card(state: State) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.started, "owned_by": "moetier",
            "max_model_len": state.engine.max_context}
