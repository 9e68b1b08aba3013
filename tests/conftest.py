"""Session fixtures: a tiny random qwen3_moe model with a real (tiny) byte-level BPE tokenizer."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU the Triton kernels are tested in Triton's interpreter. The variable must be set
# before anything imports triton (torch's and transformers' own imports can), so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# --cpu-compile auto would start background builds of the compiled CPU step; tests that want one unset this
os.environ.setdefault("MOETIER_NO_BACKGROUND_BUILD", "1")
# Q4_0 experts' prefill tile is timed per machine under auto: tests fix it (float) and force either themselves
os.environ.setdefault("MOETIER_PREFILL_INT8", "off")

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TEXT = [
    "The quick brown fox jumps over the lazy dog.", "Python is a programming language that lets you work quickly.",
    "Mixture-of-experts models route each token to a few experts.", "Déjà vu: naïve café, 東京, emoji 🙂 and ₿.",
    "def f(x):\n    return x * 2  # comment", "Numbers 12345 and 3.14159, dates 2026-11-30.",
]


def build_tokenizer(directory: Path, vocab_size: int = 300) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(TEXT * 20, trainer)
    tk.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "add_bos_token": False, "chat_template": CHATML}))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random qwen3_moe checkpoint (vocab 300) with tokenizer and chat template."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from helpers import tiny_checkpoint
    d = tmp_path_factory.mktemp("tiny_qwen3_moe")
    cfg = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                         eos_token_id=2)
    tiny_checkpoint(d, Qwen3MoeForCausalLM, cfg, scale=4.0)
    build_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def llama_cpp_dir() -> Path | None:
    """llama.cpp sources from the llama-cpp-python sdist (unpacked by .ci/run into .data/), if present."""
    root = Path(os.environ.get("MOETIER_LLAMA_CPP", Path(__file__).parent.parent / ".data" / "llama.cpp"))
    for cand in [root, *root.glob("*/vendor/llama.cpp"), *root.glob("vendor/llama.cpp")]:
        if (cand / "convert_hf_to_gguf.py").exists():
            return cand
    return None


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`): on
    a loaded 2-core machine OpenMP barriers made tiny models ~80x slower (14 s vs 0.17 s for a dense
    reference). Bit-identity holds at any fixed thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
