"""--prompt-cache DIR: snapshots on disk let a new engine (a new process) resume a prompt from the
longest saved prefix, with the same greedy tokens as computing from scratch; --snapshot-every N
snapshots a recurrent (Qwen3-Next) model's state inside long prompts."""
import argparse
import os

import pytest
import torch
from helpers import tiny_checkpoint
from test_arch_qwen3_next import VOCAB, next_config, slow_decay
from transformers import Qwen3NextForCausalLM

from moetier import EngineConfig, SamplingParams
from moetier.commands.common import add_model_args, engine_config
from moetier.runtime.engine import Engine
from moetier.runtime.generate import Done
from moetier.runtime.prompt_cache import PromptCache

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_next_pc")
    tiny_checkpoint(path, Qwen3NextForCausalLM, next_config(), scale=4.0, init=slow_decay)
    return path


def load(path, **kw) -> Engine:
    return Engine.load(path, EngineConfig(device="cpu", max_context=256, progress=False, **kw))


def ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, prompt, session=None, n=6) -> Done:
    *_, done = engine.generate(prompt_ids=prompt, max_tokens=n, params=GREEDY, session=session, ignore_eos=True)
    return done


def files(d) -> list[int]:
    return sorted(int(p.name.split("-")[0]) for p in d.glob("*.pt"))


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_moe"])
def test_new_engine_resumes_from_disk(kind, next_dir, tiny_model_dir, tmp_path):
    path, vocab = (next_dir, VOCAB) if kind == "qwen3_next" else (tiny_model_dir, 300)
    p1 = ids(30, 1, vocab)
    d1 = run(load(path, prompt_cache=str(tmp_path)), p1)
    assert d1.stats["cached_tokens"] == 0 and files(tmp_path) == [30]
    p2 = p1 + ids(9, 2, vocab)
    d2 = run(load(path, prompt_cache=str(tmp_path)), p2)   # a new engine: nothing in memory
    assert d2.stats["cached_tokens"] == 30
    scratch = run(load(path), p2)
    assert scratch.stats["cached_tokens"] == 0
    assert d2.token_ids == scratch.token_ids
    # the same prompt again: resumes from its own snapshot, all but the last token cached
    d3 = run(load(path, prompt_cache=str(tmp_path)), p2)
    assert d3.stats["cached_tokens"] == 30 and d3.token_ids == scratch.token_ids
    assert files(tmp_path) == [30, 39]


def test_snapshot_every_resumes_before_the_divergence(next_dir, tmp_path):
    engine = load(next_dir, snapshot_every=16)
    s = engine.new_session()
    long = ids(100, 3)
    run(engine, long, s)
    assert [len(t) for t, _ in s.periodic] == [16, 32, 48, 64, 80, 96]
    assert all(len(t) == snap["length"] and t == long[:len(t)] for t, snap in s.periodic)
    edited = long[:70] + ids(20, 4)            # diverges at 70: the snapshot at 64 is the last below
    d = run(engine, edited, s)
    assert d.stats["cached_tokens"] == 64
    assert d.token_ids == run(load(next_dir), edited).token_ids
    assert len(s.periodic) <= s.MAX_PERIODIC and len(s.snapshots) <= s.MAX_SNAPSHOTS
    # without the option the same edit starts over
    plain = load(next_dir)
    s2 = plain.new_session()
    run(plain, long, s2)
    assert run(plain, edited, s2).stats["cached_tokens"] == 0


def test_snapshot_every_with_disk_serves_a_new_engine(next_dir, tmp_path):
    long = ids(60, 5)
    run(load(next_dir, snapshot_every=16, prompt_cache=str(tmp_path)), long)
    assert files(tmp_path) == [16, 32, 48, 60]
    edited = long[:40] + ids(10, 6)
    d = run(load(next_dir, prompt_cache=str(tmp_path)), edited)
    assert d.stats["cached_tokens"] == 32
    assert d.token_ids == run(load(next_dir), edited).token_ids


def test_a_file_from_another_model_is_ignored(next_dir, tiny_model_dir, tmp_path):
    prompt = ids(20, 7)                        # valid ids for both vocabularies
    run(load(tiny_model_dir, prompt_cache=str(tmp_path)), prompt)
    assert files(tmp_path) == [20]
    d = run(load(next_dir, prompt_cache=str(tmp_path)), prompt + ids(5, 8))
    assert d.stats["cached_tokens"] == 0
    # nor is a file of the same model in another dtype
    d = run(load(tiny_model_dir, prompt_cache=str(tmp_path), dtype="bfloat16"), prompt + ids(5, 8))
    assert d.stats["cached_tokens"] == 0


def test_the_byte_budget_evicts_the_oldest_files(tmp_path):
    def snap(n):
        return {"length": n, "layers": [(torch.zeros(n, 256), torch.zeros(n, 256))]}
    probe = PromptCache(tmp_path / "probe", "m", 1 << 40)
    probe.save([1] * 10, snap(10))
    size = next((tmp_path / "probe").glob("*.pt")).stat().st_size
    pc = PromptCache(tmp_path / "pc", "m", int(size * 2.5))   # room for two files
    for t, n in enumerate([10, 11, 12, 13]):
        pc.save(list(range(n)), snap(10))
        f = pc.path(list(range(n)))
        os.utime(f, (1000 + t, 1000 + t))     # distinct mtimes, in order of writing
    assert files(tmp_path / "pc") == [12, 13]
    assert pc.load(list(range(20)), 0, 19)["length"] == 10      # the file of 13 tokens
    assert pc.load(list(range(12)) + [99] * 5, 0, 16) is not None
    assert pc.load([5] * 20, 0, 19) is None


def test_cli_flags_reach_the_engine_config():
    p = argparse.ArgumentParser()
    add_model_args(p)
    cfg = engine_config(p.parse_args(["--snapshot-every", "512", "--prompt-cache", "/tmp/pc",
                                      "--prompt-cache-mem", "1GiB"]))
    assert (cfg.snapshot_every, cfg.prompt_cache, cfg.prompt_cache_mem) == (512, "/tmp/pc", 1 << 30)
    assert engine_config(p.parse_args([])).prompt_cache_mem == 2 << 30
