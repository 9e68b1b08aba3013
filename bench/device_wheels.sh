#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has torch, triton, numpy, pytest, but no gguf or transformers, and it reaches no
# package index): downloaded here into .whl/ (git-ignored), carried to each device call (`carry: [".whl"]`), and
# installed by bench/device_session.sh into /tmp/site. CPython 3.12, x86_64. huggingface_hub stays below 2: 2.x
# imports httpx2, which transformers 5.24 does not pull in (a session lost its GPU tests to that import); transformers
# stays at 5.24: 5.25 requires huggingface_hub >= 2.4 (session 26 lost a call's GPU tests to that).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q -d .whl --no-deps --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: \
  gguf 'transformers==5.24.0' 'huggingface_hub<2' tokenizers safetensors regex pyyaml hf-xet httpx httpcore anyio h11 \
  idna certifi sniffio click typer typer-slim shellingham filelock fsspec typing-extensions packaging hypothesis \
  sortedcontainers pytest-timeout
# libgguf (the K / i-quant packer: tests of Q4_K experts) is built for glibc 2.28
python3 -m pip download -q -d .whl --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: \
  libgguf
# one wheel per package: a second download of a newer release left two regex wheels, pip refused to install the set
# and a device call ran without gguf (session 43)
python3 - <<'PY'
import re
from pathlib import Path
seen = {}
for w in sorted(Path(".whl").glob("*.whl"), key=lambda p: p.stat().st_mtime):
    name = re.split(r"-\d", w.name, maxsplit=1)[0].lower().replace("_", "-")
    if name in seen:
        print("dropping", seen[name].name, "for", w.name)
        seen[name].unlink()
    seen[name] = w
PY
du -sh .whl
# `bench/device_wheels.sh xl`: .whl-xl for the cpuyard step instead: llama.cpp's CPU build (xllamacpp) with its
# library stripped of debug info (106 -> 26 MB, 10 MB packed; the wheel is 33 MB) as a tar, and the wheels moetier's
# CPU path and synth import (gguf, tokenizers, pyyaml, tqdm)
if [ "${1:-}" = xl ]; then
  rm -rf .whl-xl && mkdir -p .whl-xl && t=$(mktemp -d)
  python3 -m pip download -q -d "$t" --no-deps --python-version 3.12 --platform manylinux2014_x86_64 \
    --only-binary=:all: xllamacpp gguf tokenizers pyyaml tqdm
  mv "$t"/gguf-*.whl "$t"/tokenizers-*.whl "$t"/pyyaml-*.whl "$t"/tqdm-*.whl .whl-xl/
  python3 -m zipfile -e "$t"/xllamacpp-*.whl "$t/pkg"
  strip --strip-unneeded "$t"/pkg/xllamacpp/*.so
  tar cJf .whl-xl/xllamacpp.tar.xz -C "$t/pkg" xllamacpp
  rm -rf "$t"
  du -sh .whl-xl
fi
