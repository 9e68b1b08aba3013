"""Diagnosis: pipelined tiered graph decode (MOETIER_PIPELINE=1) on the tiny model of tests/test_memory_gpu.py, one
variant per process (a stalled step poisons the process): python3 bench/diag_pipeline.py [VARIANT ...]
VARIANT = DTYPE:POLICY[:nopipe], e.g. float32:lru bfloat16:static. Prints one JSON line per variant."""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def one(spec: str, path: str) -> dict:
    import torch

    from moetier import SamplingParams
    from moetier.config import EngineConfig
    from moetier.memory.plan import make_placement
    from moetier.runtime.engine import Engine
    dtype, policy, *rest = spec.split(":")
    os.environ["MOETIER_PIPELINE"] = "0" if "nopipe" in rest else "1"
    pl = make_placement(path, EngineConfig(max_context=96, ram_mem=1 << 34, gpu_mem=1 << 34), "cuda",
                        getattr(torch, dtype), 96, bw={"pcie_gbs": 12.0})
    few = pl.dense_bytes + pl.embed_bytes + pl.kv_bytes + pl.workspace_bytes + 10 * pl.expert_fast_bytes
    eng = Engine.load(path, EngineConfig(progress=False, device="cuda", max_context=96, cuda_graphs=True,
                                         dtype=dtype, gpu_mem=few, ram_mem=1 << 32, pcie_share=0.0,
                                         cache_policy=policy))
    tokens = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    out, t0 = [], time.perf_counter()
    try:
        for at in range(4):
            r = eng.complete(prompt_ids=tokens[at:at + 24], max_tokens=16, params=SamplingParams(temperature=0),
                             ignore_eos=True)
            out.append(r.token_ids)
        ok, err = True, ""
    except Exception as e:     # noqa: BLE001 - reported
        ok, err = False, f"{type(e).__name__}: {e}"
    g = eng.tiers.graphed
    return {"variant": spec, "ok": ok, "err": err, "s": round(time.perf_counter() - t0, 1), "turns": len(out),
            "admitted": g.timing.get("admitted") if g is not None else None, "tokens": out[:1]}


def main():
    specs = sys.argv[1:] or ["float32:lru", "float32:static", "bfloat16:lru", "float32:lru:nopipe"]
    if os.environ.get("_DIAG_ONE"):
        print(json.dumps(one(specs[0], os.environ["_DIAG_ONE"])), flush=True)
        return
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from helpers import tiny_checkpoint
    path = Path(tempfile.mkdtemp()) / "tiny"
    cfg = Qwen3MoeConfig(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1],
                         max_position_embeddings=256, rope_theta=1000.0)
    tiny_checkpoint(path, Qwen3MoeForCausalLM, cfg, scale=4.0)
    for spec in specs:
        try:
            r = subprocess.run([sys.executable, __file__, spec], env={**os.environ, "_DIAG_ONE": str(path)},
                               capture_output=True, text=True, timeout=int(os.environ.get("DIAG_SECS", "60")))
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            print(lines[-1] if lines else json.dumps({"variant": spec, "rc": r.returncode,
                                                      "stderr": r.stderr[-1500:]}), flush=True)
        except subprocess.TimeoutExpired:
            print(json.dumps({"variant": spec, "timeout": True}), flush=True)


if __name__ == "__main__":
    main()
