"""Tokenizer (HF `tokenizers`), chat template (Jinja, rendered as transformers renders it) and
incremental detokenisation that never emits a broken UTF-8 character."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from ..errors import CheckpointError, UserError

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    def __init__(self, tk, chat_template: str | None = None, special: dict | None = None,
                 add_bos: bool = False, bos_id: int | None = None):
        self.tk = tk
        self.chat_template = chat_template
        self.special = special or {}      # bos_token / eos_token ... -> string, for the template
        self.add_bos = add_bos            # prepend BOS when encoding a raw prompt
        self.bos_id = bos_id
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self._special_ids = {t.content for t in tk.get_added_tokens_decoder().values() if t.special} \
            if hasattr(tk, "get_added_tokens_decoder") else set()

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path}: missing; moetier needs the model's tokenizer.json "
                                  "(or pass token ids with --prompt-ids)")
        try:
            tk = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise CheckpointError(f"{path}: cannot be read as a tokenizer ({e})") from None
        cfg = _read_json(d / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()
        elif (d / "chat_template.json").exists():
            template = _read_json(d / "chat_template.json").get("chat_template", template)
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        special = {}
        for k in SPECIAL_KEYS:
            v = cfg.get(k)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                special[k] = v
        bos = special.get("bos_token")
        bos_id = tk.token_to_id(bos) if bos else None
        return cls(tk, template, special, add_bos=bool(cfg.get("add_bos_token", False)) and bos_id is not None,
                   bos_id=bos_id)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tk.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, **kwargs) -> str:
        if not self.chat_template:
            raise UserError("this model has no chat template (tokenizer_config.json or chat_template.jinja); "
                            "use a plain prompt instead of chat messages")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        for m in messages:  # reasoning aliases, as transformers passes them to templates
            r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
            if r is not None:
                m.setdefault("thinking", r)
                m["reasoning_content"] = r
        return _compile(self.chat_template).render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **{**self.special, **kwargs})

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special=False)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


@lru_cache(maxsize=16)
def _compile(template: str):
    """The same Jinja environment transformers' apply_chat_template uses."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):  # `{% generation %}` blocks render their body unchanged
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise UserError(f"the model's chat template does not parse: {e.message} (line {e.lineno})") from None


class Detokenizer:
    """Turns a growing list of token ids into text deltas; holds back bytes of an unfinished
    UTF-8 character (decoded as U+FFFD) until the token that completes it arrives."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tok = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix = 0   # decode from here (a few tokens back, for context-dependent spacing)
        self.read = 0     # text of ids[prefix:read] was already emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip_special)
        after = self.tok.decode(self.ids[self.prefix:], self.skip_special)
        if after.endswith("\ufffd") or len(after) < len(before) or not after.startswith(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is still held back at the end (possibly an incomplete character)."""
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip_special)
        after = self.tok.decode(self.ids[self.prefix:], self.skip_special)
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if after.startswith(before) else ""
