"""Tokenizers stored in GGUF metadata (`tokenizer.ggml.*`), both ways.

GGUF -> moetier: a byte-level BPE (`tokenizer.ggml.model` = "gpt2": tokens, merges, token types,
pre-tokenizer name) is rebuilt as a Hugging Face `tokenizers` object with the pre-tokenizer regexes
of the model family named by `tokenizer.ggml.pre` (as llama.cpp and the original tokenizer.json
define them), then wrapped in moetier's Tokenizer with the chat template and BOS/EOS.
HF directory -> GGUF: the same fields, from tokenizer.json + tokenizer_config.json (`moetier quantize`).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError
from .tokenizer import Tokenizer

# token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK3 = [r"\p{N}{1,3}", "[一-龥\u3040-ゟ゠-ヿ]+",
             r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]

# tokenizer.ggml.pre -> (split regexes, ignore_merges, NFC): as llama.cpp's llama-vocab.cpp groups them
PRE = {
    "qwen2": ([QWEN2], False, True), "deepseek-r1-qwen": ([QWEN2], False, True), "megrez": ([QWEN2], False, True),
    "qwen35": ([QWEN35], False, True),
    "llama-bpe": ([LLAMA3], True, False), "llama3": ([LLAMA3], True, False), "llama-v3": ([LLAMA3], True, False),
    "glm4": ([LLAMA3], True, False), "glm5": ([LLAMA3], True, False), "chatglm-bpe": ([LLAMA3], False, False),
    "deepseek-v3": (DEEPSEEK3, False, False),
    "gpt-4o": ([GPT4O], True, False), "llama4": ([GPT4O], True, False),
    "gpt-2": ([GPT2], False, False), "olmo": ([GPT2], False, False), "default": ([GPT2], False, False),
}

# control tokens llama.cpp ends generation on (besides eos/eot/eom ids)
EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
             "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>", "<|user|>", "<|observation|>", "<EOT>"}


def hf_tokenizer_from_gguf(meta: dict):
    """-> tokenizers.Tokenizer equivalent to the GGUF's byte-level BPE."""
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, \
        pre_tokenizers
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model {kind!r} is not supported yet (moetier reads byte-level BPE, "
                              "tokenizer.ggml.model = 'gpt2'); pass token ids (--prompt-ids) instead of text")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE:
        raise CheckpointError(f"GGUF pre-tokenizer {pre!r} is not supported; moetier knows "
                              f"{', '.join(sorted(PRE))}. Pass token ids (--prompt-ids) instead of text")
    regexes, ignore_merges, nfc = PRE[pre]
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if nfc:
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    tk.add_special_tokens([a for a in added if a.special])
    tk.add_tokens([a for a in added if not a.special])
    return tk


def tokenizer_from_gguf(meta: dict) -> Tokenizer:
    tk = hf_tokenizer_from_gguf(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    special = {}
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        if i is not None and 0 <= i < len(tokens):
            special[key] = tokens[i]
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    return Tokenizer(tk, meta.get("tokenizer.chat_template"), special, add_bos=add_bos, bos_id=bos_id)


def eog_ids(meta: dict) -> set[int]:
    """Token ids that end generation: eos / eot / eom, and the control tokens llama.cpp treats so."""
    ids = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")} - {None}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    ids |= {i for i, t in enumerate(tokens) if t in EOG_TEXTS and i < len(types) and types[i] == CONTROL}
    return ids


# ---------------------------------------------------------------- HF directory -> GGUF fields

def _pre_name(pre_tokenizer: dict | None) -> str:
    """Name the pre-tokenizer of a tokenizer.json by its split regexes (llama.cpp's names)."""
    if not pre_tokenizer:
        raise CheckpointError("tokenizer.json has no pre_tokenizer; only byte-level BPE tokenizers convert to GGUF")
    steps = pre_tokenizer.get("pretokenizers") or [pre_tokenizer]
    regexes = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if not byte_level:
        raise CheckpointError("tokenizer.json is not byte-level BPE; moetier converts only byte-level tokenizers")
    if not regexes and byte_level[0].get("use_regex", True):
        return "gpt-2"
    for name in ("qwen2", "qwen35", "llama-bpe", "deepseek-v3", "gpt-4o", "gpt-2"):
        if regexes == PRE[name][0]:
            return name
    raise CheckpointError(f"tokenizer.json pre-tokenizer regex {regexes!r} matches no pre-tokenizer llama.cpp "
                          f"knows ({', '.join(sorted(PRE))})")


def gguf_tokenizer_fields(directory: Path, vocab_size: int) -> dict:
    """tokenizer.json + tokenizer_config.json -> {GGUF key: value} for a byte-level BPE."""
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        return {}
    tj = json.loads(path.read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise CheckpointError(f"{path}: model type {model.get('type')!r}; only byte-level BPE converts to GGUF")
    cfg_path = Path(directory) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    n = max(vocab_size, max(by_id, default=-1) + 1, max(added, default=-1) + 1)
    tokens, types = [], []
    for i in range(n):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = {t: i for i, t in enumerate(tokens)}

    def token_id(key):
        v = cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return ids.get(v) if isinstance(v, str) else None

    out = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _pre_name(tj.get("pre_tokenizer")),
           "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
           "tokenizer.ggml.add_bos_token": bool(cfg.get("add_bos_token", False))}
    for key, name in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
        if token_id(key) is not None:
            out[f"tokenizer.ggml.{name}_token_id"] = token_id(key)
    template = cfg.get("chat_template")
    if (Path(directory) / "chat_template.jinja").exists():
        template = (Path(directory) / "chat_template.jinja").read_text()
    if isinstance(template, str):
        out["tokenizer.chat_template"] = template
    return out
