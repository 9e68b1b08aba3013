"""Build the default model's text corpus and byte-level BPE tokenizer from text found offline.

    apt-get install -y python3-doc fortunes linux-doc-6.1      # Debian / Ubuntu, once
    python tools/build_corpus.py                                # -> .data/ and moetier/assets/default/

Sources (English prose only; code blocks, tables of numbers and ASCII art are dropped):
  - the Python 3 HTML documentation (python3-doc, PSF license), tags stripped;
  - docstrings of the Python standard library's own sources (PSF license);
  - fortune cookies (fortunes, BSD-licensed collection: quotations, jokes, poems);
  - the Linux kernel's Documentation/ (linux-doc-*, GPL-2.0), reStructuredText prose paragraphs;
  - a few percent of ChatML dialogues made from the above (a section title as the question,
    its first paragraphs as the answer), so the chat template means something to the model.
Writes .data/default_{train,val}.npy (uint16 token ids, documents separated by <|endoftext|>),
.data/default_corpus_stats.json, and tokenizer.json, tokenizer_config.json, chat_template.jinja
into moetier/assets/default/.
"""
from __future__ import annotations

import argparse
import ast
import glob
import gzip
import hashlib
import html
import html.parser
import inspect
import json
import os
import random
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "moetier" / "assets" / "default"
DATA = ROOT / ".data"

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
# Qwen2's pre-tokenizer split: words with a leading space, single digits, punctuation runs, newlines.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SYSTEM = "You are a helpful assistant."


# ---------------------------------------------------------------- prose filter
def is_prose(par: str, min_words: int = 6) -> bool:
    """A paragraph of English sentences: enough words, mostly letters and spaces."""
    words = par.split()
    if len(words) < min_words:
        return False
    letters = sum(c.isalpha() or c.isspace() for c in par)
    if letters < 0.85 * len(par) or not par.isascii():
        return False
    return sum(w.isalpha() and w.islower() for w in words) >= 0.4 * len(words)


def clean(text: str) -> str:
    text = text.replace("\u00b6", "").replace("\u2019", "'").replace("\u201c", '"').replace("\u201d", '"')
    text = text.replace("\u2014", " - ").replace("\u2013", "-").replace("\u2018", "'").replace("\u00a0", " ")
    return re.sub(r"[ \t]+", " ", text).strip()


# ---------------------------------------------------------------- Python HTML docs
class _DocHTML(html.parser.HTMLParser):
    """Text of `<div role="main">`: blocks (p, li, dd, headings) as paragraphs, code and tables skipped."""
    BLOCKS = frozenset({"p", "li", "dd", "dt", "h1", "h2", "h3", "h4", "blockquote", "div", "section"})
    SKIP = frozenset({"pre", "script", "style", "table"})

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0          # div depth inside role=main (0 = outside)
        self.skip, self.skip_tag = 0, None   # inside <skip_tag> nested `skip` deep
        self.cur: list[str] = []
        self.blocks: list[tuple[str, str]] = []  # (tag, text)
        self.tag = "p"

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "div":
            if self.depth:
                self.depth += 1
            elif a.get("role") == "main":
                self.depth = 1
        if not self.depth:
            return
        if self.skip:
            self.skip += tag == self.skip_tag
        elif tag in self.SKIP or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self.skip, self.skip_tag = 1, tag
        elif tag in self.BLOCKS:
            self.flush()
            self.tag = tag

    def handle_endtag(self, tag):
        if not self.depth:
            return
        if self.skip:
            self.skip -= tag == self.skip_tag
        elif tag in self.BLOCKS:
            self.flush()
        if tag == "div":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.cur.append(data)

    def flush(self):
        text = clean(" ".join("".join(self.cur).split()))
        if text:
            self.blocks.append((self.tag, text))
        self.cur = []


def python_html_docs(root: str) -> list[dict]:
    """One document per HTML page: {"title", "sections": [(heading, [paragraphs])]}."""
    docs = []
    skip = re.compile(r"(genindex|py-modindex|search|contents|_static|_sources|whatsnew/changelog)")
    for path in sorted(glob.glob(f"{root}/**/*.html", recursive=True)):
        if skip.search(path):
            continue
        p = _DocHTML()
        p.feed(Path(path).read_text(errors="replace"))
        p.flush()
        sections, heading = [], None
        for tag, text in p.blocks:
            if tag in ("h1", "h2", "h3", "h4"):
                heading = re.sub(r"^[\d.]+\s+", "", text)
                sections.append((heading, []))
            elif is_prose(text) and sections:
                sections[-1][1].append(text)
        sections = [(h, ps) for h, ps in sections if ps]
        if sections:
            docs.append({"source": "python-docs", "sections": sections})
    return docs


