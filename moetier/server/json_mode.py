"""response_format json_object: constrain decoding so the output is one JSON object.

A byte-level state machine for JSON (RFC 8259) knows, after any prefix, which bytes may come
next. Before each token is sampled, every token whose bytes would leave the viable prefixes of
JSON is masked to -inf; once the object closes only EOS remains. Masks are cached per state.
If generation stops early (max_tokens, a stop string, cancel), `closing_suffix` says what to
append so the returned content still parses.

A state is a hashable tuple (mode, stack, aux): stack is a str of open brackets ("{[{"),
aux is the mode's detail (whitespace run, key flag, hex digits left, literal rest).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

# modes
START, OBJ_FIRST, OBJ_KEY, COLON, VALUE, ARR_FIRST, AFTER, STR, ESC, UHEX, LIT, DONE = range(12)
N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP = range(12, 20)
NUM_DONE = {N_ZERO, N_INT, N_FRAC, N_EXP}          # a number may end here
WS = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrt')
LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
MAX_WS = 16        # whitespace run allowed between tokens (no endless blank loops)
MAX_DEPTH = 32
INITIAL = (START, "", 0)


def advance(state: tuple, b: int) -> tuple | None:
    """The state after byte b, or None when b cannot follow."""
    mode, stack, aux = state
    if mode == STR:
        if b == 0x22:
            return (COLON, stack, 0) if aux else (_after(stack))
        if b == 0x5C:
            return (ESC, stack, aux)
        return None if b < 0x20 else state
    if mode == ESC:
        if b in ESCAPES:
            return (STR, stack, aux)
        return (UHEX, stack, (aux, 4)) if b == 0x75 else None
    if mode == UHEX:
        if b not in HEX:
            return None
        key, left = aux
        return (STR, stack, key) if left == 1 else (UHEX, stack, (key, left - 1))
    if mode == LIT:
        if b != aux[0]:
            return None
        return (LIT, stack, aux[1:]) if len(aux) > 1 else _after(stack)
    if mode >= N_MINUS:
        nxt = _number(mode, b)
        if nxt is not None:
            return (nxt, stack, 0)
        return advance(_after(stack), b) if mode in NUM_DONE else None
    if b in WS:
        return None if mode == DONE or aux >= MAX_WS else (mode, stack, aux + 1)
    if mode == START:
        return (OBJ_FIRST, "{", 0) if b == 0x7B else None
    if mode in (OBJ_FIRST, OBJ_KEY):
        if b == 0x22:
            return (STR, stack, 1)
        return _close(stack) if b == 0x7D and mode == OBJ_FIRST else None
    if mode == COLON:
        return (VALUE, stack, 0) if b == 0x3A else None
    if mode in (VALUE, ARR_FIRST):
        if b == 0x5D and mode == ARR_FIRST:
            return _close(stack)
        return _value_start(stack, b)
    if mode == AFTER:
        top = stack[-1]
        if b == 0x2C:
            return (OBJ_KEY, stack, 0) if top == "{" else (VALUE, stack, 0)
        if (b == 0x7D and top == "{") or (b == 0x5D and top == "["):
            return _close(stack)
    return None


def _after(stack: str) -> tuple:
    return (AFTER, stack, 0) if stack else (DONE, "", 0)


def _close(stack: str) -> tuple:
    return _after(stack[:-1])


def _value_start(stack: str, b: int) -> tuple | None:
    if b in (0x7B, 0x5B):
        if len(stack) >= MAX_DEPTH:
            return None
        return (OBJ_FIRST, stack + "{", 0) if b == 0x7B else (ARR_FIRST, stack + "[", 0)
    if b == 0x22:
        return (STR, stack, 0)
    if b == 0x2D:
        return (N_MINUS, stack, 0)
    if b in DIGITS:
        return (N_ZERO if b == 0x30 else N_INT, stack, 0)
    if b in LITERALS:
        return (LIT, stack, LITERALS[b])
    return None


def _number(mode: int, b: int) -> int | None:
    digit = b in DIGITS
    if mode == N_MINUS:
        return (N_ZERO if b == 0x30 else N_INT) if digit else None
    if mode in (N_ZERO, N_INT, N_FRAC):
        if digit and mode != N_ZERO:
            return mode
        if b == 0x2E and mode != N_FRAC:
            return N_DOT
        return N_E if b in (0x65, 0x45) else None
    if mode == N_DOT:
        return N_FRAC if digit else None
    if mode == N_E:
        return N_ESIGN if b in (0x2B, 0x2D) else (N_EXP if digit else None)
    if mode in (N_ESIGN, N_EXP):
        return N_EXP if digit else None
    return None


def walk(state: tuple | None, data: bytes) -> tuple | None:
    for b in data:
        if state is None:
            return None
        state = advance(state, b)
    return state


def closing_suffix(state: tuple) -> str:
    """The shortest text that turns a viable prefix in `state` into complete JSON."""
    mode, stack, aux = state
    tail = {START: "{}", OBJ_KEY: '"":null', COLON: ":null", VALUE: "null",
            N_MINUS: "0", N_DOT: "0", N_E: "0", N_ESIGN: "0"}.get(mode, "")
    if mode == STR:
        tail = '":null' if aux else '"'
    elif mode == ESC:
        tail = 'n":null' if aux else 'n"'
    elif mode == UHEX:
        tail = "0" * aux[1] + ('":null' if aux[0] else '"')
    elif mode == LIT:
        tail = aux.decode()
    return tail + "".join("}" if c == "{" else "]" for c in reversed(stack))


def complete(text: str) -> str:
    """Make finished output parse: append the closing suffix (or give "{}" if it is not a JSON prefix)."""
    state = walk(INITIAL, text.encode("utf-8"))
    if state is None:
        return "{}"
    return text + closing_suffix(state)


class JsonGrammar:
    """Allowed-token sets per state, for one vocabulary (a TokenTable's bytes)."""

    def __init__(self, bytes_of: list[bytes | None], special: set[int], cache_size: int = 128):
        self.by_first: dict[int, list[tuple[int, bytes]]] = {}
        self.plain_by_first: dict[int, list[int]] = {}  # tokens that stay inside a string whatever they hold
        for i, data in enumerate(bytes_of):
            if not data or i in special:
                continue
            if all(b >= 0x20 and b not in (0x22, 0x5C) for b in data):
                self.plain_by_first.setdefault(data[0], []).append(i)
            else:
                self.by_first.setdefault(data[0], []).append((i, data[1:]))
        self.plain_bytes = {b: [(i, bytes_of[i][1:]) for i in ids] for b, ids in self.plain_by_first.items()}
        self.vocab_size = len(bytes_of)
        self.cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()   # (state, device) -> mask [V]
        self.cache_size = cache_size

    def allowed(self, state: tuple, device="cpu") -> torch.Tensor:
        """Mask [V] bool of the tokens allowed in `state`, on `device` (cached per state)."""
        key = (state, str(device))
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[torch.tensor(self.allowed_ids(state), dtype=torch.long)] = True
        self.cache[key] = mask = mask.to(device)
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return mask

    def allowed_ids(self, state: tuple) -> list[int]:
        ids: list[int] = []
        for b in range(256):
            s1 = advance(state, b)
            if s1 is None:
                continue
            if s1[0] == STR:
                ids.extend(self.plain_by_first.get(b, ()))   # the rest stays inside the string: no walk
            else:
                ids.extend(i for i, rest in self.plain_bytes.get(b, ()) if walk(s1, rest) is not None)
            ids.extend(i for i, rest in self.by_first.get(b, ()) if walk(s1, rest) is not None)
        return ids


class JsonConstraint:
    """A logits processor for one request: follows the generated tokens and masks the rest."""

    def __init__(self, grammar: JsonGrammar, bytes_of: list[bytes | None], eos_ids: set[int]):
        self.grammar, self.bytes_of = grammar, bytes_of
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
        self.state: tuple | None = INITIAL
        self.seen = 0

    def __call__(self, out: list[int], logits: torch.Tensor) -> torch.Tensor:
        """out: the tokens generated so far; logits [V] -> logits with forbidden tokens at -inf."""
        for tok in out[self.seen:]:
            data = self.bytes_of[tok] if tok < len(self.bytes_of) else None
            self.state = walk(self.state, data) if data else None
        self.seen = len(out)
        if self.state is None:
            return logits                     # cannot happen when every token went through the mask
        if self.state[0] == DONE:
            masked = torch.full_like(logits, float("-inf"))
            eos = self.eos.to(logits.device)
            masked[eos] = logits[eos]
            return masked
        mask = self.grammar.allowed(self.state, logits.device)
        if not bool(mask.any()):
            return logits
        return logits.masked_fill(~mask, float("-inf"))
