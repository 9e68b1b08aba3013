"""`moetier plan` on a Qwen3-30B-A3B-shaped checkpoint: a real safetensors header with the real
shapes over a sparse file (no weight bytes written, none read)."""
import json
import struct

import pytest
import torch

from helpers import bandwidths_home
from moetier.cli import main
from moetier.memory.plan import HOST_GROUP
from moetier.weights.safetensors import SafetensorsFile

GiB, MiB = 1 << 30, 1 << 20
QWEN3_30B = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
             "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
             "num_experts_per_tok": 8, "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1,
             "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
EXPERT = 3 * 2048 * 768 * 2                       # 9 MiB per expert in bf16
BW = {"ram_gbs": 50.0, "hbm_gbs": 4000.0, "pcie_gbs": 24.0, "ssd_gbs": 5.0, "cpu_gbs_bfloat16": 40.0,
      "cpu_gflops_bfloat16": 400.0, "cpu_gbs_float32": 30.0, "cpu_gflops_float32": 800.0}


def sparse_checkpoint(path, cfg) -> int:
    """Per-expert HF names as in the real checkpoint; the data region is a hole (f.truncate)."""
    d, e, i, L = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    h, kv, hd, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "model.norm.weight": (d,)}
    for n in range(L):
        p = f"model.layers.{n}"
        shapes.update({f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,),
                       f"{p}.self_attn.q_proj.weight": (h * hd, d), f"{p}.self_attn.k_proj.weight": (kv * hd, d),
                       f"{p}.self_attn.v_proj.weight": (kv * hd, d), f"{p}.self_attn.o_proj.weight": (d, h * hd),
                       f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,),
                       f"{p}.mlp.gate.weight": (e, d)})
        for x in range(e):
            shapes.update({f"{p}.mlp.experts.{x}.gate_proj.weight": (i, d), f"{p}.mlp.experts.{x}.up_proj.weight": (i, d),
                           f"{p}.mlp.experts.{x}.down_proj.weight": (d, i)})
    header, off = {}, 0
    for name, s in shapes.items():
        nbytes = 2 * int(torch.Size(s).numel())
        header[name] = {"dtype": "BF16", "shape": list(s), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    return off


@pytest.fixture(scope="module")
def qwen30b(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_30b")
    total = sparse_checkpoint(path, QWEN3_30B)
    return path, total


@pytest.fixture
def no_reads(monkeypatch, tmp_path):
    """Fail if any weight is read (mmap or tensor), and give plan a bandwidth cache in a fresh HOME."""
    def boom(*a, **k):
        raise AssertionError("plan read weight data")
    monkeypatch.setattr(SafetensorsFile, "_map", boom)
    monkeypatch.setattr(SafetensorsFile, "tensor", boom)
    bandwidths_home(monkeypatch, tmp_path, BW)


def plan_json(capsys, *argv) -> tuple[int, dict]:
    rc = main(["plan", *map(str, argv), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_plan_qwen3_30b_on_a_24gb_gpu(qwen30b, no_reads, capsys):
    path, total = qwen30b
    assert path.joinpath("model.safetensors").stat().st_blocks * 512 < 16 * MiB     # nothing was written
    rc, p = plan_json(capsys, path, "--device", "cuda", "--gpu-mem", "24GiB", "--ram-mem", "32GiB", "--ctx", 4096)
    assert rc == 0 and not p["problems"]
    ex = p["experts"]
    assert ex["bytes_per_expert"] == EXPERT
    assert ex["bytes_per_layer"] == 128 * EXPERT == 1_207_959_552           # 1.21 GB (1.125 GiB) per layer
    assert ex["total_bytes"] == 48 * 128 * EXPERT                           # 58.0 GB of experts
    groups = {g["group"].split(" ")[0]: g["bytes"] for g in p["groups"]}
    assert groups["lm_head"] == 151936 * 2048 * 2                           # 622 MB
    assert groups["token"] == 151936 * 2048 * 2                             # the embedding table, in pinned RAM
    assert next(g for g in p["groups"] if g["group"].startswith("token"))["group"] == HOST_GROUP
    attn = (4096 * 2048 * 2 + 512 * 2048 * 2) * 2
    assert attn * 48 < groups["dense"] < (attn + 128 * 2048 * 2 + 8 * 2048) * 48
    kv = 48 * 4096 * 2 * 4 * 128 * 2
    assert p["budgets"]["gpu"] == 24 * GiB
    assert p["kv_bytes"] == kv                                              # 384 MiB at 4K tokens
    fixed = groups["dense"] + groups["lm_head"] + kv + p["workspace_bytes"]
    gpu = p["tiers"]["gpu"]
    used = fixed + (gpu["slots"] + gpu["stage_slots"]) * EXPERT + gpu["staging_bytes"]
    assert used <= 24 * GiB < used + EXPERT                                 # fills the budget, never past it
    assert 2050 < gpu["slots"] < 2400 and max(gpu["per_layer"]) - min(gpu["per_layer"]) <= 1
    ram = p["tiers"]["ram"]
    # 4 read buffers; the table pinned as 1 GiB (the caching host allocator's power of two)
    assert ram["slots"] == (32 * GiB - GiB) // EXPERT - 4 and not ram["all_experts"]
    c = p["decode_ceiling"]
    share = gpu["slots"] / (48 * 128)
    assert c["coverage"]["gpu"] == pytest.approx(share)
    routes = 8 * 48
    assert c["bytes"]["ram"] == pytest.approx(routes * (1 - share) * EXPERT)
    assert c["bound_ms"] == pytest.approx(max(v for k, v in c["ms"].items() if k != "ram_torch"))
    assert 0 < c["bound_tok_s"] < 1000
    rule = p["prefill_rule"]
    # copying 9 MiB at 24 GB/s = 0.39 ms > one token's gemv on the CPU (9 MiB at 40 GB/s = 0.24 ms), but
    # the CPU does 9.4 MFLOP per token at 400 GFLOP/s = 0.024 ms: from 17 tokens on, copying wins
    assert rule["tokens"] == 17 and rule["copy_ms"] == pytest.approx(EXPERT / 24e9 * 1e3)


def test_embeddings_stay_on_the_gpu_with_gpu_embed(qwen30b, no_reads, capsys):
    """--gpu-embed: the table counts against the GPU budget again (fewer expert slots), not the RAM one."""
    path, _ = qwen30b
    _, host = plan_json(capsys, path, "--device", "cuda", "--gpu-mem", "24GiB", "--ram-mem", "32GiB", "--ctx", 4096)
    rc, dev = plan_json(capsys, path, "--device", "cuda", "--gpu-mem", "24GiB", "--ram-mem", "32GiB", "--ctx", 4096,
                        "--gpu-embed")
    table = 151936 * 2048 * 2
    assert rc == 0 and not any(g["group"] == HOST_GROUP for g in dev["groups"])
    assert next(g["bytes"] for g in dev["groups"] if g["group"].startswith("embeddings")) == 2 * table
    slots = host["tiers"]["gpu"]["slots"] - dev["tiers"]["gpu"]["slots"]
    assert table // EXPERT - 1 <= slots <= table // EXPERT + 1                   # the table's worth of experts
    assert dev["tiers"]["ram"]["slots"] - host["tiers"]["ram"]["slots"] in (GiB // EXPERT, GiB // EXPERT + 1)


def test_layer_stage_only_where_the_cache_cannot_use_the_room(qwen30b, no_reads, capsys):
    """--cpu-moe leaves the GPU budget to no cache: the prefill stage holds two layers (the next
    layer's experts copied while this one computes); with cacheable layers it stays a 32-slot batch."""
    path, _ = qwen30b
    rc, p = plan_json(capsys, path, "--device", "cuda", "--gpu-mem", "24GiB", "--ram-mem", "32GiB", "--ctx", 4096,
                      "--cpu-moe")
    gpu = p["tiers"]["gpu"]
    assert rc == 0 and gpu["slots"] == 0 and gpu["stage_slots"] == 2 * 128
    rc, p = plan_json(capsys, path, "--device", "cuda", "--gpu-mem", "24GiB", "--ram-mem", "32GiB", "--ctx", 4096)
    assert rc == 0 and p["tiers"]["gpu"]["stage_slots"] == 32


def test_full_bank_is_ordered_by_layer():
    """All experts fit in RAM: the bank goes layer by layer, so a layer's buffers are adjacent and
    FastTier.load_many copies runs of them at once (fast._runs)."""
    from moetier.memory.fast import _runs
    from moetier.memory.store import alloc_buffers
    bufs = alloc_buffers(10, 96, pin=False)
    for i, b in enumerate(bufs):
        b.copy_(torch.randint(0, 255, (96,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
    pick = [bufs[2], bufs[3], bufs[4], bufs[7], bufs[6], bufs[8], bufs[9]]
    runs = list(_runs(pick, 80))
    assert [(i, j) for i, j, _ in runs] == [(0, 3), (3, 4), (4, 5), (5, 7)]
    for i, j, src in runs:
        assert src.shape == (j - i, 80)
        for r in range(j - i):
            assert torch.equal(src[r], pick[i + r][:80])


def test_plan_table_and_does_not_fit(qwen30b, no_reads, capsys):
    path, _ = qwen30b
    rc = main(["plan", str(path), "--device", "cuda", "--gpu-mem", "24GiB", "--ram-mem", "64GiB", "--ctx", "8192",
               "-ot", r"blk\.(4[0-7])\.ffn_.*_exps=disk"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "1.12 GiB per layer" in out and "KV cache (8192 tokens)" in out and "768.00 MiB" in out
    assert "forced to disk: 40-47" in out and "decode ceiling" in out and "prefill rule" in out
    rc = main(["plan", str(path), "--device", "cuda", "--gpu-mem", "2GiB", "--ram-mem", "32GiB"])
    out = capsys.readouterr().out
    assert rc == 1 and "DOES NOT FIT" in out and "dense weights" in out


def test_plan_cpu_with_profile(qwen30b, no_reads, capsys, tmp_path):
    path, _ = qwen30b
    from moetier.memory.profile import ExpertProfile
    prof = ExpertProfile(list(range(48)), 128, "qwen3_moe")
    prof.counts["weight"][:, :16] = 10.0                 # 16 hot experts per layer carry 10x the weight
    prof.counts["weight"][:, 16:] = 1.0
    prof.save(tmp_path / "p.json")
    rc, p = plan_json(capsys, path, "--device", "cpu", "--dtype", "bfloat16", "--ram-mem", "40GiB",
                      "--gpu-mem", f"{16 * 48 * 9}MiB", "--expert-profile", tmp_path / "p.json", "--cache-policy", "static")
    assert rc == 0
    assert p["tiers"]["gpu"]["slots"] == 16 * 48 and p["tiers"]["gpu"]["pinned"] == 16 * 48
    assert p["decode_ceiling"]["coverage"]["gpu"] == pytest.approx(160 / (160 + 112))   # hot share per layer


def test_prefill_chunk_follows_the_gpu_budget(qwen30b, no_reads, capsys):
    """CUDA tiers prefill in 8K chunks (each chunk copies the experts it uses once) unless that
    workspace passes a tenth of the GPU budget; then 2K. The chunk plan prints is the one loads use."""
    path, _ = qwen30b
    sizes = {}
    for budget in ("80GiB", "8GiB"):
        rc, p = plan_json(capsys, path, "--device", "cuda", "--gpu-mem", budget, "--ram-mem", "64GiB", "--ctx", 16384)
        assert rc == 0
        sizes[budget] = (p["prefill_chunk"], p["workspace_bytes"])
    assert sizes["80GiB"][0] == 8192 and sizes["80GiB"][1] <= 8 * GiB
    assert sizes["8GiB"][0] == 2048 and sizes["8GiB"][1] <= 0.8 * GiB


def test_pcie_share_follows_the_measured_bandwidths():
    """The default PCIe share: 0.6 x PCIe / (PCIe + RAM), bounded; the fixed default without both figures."""
    from moetier.memory.plan import PCIE_SHARE, pcie_share_default
    assert pcie_share_default({"pcie_gbs": 53.0, "ram_gbs": 88.0}) == pytest.approx(0.226, abs=1e-3)   # H200 box
    assert pcie_share_default({"pcie_gbs": 12.0, "ram_gbs": 40.0}) < pcie_share_default({"pcie_gbs": 25.0,
                                                                                         "ram_gbs": 40.0})
    assert pcie_share_default({"pcie_gbs": 1000.0, "ram_gbs": 1.0}) == pytest.approx(0.599, abs=1e-3)
    assert pcie_share_default(None) == pcie_share_default({"pcie_gbs": 12.0}) == PCIE_SHARE


def test_pcie_share_beside_the_prefetch_of_guessed_misses():
    """With the CPU's prefetch of guessed misses the PCIe share is 0 where up to PREFETCH_SHARE_FROM of the routes
    come from RAM (measured: 8 GiB, 55%), the full share where all do (--cpu-moe), linear between; without the
    prefetch the full share; either way 0 where it would read no expert of an average layer."""
    from moetier.memory.plan import PREFETCH_SHARE_FROM, prefetch_share
    assert prefetch_share(0.211, 0.55) == prefetch_share(0.211, PREFETCH_SHARE_FROM) == 0.0
    assert prefetch_share(0.211, 1.0) == 0.211
    mid = (PREFETCH_SHARE_FROM + 1.0) / 2
    assert prefetch_share(0.2, mid) == pytest.approx(0.1, abs=1e-3)
    assert prefetch_share(0.2, 0.0) == 0.0 and prefetch_share(0.0, 1.0) == 0.0
    # a share that reads no expert of an average layer's misses (k = 8 routes): off, it only costs the fusions
    assert prefetch_share(0.22, 0.61) == pytest.approx(0.006, abs=1e-3) and prefetch_share(0.22, 0.61, 8) == 0.0
    assert prefetch_share(0.22, 0.8, 8) == prefetch_share(0.22, 0.8) == pytest.approx(0.11, abs=1e-3)
    assert prefetch_share(0.22, 1.0, 8) == 0.22
    # without the prefetch: the full share, unless it reads no expert of an average layer (14 GiB, 15% from RAM)
    assert prefetch_share(0.228, 0.15, prefetch=False) == 0.228 and prefetch_share(0.228, 0.15, 8, False) == 0.0
    assert prefetch_share(0.228, 0.55, 8, False) == 0.228 and prefetch_share(0.228, 0.3, 8, False) == 0.228


def test_gpu_bandwidth_test_fits_the_budget():
    """Engine.load measures HBM and PCIe once (two device buffers): under --gpu-mem they fit in it."""
    from moetier.memory.bandwidth import gpu_test_bytes
    assert gpu_test_bytes(None) == 512 << 20
    assert gpu_test_bytes(8 << 30) == 512 << 20
    for budget in (256 << 20, 100 << 20, 40 << 20):
        assert 2 * gpu_test_bytes(budget) <= budget // 2


def test_ram_bandwidth_is_read_on_every_cpu_and_remeasured_from_an_older_cache(monkeypatch, tmp_path):
    """The RAM ceiling is read with as many threads as the miss server uses (every CPU of the process, not torch's
    default: on the H200 box its 8 threads read 63 GB/s where the server streamed 86); torch's thread count is
    restored; a cached ram_gbs measured another way is measured again, the other cached figures are kept."""
    from moetier.kernels import cpu
    from moetier.memory import bandwidth as bw
    monkeypatch.setattr(bw, "process_cpus", lambda: 3)
    seen = []
    real = cpu.stream_sum
    monkeypatch.setattr(cpu, "stream_sum", lambda a, threads=None: (seen.append((threads, torch.get_num_threads())),
                                                                    real(a, threads))[1])
    before = torch.get_num_threads()
    assert bw.measure_ram(4 << 20) > 0
    assert seen and all(t == 3 for t, _ in seen) and torch.get_num_threads() == before

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".cache" / "moetier").mkdir(parents=True)
    old = {"ram_gbs": 63.0, "cpu_gbs_bfloat16": 25.0, "cpu_gflops_bfloat16": 1800.0}     # no ram_method
    (tmp_path / ".cache" / "moetier" / "bandwidth.json").write_text(json.dumps(old))
    asked = []
    monkeypatch.setattr(bw, "measure", lambda device, keys, *a, **k: (asked.append(set(keys)),
                                                                      {"ram_gbs": 90.0, "ram_method": bw.RAM_METHOD})[1])
    got = bw.bandwidths("cpu")
    assert asked == [{"ram_gbs"}] and got["ram_gbs"] == 90.0 and got["cpu_gbs_bfloat16"] == 25.0
    asked.clear()
    assert bw.bandwidths("cpu")["ram_gbs"] == 90.0 and asked == []            # cached with its method now
