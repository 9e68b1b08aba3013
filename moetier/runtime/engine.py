"""The engine: owns the model, its device, the tokenizer and sessions.

    engine = Engine.load("path/to/model")            # or Engine.load() for the embedded default
    for ev in engine.generate("Hello", max_tokens=32):
        print(ev.text, end="")                       # TokenEvent ... then one Done (ev.stats)

A `Session` keeps the cache of one conversation: a new request on the same session reuses the
longest common token prefix and computes only the rest (`stats["cached_tokens"]`).
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Callable, Iterator

import torch

from .. import memory
from ..config import EngineConfig, ModelArgs
from ..errors import ContextOverflow, UserError
from ..memory.bandwidth import process_cpus
from ..weights.tokenizer import Detokenizer, Tokenizer
from .generate import Done, TokenEvent, generate_stream
from .kv_cache import Cache, session_cache
from .prompt_cache import PromptCache
from .sampling import Sampler, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 4096


def default_model_path() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "default"


def resolve_model_path(model: str | Path | None) -> Path:
    """A local directory, or a Hugging Face repo id (downloaded when huggingface_hub is installed)."""
    if model is None:
        path = default_model_path()
        if not (path / "config.json").exists():
            raise UserError(f"the embedded default model is missing from {path}; reinstall moetier")
        return path
    path = Path(model).expanduser()
    if path.exists():
        return path
    if str(model).count("/") == 1 and not str(model).startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise UserError(f"{model}: no such directory; to download it from the Hugging Face hub, "
                            "pip install huggingface_hub") from None
        try:
            return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.jinja",
                                                                       "*.model", "*.txt"]))
        except Exception as e:
            raise UserError(f"{model}: not a local path, and the hub download failed: {e}") from None
    raise UserError(f"{model}: no such model directory or file")


def default_threads() -> int:
    """Half the CPUs this process may use (at least 1). The seeds measured half the hardware
    threads faster than all; on a 2-vCPU box whose host is busy, 2 OpenMP threads made decoding
    the default model 3-100x slower than 1 (a stalled thread holds every barrier)."""
    return max(1, process_cpus() // 2)


BIG_CHUNK_FREE = 8 << 30   # CUDA without tiers: 8K-token prefill chunks when this much VRAM is free after loading


def miss_threads(admitting: bool = False) -> int:
    """Threads of the graphed tier step's miss server: every CPU this process may use, less one when
    the fast tier admits experts (the step's bookkeeping thread then runs while the next step is
    served; one preempted team thread stalls the whole team at every layer's barrier: 16 threads on
    16 CPUs gave 5.0 tok/s at --gpu-mem 8GiB, docs/perf-log.md). Measured on the H200 box (16 CPUs),
    48-layer Q4_0 at --gpu-mem 8GiB with inline bookkeeping: 16 threads 41.6 tok/s, 8 threads 32.3."""
    n = process_cpus()
    return max(1, n - 1 if admitting and n > 2 else n)


class Session:
    """One conversation's cache and the tokens it holds. A cache with recurrent layers cannot be
    cut back, so the session also keeps the last few snapshots of their state taken at turn
    boundaries (the end of each prompt's prefill) and, with --snapshot-every, inside long prompts;
    a prompt that leaves the cached tokens resumes from the longest snapshot it extends instead of
    from 0. Attention-only caches just truncate. With a `disk` PromptCache, snapshots (KV included)
    are also written there, and a prompt resumes from a longer saved prefix found there."""

    MAX_SNAPSHOTS = 4
    MAX_PERIODIC = 8   # --snapshot-every snapshots kept (the latest: edits are mostly near the end)

    def __init__(self, cache: Cache, disk: PromptCache | None = None):
        self.cache = cache
        self.disk = disk
        self.tokens: list[int] = []
        self.lock = threading.Lock()
        self.snapshots: list[tuple[list[int], dict]] = []   # (tokens, Cache.snapshot(kv=False)), oldest first
        self.periodic: list[tuple[list[int], dict]] = []    # the same, taken every N prompt tokens
        self.graph = None  # runtime.cuda_graph.GraphStep (its DecodeGraph captured on first CUDA decode)

    def reuse(self, prompt: list[int]) -> int:
        """Keep the longest common prefix with `prompt` (at least one token left to compute)."""
        n = 0
        limit = min(len(self.tokens), self.cache.length, len(prompt) - 1)
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        if self.cache.can_truncate or n == self.cache.length:
            self.cache.truncate(n)
        elif (snap := self._best_snapshot(prompt, n)) is not None:
            self.cache.restore(snap)   # recurrent state cannot roll back: resume from a snapshot ...
            n = snap["length"]
        else:
            self.cache.truncate(0)     # ... or from 0
            n = 0
        if self.disk is not None and (snap := self.disk.load(prompt, n, len(prompt) - 1)) is not None:
            self.cache.restore(snap)   # a longer prefix saved on disk (KV and recurrent state)
            n = snap["length"]
        self.tokens = list(prompt[:n])
        return n

    def _best_snapshot(self, prompt: list[int], n: int) -> dict | None:
        """The longest snapshot of a prefix of `prompt` no longer than n: its recurrent states hold
        those tokens, and the KV positions [0, length) still do too (they equal self.tokens[:n])."""
        fits = [(kept, i) for kept in (self.snapshots, self.periodic) for i, (tokens, _) in enumerate(kept)
                if len(tokens) <= n and tokens == prompt[:len(tokens)]]
        if not fits:
            return None
        kept, i = max(fits, key=lambda f: f[0][f[1]][1]["length"])
        kept.append(kept.pop(i))   # most recently used last: a shared prefix outlives its follow-ups' snapshots
        return kept[-1][1]

    def save_snapshot(self, periodic: bool = False) -> None:
        """Remember the state of the cache as it is now (call at a turn boundary, or with periodic
        inside a prefill). In memory only caches that cannot truncate need it; the MAX_SNAPSHOTS
        (MAX_PERIODIC) most recently taken or resumed from are kept. The disk copy holds the KV too."""
        n = self.cache.length
        if n == 0 or len(self.tokens) < n:
            return
        tokens = self.tokens[:n]   # only what the cache really holds
        if self.disk is not None:
            self.disk.save(tokens, self.cache.snapshot(kv=True))
        if self.cache.can_truncate:
            return
        kept, limit = (self.periodic, self.MAX_PERIODIC) if periodic else (self.snapshots, self.MAX_SNAPSHOTS)
        kept = [s for s in kept if s[0] != tokens][-(limit - 1):] + [(tokens, self.cache.snapshot(kv=False))]
        if periodic:
            self.periodic = kept
        else:
            self.snapshots = kept

    @property
    def nbytes(self) -> int:
        """The cache plus the snapshots (bytes)."""
        snap = sum(t.numel() * t.element_size() for _, s in self.snapshots + self.periodic
                   for layer in s["layers"] if layer is not None for t in layer)
        return self.cache.nbytes + snap


class Engine:
    def __init__(self, model, args: ModelArgs, tokenizer: Tokenizer | None, config: EngineConfig,
                 device: str, dtype, path: Path, eos_ids: set[int], generation_defaults: dict):
        self.model, self.args, self.tokenizer, self.config = model, args, tokenizer, config
        self.device, self.dtype, self.path = device, dtype, path
        self.eos_ids = eos_ids
        self.generation_defaults = generation_defaults
        self.max_context = config.max_context or min(args.max_position_embeddings, DEFAULT_CONTEXT)
        self.prefill_chunk = 2048
        self.name = path.name if path != default_model_path() else "moetier-default"
        self.tiers = None  # memory.experts.Tiers when experts are tiered (Engine.load installs them)
        self.prompt_cache = None if not config.prompt_cache else PromptCache(
            config.prompt_cache, f"{path.resolve()}|{dtype}|kv={config.kv_dtype}", config.prompt_cache_mem)

    @classmethod
    def load(cls, model: str | Path | None = None, config: EngineConfig | None = None) -> "Engine":
        from ..weights.loader import load_model
        config = config or EngineConfig()
        torch.set_num_threads(config.threads or default_threads())
        path = resolve_model_path(model)
        device = config.resolved_device()
        dtype = config.resolved_dtype(device)
        placement = None
        if memory.wants_tiers(config):  # budgets checked from headers before any weight is read
            placement = memory.plan_for_load(path, config, device, dtype, DEFAULT_CONTEXT)
        # GGUF experts stay in their stored format unless tiers want float ones (the compiled CPU step
        # calls the packed experts' kernel as a torch op)
        packed = path.suffix == ".gguf" and placement is None and not config.dequantize_experts
        from . import cpu_compile
        net, args, ckpt = load_model(path, device=device, dtype=dtype, progress=config.progress,
                                     skip=memory.EXPERT_PARAM if placement is not None or packed else None,
                                     quant_dense=not config.dequantize_dense,
                                     host_embed=placement is not None and placement.embed_host_bytes > 0,
                                     release_dense=device == "cpu" and not cpu_compile.KEEP_FLOATS)
        if packed:
            from ..weights.gguf import pack_experts
            pack_experts(net, ckpt, device, dtype)
        gen = {}
        if path.suffix == ".gguf":  # tokenizer, chat template and end-of-generation ids live in the metadata
            from ..weights.gguf_tokenizer import eog_ids, tokenizer_from_gguf
            meta = ckpt.metadata
            tokenizer = tokenizer_from_gguf(meta) if meta.get("tokenizer.ggml.tokens") else None
            args.eos_token_id = sorted(set(args.eos_token_id) | eog_ids(meta))
        else:
            tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
        if (path / "generation_config.json").exists():
            gen = json.loads((path / "generation_config.json").read_text())
        eos = set(args.eos_token_id)
        g_eos = gen.get("eos_token_id")
        if g_eos is not None:
            eos |= {g_eos} if isinstance(g_eos, int) else set(g_eos)
        if tokenizer is not None and "eos_token" in tokenizer.special:
            tid = tokenizer.token_to_id(tokenizer.special["eos_token"])
            if tid is not None:
                eos.add(tid)
        from ..kernels import small_ops
        small_ops.set_enabled(config.fused_decode)
        # one q/k/v GEMM per layer instead of three (weights become views of one stacked tensor)
        from ..models.layers import Attention
        for m in net.modules():
            if isinstance(m, Attention):
                m.fuse_qkv()
        engine = cls(net, args, tokenizer, config, device, dtype, path, eos, gen)
        if device == "cpu":
            if not cpu_compile.KEEP_FLOATS:     # linears on their blocks (GGUF ones were loaded without float values)
                cpu_compile.dense_copies(net)
            cpu_compile.prefill_int8_experts(net)   # packed experts' prefill: int8 activations where faster
        if placement is not None:
            engine.tiers = memory.install(net, placement, config)
            engine.prefill_chunk = placement.prefill_chunk
        elif device.startswith("cuda") and torch.cuda.mem_get_info(torch.device(device))[0] >= BIG_CHUNK_FREE:
            # every chunk dequantizes (GGUF) or reads all the experts it uses once per layer: 4x fewer
            # passes over the expert weights for an 8K prompt than 2K chunks (docs/perf-log.md)
            engine.prefill_chunk = memory.TIERED_PREFILL_CHUNK
        return engine

    def new_session(self, max_context: int | None = None) -> Session:
        return Session(session_cache(self.model, max_context or self.max_context, self.dtype, self.device,
                                     self.config.kv_dtype, self.config.kv_offload), self.prompt_cache)

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               prompt_ids: list[int] | None = None) -> list[int]:
        if prompt_ids is not None:
            ids = list(prompt_ids)
            bad = [i for i in ids if not (0 <= int(i) < self.args.vocab_size)]
            if bad:
                raise UserError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.args.vocab_size})")
            return ids
        if self.tokenizer is None:
            raise UserError(f"{self.path} has no tokenizer.json; pass token ids (--prompt-ids) instead of text")
        if messages is not None:
            return self.tokenizer.encode_chat(messages)
        if prompt is None:
            raise UserError("nothing to generate from: give a prompt, chat messages or prompt ids")
        return self.tokenizer.encode(prompt)

    def sampling_defaults(self) -> dict:
        """The checkpoint's generation_config.json sampling values, for callers that want them."""
        g = self.generation_defaults
        keys = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                "repetition_penalty": "repetition_penalty"}
        out = {ours: g[theirs] for ours, theirs in keys.items() if g.get(theirs) is not None}
        if g.get("do_sample") is False:
            out["temperature"] = 0.0
        return out

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 prompt_ids: list[int] | None = None, max_tokens: int = 256,
                 params: SamplingParams = SamplingParams(), stop: list[str] | str = (),
                 session: Session | None = None, logprobs: int | None = None,
                 cancel: Callable[[], bool] | None = None, ignore_eos: bool = False,
                 logits_processor: Callable | None = None) -> Iterator[TokenEvent | Done]:
        """Stream the generation: TokenEvent per token, then Done. Raises UserError on bad input
        before anything is computed. `logits_processor(generated_ids, logits [V]) -> logits` runs
        before each sampling step (the server's JSON mode masks tokens with it)."""
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise UserError(f"max_tokens must be a non-negative integer (got {max_tokens!r})")
        params.check()
        ids = self.encode(prompt, messages, prompt_ids)
        if not ids:
            raise UserError("the prompt is empty: give at least one token")
        session = session or self.new_session()
        limit = session.cache.max_len
        if len(ids) >= limit:
            raise ContextOverflow(f"the prompt has {len(ids)} tokens but the context holds {limit}; "
                                  "shorten the prompt or raise --ctx", len(ids), limit)
        return self._run(ids, session, max_tokens, params, [stop] if isinstance(stop, str) else list(stop),
                         logprobs, cancel, set() if ignore_eos else self.eos_ids, logits_processor)

    def _run(self, ids, session, max_tokens, params, stops, logprobs, cancel, eos, logits_processor=None):
        with session.lock:
            cached = session.reuse(ids)
            sampler = Sampler(params, self.args.vocab_size, self.device, ids)
            detok = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
            session.tokens = list(ids)
            mem0 = self.tiers.snapshot() if self.tiers is not None else None
            first = True
            every = 0 if session.cache.can_truncate else self.config.snapshot_every
            step = self._decode_step(session)
            path = "eager" if step is None else getattr(step, "decode_path", None) or (
                "cuda-graph" if self.device.startswith("cuda") else "cpu-compiled")
            for ev in generate_stream(self.model, session.cache, ids, ids[cached:], sampler, max_tokens, eos,
                                      detok, stops, logprobs, cancel, self.prefill_chunk, cached,
                                      logits_processor, step, every,
                                      lambda: session.save_snapshot(periodic=True), self._prefill_graphs()):
                if first:  # the prompt is prefilled and nothing decoded yet: a turn boundary
                    session.save_snapshot()
                    first = False
                if isinstance(ev, TokenEvent) and ev.token_id >= 0:
                    session.tokens.append(ev.token_id)
                if isinstance(ev, Done):
                    # the cache holds every generated token except the last sampled one
                    session.tokens = session.tokens[:session.cache.length]
                    ev.stats["device"] = self.device
                    ev.stats["dtype"] = str(self.dtype).removeprefix("torch.")
                    ev.stats["decode_path"] = path     # eager | cuda-graph | cpu-compiled
                    ev.stats["memory"] = self.tiers.request_stats(mem0) if mem0 is not None else \
                        self.memory_stats()
                yield ev

    def _decode_step(self, session: Session):
        """The per-token forward: a CUDA-graph replay on CUDA (captured once per session), an
        AOT-compiled step on the CPU (runtime/cpu_compile.py: used whenever it is cached; auto builds it
        in the background and switches to it at the first request after it lands), else eager."""
        from . import cpu_compile
        if cpu_compile.wanted(self.config.cpu_compile, self.device, self.tiers, session.cache):
            if getattr(self, "_cpu_decode", None) is None:  # tried once per Engine (False: unavailable)
                step, self.cpu_build = cpu_compile.compiled_step(self.model, self.path, self.config)
                self._cpu_decode = step or False
            elif not self._cpu_decode and getattr(self, "cpu_build", None) is not None and self.cpu_build.landed():
                self._cpu_decode = cpu_compile.CpuDecode.get(self.model, build=False) or False   # built meanwhile
            if self._cpu_decode:
                cpu_step, cache = self._cpu_decode, session.cache
                return lambda tok: cpu_step(cache, tok)[-1]
        if self.device == "cpu":
            cpu_compile.eager_blocks(self.model)    # the eager step reads the GGML blocks too
            from .cpu_step import EagerLayers
            return EagerLayers.get(self.model, session.cache)     # its layers in one C call (None: the modules)
        if not (self.device.startswith("cuda") and self.config.cuda_graphs) \
                or self.config.kv_offload:  # offloaded KV is written on the host: not capturable
            return None
        graphed = None
        if self.tiers is not None:
            graphed = self._graph_tiers()
            if graphed is None:
                return None   # these tiers need the eager step (it syncs with the host per layer)
        if session.graph is None:
            from .cuda_graph import DecodeGraph, GraphStep
            session.graph = GraphStep(DecodeGraph(self.model, session.cache, tiers=graphed))
        return session.graph

    def _prefill_graphs(self):
        """runtime.cuda_graph.PrefillGraphs for this engine (made once), or None: CUDA with graphs on, no memory
        tiers (their prefill stages experts from the host), no --kv-offload, experts that fit (PrefillGraphs.fits),
        MOETIER_PREFILL_GRAPH_MAX > 0; continuations up to MOETIER_PREFILL_GRAPH_CONTEXT (capped at the context)."""
        pg = getattr(self, "_prefill_g", None)
        if pg is None:
            from .cuda_graph import PrefillGraphs, prefill_graph_context, prefill_graph_max
            n = prefill_graph_max() if self.device.startswith("cuda") else 0
            ok = (n > 0 and self.config.cuda_graphs and self.tiers is None and not self.config.kv_offload
                  and PrefillGraphs.fits(self.model, self.dtype))
            pg = self._prefill_g = PrefillGraphs(self.model, self.dtype, self.device, n,
                                                 min(prefill_graph_context(), self.max_context)) if ok else False
        return pg or None

    def _graph_tiers(self):
        """The tiers' CUDA-graph decode path (memory.doorbell), or None with the reason logged once."""
        from ..memory.experts import TieredExperts
        act = next(m.act for m in self.model.modules() if isinstance(m, TieredExperts))
        graphed, why = self.tiers.graph_path(act, self.config.cpu_threads or miss_threads(self.tiers.admits()),
                                              self.args.num_experts_per_tok)
        if why and not getattr(self, "_told_eager", False):
            log.info("tiered decode runs eagerly: %s", why)
            self._told_eager = True
        return graphed

    def memory_stats(self) -> dict:
        """Where the experts are and how often each tier served them (the chat page's tier panel,
        `stats.memory` in `run --json`). Without memory tiers every expert sits on the model's device."""
        if self.tiers is not None:
            return self.tiers.memory_stats()
        tier = "gpu" if self.device.startswith("cuda") else "ram"
        layers = [i for i, blk in enumerate(self.model.model.layers)
                  if hasattr(getattr(blk, "mlp", None), "experts")]
        n = self.args.num_experts
        return {
            "tiers": {t: {"experts": len(layers) * n if t == tier else 0} for t in ("gpu", "ram", "ssd")},
            "layers": [{"layer": i, "gpu": n if tier == "gpu" else 0, "ram": n if tier == "ram" else 0,
                        "ssd": 0, "hit_rate": 1.0} for i in layers],
            "hit_rate": 1.0,
        }

    def complete(self, *args, **kwargs) -> Done:
        """Run `generate` to the end and return the final Done."""
        done = None
        for ev in self.generate(*args, **kwargs):
            if isinstance(ev, Done):
                done = ev
        return done
