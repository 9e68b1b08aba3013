"""`moetier bench` measurements: warm-up, prefill per prompt length, TTFT, greedy decode, peak VRAM
and RSS, hits per tier, the per-token time split, and the byte-budget bound of the configuration
(bytes each tier must read per token over its measured bandwidth) with the achieved fraction.

    result = bench_config(engine, model_path, prompt_lens=[512, 4096], gen=128, bw=bandwidths)
"""
from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import torch

from ..runtime.generate import Done, TokenEvent
from ..runtime.sampling import SamplingParams
from .synth import read_meta, stream_for

GREEDY = SamplingParams(temperature=0.0)


# ---------------------------------------------------------------- process memory
def reset_peaks(device: str) -> None:
    """Start a fresh peak for VRAM (torch's allocator) and RSS (Linux VmHWM, via clear_refs)."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_vram(device: str) -> int:
    return int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else 0


def gpu_budget(engine) -> int | None:
    """The GPU budget the memory tiers planned for (None: no tiers, or no GPU)."""
    pl = getattr(getattr(engine, "tiers", None), "pl", None)
    return int(pl.gpu_budget) if pl is not None and engine.device.startswith("cuda") else None


def release(engine) -> None:
    """Drop an engine before loading the next configuration."""
    tiers = getattr(engine, "tiers", None)
    if tiers is not None and hasattr(tiers, "close"):
        tiers.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        # each engine's streams got their own 32 MiB cuBLAS workspaces, kept by torch: without this a
        # --compare run's later configurations peaked ~100 MiB higher per configuration before them
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- bandwidths
def measure_bandwidths(device: str, model_path: Path, use_cache: bool = True) -> dict:
    """memory.bandwidth's cached micro-benchmarks (RAM sum, HBM, pinned PCIe copy, SSD preads)."""
    files = [model_path] if model_path.is_file() else sorted(model_path.glob("*.safetensors"))
    biggest = max(files, key=lambda p: p.stat().st_size, default=None)
    try:
        from ..memory.bandwidth import bandwidths
        return bandwidths(device, biggest, use_cache=use_cache)
    except ImportError:  # memory tiers not installed: rough defaults, labelled as such
        return {"ram_gbs": 20.0, "hbm_gbs": 2000.0, "pcie_gbs": 12.0, "ssd_gbs": 2.0, "source": "assumed"}


# ---------------------------------------------------------------- one request
def _tier_snapshot(engine):
    return engine.tiers.snapshot() if getattr(engine, "tiers", None) is not None else None


def _decode_view(engine, mid):
    """Tier counters of the decode phase only (after the first token), or None without tiers."""
    if mid is None:
        return None
    from ..memory.stats import delta, request_view
    return request_view(delta(engine.tiers.snapshot(), mid))


