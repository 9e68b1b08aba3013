"""The embedded default model (moetier/assets/default): shipped files, tokenizer, English output, CLI JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moetier.config import EngineConfig
from moetier.runtime.engine import Engine, default_model_path
from moetier.runtime.sampling import SamplingParams
from moetier.weights.tokenizer import Tokenizer

ASSETS = default_model_path()
ENGLISH = {"the", "a", "an", "is", "are", "of", "and", "to", "in", "it", "that", "this", "be", "for", "with",
           "can", "which", "as", "by", "on", "not", "or", "language", "program", "programs", "programming",
           "python", "code", "module", "function", "used", "use", "there", "was", "has", "have"}


@pytest.fixture(scope="module")
def engine():
    return Engine.load(config=EngineConfig(device="cpu", progress=False))


def test_files_are_small_and_sharded():
    shards = sorted(ASSETS.glob("model-*-of-*.safetensors"))
    assert shards and (ASSETS / "model.safetensors.index.json").exists()
    index = json.loads((ASSETS / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert all(s.stat().st_size <= 15 * 2**20 for s in shards), "a shard is over 15 MiB"
    assert sum(s.stat().st_size for s in shards) <= 30_000_000
    cfg = json.loads((ASSETS / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] >= 8 and cfg["num_experts_per_tok"] == 2
    gen = json.loads((ASSETS / "generation_config.json").read_text())
    assert gen["eos_token_id"] and 0 < gen["temperature"] <= 1 and gen["top_k"] > 0


def test_tokenizer_round_trips_and_has_chatml():
    tok = Tokenizer.from_dir(ASSETS)
    text = "naïve café 東京 🙂\n\tdef f(x):  return x**2  # done\r\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.token_to_id("<|im_start|>") is not None and tok.token_to_id("<|im_end|>") is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert (ASSETS / "chat_template.jinja").read_text().strip() == tok.chat_template.strip()


def test_greedy_output_is_english(engine):
    done = engine.complete("The Python programming language", max_tokens=20, params=SamplingParams(temperature=0.0))
    text = done.text
    assert len(done.token_ids) >= 10, f"stopped too early: {text!r}"
    letters = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert letters >= 0.75 * len(text), f"not mostly letters and spaces: {text!r}"
    words = {w.strip(".,;:!?\"'()-").lower() for w in text.split()}
    assert len(words & ENGLISH) >= 3, f"too few English words in {text!r}"


def test_run_json_cli():
    out = subprocess.run([sys.executable, "-m", "moetier", "run", "--json", "-n", "8"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout.strip())       # exactly one JSON object on stdout
    assert {"text", "token_ids", "prompt_token_ids", "finish_reason", "stats"} <= obj.keys()
    assert {"prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s", "ttft_s"} <= obj["stats"].keys()
    assert obj["stats"]["generated_tokens"] == len(obj["token_ids"]) <= 8
    assert isinstance(obj["text"], str) and obj["prompt_token_ids"]
