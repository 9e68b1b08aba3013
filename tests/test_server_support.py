"""Support for the server tests (no tests here): a tiny random qwen3_moe model with a tiny
byte-level BPE tokenizer and a ChatML template, and a real `moetier serve` subprocess on a
free loopback port."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

API_KEY = "sk-test-moetier"
ALIAS = "tiny-moe"

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts.",
    "Hello! How are you today? I am fine, thank you.",
    "Python is a programming language; JSON has objects, arrays, strings and numbers.",
    '{"name": "moetier", "tiers": ["gpu", "ram", "ssd"], "fast": true, "count": 42}',
    "def add(a, b):\n    return a + b\n",
    "Experts live on the GPU, in RAM, or on the SSD, and each is computed where its bytes are.",
]

# ChatML; `enable_thinking` opens a reasoning block in the generation prompt (as R1-style templates do)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}")


def build_tokenizer(path: Path) -> int:
    """Train a byte-level BPE on SENTENCES into path/tokenizer.json; -> vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(SENTENCES * 4, trainer)
    tk.add_tokens(["<think>", "</think>"])  # added but not special: they stay in decoded text, as in Qwen3
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False}))
    return tk.get_vocab_size(with_added_tokens=True)


def build_model(path: Path, max_positions: int = 512) -> Path:
    """A tiny random Qwen3-MoE checkpoint plus tokenizer in `path` (built once, then reused)."""
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from helpers import tiny_checkpoint
    vocab = build_tokenizer(path)
    from tokenizers import Tokenizer
    eos = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id("<|im_end|>")
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=48, intermediate_size=72, moe_intermediate_size=24,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=7, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
                         max_position_embeddings=max_positions, rope_theta=1000.0, eos_token_id=eos,
                         tie_word_embeddings=False)
    tiny_checkpoint(path, Qwen3MoeForCausalLM, cfg, scale=4.0)
    sharpen_head(path, 6.0)
    return path


def sharpen_head(path: Path, factor: float) -> None:
    """Scale lm_head so greedy choices have clear margins (float noise never flips an argmax)."""
    from safetensors.torch import load_file, save_file
    f = path / "model.safetensors"
    sd = load_file(str(f))
    sd["lm_head.weight"] = sd["lm_head.weight"] * factor
    save_file(sd, str(f), metadata={"format": "pt"})


def model_dir(tmp_path_factory) -> Path:
    """One model directory for the whole pytest session (every server test module shares it)."""
    return build_model(tmp_path_factory.getbasetemp() / "server-tiny-moe")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m moetier serve MODEL ...` in a subprocess; stopped by stop()."""

    def __init__(self, model: Path, *extra: str, api_key: str | None = API_KEY, log: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "moetier", "serve", str(model), "--port", str(self.port),
               "--model-alias", ALIAS, "--threads", "1", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(log, "wb") if log else subprocess.DEVNULL
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready()

    def wait_ready(self, timeout: float = 60.0) -> None:
        import urllib.request
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moetier serve exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError("moetier serve did not become ready")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        from openai import OpenAI
        kw = {"api_key": self.api_key or "none", "max_retries": 0, "timeout": 60, **kw}
        return OpenAI(base_url=self.url + "/v1", **kw)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()


def start_server(tmp_path_factory, *extra: str, api_key: str | None = API_KEY) -> Server:
    model = model_dir(tmp_path_factory)
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    try:
        return Server(model, *extra, api_key=api_key, log=log)
    except RuntimeError as e:
        pytest.fail(f"{e}; server log:\n{log.read_text()[-4000:]}")


def artifact(path: Path) -> None:
    """Copy a test artifact (screenshot, log) to $MOETIER_ARTIFACTS when it is set."""
    dest = os.environ.get("MOETIER_ARTIFACTS")
    if dest:
        import shutil
        Path(dest).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(dest) / path.name)
