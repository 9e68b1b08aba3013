"""A byte-level BPE tokenizer of exactly the model's vocabulary size, built without training:
256 byte tokens, then merges of byte pairs (then triples) in a fixed order, special tokens at the
ids the model's config names. Written as tokenizer.json (HF `tokenizers`) or as GGUF metadata.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@lru_cache(maxsize=1)
def byte_chars() -> list[str]:
    """GPT-2's byte -> printable unicode map, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


def build_vocab(vocab_size: int, specials: dict[int, str]) -> tuple[list[str], list[tuple[str, str]]]:
    """-> (token string of every id, merges in rank order). Ordinary ids get byte tokens, then
    pair merges, then triple merges; the ids in `specials` get those strings."""
    chars = byte_chars()
    # printable ASCII first, so the common merges look like text
    order = sorted(range(256), key=lambda b: (not (32 <= b < 127), b))
    n_plain = vocab_size - len(specials) - 256
    if n_plain < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small for 256 byte tokens and {len(specials)} specials")
    merges: list[tuple[str, str]] = []
    pairs = [(chars[a], chars[b]) for a in order for b in order]
    merges += pairs[:n_plain]
    if n_plain > len(pairs):
        triples = ((a + b, chars[c]) for a, b in pairs for c in order)
        for m in triples:
            if len(merges) >= n_plain:
                break
            merges.append(m)
    plain = iter(chars + [a + b for a, b in merges])
    tokens = [specials[i] if i in specials else next(plain) for i in range(vocab_size)]
    return tokens, merges


def special_tokens(cfg: dict, special_ids: list[int]) -> dict[int, str]:
    """Names for the config's special ids (ChatML-style for the ones a chat template needs)."""
    eos = cfg.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    out = {}
    for i in special_ids:
        if i == cfg.get("bos_token_id"):
            out[i] = "<|begin_of_text|>" if i not in eos else "<|endoftext|>"
        elif i == cfg.get("pad_token_id") and i not in eos:
            out[i] = "<|pad|>"
        elif eos and i == eos[0]:
            out[i] = "<|im_end|>"
        else:
            out[i] = f"<|special_{i}|>"
    # a chat template needs <|im_start|>: give it the highest free id
    free = max(j for j in range(cfg["vocab_size"]) if j not in out)
    out[free] = "<|im_start|>"
    return out


def write_tokenizer_files(out_dir: Path, cfg: dict, special_ids: list[int]) -> None:
    """tokenizer.json + tokenizer_config.json for a model directory."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    specials = special_tokens(cfg, special_ids)
    tokens, merges = build_vocab(cfg["vocab_size"], specials)
    # specials sit in the BPE vocab at their ids too: added tokens found there keep those ids
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    tk.save(str(out_dir / "tokenizer.json"))
    eos = cfg.get("eos_token_id")
    eos = eos if isinstance(eos, int) else (eos or [None])[0]
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "add_bos_token": False,
            "eos_token": specials.get(eos), "model_max_length": cfg["max_position_embeddings"]}
    if cfg.get("bos_token_id") is not None:
        tcfg["bos_token"] = specials[cfg["bos_token_id"]]
    if cfg.get("pad_token_id") is not None:
        tcfg["pad_token"] = specials[cfg["pad_token_id"]]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))


def gguf_tokenizer_metadata(cfg: dict, special_ids: list[int], pre: str) -> dict:
    """llama.cpp's tokenizer.ggml.* keys for the same vocabulary ('gpt2' = byte-level BPE)."""
    specials = special_tokens(cfg, special_ids)
    tokens, merges = build_vocab(cfg["vocab_size"], specials)
    eos = cfg.get("eos_token_id")
    eos = eos if isinstance(eos, int) else (eos or [None])[0]
    m = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
         "tokenizer.ggml.token_type": [3 if i in specials else 1 for i in range(len(tokens))],
         "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges], "tokenizer.chat_template": CHATML}
    for key, val in (("bos", cfg.get("bos_token_id")), ("eos", eos), ("padding", cfg.get("pad_token_id"))):
        if val is not None:
            m[f"tokenizer.ggml.{key}_token_id"] = val
    return m
