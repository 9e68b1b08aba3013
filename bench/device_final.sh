#!/usr/bin/env bash
# The last call of a session on the GPU machine, in priority order, each step time-limited, results
# under $OUT as they come: GPU tests of the new paths; the 48-layer Q4_0 Qwen3-30B-A3B-shaped bench
# (all on GPU / --gpu-mem 8GiB / all experts in RAM, prompts 512 and 8192); the 12-layer file with
# uniform routing (--skew 0) vs skewed at --gpu-mem 3GiB; the default model's real routing tiered.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
summary() {
python3 - "$1" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json:", e); sys.exit()
for c in d.get("configs", [d]):
    m = c.get("memory") or {}
    print(c.get("label"), "decode", c.get("decode_tok_s"), "prefill", c.get("prefill_tok_s"), "bound",
          c.get("bound_tok_s"), "frac", c.get("fraction_of_bound"), "vram", c.get("peak_vram_bytes"),
          "hit", m.get("hit_rate"), "graph", m.get("graph"))
print("failed", d.get("failed"))
PY
}
timeout 75 python3 -m pytest -q -o addopts="" -m gpu tests/test_memory_gpu.py tests/test_quant_experts.py \
  -k "graphed or gguf or cuda_module" -p no:cacheprovider 2>&1 | tail -12 > "$OUT/gpu_tests.txt"; tail -4 "$OUT/gpu_tests.txt"
M=.data/q30-Q4_0-48.gguf
timeout 150 python3 -m moetier synth qwen3-30b-a3b --quant Q4_0 --layers 48 --skew 0.5 --out $M 2>&1 | tail -1
timeout 170 python3 -m moetier bench $M --prompt-len 512,8192 --gen 48 \
  --compare "g8:--gpu-mem 8GiB" --compare "cpu-moe:--cpu-moe" --json > "$OUT/bench48.json" 2> "$OUT/bench48.err"
tail -2 "$OUT/bench48.err"; summary "$OUT/bench48.json"
rm -f $M
for S in 0 0.5; do
  U=.data/q30-12-skew$S.gguf
  timeout 40 python3 -m moetier synth qwen3-30b-a3b --quant Q4_0 --layers 12 --skew $S --out $U 2>&1 | tail -1
  timeout 45 python3 -m moetier bench $U --prompt-len 512 --gen 48 --gpu-mem 3GiB --json > "$OUT/bench12_skew$S.json" \
    2> "$OUT/bench12_skew$S.err"; summary "$OUT/bench12_skew$S.json"
done
timeout 40 python3 -m moetier bench --prompt-len 256 --gen 64 --ctx 400 --gpu-mem 95MiB --decode greedy --json \
  > "$OUT/bench_default.json" 2> "$OUT/bench_default.err"; tail -2 "$OUT/bench_default.err"; summary "$OUT/bench_default.json"