class Forcing:
    """A logits processor that makes greedy decoding emit `ids` in order: the model still runs every
    step, but the tokens (hence the routing) follow the topic-local stream instead of the loops
    that greedy decoding of random weights falls into. `forced(n)` tells generate_stream's pipelined
    greedy path the inputs ahead (the graph still makes each step's argmax, as greedy decoding does)."""

    def __init__(self, ids: list[int]):
        if not ids:
            raise ValueError("Forcing needs at least one token id")
        self.ids = list(ids)

    def forced(self, n: int) -> int:
        """The token emitted after n generated ones (the last id repeats past the end)."""
        return self.ids[min(n, len(self.ids) - 1)]

    def __call__(self, out: list[int], logits: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(logits, float("-inf"))
        forced[self.forced(len(out))] = 0.0
        return forced


def run_prompt(engine, prompt: list[int], gen: int, forced: list[int] | None = None,
               params: SamplingParams = GREEDY) -> dict:
    """Prefill `prompt`, decode `gen` tokens (EOS ignored; greedy unless `params` say otherwise) on a fresh session;
    with `forced`, the decoded tokens are those ids (see `Forcing`)."""
    session = engine.new_session()
    done, mid = None, None
    extra = {"logits_processor": Forcing(forced)} if forced else {}
    for ev in engine.generate(prompt_ids=prompt, max_tokens=gen, params=params, session=session, ignore_eos=True,
                              **extra):
        if isinstance(ev, TokenEvent) and mid is None:
            mid = _tier_snapshot(engine)
        elif isinstance(ev, Done):
            done = ev
    s = done.stats
    decode_view = _decode_view(engine, mid)
    out = {"prompt_tokens": len(prompt), "prefill_tok_s": s["prefill_tok_s"], "ttft_s": s["ttft_s"],
           "decode_tok_s": s["decode_tok_s"], "generated_tokens": s["generated_tokens"],
           "distinct_token_frac": round(len(set(done.token_ids)) / max(1, len(done.token_ids)), 3),
           "memory": s.get("memory"), "decode_memory": decode_view}
    out["time_split"] = time_split(engine.device, s["decode_tok_s"], decode_view)
    del session
    return out


def time_split(device: str, decode_tok_s: float, view: dict | None) -> dict:
    """Per decode token: total, experts on the GPU / CPU, copies, SSD waits, and the rest
    (attention, launches, Python). Without tiers only the total is known (the model's device)."""
    total = 1e3 / decode_tok_s if decode_tok_s else 0.0
    if view is None:
        gpu = device.startswith("cuda")
        return {"total_ms": round(total, 3), "gpu_ms": round(total if gpu else 0.0, 3),
                "cpu_ms": round(0.0 if gpu else total, 3), "copy_ms": 0.0, "ssd_wait_ms": 0.0, "idle_ms": 0.0,
                "source": "total (no memory tiers: all work on " + ("GPU" if gpu else "CPU") + ")"}
    ms = view["per_token"]["ms"]
    parts = {"gpu_ms": ms.get("gpu", 0.0), "cpu_ms": ms.get("cpu", 0.0), "copy_ms": ms.get("copy", 0.0),
             "ssd_wait_ms": ms.get("ssd_wait", 0.0)}
    return {"total_ms": round(total, 3), **{k: round(v, 3) for k, v in parts.items()},
            "idle_ms": round(max(0.0, total - sum(parts.values())), 3),
            "source": "memory tiers (gpu/cpu = expert compute; idle = attention, launches, Python, waits)"}


# ---------------------------------------------------------------- the byte budget
def bytes_per_token(engine, context: int) -> dict:
    """Bytes a decode token reads with every weight on the model's device: dense weights (one
    embedding row; a float weight's GGML copy where the CPU step multiplies on it), top-k experts of every MoE layer,
    and the KV cache at `context` positions."""
    model, args = engine.model, engine.args
    dense = experts = 0
    seen = set()
    embed = getattr(model.model.embed_tokens, "weight", None)
    lm = getattr(getattr(model, "lm_head", None), "weight", None)
    # float weights with a GGML copy that the CPU step reads instead (runtime.cpu_compile._quantized_copies): storage ->
    # the copy's bytes, counted once per storage (fuse_qkv's q, k, v are views of one)
    copies = {getattr(m, a).untyped_storage().data_ptr(): getattr(m, f"{a}_q").nbytes
              for m in model.modules() for a in getattr(m, "_quant_copies", {}) if hasattr(m, f"{a}_q")}
    counted = set()
    for name, p in model.named_parameters():
        if id(p) in seen or p.device.type == "meta":
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size()
        key = p.untyped_storage().data_ptr()
        if key in copies and (p is not embed or p is lm):
            dense += copies[key] if key not in counted else 0
            counted.add(key)
            continue
        if ".experts." in name:
            experts += n
        elif p is embed and p is not lm:        # one row a token (a tied lm_head of its own, as a copy, is counted)
            dense += n // max(1, p.shape[0])
        else:
            dense += n
    from ..models.quant_experts import QuantExperts
    from ..models.quant_linear import QuantEmbedding, QuantLinear
    for m in model.modules():          # GGUF blocks kept as buffers: dense layers and packed experts
        if isinstance(m, QuantLinear):
            dense += m.nbytes
        elif isinstance(m, QuantEmbedding):             # one row a token
            dense += m.nbytes // max(1, m.num_embeddings)
        elif isinstance(m, QuantExperts):   # (not the CPU step's x8 copies of the same experts)
            experts += sum(b.numel() * b.element_size() for n, b in m.named_buffers()
                           if b.device.type != "meta" and not n.endswith("_x8"))
    n_moe = sum(1 for blk in model.model.layers if hasattr(getattr(blk, "mlp", None), "experts"))
    E, k = max(1, args.num_experts), args.num_experts_per_tok
    cache = engine.new_session(max_context=2).cache    # KV bytes per position, without a big allocation
    kv = cache.nbytes // cache.max_len * context
    return {"dense": dense, "experts": experts // E * k if n_moe else 0, "kv": kv}


def byte_bound(engine, bw: dict, context: int) -> dict:
    """Decode ceiling. With memory tiers: memory.plan.decode_ceiling (the planned tier coverage,
    the KV cache at the configured context). Without: every byte from the model's device memory
    (HBM on CUDA, RAM on CPU), the KV cache at `context` positions."""
    tiers = getattr(engine, "tiers", None)
    if tiers is not None:
        try:
            from ..memory.plan import decode_ceiling
            c = decode_ceiling(tiers.pl, bw)
            return {"bound_tok_s": c["bound_tok_s"], "bytes_per_token": c["bytes"],
                    "ms": c["ms"], "source": "memory.plan.decode_ceiling"}
        except (ImportError, AttributeError, KeyError, TypeError) as e:
            fallback = f"memory.plan.decode_ceiling failed ({type(e).__name__}: {e}); "
    else:
        fallback = ""
    b = bytes_per_token(engine, context)
    total = sum(b.values())
    cuda = engine.device.startswith("cuda")
    rate = (bw["hbm_gbs"] if cuda else bw["ram_gbs"]) * 1e9
    where = "HBM" if cuda else "RAM"
    if not cuda and 0 < total < SMALL_WORKING_SET:
        # a small model's weights stay in the CPU caches between tokens: the RAM rate (a 256 MiB sum) is
        # no bound for it (the default model decoded at 122% of it); read a buffer of its size instead
        from ..memory.bandwidth import measure_ram
        rate = measure_ram(max(total, 1 << 20)) * 1e9
        where = f"a {total / 2**20:.0f} MiB working set (cache-resident; read rate measured at that size)"
    return {"bound_tok_s": rate / total if total else float("inf"),
            "bytes_per_token": {("gpu" if cuda else "ram"): total, **{f"{k}_bytes": v for k, v in b.items()}},
            "ms": {"gpu" if cuda else "ram": total / rate * 1e3},
            "source": fallback + f"bench: all weights in {where}"}


SMALL_WORKING_SET = 128 << 20   # CPU bytes per token below which the bound uses a read of that size


def rests_on_ram(engine, bw: dict, bound: dict) -> bool:
    """The bound rests on the RAM rate: memory tiers with routes from RAM."""
    return bool(getattr(engine, "tiers", None) is not None and bw.get("ram_gbs")
                and bound.get("source") == "memory.plan.decode_ceiling" and bound["bytes_per_token"].get("ram"))


class RunReadings:
    """The RAM read rate on both sides of each decode run, where the bound rests on it. A shared H200 box read 82
    then 117 GB/s minutes apart (docs/perf-log.md, session 12) and 90 before / 122 after one configuration's runs
    (session 21): one reading before the runs (cached) or after them can flatter or sink the fraction; a reading
    next to each run tells what the machine could do while it ran. measure_ram reads a fresh 1 GiB buffer: each
    reading resets the kernel's peak-RSS mark after it (/proc/self/clear_refs) and peak_rss() is the peak without
    them. make() -> None where that reset is refused (then only one reading, after the runs)."""

    def __init__(self):
        self.pairs: list[tuple[float, float]] = []
        self._peak = 0

    @classmethod
    def make(cls) -> "RunReadings | None":
        w = cls()
        w._peak = peak_rss()
        return w if w._reset() else None

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def read(self) -> float:
        from ..memory.bandwidth import measure_ram
        self._peak = max(self._peak, peak_rss())
        rate = measure_ram()
        self._reset()
        return rate

    def around(self, run):
        """run() with a reading on each side; -> its result."""
        before = self.read()
        r = run()
        self.pairs.append((before, self.read()))
        return r

    def peak_rss(self) -> int:
        return max(self._peak, peak_rss())

    def check(self, bw: dict) -> dict:
        """-> the readings: before (the bandwidths' reading), runs [[before, after] per run], run_gbs (the median over
        the runs of the faster reading next to each: the bound's rate), fastest (of all readings), spread
        (fastest / slowest - 1)."""
        every = [bw["ram_gbs"]] + [r for p in self.pairs for r in p]
        return {"before": round(bw["ram_gbs"], 2), "runs": [[round(a, 2), round(b, 2)] for a, b in self.pairs],
                "run_gbs": round(float(np.median([max(p) for p in self.pairs])), 2), "fastest": round(max(every), 2),
                "spread": round(max(every) / min(every) - 1, 3)}


def ram_recheck(engine, bw: dict, bound: dict) -> dict | None:
    """The RAM read rate again after the runs, where the bound rests on it and RunReadings could not read next to
    each run: -> {"before", "after" GB/s, "run_gbs" (the faster one: the bound's rate), "fastest", "spread"}, or
    None where the bound does not rest on the RAM rate."""
    if not rests_on_ram(engine, bw, bound):
        return None
    from ..memory.bandwidth import measure_ram
    after = measure_ram()
    fast = max(after, bw["ram_gbs"])
    return {"before": round(bw["ram_gbs"], 2), "after": round(after, 2), "run_gbs": round(fast, 2),
            "fastest": round(fast, 2), "spread": round(abs(after / bw["ram_gbs"] - 1), 3)}


def hbm_recheck(engine, bw: dict) -> dict | None:
    """The HBM read rate again after the runs, on CUDA: -> {"before", "after" GB/s, "used" (the faster: the bound's
    rate)}, or None off CUDA. One H200 box read 1,473 GB/s before a bench (cached for the box) and its all-GPU bound
    came out 826 tok/s where a box reading 3,938 gave 2,210 for the same decode speed (docs/perf-log.md, session 30)."""
    if not engine.device.startswith("cuda") or not bw.get("hbm_gbs"):
        return None
    from ..memory.bandwidth import measure_hbm
    nbytes, budget = 512 << 20, gpu_budget(engine)
    if budget:      # a hard limit (--gpu-mem), the expert cache filled to it: read within what is left
        nbytes = min(nbytes, max(0, budget - torch.cuda.memory_allocated(engine.device)) // 2 >> 22 << 22)
    before = round(bw["hbm_gbs"], 1)
    if nbytes < 32 << 20:
        return {"before": before, "after": None, "used": before}
    after = round(measure_hbm(engine.device, nbytes), 1)
    return {"before": before, "after": after, "used": max(after, before)}


# ---------------------------------------------------------------- one configuration
SAMPLE_DEFAULTS = dict(temperature=0.7, top_k=20, top_p=0.8)     # Qwen3's advice for non-thinking chat


def sample_params(engine) -> SamplingParams:
    """`--decode sample`: the checkpoint's generation_config sampling values (a chat's defaults), else
    SAMPLE_DEFAULTS; seeded, so runs draw the same tokens."""
    kw = engine.sampling_defaults()
    if not kw.get("temperature", 1.0) > 0:      # do_sample false: a greedy checkpoint
        kw = {}
    return SamplingParams(**(kw or SAMPLE_DEFAULTS), seed=0)


def decode_mode(mode: str, model_path: Path) -> str:
    """auto: 'stream' for moetier synth checkpoints (random weights loop under greedy decoding,
    which makes every decode step hit the same experts), 'greedy' for real models."""
    if mode != "auto":
        return mode
    return "stream" if read_meta(model_path) else "greedy"


def bench_config(engine, model_path: Path, prompt_lens: list[int], gen: int, warmup: int, bw: dict,
                 mode: str = "greedy", log=lambda *a: None, repeat: int = 1) -> dict:
    """repeat: decode at the first prompt length this many times in all; decode_tok_s is then their
    median, decode_tok_s_runs every figure (a shared machine varies +-15% between runs)."""
    vocab = engine.args.vocab_size
    params = sample_params(engine) if mode == "sample" else GREEDY

    def request(n: int, g: int, seed: int) -> dict:
        ids = stream_for(model_path, vocab, n + g, seed=seed)
        return run_prompt(engine, ids[:n], g, ids[n:] if mode == "stream" else None, params)

    # the warm-up prompt is as long as the first measured one (up to 512): prefill kernels compile for their row
    # counts, and a 32-token warm-up left those compiles in the first figure (all on the GPU: 571 tok/s for 5,100)
    for i in range(warmup):
        request(min(prompt_lens[0], 512) if prompt_lens else 32, min(gen, 8), 10_000 + i)
    # the decode runs that give decode_tok_s, each between two RAM readings where the bound rests on the RAM rate
    watch = RunReadings.make() if rests_on_ram(engine, bw, byte_bound(engine, bw, prompt_lens[0] + gen // 2)) \
        else None
    measured = watch.around if watch is not None else (lambda run: run())
    runs = []
    for j, n in enumerate(prompt_lens):
        log(f"  prompt {n} tokens + {gen} decode ({mode}) ...")
        runs.append(measured(lambda: request(n, gen, n)) if j == 0 else request(n, gen, n))
    first = runs[0]
    again = []
    for i in range(1, repeat):
        log(f"  prompt {prompt_lens[0]} tokens + {gen} decode ({mode}), repeat {i + 1} of {repeat} ...")
        again.append(measured(lambda: request(prompt_lens[0], gen, prompt_lens[0] + i)))
    decodes = [first["decode_tok_s"]] + [r["decode_tok_s"] for r in again]
    context = first["prompt_tokens"] + gen // 2
    rss, vram = (watch.peak_rss() if watch is not None else peak_rss()), peak_vram(engine.device)
    hbm = hbm_recheck(engine, bw)       # (after the peaks: its buffer is the bench's, not the engine's)
    if hbm is not None:
        bw = dict(bw, hbm_gbs=hbm["used"])
    bound = byte_bound(engine, bw, context)
    ram = watch.check(bw) if watch is not None else ram_recheck(engine, bw, bound)     # (after the peak RSS)
    fastest = None
    if ram is not None:     # the bound at the RAM rate of the runs; the one at the fastest reading beside it
        bound = byte_bound(engine, dict(bw, ram_gbs=ram["run_gbs"]), context)
        fastest = byte_bound(engine, dict(bw, ram_gbs=ram["fastest"]), context)["bound_tok_s"]
    dec = float(np.median(decodes))
    bound_tok_s = bound["bound_tok_s"]
    return {
        "decode_tok_s": dec, "decode_tok_s_runs": decodes,
        "prefill_tok_s": {str(r["prompt_tokens"]): r["prefill_tok_s"] for r in runs},
        "ttft_s": first["ttft_s"],
        "ttft_s_by_length": {str(r["prompt_tokens"]): r["ttft_s"] for r in runs},
        "decode_tok_s_by_length": {str(r["prompt_tokens"]): r["decode_tok_s"] for r in runs},
        "peak_vram_bytes": vram, "peak_rss_bytes": rss,
        "gpu_budget_bytes": gpu_budget(engine),
        "memory": engine.memory_stats(), "decode_memory": first["decode_memory"],
        "time_split": first["time_split"],
        "bound_tok_s": float(f"{bound_tok_s:.5g}"),
        "fraction_of_bound": float(f"{dec / bound_tok_s:.4g}") if bound_tok_s else None,
        "fastest_bound_tok_s": float(f"{fastest:.5g}") if fastest else None,
        "fraction_of_fastest_bound": float(f"{dec / fastest:.4g}") if fastest else None,
        "bound": bound, "ram_gbs_check": ram, "hbm_gbs_check": hbm,
        "distinct_token_frac": first["distinct_token_frac"], "runs": runs,
        "device": engine.device, "dtype": str(engine.dtype).removeprefix("torch."), "decode_mode": mode,
    }


def hit_summary(memory: dict | None) -> str:
    """'gpu 80% ram 20% ssd 0%' from memory stats (hits per tier when counted, else placement)."""
    if not memory or "tiers" not in memory:
        return "-"
    t = memory["tiers"]
    hits = {k: v.get("hits") for k, v in t.items()}
    if all(v is not None for v in hits.values()) and sum(hits.values()):
        tot = sum(hits.values())
        pcie = t.get("ram", {}).get("pcie_experts") or 0
        via = f" ({pcie / tot:.0%} of all read by the GPU over PCIe)" if pcie else ""
        return " ".join(f"{k} {v / tot:.0%}" for k, v in hits.items()) + via
    tot = sum(v.get("experts", 0) for v in t.values()) or 1
    return "placed " + " ".join(f"{k} {v.get('experts', 0) / tot:.0%}" for k, v in t.items())
