"""The CPU decode step compiled ahead of time by AOTInductor (generated C++), cached on disk.

Eager decode of a small model on the CPU is dispatch-bound (~1,000 tiny ops per token; see
docs/perf-log.md). torch.compile removed the dispatch but kept Dynamo's guards and a Python
wrapper (~0.2 ms a token) and recompiled in every process (4-18 s). Here the one-token step
`model(token [1], cache, pos=p)` (the static-shape path CUDA graphs use) is exported once and
built by AOTInductor into a package of a few MB: the weights are not in it, they are bound by name
to the model's own tensors at load (no copy). The package is cached per model shape, dtype,
thread count, torch version, CPU and moetier source, so only the first build pays (15-25 s on the
2-core dev box); later processes load it in milliseconds. Attention reads KV views cut to the next
multiple of `BUCKET` positions past the token (a dynamic dimension of the export); experts take
`fused_gather_experts` (no host sync) inside the graph; GGUF experts kept packed (QuantExperts) stay
one call of the torch op moetier::moe_tokens (C kernels on the stored blocks), which the package calls
back through the dispatcher (C++ kernels, cpu_ops.cpp). Float weights that are exactly Q4_0 / Q8_0 values
(a GGUF file's attention and lm_head, dequantized at load) get those blocks back as `<name>_q` buffers and
the step multiplies on them (moetier::qlinear); with Q8_ACTIVATIONS these products use int8 activations.

    step = CpuDecode.get(model, build=True)   # None when not cached and build=False, or not compilable
    logits = step(cache, token_id)            # [1, V]; advances the cache

Under `--cpu-compile auto` (the default) a model without a cached package decodes eagerly while a
detached, low-priority process builds it (`start_background_build`): the next run loads it, and a
long-lived engine (serve, chat) switches to it at the next request once it lands. Builds take
`<package>.lock`, write a temporary file renamed into place, and leave `<package>.failed` when they
fail (not retried under auto). MOETIER_NO_BACKGROUND_BUILD=1 turns background builds off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import torch

from ..kernels import cpu as cpu_kernels
from ..models.layers import DenseExperts
from .kv_cache import Cache, KVCache

log = logging.getLogger(__name__)

BUCKET = 128  # attention view granularity (positions)
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moetier" / "cpu_decode"
NO_BACKGROUND_ENV = "MOETIER_NO_BACKGROUND_BUILD"   # =1: --cpu-compile auto never starts a build


def wanted(mode: str, device: str, tiers, cache: Cache) -> bool:
    """`mode` is EngineConfig.cpu_compile: on = load or build the compiled step; auto = use it when a
    package for this model is cached already, else decode eagerly and build it in the background;
    off = eager, never built. Only plain KV caches on the CPU without memory tiers qualify."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"cpu_compile must be auto, on or off (got {mode!r})")
    if mode == "off" or device != "cpu" or tiers is not None:
        return False
    return all(type(layer) is KVCache for layer in cache.layers)  # recurrent/int8 caches: eager


