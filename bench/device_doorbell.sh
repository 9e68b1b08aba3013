#!/usr/bin/env bash
# One call on the GPU machine: the graphed tiered decode (memory.doorbell) vs the eager tiered step on
# synthetic Qwen3-30B-A3B-shaped checkpoints (first $LAYERS layers; BF16 safetensors and Q4_0 GGUF),
# plus its GPU tests. Every step has a time limit. Outputs under $OUT.
set -u
LAYERS=${LAYERS:-12}
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
    print(c.get("label"), "decode", c.get("decode_tok_s"), "bound", c.get("bound_tok_s"),
          "frac", c.get("fraction_of_bound"), "split", c.get("time_split"), "hits", c.get("hits"))
PY
}
timeout 200 python3 -m pytest -q -o addopts="" -m gpu tests/test_memory_gpu.py -k graphed -p no:cacheprovider -x \
  2>&1 | tail -30 > "$OUT/gpu_tests.txt"; tail -3 "$OUT/gpu_tests.txt"
for Q in ${QUANTS:-Q4_0 BF16}; do
  M=.data/q30-$Q; [ $Q != BF16 ] && M=$M.gguf
  timeout 150 python3 -m moetier synth qwen3-30b-a3b --quant $Q --layers "$LAYERS" --skew 0.5 --out $M \
    2>&1 | tail -2 > "$OUT/synth_$Q.txt"
  timeout 180 python3 -m moetier bench $M --prompt-len 512 --gen 64 --gpu-mem ${GPUMEM:-3GiB} \
    --compare "eager:--no-cuda-graph" ${EXTRA:-} --json > "$OUT/bench_$Q.json" 2> "$OUT/bench_$Q.err"
  tail -3 "$OUT/bench_$Q.err"; summary "$OUT/bench_$Q.json"
done
