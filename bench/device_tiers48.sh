#!/usr/bin/env bash
# One call on the GPU machine: a synthetic Qwen3-30B-A3B-shaped Q4_0 GGUF (all 48 layers, 17 GB) benched
# with the issue #5 placements: --gpu-mem 8GiB (graphed tiered decode), policies and threads, all experts in
# RAM (--cpu-moe), everything on the GPU. GPU tests first. Outputs under $OUT.
set -u
LAYERS=${LAYERS:-48}
OUT=${OUT:-out}; mkdir -p "$OUT"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
[ -z "${SKIP_TESTS:-}" ] && timeout 150 python3 -m pytest -q -o addopts="" -m gpu tests/test_memory_gpu.py tests/test_quant_experts.py \
  -p no:cacheprovider 2>&1 | tail -15 > "$OUT/gpu_tests.txt"; tail -3 "$OUT/gpu_tests.txt"
M=.data/q30-Q4_0-$LAYERS.gguf
timeout 240 python3 -m moetier synth qwen3-30b-a3b --quant Q4_0 --layers "$LAYERS" --skew 0.5 --out $M \
  2>&1 | tail -3 > "$OUT/synth.txt"; tail -2 "$OUT/synth.txt"
timeout ${BENCH_S:-300} python3 -m moetier bench $M --prompt-len 512 --gen 64 \
  --compare "g8:--gpu-mem 8GiB" --compare "g8-lfu:--gpu-mem 8GiB --cache-policy lfu" \
  --compare "g8-t16:--gpu-mem 8GiB --cpu-threads 16" --compare "cpu-moe:--cpu-moe" ${EXTRA:-} --json > "$OUT/bench.json" 2> "$OUT/bench.err"
tail -4 "$OUT/bench.err"
python3 - "$OUT/bench.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json:", e); sys.exit()
for c in d.get("configs", [d]):
    m = c.get("memory") or {}
    print(c.get("label"), c.get("flags"), "decode", c.get("decode_tok_s"), "prefill", c.get("prefill_tok_s"),
          "bound", c.get("bound_tok_s"), "frac", c.get("fraction_of_bound"), "vram", c.get("peak_vram_bytes"),
          "hit", m.get("hit_rate"), "graph", m.get("graph"), "split", c.get("time_split"))
PY
