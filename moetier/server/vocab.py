"""The bytes each token id stands for: logprobs' `bytes` fields and the JSON constraint need them.

Byte-level BPE (GPT-2 / Qwen / Llama-3) spells bytes as printable characters; SentencePiece uses
`<0xNN>` byte tokens and `▁` for spaces. Added tokens are their own text.
"""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenTable:
    """bytes_of[id] (None for ids without text) and which ids are special, for one tokenizer."""

    def __init__(self, tokenizer, vocab_size: int):
        """tokenizer: moetier's Tokenizer, or None (a model served by token ids: no text at all)."""
        self.tokenizer = tokenizer
        dec = _byte_decoder()
        tk = tokenizer.tk if tokenizer is not None else None
        added = tk.get_added_tokens_decoder() if hasattr(tk, "get_added_tokens_decoder") else {}
        self.special = {i for i, t in added.items() if t.special}
        self.bytes_of: list[bytes | None] = []
        for i in range(vocab_size if tokenizer is not None else 0):
            if i in added:
                self.bytes_of.append(added[i].content.encode())
                continue
            tok = tokenizer.id_to_token(i)
            if tok is None:
                self.bytes_of.append(None)
            elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                self.bytes_of.append(bytes([int(tok[3:5], 16)]))
            elif all(c in dec for c in tok):
                self.bytes_of.append(bytes(dec[c] for c in tok))
            else:
                self.bytes_of.append(tok.replace("\u2581", " ").encode())

    def text(self, token_id: int) -> str:
        """The token as text (partial UTF-8 shows as U+FFFD), special tokens included."""
        b = self.bytes_of[token_id] if 0 <= token_id < len(self.bytes_of) else None
        return b.decode("utf-8", errors="replace") if b is not None else ""

    def byte_list(self, token_id: int) -> list[int]:
        b = self.bytes_of[token_id] if 0 <= token_id < len(self.bytes_of) else None
        return list(b) if b is not None else []

