"""One engine thread fed by a FIFO queue, and the pool of Sessions that gives prefix reuse.

HTTP handlers (asyncio) submit a `Job` and read its events from an asyncio.Queue; the engine
thread runs jobs one at a time, in arrival order. A job whose client went away is cancelled:
waiting, it is skipped; running, `Engine.generate(cancel=...)` stops it at the next decode step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import UserError
from ..runtime.generate import Done
from .protocol import APIError

log = logging.getLogger("moetier.server")


def gone() -> APIError:
    return APIError(499, "the client closed the request before it ran", code="client_closed_request")


@dataclass
class Job:
    """One generation request: the prompt ids and Engine.generate keyword arguments."""
    prompt_ids: list[int]
    kwargs: dict
    loop: asyncio.AbstractEventLoop
    kind: str = "chat"
    id: int = field(default_factory=itertools.count().__next__)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    cancel_time: float | None = None

    def push(self, item) -> None:
        """From the engine thread: hand an event (TokenEvent, Done or APIError) to the handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:      # the event loop is closed (server shutting down)
            self.cancel()

    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancel_time = time.perf_counter()
            self.cancelled.set()


def common_prefix(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


class SessionPool:
    """A small LRU of Sessions within a byte budget. A prompt goes to the session holding its
    longest prefix when it continues that session's last prompt (a conversation going on: only the
    re-sent last reply may differ) or saves more tokens than cutting the session back loses;
    otherwise to a new session while the budget allows, else to the longest-prefix or least
    recently used one."""

    def __init__(self, engine, budget_bytes: int, max_sessions: int):
        self.engine = engine
        self.budget, self.max_sessions = budget_bytes, max(1, max_sessions)
        self.sessions: list = []       # least recently used first
        self.prompt_len: dict[int, int] = {}   # id(session) -> length of the last prompt it ran

    def acquire(self, ids: list[int]):
        best, best_n = None, 0
        for s in self.sessions:
            n = common_prefix(s.tokens, ids)
            if n > best_n:
                best, best_n = s, n
        worth = best is not None and (best_n >= self.prompt_len.get(id(best), len(best.tokens))
                                      or len(best.tokens) - best_n < best_n)
        if not worth and self._room():
            best = self.engine.new_session()
        elif best is None:
            best = self.sessions[0]
        if best in self.sessions:
            self.sessions.remove(best)
        self.sessions.append(best)
        self.prompt_len = {id(x): self.prompt_len.get(id(x), 0) for x in self.sessions}
        self.prompt_len[id(best)] = len(ids)
        return best

    def clear(self) -> None:
        self.sessions.clear()
        self.prompt_len.clear()

    def _room(self) -> bool:
        if not self.sessions:
            return True
        per = max(session_bytes(s) for s in self.sessions)
        return len(self.sessions) < self.max_sessions and self.nbytes + per <= self.budget

    @property
    def nbytes(self) -> int:
        return sum(session_bytes(s) for s in self.sessions)


def session_bytes(session) -> int:
    """The KV cache (plus recurrent-state snapshots, where the session keeps them)."""
    return getattr(session, "nbytes", None) or session.cache.nbytes


class Scheduler:
    """The engine thread and its queue. `submit` raises APIError(429) when the queue is full."""

    def __init__(self, engine, queue_size: int, session_mem: int, max_sessions: int, on_done=None):
        self.engine = engine
        self.queue_size = queue_size
        self.pool = SessionPool(engine, session_mem, max_sessions)
        self.pending: deque[Job] = deque()
        self.running: Job | None = None
        self.cond = threading.Condition()
        self.busy = threading.Lock()      # held by the engine thread while it runs a job
        self.stopping = False
        self.on_done = on_done            # called (job, Done | None) in the engine thread
        self.thread = threading.Thread(target=self._loop, name="moetier-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> int:
        """Queue a job; -> its position (0: runs next or now)."""
        with self.cond:
            if len(self.pending) >= self.queue_size:
                raise APIError(429, f"the server is busy: {len(self.pending)} requests are already waiting "
                                    f"(--queue-size {self.queue_size}); retry in a moment",
                               type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            self.pending.append(job)
            self.cond.notify()
            return len(self.pending) - (0 if self.running is not None else 1)

    def position(self, job: Job) -> int:
        """0 while running (or done), k >= 1 while k requests are ahead of it."""
        with self.cond:
            try:
                return self.pending.index(job) + (1 if self.running is not None else 0)
            except ValueError:
                return 0

    def cancel(self, job: Job) -> None:
        """Stop a job: taken off the queue when waiting, stopped at the next decode step when running."""
        job.cancel()
        with self.cond:
            if job not in self.pending:
                return
            self.pending.remove(job)
        job.push(gone())      # wake its handler, which is still waiting for events

    @property
    def waiting(self) -> int:
        return len(self.pending)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            for job in self.pending:
                job.cancel()
                job.push(gone())
            self.pending.clear()
            if self.running is not None:
                self.running.cancel()
            self.cond.notify_all()
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                job = self.running = self.pending.popleft()
            try:
                if job.cancelled.is_set():
                    job.push(gone())
                else:
                    with self.busy:
                        self._run(job)
            finally:
                with self.cond:
                    self.running = None

    def _run(self, job: Job) -> None:
        done = None
        try:
            session = self.pool.acquire(job.prompt_ids)
            events = self.engine.generate(prompt_ids=job.prompt_ids, session=session,
                                          cancel=job.cancelled.is_set, **job.kwargs)
            for ev in events:
                if isinstance(ev, Done):
                    done = ev
                    done.stats["queue_s"] = round(max(0.0, time.perf_counter() - job.submitted
                                                      - done.stats.get("total_s", 0.0)), 6)
                    if job.cancel_time is not None:
                        done.stats["cancel_to_free_s"] = round(time.perf_counter() - job.cancel_time, 6)
                job.push(ev)
        except UserError as e:
            job.push(APIError(400, str(e)))
        except Exception as e:  # a bug, not the client's fault: keep serving
            log.exception("generation failed")
            self.pool.clear()            # a half-written cache must not be reused
            job.push(APIError(500, f"internal error during generation ({type(e).__name__}); "
                                   "see the server log", type="server_error", code="internal_error"))
        if self.on_done is not None:
            try:
                self.on_done(job, done)
            except Exception:
                log.exception("stats hook failed")
