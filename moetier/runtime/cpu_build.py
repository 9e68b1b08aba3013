"""Building the compiled CPU decode step (runtime/cpu_compile.py) in the background, for
`--cpu-compile auto`: a model without a cached package decodes eagerly while a detached, low-priority
process builds it; the next run loads it, and a long-lived engine (serve, chat) switches to it at the
next request once it lands. Builds take `<package>.lock` (an flock), write a temporary file renamed
into place, and leave `<package>.failed` when they fail (not retried under auto).
MOETIER_NO_BACKGROUND_BUILD=1 turns background builds off.

    build = start_background_build(model, model_path, config)   # None: not started (off, cached, failed ...)
    if build is not None and build.landed(): ...                   # load the package now
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from . import cpu_compile

log = logging.getLogger("moetier.runtime.cpu_compile")   # one logger name for the whole feature

NO_BACKGROUND_ENV = "MOETIER_NO_BACKGROUND_BUILD"   # =1: --cpu-compile auto never starts a build


def background_allowed() -> bool:
    return os.environ.get(NO_BACKGROUND_ENV, "") in ("", "0") and os.name == "posix"   # flock: POSIX


@contextlib.contextmanager
def locked(path: Path, wait: bool):
    """Hold `<package>.lock` (an flock: the kernel drops it when its process dies, so it never goes
    stale). Yields True, or False when another process holds it and wait is False."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _record_failure(path: Path, e: BaseException) -> None:
    record = {"error": f"{type(e).__name__}: {e}"[:2000], "log": str(path.with_suffix(".log")), "reported": False}
    path.with_suffix(".failed").write_text(json.dumps(record))


def _report_failure(path: Path) -> bool:
    """True when a build of `path` failed before (auto does not retry it); says so once, on the first call
    of any process that finds the record."""
    rec = path.with_suffix(".failed")
    try:
        record = json.loads(rec.read_text())
    except (OSError, ValueError):
        return rec.exists()
    if not record.get("reported"):
        log.warning("cpu_compile: building the compiled CPU decode step failed (%s; log: %s); decoding eagerly. "
                    "Run once with --cpu-compile on to retry, or --cpu-compile off to stop trying.",
                    record.get("error"), record.get("log"))
        rec.write_text(json.dumps({**record, "reported": True}))
    return True


class BackgroundBuild:
    """A package being built by another process: started here (`proc`), or found building (None)."""

    def __init__(self, path: Path, proc: subprocess.Popen | None):
        self.path, self.proc, self.log_path = path, proc, path.with_suffix(".log")
        self._lock, self._watching = threading.Lock(), True

    def landed(self) -> bool:
        """True once, on the first call after the package appeared (load it then); False while it is
        being built, and for good once the build ended without it (its failure is reported once)."""
        with self._lock:
            if not self._watching:
                return False
            ended = self.proc.poll() is not None if self.proc is not None else not _held_elsewhere(self.path)
            if self.path.exists():           # checked after `ended`: a build that just finished counts
                self._watching = False
                return True
            if ended:
                self._watching = False
                _report_failure(self.path)
            return False

    def describe(self) -> str:
        if self.path.exists():
            return f"the compiled CPU decode step was built in the background into {self.path.parent}; " \
                   "the next run uses it"
        who = f"pid {self.proc.pid}" if self.proc is not None else "another moetier process"
        return f"the compiled CPU decode step (~1.7x faster decode) is being built in the background ({who}, " \
               f"low priority, ~25 s once this process is idle or has ended) into {self.path.parent}; the next " \
               f"run uses it. Log: {self.log_path}"


def _held_elsewhere(path: Path) -> bool:
    with locked(path, wait=False) as free:
        return not free


