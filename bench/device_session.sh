#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then a synthetic Qwen3-30B-A3B-shaped checkpoint (BF16,
# first $LAYERS layers) benched fully on the GPU and under smaller GPU budgets. Outputs under $OUT.
set -u
LAYERS=${LAYERS:-12}
OUT=${OUT:-out}; mkdir -p "$OUT"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
python3 -m pytest -q -o addopts="" -m gpu tests/test_gpu.py tests/test_memory_gpu.py -p no:cacheprovider \
  --timeout 200 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
df -h . | tail -1
python3 -m moetier synth qwen3-30b-a3b --quant BF16 --layers "$LAYERS" --skew 0.5 --out .data/q30-bf16 \
  2>&1 | tail -8 | tee "$OUT/synth.txt"
python3 -m moetier bench .data/q30-bf16 --prompt-len 512,4096 --gen 64 \
  --compare "gpu6:--gpu-mem 6GiB" --compare "cpu-moe:--cpu-moe" --json > "$OUT/bench_tiers.json" 2> "$OUT/bench_tiers.err"
tail -5 "$OUT/bench_tiers.err"
python3 - "$OUT/bench_tiers.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for c in d.get("configs", [d]):
    print(c.get("label"), "decode", c.get("decode_tok_s"), "prefill", c.get("prefill_tok_s") or c.get("prefill"),
          "bound", c.get("bound_tok_s"), "frac", c.get("fraction_of_bound"), "vram", c.get("peak_vram_bytes"))
PY