class _KVView(KVCache):
    """A KVCache over given k/v views (writes land in the real cache), built inside the graph."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v


def _graph_friendly_experts(model: torch.nn.Module) -> None:
    """While tracing, DenseExperts take fused_gather_experts (no `.tolist()` host sync); eager calls
    keep their own path. Installed once per model, per instance (model code untouched)."""
    for m in model.modules():
        if getattr(m, "fused_cpu", False) and "forward" not in m.__dict__:   # QuantExperts: one torch op
            eager = m.forward

            def forward(self, x, ids, w, eager=eager):
                if torch.compiler.is_compiling():
                    return self.forward_fused(x, ids, w, q8=Q8_ACTIVATIONS)
                return eager(x, ids, w)
            m.forward = types.MethodType(forward, m)
            continue
        if type(m) is not DenseExperts and isinstance(m, DenseExperts) and not hasattr(m, "gate_up_proj"):
            raise NotImplementedError(f"{type(m).__name__} ({m.extra_repr()}) has no graph path on the CPU "
                                      "(the fused kernel takes SwiGLU experts without biases); pass "
                                      "--dequantize-experts to compile this model")
        if isinstance(m, DenseExperts) and "forward" not in m.__dict__:
            eager = m.forward

            def forward(self, x, ids, w, eager=eager):
                if torch.compiler.is_compiling():
                    return fused_gather_experts(x, ids, w, self)
                return eager(x, ids, w)
            m.forward = types.MethodType(forward, m)


def fused_gather_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, ex: DenseExperts) -> torch.Tensor:
    """gathered_experts written as multiply + reduce, so inductor fuses the weight gather into the
    dot products instead of copying k expert matrices per token. x [T, D], ids/w [T, k] -> [T, D]."""
    t, k = ids.shape
    flat = ids.reshape(-1)                                                  # [T*k]
    xs = x.repeat_interleave(k, dim=0)                                      # [T*k, D]
    h = (ex.gate_up_proj[flat] * xs[:, None, :]).sum(-1)                    # [T*k, 2I]
    if ex.gate_up_bias is not None:
        h = h + ex.gate_up_bias[flat]
    gate, up = h.chunk(2, dim=-1)
    y = (ex.down_proj[flat] * ex.act(gate, up)[:, None, :]).sum(-1)         # [T*k, D]
    if ex.down_bias is not None:
        y = y + ex.down_bias[flat]
    return (y * w.reshape(-1, 1).to(y.dtype)).view(t, k, -1).sum(1)


QUANT_COPY_TYPES = ("Q4_0", "Q8_0")   # tried in this order (fewest bytes first)
# The compiled step's Q4_0 / Q8_0 products (packed experts, quantized copies) dot activations rounded to
# int8 per 32 values, as llama.cpp does: ~1.5x faster kernels; measured KL vs F32 in docs/perf-log.md.
Q8_ACTIVATIONS = True


def _exact_blocks(w: torch.Tensor):
    """(uint8 blocks, GGML type id) of the first format in QUANT_COPY_TYPES whose dequantized blocks are
    exactly `w` (a GGUF tensor dequantized at load: re-quantizing gives its blocks back), else None."""
    from ..quant.formats import dequantize, get_format
    from ..quant.pack import quantize
    for name in QUANT_COPY_TYPES:
        fmt = get_format(name)
        for part in (w[:64], w):          # a cheap look at the first rows before the whole tensor
            raw = quantize(part, name).view(part.shape[0], -1)
            if not torch.equal(dequantize(raw, fmt, tuple(part.shape)), part):
                break
        else:
            return raw, fmt.type_id
    return None


def _quantized_copies(model: torch.nn.Module) -> None:
    """Float weights of Linear modules (and 2-D `*weight` buffers: Attention.qkv_weight) that are exactly
    Q4_0 / Q8_0 values get those blocks as a buffer `<name>_q`; the compiled step multiplies on them with
    the C kernels (3.8-7x fewer bytes than float32, the same products). Once per model."""
    if cpu_kernels.backend() != "c" or getattr(model, "_quant_copies_done", False):
        return
    model._quant_copies_done = True
    found = []                                          # (module, attribute, weight)
    for m in model.modules():
        names = ["weight"] if isinstance(m, torch.nn.Linear) else []
        names += [n for n, b in m.named_buffers(recurse=False) if n.endswith("weight") and b is not None]
        found += [(m, a, getattr(m, a)) for a in names]
    found = [(m, a, w) for m, a, w in found if w is not None and w.dim() == 2 and w.dtype == torch.float32
             and w.device.type == "cpu" and w.shape[1] % 32 == 0]
    largest = {}                                        # storage -> most elements a weight of it has
    for _, _, w in found:
        key = w.untyped_storage().data_ptr()
        largest[key] = max(largest.get(key, 0), w.numel())
    for m in model.modules():
        m._quant_copies = {}
    for m, a, w in found:
        if w.numel() < largest[w.untyped_storage().data_ptr()]:
            continue                                    # part of a fused weight (fuse_qkv's q/k/v views)
        hit = _exact_blocks(w.detach())
        if hit is not None:
            m.register_buffer(f"{a}_q", hit[0], persistent=False)
            m._quant_copies[a] = hit[1]


def _drop_quantized_copies(model: torch.nn.Module) -> None:
    for m in model.modules():
        for a in getattr(m, "_quant_copies", {}):
            delattr(m, f"{a}_q")
        m._quant_copies = {}
    model._quant_copies_done = False


class _QuantLinears(torch.overrides.TorchFunctionMode):
    """While tracing: F.linear on a weight with a quantized copy becomes moetier::qlinear on the copy."""

    def __init__(self, subs: dict):
        super().__init__()
        self.subs = subs       # id(float weight) -> (blocks, type id)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w, *rest = args
            b = rest[0] if rest else kwargs.get("bias")
            hit = self.subs.get(id(w))
            if hit is not None:
                y = torch.ops.moetier.qlinear(x, *hit, Q8_ACTIVATIONS)
                return y if b is None else y + b
        return func(*args, **kwargs)


class _Step(torch.nn.Module):
    """The exported function: (tokens [1], pos 0-d, per-layer k/v views) -> logits [1, V]."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, pos, ks, vs):
        cache = Cache([_KVView(k, v) for k, v in zip(ks, vs)], ks[0].shape[0])
        subs = {id(getattr(m, a)): (getattr(m, f"{a}_q"), t)
                for m in self.model.modules() for a, t in getattr(m, "_quant_copies", {}).items()}
        with _QuantLinears(subs):
            return self.model(tokens, cache, pos=pos)


