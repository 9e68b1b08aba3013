"""Tokenizers in GGUF metadata: a tokenizer.json written into GGUF keys (as `moetier quantize` and
llama.cpp's converter write them) and rebuilt from them encodes and decodes exactly as the
tokenizer.json does, for each pre-tokenizer family moetier knows."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from moetier.weights.gguf_tokenizer import (DEEPSEEK3, GPT4O, LLAMA3, PRE, QWEN2, eog_ids, gguf_tokenizer_fields,
                                            tokenizer_from_gguf)
from test_gguf import build_qwen3_moe, build_tokenizer

TEXTS = ["Hello, world! It's 2026-11-30 and we've got 12345 tokens.", "def f(x):\n    return x ** 2  # square\n",
         "Déjà vu — naïve café, 東京タワー, Привет, мир! 🙂🚀", "   leading spaces\n\n\ttabs and\r\nCRLF  ",
         "<|im_start|>user\nhi<|im_end|>", "3.14159 + 2.71828 = 5.85987; x=[1,2,3]", "I'LL DO IT, you'd've"]


def reference(directory, pre: str) -> Tokenizer:
    """The tokenizer.json, with ignore_merges as llama.cpp applies it for this pre-tokenizer."""
    tj = json.loads((directory / "tokenizer.json").read_text())
    tj["model"]["ignore_merges"] = PRE[pre][1]
    return Tokenizer.from_str(json.dumps(tj))


@pytest.mark.parametrize("pre,regexes", [("qwen2", [QWEN2]), ("llama-bpe", [LLAMA3]), ("deepseek-v3", DEEPSEEK3),
                                         ("gpt-4o", [GPT4O]), ("gpt-2", None)])
def test_gguf_tokenizer_encodes_like_tokenizer_json(tmp_path, pre, regexes):
    if regexes is None:   # plain GPT-2 byte-level (its regex inside ByteLevel)
        from tokenizers import decoders, models, pre_tokenizers, trainers
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        tk.train_from_iterator(TEXTS * 10, trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tk.save(str(tmp_path / "tokenizer.json"))
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    else:
        build_tokenizer(tmp_path, regexes)
    meta = gguf_tokenizer_fields(tmp_path, 320)
    assert meta["tokenizer.ggml.pre"] == pre and len(meta["tokenizer.ggml.tokens"]) == 320
    ours, ref = tokenizer_from_gguf(meta), reference(tmp_path, pre)
    for t in TEXTS:
        ids = ours.encode(t)
        assert ids == ref.encode(t, add_special_tokens=False).ids, t
        assert ours.decode(ids, skip_special=False) == ref.decode(ids, skip_special_tokens=False) == t
    assert ours.decode(ours.encode("<|im_end|>a")) == "a"        # control tokens are special
    assert eog_ids(meta) >= {meta["tokenizer.ggml.eos_token_id"]}


def test_engine_reads_tokenizer_and_template_from_gguf(tmp_path):
    from moetier.commands.quantize import quantize
    from moetier.runtime.engine import Engine
    from moetier.runtime.sampling import SamplingParams
    d = build_qwen3_moe(tmp_path / "model")
    gguf_engine = Engine.load(quantize(d, "F32", tmp_path / "m.gguf"))
    dir_engine = Engine.load(d)
    msgs = [{"role": "user", "content": "Déjà vu? 12345"}]
    assert gguf_engine.tokenizer.apply_chat_template(msgs) == dir_engine.tokenizer.apply_chat_template(msgs)
    assert gguf_engine.encode(messages=msgs) == dir_engine.encode(messages=msgs)
    assert dir_engine.eos_ids <= gguf_engine.eos_ids
    a = gguf_engine.complete("The quick brown", max_tokens=12, params=SamplingParams(temperature=0.0), ignore_eos=True)
    b = dir_engine.complete("The quick brown", max_tokens=12, params=SamplingParams(temperature=0.0), ignore_eos=True)
    assert a.token_ids == b.token_ids and a.text == b.text


def test_unsupported_tokenizers_say_so():
    from moetier.errors import CheckpointError
    with pytest.raises(CheckpointError, match="'llama' is not supported yet"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(CheckpointError, match="pre-tokenizer 'falcon'"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "falcon",
                             "tokenizer.ggml.tokens": ["a"]})
