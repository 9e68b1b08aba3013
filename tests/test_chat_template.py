"""Chat templates render byte-identical to transformers' apply_chat_template, and tokenize identically.

Real templates come from llama.cpp's models/templates (inside the llama-cpp-python source package,
unpacked by .ci/run into .data/llama.cpp; the tests skip without it)."""
import json
import shutil

import pytest
from transformers import PreTrainedTokenizerFast

from moetier.weights.tokenizer import Tokenizer

TEMPLATES = ["Qwen-Qwen3-0.6B", "Qwen3-Coder", "Qwen3.5-4B", "deepseek-ai-DeepSeek-V3.1", "GLM-4.6",
             "openai-gpt-oss-120b", "moonshotai-Kimi-K2", "meta-llama-Llama-3.1-8B-Instruct"]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello! What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another, with ünïcödé 東京?"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "2+2 is 4."},
     {"role": "user", "content": "And 3+3?"}],
]


@pytest.fixture(scope="module")
def template_dir(llama_cpp_dir):
    if llama_cpp_dir is None:
        pytest.skip("llama.cpp templates not unpacked in .data/llama.cpp (see .ci/run)")
    return llama_cpp_dir / "models" / "templates"


def make_tokenizer(tmp_path, tiny_model_dir, template: str):
    d = tmp_path / "tok"
    d.mkdir(exist_ok=True)
    shutil.copy(tiny_model_dir / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    cfg.update(chat_template=template, bos_token="<|endoftext|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ref = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=template,
                                  eos_token=cfg["eos_token"], pad_token=cfg["pad_token"], bos_token="<|endoftext|>")
    return Tokenizer.from_dir(d), ref


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_renders_like_transformers(tmp_path, tiny_model_dir, template_dir, name, conv, gen_prompt):
    path = template_dir / f"{name}.jinja"
    if not path.exists():
        pytest.skip(f"{path.name} not in this llama.cpp version")
    ours, ref = make_tokenizer(tmp_path, tiny_model_dir, path.read_text())
    msgs = CONVERSATIONS[conv]
    try:
        want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
    except Exception as e:  # the template itself rejects this conversation shape
        with pytest.raises(Exception):
            ours.apply_chat_template(msgs, add_generation_prompt=gen_prompt)
        return
    got = ours.apply_chat_template(msgs, add_generation_prompt=gen_prompt)
    assert got == want
    assert ours.encode_chat(msgs, gen_prompt) == ref.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=gen_prompt, return_dict=False)
