"""Split a reasoning model's output into reasoning_content (inside <think>...</think>) and content.

The opening tag counts only at the start of the output (or is implied when the chat template
already opened it in the prompt); streamed text is split as it arrives, holding back a tail that
could still become a tag.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_in_prompt(prompt_text: str) -> bool:
    """Did the chat template open the reasoning block itself (R1-style `...assistant\\n<think>\\n`)?"""
    return prompt_text.rstrip().endswith(OPEN)


class ReasoningSplitter:
    def __init__(self, thinking: bool = False):
        self.mode = "reasoning" if thinking else "start"   # start -> (reasoning ->) content
        self.buf = ""
        self.strip = thinking        # drop whitespace at the start of the current part

    def feed(self, delta: str) -> list[tuple[str, str]]:
        """-> [(kind, text)] with kind "reasoning" or "content", ready to send."""
        self.buf += delta
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.mode == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.mode, self.strip = head[len(OPEN):], "reasoning", True
                    continue
                if not head or OPEN.startswith(head):
                    break                    # could still be the opening tag
                self.mode = "content"
                continue
            if self.mode == "reasoning":
                i = self.buf.find(CLOSE)
                if i >= 0:
                    self._emit(out, "reasoning", self.buf[:i])
                    self.buf, self.mode, self.strip = self.buf[i + len(CLOSE):], "content", True
                    continue
                keep = _partial_tail(self.buf, CLOSE)
                self._emit(out, "reasoning", self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            self._emit(out, "content", self.buf)
            self.buf = ""
        return out

    def flush(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        kind = "reasoning" if self.mode == "reasoning" else "content"
        self._emit(out, kind, self.buf)
        self.buf = ""
        return out

    def _emit(self, out: list, kind: str, text: str) -> None:
        if self.strip:
            text = text.lstrip()
            if not text:
                return
            self.strip = False
        if text:
            out.append((kind, text))


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split(text: str, thinking: bool = False) -> tuple[str | None, str]:
    """Whole text -> (reasoning or None, content)."""
    s = ReasoningSplitter(thinking)
    parts = s.feed(text) + s.flush()
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    content = "".join(t for k, t in parts if k == "content")
    saw = thinking or text.lstrip().startswith(OPEN)
    return (reasoning if saw else None), content
