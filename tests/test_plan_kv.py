"""`moetier plan` counts the cache the engine allocates (session_cache): --kv-dtype int8 (int8 + an fp16
scale per 32 values), --kv-offload (KV in RAM, out of the GPU budget), and for Qwen3-Next's DeltaNet
layers a recurrent state (conv + ssm) instead of a KV cache."""
import pytest
import test_memory_plan as mp
import torch
from helpers import tiny_checkpoint
from test_arch_qwen3_next import next_config
from test_memory_plan import EXPERT, GiB, plan_json
from transformers import Qwen3NextForCausalLM

from moetier.config import EngineConfig
from moetier.memory.plan import inspect, make_placement
from moetier.runtime.kv_cache import KVCache, RecurrentState, session_cache
from moetier.weights.loader import load_model

CTX = 32768
qwen30b, no_reads = mp.qwen30b, mp.no_reads   # fixtures: the Qwen3-30B-A3B-shaped header, no reads


def allocated(model, ctx: int, dtype, kv_dtype: str, kinds=(KVCache,)) -> int:
    """Bytes session_cache really allocates on the CPU for `ctx` positions (state entries: fixed size)."""
    return sum(c.nbytes for c in session_cache(model, ctx, dtype, "cpu", kv_dtype).layers if isinstance(c, kinds))


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_qwen3_30b_kv_at_32k(qwen30b, no_reads, capsys, kv_dtype):
    path, _ = qwen30b
    rc, p = plan_json(capsys, path, "--device", "cuda", "--gpu-mem", "24GiB", "--ram-mem", "64GiB",
                      "--ctx", CTX, "--kv-dtype", kv_dtype)
    assert rc == 0 and p["state_bytes"] == 0 and p["kv_tier"] == "device"
    _, model, _, _ = inspect(path)             # the meta model: its caches at 512 positions, scaled up
    want = allocated(model, 512, torch.bfloat16, kv_dtype) * (CTX // 512)
    assert p["kv_bytes"] == pytest.approx(want, rel=0.05)
    bf16 = 48 * CTX * 2 * 4 * 128 * 2                                       # 3 GiB: 48 layers, K + V, 4 x 128
    assert p["kv_bytes"] == pytest.approx(bf16 if kv_dtype == "bf16" else bf16 * 1.0625 / 2, rel=1e-6)


def test_kv_offload_leaves_the_gpu_budget_to_experts(qwen30b, no_reads, capsys):
    path, _ = qwen30b
    args = [path, "--device", "cuda", "--gpu-mem", "24GiB", "--ram-mem", "32GiB", "--ctx", CTX]   # a partial bank
    _, on_gpu = plan_json(capsys, *args)
    _, off = plan_json(capsys, *args, "--kv-offload")
    assert off["kv_tier"] == "ram" and off["kv_bytes"] == on_gpu["kv_bytes"] == 3 * GiB
    gained = off["tiers"]["gpu"]["slots"] - on_gpu["tiers"]["gpu"]["slots"]
    assert abs(gained - 3 * GiB // EXPERT) <= 1                              # the 3 GiB hold experts instead
    lost = on_gpu["tiers"]["ram"]["slots"] - off["tiers"]["ram"]["slots"]   # and the bank pays for the KV
    assert abs(lost - 3 * GiB // EXPERT) <= 1


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, "auto"), (torch.bfloat16, "int8")])
def test_qwen3_next_counts_recurrent_state(tmp_path, dtype, kv_dtype):
    tiny_checkpoint(tmp_path, Qwen3NextForCausalLM, next_config(), scale=4.0)
    ctx = 4096
    pl = make_placement(tmp_path, EngineConfig(ram_mem=1 * GiB, kv_dtype=kv_dtype), "cpu", dtype, ctx)
    model = load_model(tmp_path)[0]
    state = allocated(model, ctx, dtype, kv_dtype, RecurrentState)
    # 3 DeltaNet layers: conv [K-1, 2 * 2 * 12 + 4 * 10] in dtype + ssm [4, 12, 10] fp32, whatever ctx
    assert state == 3 * (3 * 88 * dtype.itemsize + 4 * 12 * 10 * 4)
    assert pl.state_bytes == pytest.approx(state, rel=0.05)
    # 2 attention layers: K + V of 1 x 24 per position
    assert pl.kv_bytes == pytest.approx(allocated(model, ctx, dtype, kv_dtype), rel=0.05)
    assert pl.summary()["state_bytes"] == pl.state_bytes


def test_plan_text_shows_the_recurrent_state(tmp_path, capsys):
    tiny_checkpoint(tmp_path, Qwen3NextForCausalLM, next_config(), scale=4.0)
    from moetier.cli import main
    assert main(["plan", str(tmp_path), "--ctx", "4096", "--ram-mem", "1GiB"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("recurrent state"))
    pl = make_placement(tmp_path, EngineConfig(ram_mem=1 * GiB), "cpu", torch.float32, 4096)
    assert pl.state_bytes > 0 and row.split()[-2] == f"{pl.state_bytes / 1024:.2f}" and row.split()[-1] == "KiB"