def package_key(model: torch.nn.Module) -> str:
    """What the built code depends on: model config, tensor names/shapes/dtypes, module types,
    thread count (baked into the OpenMP loops), torch, the CPU's vector ISA, and the source of the
    model's modules, the KV cache and this file."""
    h = hashlib.sha256()
    h.update(repr(getattr(model, "args", None)).encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    h.update(" ".join(sorted({type(m).__qualname__ for m in model.modules()})).encode())
    h.update(f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{torch.get_num_threads()}".encode())
    sources = {inspect.getsourcefile(type(m)) for m in model.modules() if type(m).__module__.startswith("moetier.")}
    sources |= {inspect.getsourcefile(KVCache), __file__, cpu_kernels.__file__}   # the latter: moetier::moe_tokens
    for src in sorted(str(Path(f).resolve()) for f in sources):
        h.update(Path(src).read_bytes())
    return h.hexdigest()[:24]


def package_path(model: torch.nn.Module) -> Path:
    """Where the model's package is cached. Adds the quantized copies first: they are named tensors of it."""
    _quantized_copies(model)
    return CACHE_DIR / f"{type(model).__module__.rsplit('.', 1)[-1]}-{package_key(model)}.pt2"


class CpuDecode:
    """One AOT-compiled one-token decode step bound to a model's weights."""

    def __init__(self, model: torch.nn.Module, runner, path: Path):
        self.model, self.runner, self.path = model, runner, path
        self.lock = threading.Lock()   # one runner: sessions on several threads take turns
        self.token, self.pos = torch.zeros(1, dtype=torch.long), torch.zeros((), dtype=torch.long)
        self.kv_dtype = next(model.parameters()).dtype   # the KV dtype _build exported with
        # the loader's flat call (inputs in export order, outputs as a list) skips the wrapper's
        # per-call pytree (de)serialisation: ~70 us a token on the dev box
        loader = getattr(runner, "loader", None)
        self.boxed_run = getattr(loader, "boxed_run", None) if loader is not None and \
            torch.utils._pytree.treespec_loads(loader.get_call_spec()[1]).num_leaves == 1 else None

    @classmethod
    def get(cls, model: torch.nn.Module, build: bool) -> CpuDecode | None:
        """Load the cached package for this model, or (build=True) export and build it first.
        None when it is not cached and build is False, or when the model cannot be compiled (warned)."""
        try:
            path = package_path(model)
            if not path.exists():
                if not build:
                    _drop_quantized_copies(model)     # eager decode does not use them
                    return None
                with _locked(path, wait=True):        # a background build of it may be running: wait
                    if not path.exists():
                        _build(model, path)
                path.with_suffix(".failed").unlink(missing_ok=True)
            cpu_kernels.load_native_ops()   # the package's moetier:: op calls skip Python (~6 us each)
            runner = torch._inductor.aoti_load_package(str(path))
            names = dict(_Step(model).named_parameters())
            names.update(_Step(model).named_buffers())
            missing = [n for n in runner.get_constant_fqns() if n not in names]
            if missing:
                raise RuntimeError(f"the compiled step needs tensors the model does not name: {missing[:3]}")
            runner.load_constants({n: names[n] for n in runner.get_constant_fqns()}, check_full_update=True,
                                  user_managed=True)   # the model's own tensors: no copy
        except Exception as e:  # a model or op the exporter cannot take whole: stay eager
            warnings.warn(f"cpu_compile: the compiled CPU decode step is unavailable ({type(e).__name__}: "
                          f"{str(e)[:300]}); decoding eagerly. Pass --cpu-compile off to skip the attempt.")
            return None
        return cls(model, runner, path)

    def __call__(self, cache: Cache, token: int) -> torch.Tensor:
        start = cache.length
        if start + 1 > cache.max_len:
            raise ValueError("the cache is full")
        n = min(cache.max_len, (start // BUCKET + 1) * BUCKET)
        views = getattr(cache, "_decode_views", None)   # (n, k views, v views, layer 0's k buffer)
        if views is None or views[0] != n or views[3] is not cache.layers[0].k:  # new once per BUCKET tokens
            if n < 2 or cache.layers[0].k.dtype != self.kv_dtype:  # outside what was exported: eager
                return self.model(torch.tensor([token], dtype=torch.long), cache)
            views = cache._decode_views = (n, [kv.k[:n] for kv in cache.layers], [kv.v[:n] for kv in cache.layers],
                                           cache.layers[0].k)
        with self.lock:
            self.token.fill_(token)
            self.pos.fill_(start)
            if self.boxed_run is not None:
                logits = self.boxed_run([self.token, self.pos, *views[1], *views[2]])[0]
            else:
                logits = self.runner(self.token, self.pos, views[1], views[2])
        cache.advance(1)
        return logits


def _build(model: torch.nn.Module, path: Path) -> None:
    """Export the step with a dynamic KV length and build it with AOTInductor into `path`."""
    _graph_friendly_experts(model)
    p = next(model.parameters())
    example = model.make_cache(2 * BUCKET, p.dtype, p.device)
    ks, vs = [kv.k for kv in example.layers], [kv.v for kv in example.layers]
    n = torch.export.Dim("kv_len", min=2, max=1 << 20)
    t0 = time.perf_counter()
    log.warning("cpu_compile: building the compiled CPU decode step once for this model (~15-25 s on 2 cores); "
                "later runs load it from %s", path.parent)
    with torch.inference_mode():
        ep = torch.export.export(_Step(model), (torch.tensor([0]), torch.tensor(BUCKET), ks, vs),
                                 dynamic_shapes=(None, None, [{0: n}] * len(ks), [{0: n}] * len(vs)), strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
        try:
            torch._inductor.aoti_compile_and_package(
                ep, package_path=str(tmp), inductor_configs={"aot_inductor.package_constants_in_so": False})
            os.replace(tmp, path)   # atomic: another process never sees half a package
        finally:
            tmp.unlink(missing_ok=True)
    log.warning("cpu_compile: built in %.1f s", time.perf_counter() - t0)


# ---- building in the background (--cpu-compile auto) ----

def compiled_step(model: torch.nn.Module, model_path: Path, config) -> tuple[CpuDecode | None, BackgroundBuild | None]:
    """The engine's choice for `config.cpu_compile`: (the loaded step or None, the background build
    started or watched under auto when no package is cached, else None)."""
    step = CpuDecode.get(model, build=config.cpu_compile == "on")
    if step is not None or config.cpu_compile != "auto":
        return step, None
    return None, start_background_build(model, model_path, config)


def background_allowed() -> bool:
    return os.environ.get(NO_BACKGROUND_ENV, "") in ("", "0") and os.name == "posix"   # flock: POSIX


@contextlib.contextmanager
def _locked(path: Path, wait: bool):
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
    with _locked(path, wait=False) as free:
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
        path = package_path(model)
        _drop_quantized_copies(model)                 # this process decodes eagerly until the package lands
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
        spec = {"model": str(model_path), "config": dataclasses.asdict(cfg), "path": str(path)}
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
from moetier.runtime.cpu_compile import _child_main
sys.exit(_child_main(sys.argv[1]))
"""


def _spawn(spec: dict, log_path: Path) -> subprocess.Popen:
    """`build_from_spec(spec)` in a new session (it survives this process and the terminal's Ctrl-C)."""
    root = str(Path(__file__).resolve().parents[2])   # the directory holding the moetier package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           NO_BACKGROUND_ENV: "1"}
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
    with _locked(path, wait=False) as free:
        if not free or path.exists():
            log.info("cpu_compile: %s is built or being built by another process", path.name)
            return 0
        for stale in path.parent.glob(f"{path.stem}.*.tmp.pt2"):   # left by a build that was killed
            stale.unlink(missing_ok=True)
        try:
            cfg = {**spec["config"], "override_tensor": tuple(tuple(r) for r in spec["config"]["override_tensor"])}
            engine = Engine.load(spec["model"], EngineConfig(**cfg))
            got = package_path(engine.model)
            if got.name != path.name:
                raise RuntimeError(f"the model loaded for the build hashes to {got.name}, not {path.name} "
                                   "(it must load exactly as in the process that asked)")
            _build(engine.model, path)
        except Exception as e:  # noqa: BLE001 - recorded for the processes that come next
            log.exception("cpu_compile: the build failed")
            _record_failure(path, e)
            return 1
    return 0