def _enough_memory(model: torch.nn.Module) -> bool:
    """The build process loads the model a second time: skip it when that would not fit in free RAM."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(model.parameters()) + list(model.buffers())}
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return True
    return avail > 1.5 * sum(storages.values())


def start_background_build(model: torch.nn.Module, model_path: Path, config) -> BackgroundBuild | None:
    """Build this model's package in a detached, low-priority process that outlives this one (for the
    next run), unless background builds are off, it is cached, it failed before or RAM is short. Never
    raises: the current run decodes eagerly whatever happens here."""
    if not background_allowed():
        return None
    try:
        path = cpu_compile.package_path(model)
        if path.exists():
            return None                               # cached but would not load (CpuDecode.get warned)
        if _report_failure(path):
            return None
        if _held_elsewhere(path):
            return BackgroundBuild(path, None)        # another process is building it: watch for it
        if not _enough_memory(model):
            log.info("cpu_compile: not building the compiled step in the background: too little free RAM "
                     "for a second copy of the model (--cpu-compile on builds it in this process)")
            return None
        cfg = dataclasses.replace(config, device="cpu", threads=torch.get_num_threads(), progress=False,
                                  prompt_cache=None)  # threads: baked into the package (and its key)
        spec = {"model": str(model_path), "config": dataclasses.asdict(cfg), "path": str(path),
                "x8_experts": any(getattr(m, "_x8_types", None) for m in model.modules())}
        proc = _spawn(spec, path.with_suffix(".log"))
    except Exception as e:  # noqa: BLE001 - a background nicety must never end the run
        log.warning("cpu_compile: could not start the background build (%s: %s); decoding eagerly",
                    type(e).__name__, e)
        return None
    log.info("cpu_compile: building %s in the background (pid %d)", path, proc.pid)
    return BackgroundBuild(path, proc)


# The build process's first lines, before it imports torch: lowest priority, then wait while the process
# that asked is busy (over 20% of a CPU in the last second; at most 5 minutes), so the build runs once that
# one idles (serve, chat) or exits (run). Beside a decode it slowed eager decode 0.5-0.7x on the 2-core dev
# box even at nice 19 (shared caches and memory, not CPU time).
_CHILD = """
import os, sys, time
os.nice(19)
def ticks(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return sum(map(int, f.read().rsplit(")", 1)[1].split()[11:13]))   # utime + stime
    except (OSError, ValueError):
        return None
pid, start = int(sys.argv[2]), time.monotonic()
last = ticks(pid)
while last is not None and time.monotonic() - start < 300:
    time.sleep(1.0)
    now = ticks(pid)
    if now is None or now - last < 0.2 * os.sysconf("SC_CLK_TCK"):
        break
    last = now
from moetier.runtime.cpu_build import _child_main
sys.exit(_child_main(sys.argv[1]))
"""


def _spawn(spec: dict, log_path: Path) -> subprocess.Popen:
    """`build_from_spec(spec)` in a new session (it survives this process and the terminal's Ctrl-C)."""
    env = cpu_compile.child_env(**{NO_BACKGROUND_ENV: "1"})
    with open(log_path, "w") as out:
        return subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(spec), str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _child_main(spec_json: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    return build_from_spec(json.loads(spec_json))


def build_from_spec(spec: dict) -> int:
    """Load the model as the engine that asked did, and build its package at spec["path"] (under the
    lock; a failure is recorded beside it). 0 when built or not needed, 1 when it failed."""
    from ..config import EngineConfig
    from .engine import Engine
    path = Path(spec["path"])
    with locked(path, wait=False) as free:
        if not free or path.exists():
            log.info("cpu_compile: %s is built or being built by another process", path.name)
            return 0
        for stale in path.parent.glob(f"{path.stem}.*.tmp.pt2"):   # left by a build that was killed
            stale.unlink(missing_ok=True)
        try:
            cfg = {**spec["config"], "override_tensor": tuple(tuple(r) for r in spec["config"]["override_tensor"])}
            cpu_compile.x8_decided = spec.get("x8_experts")     # the experts' x8 copies as the asking process has
            engine = Engine.load(spec["model"], EngineConfig(**cfg))
            got = cpu_compile.package_path(engine.model)
            if got.name != path.name:
                raise RuntimeError(f"the model loaded for the build hashes to {got.name}, not {path.name} "
                                   "(it must load exactly as in the process that asked)")
            cpu_compile._build(engine.model, path)
        except Exception as e:  # noqa: BLE001 - recorded for the processes that come next
            log.exception("cpu_compile: the build failed")
            _record_failure(path, e)
            return 1
    return 0
