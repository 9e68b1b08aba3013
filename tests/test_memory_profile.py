"""`moetier profile` -> profile file -> --expert-profile; --save-profile; `run --json` stats.memory."""
import json

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from helpers import tiny_checkpoint
from moetier.cli import main
from moetier.errors import UserError
from moetier.memory.profile import ExpertProfile


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("prof_moe")
    cfg = Qwen3MoeConfig(vocab_size=131, hidden_size=48, intermediate_size=72, moe_intermediate_size=24,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=256)
    tiny_checkpoint(path, Qwen3MoeForCausalLM, cfg, scale=4.0)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield path
    torch.set_num_threads(n)


def test_profile_command_and_reuse(tiny, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('1,2,3,4,5,6,7,8,9,10,11,12\n\n{"prompt_ids": [20, 21, 22, 23]}\n')
    out = tmp_path / "profile.json"
    assert main(["profile", str(tiny), "--prompts", str(prompts), "--out", str(out), "-n", "6", "--temp", "0"]) == 0
    d = json.loads(out.read_text())
    assert d["format"] == "moetier-expert-profile" and d["layers"] == [0, 1, 2] and d["num_experts"] == 16
    tokens = torch.tensor(d["tokens"])
    # 3 layers x k=4 routes per token; each prompt is prefilled, then 5 of its 6 tokens are fed back.
    # A call of <= 8 tokens counts as decode (plan.DECODE_MAX), so the 4-token prompt does too.
    assert tokens.sum() == 3 * 4 * (12 + 5 + 4 + 5)
    assert torch.tensor(d["decode_tokens"]).sum() == 3 * 4 * (5 + 4 + 5)
    assert "of its routes" in capsys.readouterr().out
    # the profile drives placement; run --json reports stats.memory
    rc = main(["run", str(tiny), "--prompt-ids", "5,6,7,8,9,10,11,12,13,14", "-n", "5", "--temp", "0", "--json",
               "--expert-profile", str(out), "--gpu-mem", "100KB", "--ram-mem", "64MB"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    mem = res["stats"]["memory"]
    assert mem["decode_tokens"] == 4 and mem["prefill_tokens"] == 10 and mem["hits"]["gpu"] > 0
    assert set(mem["per_token"]) == {"bytes_read", "ms", "hits", "pcie_experts"} and "prefetch" in mem
    # --save-profile: the counts a run saw, written by Tiers.close (or at exit)
    from moetier.config import EngineConfig
    from moetier.runtime.engine import Engine
    learned = tmp_path / "learned.json"
    eng = Engine.load(tiny, EngineConfig(progress=False, ram_mem=64 << 20, save_profile=str(learned)))
    eng.complete(prompt_ids=list(range(5, 15)), max_tokens=5, ignore_eos=True)
    eng.tiers.close()
    got = ExpertProfile.load(learned, [0, 1, 2], 16)
    assert got.counts["tokens"].sum() == 3 * 4 * (10 + 4)
    assert got.counts["decode_tokens"].sum() == 3 * 4 * 4


def test_profile_mismatch_is_a_user_error(tiny, tmp_path):
    p = ExpertProfile([0, 1], 16)
    p.save(tmp_path / "other.json")
    with pytest.raises(UserError, match="another model"):
        ExpertProfile.load(tmp_path / "other.json", [0, 1, 2], 16)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserError, match="bad JSON"):
        ExpertProfile.load(tmp_path / "bad.json")
    with pytest.raises(UserError, match="needs|pins"):
        from moetier.config import EngineConfig
        from moetier.runtime.engine import Engine
        Engine.load(tiny, EngineConfig(progress=False, cache_policy="static", gpu_mem=1 << 20))
