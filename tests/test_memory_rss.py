"""A model whose experts far exceed --ram-mem runs within the budget: the process's peak RSS
(VmHWM, measured in a fresh subprocess) grows by at most the budget plus a stated overhead.
Streamed experts are read with preadv into preallocated buffers, never through the mmap."""
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

MiB = 1 << 20
OVERHEAD = 32 * MiB     # allocator slack, activations, Python objects, mmapped pages of dense tensors
LAYERS, EXPERTS, DIM, INTER, VOCAB = 6, 64, 256, 512, 512


def qwen3_config() -> dict:
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": VOCAB,
            "hidden_size": DIM, "intermediate_size": 4 * DIM, "moe_intermediate_size": INTER,
            "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "num_experts": EXPERTS, "num_experts_per_tok": 4, "norm_topk_prob": True, "mlp_only_layers": [],
            "decoder_sparse_step": 1, "max_position_embeddings": 1024, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def shapes(cfg: dict) -> dict:
    d, e, i, h, kv, hd = (cfg[k] for k in ("hidden_size", "num_experts", "moe_intermediate_size",
                                           "num_attention_heads", "num_key_value_heads", "head_dim"))
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], d), "lm_head.weight": (cfg["vocab_size"], d),
           "model.norm.weight": (d,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        out.update({f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,),
                    f"{p}.self_attn.q_proj.weight": (h * hd, d), f"{p}.self_attn.k_proj.weight": (kv * hd, d),
                    f"{p}.self_attn.v_proj.weight": (kv * hd, d), f"{p}.self_attn.o_proj.weight": (d, h * hd),
                    f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,),
                    f"{p}.mlp.gate.weight": (e, d),
                    f"{p}.mlp.experts.gate_up_proj": (e, 2 * i, d), f"{p}.mlp.experts.down_proj": (e, d, i)})
    return out


def write_checkpoint(path: Path, cfg: dict, data: bool = True) -> int:
    """Stream a bf16 safetensors file tensor by tensor (never the whole model in memory).
    data=False writes only the header and makes the file sparse (f.truncate) at its full size."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    shp = shapes(cfg)
    header, off = {}, 0
    for name, s in shp.items():
        n = 2 * int(torch.Size(s).numel())
        header[name] = {"dtype": "BF16", "shape": list(s), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator().manual_seed(0)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        if not data:
            f.truncate(8 + len(raw) + off)
            return off
        for name, s in shp.items():
            t = torch.ones(s) if name.endswith("norm.weight") else torch.randn(s, generator=g) * 0.05
            f.write(t.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
    return off


CHILD = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from moetier.config import EngineConfig
    from moetier.memory.budget import rss_bytes
    from moetier.runtime.engine import Engine
    # code, not data, belongs to the baseline: torch's lazy CPU init, and the ~900 modules (~130 MB)
    # torch imports the first time a model is built on the meta device (any load does that)
    torch.ones(64, 64) @ torch.ones(64, 64)
    with torch.device("meta"):
        torch.nn.Embedding(4, 4)
    base = rss_bytes()[0]
    eng = Engine.load(sys.argv[1], EngineConfig(progress=False, max_context=128, ram_mem=int(sys.argv[2])))
    loaded = rss_bytes()[0]
    done = eng.complete(prompt_ids=list(range(1, 41)), max_tokens=24, ignore_eos=True)
    cur, peak = rss_bytes()
    print(json.dumps({"base": base, "loaded": loaded, "peak": peak, "memory": done.stats["memory"],
                      "bank": eng.tiers.pl.bank_slots, "fixed": eng.tiers.pl.dense_bytes + eng.tiers.pl.embed_bytes
                      + eng.tiers.pl.kv_bytes + eng.tiers.pl.workspace_bytes}))
""")


def run_child(path: Path, budget: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(budget)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("rss_moe")
    write_checkpoint(path, qwen3_config())
    return path


def test_peak_rss_stays_within_ram_budget(big):
    expert_bytes = LAYERS * EXPERTS * 3 * DIM * INTER * 2            # 302 MB of bf16 experts
    budget = 48 * MiB
    r = run_child(big, budget)
    grew = r["peak"] - r["base"]
    print(f"\nexperts {expert_bytes / MiB:.0f} MiB, --ram-mem {budget / MiB:.0f} MiB: peak RSS grew "
          f"{grew / MiB:.1f} MiB (base {r['base'] / MiB:.0f} MiB), bank {r['bank']} experts, "
          f"hits {r['memory']['hits']}, ssd reads {r['memory']['ssd_reads']}")
    assert expert_bytes > 5 * budget
    assert r["memory"]["hits"]["ssd"] > 0
    assert grew <= budget + OVERHEAD, f"peak RSS grew {grew / MiB:.1f} MiB > budget + {OVERHEAD / MiB:.0f} MiB"


def test_rss_measure_sees_a_full_bank(big):
    """Control: with room for every expert the bank fills and RSS grows by ~the experts' bytes,
    so the measurement above would catch experts landing in memory."""
    expert_bytes = LAYERS * EXPERTS * 3 * DIM * INTER * 2
    r = run_child(big, 1 << 30)
    grew = r["peak"] - r["base"]
    print(f"\n--ram-mem 1 GiB: peak RSS grew {grew / MiB:.1f} MiB for {expert_bytes / MiB:.0f} MiB of experts")
    assert r["memory"]["hits"]["ssd"] == 0
    assert grew >= expert_bytes