# ---------------------------------------------------------------- stdlib docstrings
def stdlib_docstrings(root: str) -> list[dict]:
    docs = []
    for path in sorted(glob.glob(f"{root}/**/*.py", recursive=True)):
        if re.search(r"/(test|tests|idlelib|lib2to3|site-packages|dist-packages|turtledemo)/", path):
            continue
        try:
            tree = ast.parse(Path(path).read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        pars = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    for par in inspect.cleandoc(doc).split("\n\n"):
                        par = clean(" ".join(par.split()))
                        if is_prose(par, 8):
                            pars.append(par)
        if pars:
            docs.append({"source": "python-stdlib", "sections": [(Path(path).stem, pars)]})
    return docs


# ---------------------------------------------------------------- fortunes
FORTUNE_SKIP = {"ascii-art", "translate-me", "perl"}


def fortunes(root: str) -> list[str]:
    out = []
    for path in sorted(glob.glob(f"{root}/*")):
        name = os.path.basename(path)
        if "." in name or name in FORTUNE_SKIP or os.path.isdir(path):
            continue
        for f in Path(path).read_text(errors="replace").split("\n%\n"):
            lines = [ln.strip() for ln in f.strip("\n%").splitlines()]
            text = "\n".join(lines).strip()
            body = " ".join(text.split())
            if len(body) < 20 or not body.isascii():
                continue
            if sum(c.isalpha() or c.isspace() for c in body) < 0.8 * len(body):
                continue
            out.append(clean(text) if "\n" not in text else "\n".join(clean(ln) for ln in text.splitlines()))
    return out


# ---------------------------------------------------------------- kernel docs (reStructuredText)
def _rst_paragraphs(text: str) -> list[str]:
    pars = []
    for par in re.split(r"\n\s*\n", text):
        lines = par.splitlines()
        if not lines or lines[0][:1] in (" ", "\t") or lines[0].startswith(".."):
            continue  # indented = literal block / directive body
        if any(re.fullmatch(r"[=\-~^*#+`':.]{3,}", ln.strip()) for ln in lines):
            continue  # headings
        par = " ".join(ln.strip() for ln in lines)
        par = re.sub(r":\w+:`([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", par)   # :ref:`text <target>` -> text
        par = re.sub(r"``([^`]*)``", r"\1", par)
        par = re.sub(r"`([^`<]*?)(?:\s*<[^>]*>)?`_*", r"\1", par)
        par = re.sub(r"\*\*?([^*]+)\*\*?", r"\1", par).rstrip(":")
        par = clean(par)
        if is_prose(par, 10):
            pars.append(par)
    return pars


def kernel_docs(root: str) -> list[dict]:
    docs = []
    for path in sorted(glob.glob(f"{root}/**/*.rst.gz", recursive=True) + glob.glob(f"{root}/**/*.txt.gz",
                                                                                       recursive=True)):
        if "/devicetree/" in path or "/translations/" in path or "/ABI/" in path:
            continue
        with gzip.open(path, "rt", errors="replace") as f:
            pars = _rst_paragraphs(f.read())
        if len(pars) >= 2:
            docs.append({"source": "linux-docs", "sections": [(Path(path).stem, pars)]})
    return docs


# ---------------------------------------------------------------- assembling
def doc_text(doc: dict) -> str:
    out = []
    for heading, pars in doc["sections"]:
        if doc["source"] == "python-docs" and is_heading(heading):
            out.append(heading)
        out.extend(pars)
    return "\n\n".join(out)


def is_heading(h: str) -> bool:
    return 2 <= len(h.split()) <= 10 and h.isascii() and sum(c.isalpha() or c == " " for c in h) > 0.8 * len(h)


def chat_samples(docs: list[dict], fortunes_: list[str], rng: random.Random, n: int) -> list[str]:
    """ChatML dialogues: 'Tell me about <section title>.' -> its first paragraphs; fortunes as sayings."""
    asks = ["Tell me about {}.", "What is {}?", "Explain {}.", "Can you describe {}?", "Write a few words about {}."]
    pairs = []
    for d in docs:
        if d["source"] != "python-docs":
            continue
        for h, pars in d["sections"]:
            if is_heading(h) and len(" ".join(pars[:2])) > 150:
                topic = h[0].lower() + h[1:] if h[1:2].islower() else h
                pairs.append((rng.choice(asks).format(topic), "\n\n".join(pars[:2])))
    sayings = ["Tell me something wise.", "Say something funny.", "Give me a quotation.", "Tell me a fortune.",
               "Share a thought with me."]
    pairs += [(rng.choice(sayings), f) for f in fortunes_]
    rng.shuffle(pairs)
    out = []
    for q, a in pairs[:n]:
        system = f"{IM_START}system\n{SYSTEM}{IM_END}\n" if rng.random() < 0.5 else ""
        out.append(f"{system}{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{a}{IM_END}\n")
    return out


def dedupe(docs: list[str]) -> list[str]:
    seen, out = set(), []
    for d in docs:
        h = hashlib.md5(d.encode()).digest()
        if h not in seen:
            seen.add(h)
            out.append(d)
    return out


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE(byte_fallback=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer=trainer)
    return tk


def write_tokenizer_files(tk, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tk.save(str(out / "tokenizer.json"))
    added = {str(tk.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    cfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 2048,
        "bos_token": EOT, "eos_token": EOT, "pad_token": EOT, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")
    (out / "special_tokens_map.json").unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python-html", default="/usr/share/doc/python3/html")
    ap.add_argument("--python-lib", default=None, help="stdlib sources (default: this Python's)")
    ap.add_argument("--fortunes", default="/usr/share/games/fortunes")
    ap.add_argument("--kernel-docs", default=None, help="default: newest /usr/share/doc/linux-doc-*/Documentation")
    ap.add_argument("--skip-kernel-docs", action="store_true", help="leave out the GPL-2.0 kernel docs")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=19_000_000, help="train+val tokens (uint16: 2 bytes each)")
    ap.add_argument("--fortune-repeats", type=int, default=2, help="fortunes are short and very English: repeat")
    ap.add_argument("--chat-fraction", type=float, default=0.05)
    ap.add_argument("--val-fraction", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DATA))
    ap.add_argument("--assets", default=str(ASSETS))
    a = ap.parse_args()
    rng = random.Random(a.seed)
    import sysconfig
    lib = a.python_lib or sysconfig.get_paths()["stdlib"]
    kdocs = a.kernel_docs or next(iter(sorted(glob.glob("/usr/share/doc/linux-doc-*/Documentation"))[::-1]), None)
    html_root = a.python_html if os.path.isdir(a.python_html) else \
        next(iter(sorted(glob.glob("/usr/share/doc/python3*/html"))[::-1]), a.python_html)

    pydocs = python_html_docs(html_root)
    stdlib = stdlib_docstrings(lib)
    fort = fortunes(a.fortunes)
    kern = kernel_docs(kdocs) if kdocs and not a.skip_kernel_docs else []
    print(f"python docs pages {len(pydocs)}, stdlib modules {len(stdlib)}, fortunes {len(fort)}, "
          f"kernel docs {len(kern)}")
    if not pydocs or not fort:
        raise SystemExit("python3-doc or fortunes not found: apt-get install -y python3-doc fortunes")

    # documents: a python/kernel page, stdlib module, or a pack of 8 fortunes. Hold out val_fraction of
    # each source before anything is repeated or turned into chat, so the val set never leaks into train.
    rng.shuffle(fort)
    packs = [fort[i:i + 8] for i in range(0, len(fort), 8)]
    sources = {"python-docs": pydocs, "python-stdlib": stdlib, "fortunes": packs, "linux-docs": kern}
    sources = {k: v for k, v in sources.items() if v}
    train, val = {}, {}
    for name, items in sources.items():
        items = list(items)
        rng.shuffle(items)
        n_val = max(1, round(len(items) * a.val_fraction))
        val[name], train[name] = items[:n_val], items[n_val:]

    def texts(name, items):
        return ["\n\n".join(i) for i in items] if name == "fortunes" else dedupe([doc_text(d) for d in items])

    train_texts = {k: texts(k, v) for k, v in train.items()}
    train_texts["fortunes"] *= a.fortune_repeats
    val_texts = {k: texts(k, v) for k, v in val.items()}
    chars = {k: sum(map(len, v)) for k, v in train_texts.items()}
    print("training characters by source:", chars)

    tk = train_tokenizer([t for v in train_texts.values() for t in v], a.vocab_size)
    write_tokenizer_files(tk, Path(a.assets))
    eot = tk.token_to_id(EOT)

    def encode(texts_):
        return [e.ids for e in tk.encode_batch(texts_)]

    enc = {k: encode(v) for k, v in train_texts.items()}
    n_text = sum(len(x) + 1 for v in enc.values() for x in v)
    chat_ids, n_chat = [], 0
    for c in encode(chat_samples(train["python-docs"], [f for p in train["fortunes"] for f in p], rng, 10**9)):
        if n_chat >= a.chat_fraction * n_text:
            break
        chat_ids.append(c)
        n_chat += len(c) + 1
    enc["chat"] = chat_ids
    over = n_text + n_chat - a.max_tokens
    while over > 0 and enc.get("linux-docs"):   # over the budget: drop kernel docs first
        over -= len(enc["linux-docs"].pop()) + 1
    if over > 0:
        raise SystemExit(f"the corpus is {over} tokens over --max-tokens {a.max_tokens}")

    train_docs = [ids for v in enc.values() for ids in v]
    rng.shuffle(train_docs)
    val_docs = [ids for v in val_texts.values() for ids in encode(v)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stats = {"vocab_size": tk.get_vocab_size(), "train_chars": chars, "sources": {}}
    for name, part in (("train", train_docs), ("val", val_docs)):
        flat = np.fromiter((t for ids in part for t in [eot, *ids]), dtype=np.uint16)
        np.save(out / f"default_{name}.npy", flat)
        stats[f"{name}_tokens"] = int(flat.size)
    for k, v in enc.items():
        stats["sources"][k] = {"docs": len(v), "tokens": int(sum(len(x) + 1 for x in v))}
    stats["val_docs"] = {k: len(v) for k, v in val_texts.items()}
    sample = "\n\n".join(val_texts["python-docs"] + val_texts["fortunes"])
    stats["chars_per_token_val_prose"] = round(len(sample) / len(tk.encode(sample).ids), 2)
    (out / "default_corpus_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats, indent=2))
    print(f"wrote {out}/default_train.npy and default_val.npy; tokenizer files to {a.assets}")


if __name__ == "__main__":
    main()
