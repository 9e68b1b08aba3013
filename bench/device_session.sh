#!/usr/bin/env bash
# One call on the GPU machine (30 device-minutes a session: plan the steps). Each step is time-limited
# and writes under $OUT as it goes, so a call cut short still returns what finished. Run from the repository root
# with `carry: [".whl"]` (bench/device_wheels.sh fills .whl/ with gguf, transformers and what they need).
# Everything comes back as $OUT/session.tgz, packed at the end (do not pack $OUT again after it: session 21 lost two
# calls' files that way).
#   STEPS="tests bench48 uniform12 longctx doorbell12"  (default: all but doorbell12, in that order)
#   tests       GPU tests of the graphed tier step, GGUF tiers, packed GGUF experts, Triton DeltaNet
#   bench48     synthetic Qwen3-30B-A3B Q4_0 GGUF, all 48 layers (17 GB): all on GPU / --gpu-mem 8GiB /
#               --cpu-moe, prompts 512 and 8192
#   longctx     synthetic Qwen3-Next-80B-A3B Q4_0 GGUF, 4 layers: prefill 4K/32K/128K, decode after, TTFT
#               of a repeated prompt cold vs from the snapshot (bench/bench_long_context.py)
#   pcie48      48 layers Q4_0: the PCIe share of decode misses off / 0.25 / default, at 8 GiB and --cpu-moe
#               (AB48=1: again with MOETIER_STAGE_REPACK=triton; KEEP48=1 keeps the model)
#   share48     48 layers Q4_0: PCIe share 0 vs $SHARE interleaved (0, S, 0, S) at --cpu-moe and 8 GiB
#   place48     48 layers Q4_0 at the defaults: all on the GPU, --gpu-mem 8GiB, --cpu-moe (one process;
#               PL48DEQ=1: all on the GPU and 8 GiB again with --dequantize-dense; PL48X=LABEL:FLAGS one more
#               configuration, e.g. g9:--gpu-mem=9GiB, llama.cpp's 9.5 GB placement with its CUDA context)
#   pf48        48 layers Q4_0: the CPU's prefetch of guessed misses on / off at 8 GiB and --cpu-moe, and 9 GiB
#   pfab48      48 layers Q4_0 at 8 GiB, PCIe share 0: the guessed-miss prefetch on / off / on, one process
#   proof48     48 layers Q4_0, one process each: 9 GiB and 8 GiB decode, an 8K prefill with all experts in RAM
#   gpu48       48 layers Q4_0 all on the GPU: decode with the v2 kernels vs v3 (G48V=v3pdl ...)
#   decode48    48 layers Q4_0: the kernels of a decode token (bench/profile_decode.py), all on GPU / --cpu-moe
#   chain12     12 layers Q4_0: one decode layer's kernels in order (start, length, gap), all on GPU and tiered
#   vram48      48 layers Q4_0 at --gpu-mem 8GiB: the blocks live at the VRAM peak by allocation site
#   prefill48   48 layers Q4_0: torch.profiler of an 8K prefill at --cpu-moe and 8 GiB (bench/profile_prefill.py;
#               PPLEN=512 another length; PPBENCH=1 the bench's 8K figure at both)
#   prefillhost 48 layers Q4_0 all on the GPU: a short prefill's host enqueue vs its synced time vs a CUDA graph
#               of it, one layer's MoE by both prefill paths (bench/prefill_host.py; PHLEN lengths, PHFLAGS)
#   pp512       48 layers Q4_0 all on the GPU: the 512-token prefill with prefill graphs vs eager (PPLENS; PPNOCMP=1
#               the default configuration alone)
#   chatturns   48 layers Q4_0 all on the GPU: a chat's next turns' TTFT, continuation prefill graphs vs eager
#   deqtiles    the prefill's expert dequantizer at several tiles (bench/dequant_tiles.py, DQFMT)
#   g8skew      48 layers Q4_0 with --skew 0.5 at --gpu-mem 8GiB: LRU vs LFU
#   uniform12   12 layers, --skew 0 (uniform routing) vs 0.5, --gpu-mem 3GiB
#   doorbell12  12 layers Q4_0 and BF16 at --gpu-mem 3GiB: graphed vs eager tiered decode
#   default     the embedded default model on real text (its real routing) at GPU budgets that cache
#               all / about half / few of its 32 experts: tok/s, hit rate, time split
#   kernels     Triton decode kernels' GB/s against HBM (bench/bench_gpu_kernels.py --variants)
#   qlinear     dense GEMVs on GGUF blocks (QuantLinear) vs cuBLAS bf16 at Qwen3-30B-A3B's shapes, tiles
#   missbench   the C miss server alone against the RAM read bandwidth (bench/bench_miss_server.py; MVARIANTS, MPF
#               prefetch distances, MMISSES, MTHREADS, MGIB)
#   layout      GGUF rows vs rows interleaved by 8 in the C int8 matvec, in cache and from RAM (LTHREADS, LTYPES)
#   v5new       the v5 kernels of MXFP4 / Q5_K / IQ3_XXS (and Q4_K): GPU tests, then their pairs against v2
#   v5ab        the decode pairs of this tree against a snapshot in .run (carried), new / old / new
#   v5qtiles    v5q (h quantized by gate_up) at wider gate_up tiles beside v5pdl (TFMT, TLBUDGET)
#   v5qxdown    v5qx with other down tiles (V5QX_PAIRS: (gate_up, down) pairs; V5QX_SPLIT_AB=1: each with gate_up's
#               row in one and in two pieces), and the registers the JIT gave each compiled kernel (TFMT, TLBUDGET)
#   v5qwave     v5q at the shipped tiles, then at PAIR_TILES_WAVE (whole waves, no spills: bench/kernel_regs.py)
#   v5tiles     the v5pdl pair at the tile combinations of PAIR_TILES_V5 (TFMT formats, TLBUDGET seconds)
#   pairprof    the T=1 decode pair: each kernel's device time, the gaps, one launch's read ceiling (KFMT; PPONLY
#               variants)
#   timeline    the T=1 decode pair program by program (bench/pair_timeline.py: %globaltimer stamps; KFMT)
#   graphcheck  graph replay vs eager step module by module, replays of one state repeated (bench/graph_check.py)
#   sampling    the CUDA sampler's GPU tests, then its cost a token against its eager form, the masks + multinomial
#               it replaced, the CPU one on a host copy of the logits (bench/bench_sampling.py --device cuda;
#               vocabularies 8,192 and 151,936)
#   topo        the box: CPUs, cores, NUMA nodes, huge pages, load, the busiest processes
#   cpumv       no GPU: the CPU int8 matvec alone at a decode layer's one-row shapes, 8 and 16 threads (CMTHREADS)
#   rawq        the formats read as stored (Q2_K, IQ2_*, ...): GPU tests, decode pairs (RQFMT, RQONLY)
#   pcie        a kernel reading experts from pinned host memory: GB/s vs the copy engine, with CPU load
#   cpuyard     no GPU: moetier vs llama.cpp (xllamacpp) on the CPU, the same 48-layer Q4_0 GGUF, 16 threads
#               (bench/bench_cpu_vs_llamacpp.py --gguf; CYCOMPILE="off on": the eager step, then the compiled one;
#               CYLAYERS other layer counts; CYPROF=16,8 first bench/profile_cpu_decode.py at those thread counts;
#               CYARGS more options for the bench, e.g. --thp-ab;
#               carry .whl-xl, not .whl)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
STEPS=${STEPS:-tests bench48 uniform12 longctx}
FLAGS=${FLAGS:-}
REPEAT=${REPEAT:-3}     # decode runs per configuration (median reported): the box varies +-15% between runs
# models outside the repository copy: a warm machine keeps them for the next call (KEEP48=1)
DATA=${DATA:-/tmp/moetier-data}; mkdir -p "$DATA"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
# the CPU yardstick (step cpuyard): `bench/device_wheels.sh xl` fills .whl-xl with llama.cpp (xllamacpp, its library
# stripped: 10 MB) and the few wheels moetier's CPU path imports; carry .whl-xl instead of .whl (a call carries 64 MiB)
if [ -d .whl-xl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-xl/*.whl
  tar xJf .whl-xl/xllamacpp.tar.xz -C /tmp/site
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
synth() {  # NAME QUANT LAYERS SKEW OUT SECONDS
  timeout "$6" python3 -m moetier synth "$1" --quant "$2" --layers "$3" --skew "$4" --out "$5" 2>&1 | tail -1
  # the 17 GB just written fill the page cache: the first bench after it read slow in session 14 (calls 4, 5)
  sync; echo 1 > /proc/sys/vm/drop_caches 2>/dev/null || true
}
bench() {  # LABEL SECONDS MODEL FLAGS...
  local label=$1 secs=$2; shift 2
  timeout "$secs" python3 -m moetier bench "$@" $FLAGS --repeat $REPEAT --json > "$OUT/$label.json" 2> "$OUT/$label.err"
  tail -2 "$OUT/$label.err"
  python3 - "$OUT/$label.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json:", e); sys.exit()
for c in d.get("configs", [d]):
    m = c.get("memory") or {}
    print(c.get("label"), "decode", c.get("decode_tok_s"), "prefill", c.get("prefill_tok_s"), "bound",
          c.get("bound_tok_s"), "frac", c.get("fraction_of_bound"), "vram", c.get("peak_vram_bytes"),
          "hit", m.get("hit_rate"), "graph", m.get("graph"), "split", c.get("time_split"))
print("failed", d.get("failed"))
PY
}
for step in $STEPS; do
  echo "== $step"
  case $step in
  cpuyard)
    M=$DATA/q30-Q4_0-${CYLAYERS:-48}.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 ${CYLAYERS:-48} ${SKEW48:-0} $M 120
    if [ -n "${CYPROF:-}" ]; then   # where an eager CPU-only token's time goes, at 16 and 8 threads
      CUDA_VISIBLE_DEVICES= timeout ${CYSECS:-240} python3 -X faulthandler bench/profile_cpu_decode.py $M \
        --threads ${CYPROF} --gen 24 > "$OUT/cpuprof.json" 2> "$OUT/cpuprof.err"
      grep -v "^WARNING" "$OUT/cpuprof.err" | tail -3 | cut -c1-1500
    fi
    for C in ${CYCOMPILE:-off}; do
      CUDA_VISIBLE_DEVICES= timeout ${CYSECS:-240} python3 -X faulthandler bench/bench_cpu_vs_llamacpp.py --gguf $M \
        --threads ${CYTHREADS:-16} \
        --rounds ${CYROUNDS:-3} --gen ${CYGEN:-48} --prompt-len ${CYPROMPT:-512} --cpu-compile $C ${CYARGS:-} \
        > "$OUT/cpuyard_$C.json" 2> "$OUT/cpuyard_$C.err"
      grep -v "^[0-9.]* [IWD] \|^WARNING" "$OUT/cpuyard_$C.err" | tail -4; cat "$OUT/cpuyard_$C.json"
    done
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  topo)
    { lscpu; numactl -H; cat /sys/kernel/mm/transparent_hugepage/enabled /proc/loadavg; grep -i huge /proc/meminfo
      top -bn1 | head -15; } > "$OUT/topo.txt" 2>&1
    grep -E "^CPU\(s\)|Thread|Core|Socket|NUMA|Model name|available|node . cpus|always|load" "$OUT/topo.txt" \
      | head -20; sed -n '/PID/,$p' "$OUT/topo.txt" | head -8 ;;
  cpumv)
    # the CPU's int8 matvec alone at a decode layer's one-row shapes (q/k/v 5120x2048, o_proj 2048x4096, an expert's
    # gate 768x2048) against the RAM read, per thread count (CMTHREADS), from a bank bigger than the caches
    for T in ${CMTHREADS:-8 16}; do
      timeout ${CMSECS:-150} python3 bench/bench_cpu_kernels.py --gib ${CMGIB:-2} --rounds 3 --threads $T --q8 \
        --types ${CMTYPES:-Q4_0,Q8_0} --shapes ${CMSHAPES:-5120x2048,2048x4096,768x2048} > "$OUT/cpumv_$T.json" \
        2> "$OUT/cpumv_$T.err"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['ram_read_gbps'], *d['cases'], sep='\n')" \
        "$OUT/cpumv_$T.json" || tail -3 "$OUT/cpumv_$T.err"
    done ;;
  pcie)
    timeout ${PSECS:-120} python3 bench/bench_pcie_read.py > "$OUT/pcie.json" 2> "$OUT/pcie.err"
    tail -3 "$OUT/pcie.err"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(k, d[k]) for k in d if k not in ('gather','gather_base')]" "$OUT/pcie.json" ;;
  tests)
    TEST_K_DEFAULT="graphed or gguf or fused or rms or softmax or cuda_graph or deltanet or dequantize or cuda_module"
    TEST_K_DEFAULT="$TEST_K_DEFAULT or add_norm or ring or topk or prefill"
    timeout ${TSECS:-240} python3 -m pytest -q -o addopts="" tests/test_small_ops.py tests/test_gpu.py tests/test_deltanet_triton.py \
      tests/test_memory_gpu.py tests/test_kernels_triton.py tests/test_quant_experts.py tests/test_triton_repack.py \
      tests/test_quant_linear.py tests/test_doorbell.py tests/test_prefill_graph.py \
      -k "${TEST_K:-$TEST_K_DEFAULT}" \
      -p no:cacheprovider -rf --tb=short 2>&1 | tail -60 > "$OUT/gpu_tests.txt"
    grep -E "^E |passed|failed|FAILED" "$OUT/gpu_tests.txt" | tail -14
    # a broken fused decode kernel must not spoil the measurements: bench without it then
    # (said loudly: session 19's call 5 took two failed gate tests' fallback benches for a regression at first)
    if grep -q "FAILED tests/test_small_ops\|FAILED tests/test_gpu" "$OUT/gpu_tests.txt"; then
      FLAGS="--no-fused-decode"; echo "!! a fused-kernel test failed: the benches below run with $FLAGS"
    fi ;;
  bench48)
    M=$DATA/q30-Q4_0-48.gguf
    synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0.5} $M 120
    bench bench48 ${B48SECS:-280} $M --prompt-len 512,8192 --gen 40 --compare "g8:--gpu-mem 8GiB" --compare "g8t12:--gpu-mem 8GiB --cpu-threads 12" --compare "cpu-moe:--cpu-moe"
    rm -f $M ;;
  pcie48)
    # the PCIe share of decode misses (memory.doorbell): off vs shares, at 8 GiB and with all experts in RAM
    M=$DATA/q30-Q4_0-48.gguf
    synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    bench pcie48 ${P48SECS:-330} $M --prompt-len 512 --gen 40 --gpu-mem 8GiB ${P48:---compare "g8p0:--gpu-mem 8GiB --pcie-share 0" --compare "g8p25:--gpu-mem 8GiB --pcie-share 0.25" --compare "cpumoe:--cpu-moe" --compare "cpumoe-p0:--cpu-moe --pcie-share 0" --compare "cpumoe-p35:--cpu-moe --pcie-share 0.35"}
    if [ -n "${AB48:-}" ]; then   # the same with the Triton repack of the PCIe share's staging rows
      MOETIER_STAGE_REPACK=triton bench pcie48_triton_repack ${P48SECS:-330} $M --prompt-len 512 --gen 40 --gpu-mem 8GiB \
        --compare cpumoe:--cpu-moe
    fi
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  share48)
    # the PCIe share of decode misses, interleaved A/B in one process each: 0 vs S (default 0.22), --cpu-moe and 8 GiB
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    S=${SHARE:-0.22}
    for P in ${SPLACE:-cpumoe g8}; do
      B="--cpu-moe"; [ $P = g8 ] && B="--gpu-mem 8GiB"
      bench share48_$P ${S48SECS:-200} $M --prompt-len 512 --gen 40 $B --pcie-share 0 \
        --compare s1:--pcie-share=$S --compare z2:--pcie-share=0 --compare s2:--pcie-share=$S
    done
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  place48)
    # the three placements of the issues' targets at the defaults, one process: all on the GPU, 8 GiB, --cpu-moe
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    if [ -n "${PL48DEQ:-}" ]; then   # A/B: the dense weights dequantized to bf16 (as before QuantLinear)
      bench place48 ${PL48SECS:-450} $M --prompt-len 512 --gen ${PL48GEN:-48} --compare g8:--gpu-mem=8GiB \
        --compare cpumoe:--cpu-moe --compare deq:--dequantize-dense --compare "g8deq:--gpu-mem=8GiB --dequantize-dense"
    else
      bench place48 ${PL48SECS:-240} $M --prompt-len 512 --gen ${PL48GEN:-48} --compare g8:--gpu-mem=8GiB \
        --compare cpumoe:--cpu-moe ${PL48X:+--compare} ${PL48X:-}
    fi
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  pf48)
    # A/B of the CPU's prefetch of guessed misses (doorbell.c prefetch_guess; --prefetch off), at 8 GiB and --cpu-moe,
    # interleaved, plus 9 GiB (llama.cpp's 9.5 GB placement with its CUDA context), one process
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    # (PF48S0=1: both again with --pcie-share 0 and the prefetch on, instead of 9 GiB)
    if [ -n "${PF48S0:-}" ]; then X=(--compare "g8s0:--gpu-mem=8GiB --pcie-share=0" --compare "cpumoes0:--cpu-moe --pcie-share=0")
    else X=(--compare g9:--gpu-mem=9GiB); fi
    bench pf48 ${PF48SECS:-360} $M --prompt-len 512 --gen ${PL48GEN:-48} --compare g8:--gpu-mem=8GiB \
      --compare "g8off:--gpu-mem=8GiB --prefetch=off" --compare cpumoe:--cpu-moe \
      --compare "cpumoeoff:--cpu-moe --prefetch=off" "${X[@]}"
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  pfab48)
    # the guessed-miss prefetch on / off / on at 8 GiB, the PCIe share 0 in all three (--prefetch off alone turns
    # the share on), one process: CPU busy ms, round trip and MB prefetched per layer side by side
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    bench pfab48 ${PFABSECS:-300} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB --pcie-share 0 \
      --compare "off:--gpu-mem=8GiB --pcie-share=0 --prefetch=off" --compare "on:--gpu-mem=8GiB --pcie-share=0"
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  proof48)
    # the issues' proof figures, one process each (a clean VRAM peak per placement): 9 GiB (llama.cpp's 9.5 GB
    # placement: 76.6 tok/s), 8 GiB (>= 100 tok/s and >= 70% of the bound), an 8K prefill with all experts in RAM
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    for P in ${P48ONLY:-g9 g8 pp8k}; do     # (P48ONLY="g8 all": those; g8nopdl / g8v2: 8 GiB with
                                            # MOETIER_PDL=0 / MOETIER_MISS_VARIANT=2;
                                            # g8rows / g9rows: the bank's GGML rows, MOETIER_X8_BANK=0; cpumoe;
                                            # g8pf0: 8 GiB without the guessed-miss prefetch; g8v5 / g9v5: the
                                            # miss server's variant 5 (g8v6, g8v6b: 6; g8b: g8 again);
                                            # g8c8 / g8c16: its chunks per
                                            # thread and phase 8 / 16, MOETIER_MISS_CHUNKS;
                                            # g8t14: 8 GiB on 14 miss threads; g8stamp: 8 GiB with the GPU's
                                            # clock stamps (g8trace: and the miss threads' timelines);
                                            # g8q8: that with x's int8 copy written by the ring only,
                                            # MOETIER_RING_Q8; g8wan: that with the next block's input norm made
                                            # by wait_add only, MOETIER_WAIT_ADD_NORM; g8fused: both (the default);
                                            # g8base: neither; g8ab: default / neither / default / neither in one
                                            # process, --compare's MOETIER_* switches; g8ab3: its first three;
                                            # allsample / g8sample: --decode sample, allsample0 without the
                                            # sampler's graph, allsampletri with MOETIER_SAMPLER=triton)
      case $P in
      g9) bench proof48_g9 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 9GiB ;;
      g8) bench proof48_g8 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      pp8k) bench proof48_pp8k ${P48SECS:-150} $M --prompt-len 8192 --gen 16 --cpu-moe ;;
      all) bench proof48_all ${P48SECS:-150} $M --prompt-len 512 --gen 48 ;;
      g8nopdl) MOETIER_PDL=0 bench proof48_g8nopdl ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8pf0) bench proof48_g8pf0 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB --prefetch off ;;
      g8v6) MOETIER_MISS_VARIANT=6 bench proof48_g8v6 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8v6b) MOETIER_MISS_VARIANT=6 bench proof48_g8v6b ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8stamp) MOETIER_STAMP=1 bench proof48_g8stamp ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8trace)  # g8stamp with the miss threads' timelines: graph.straggler_us splits a layer's tail
                # (MOETIER_MISS_TRACE)
        MOETIER_STAMP=1 MOETIER_MISS_TRACE=1 \
          bench proof48_g8trace ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8old) MOETIER_STAMP=1 MOETIER_ROUTER_ADD_NORM=0 \
        bench proof48_g8old ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8ab)   # the default against neither fusion, interleaved in one process (the box's RAM rate drifts between
              # processes more than the fusions' ~3%): default / neither / default / neither
        N="MOETIER_RING_Q8=0 MOETIER_WAIT_ADD_NORM=0"
        MOETIER_STAMP=1 bench proof48_g8ab ${P48ABSECS:-480} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB \
          --compare "neither:$N" --compare "default2:" --compare "neither2:$N" ;;
      g8ab3)  # g8ab's first three: default / neither / default (one bench in a 600 s call with the synth)
        N="MOETIER_RING_Q8=0 MOETIER_WAIT_ADD_NORM=0"
        MOETIER_STAMP=1 bench proof48_g8ab3 ${P48ABSECS:-420} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB \
          --compare "neither:$N" --compare "default2:" ;;
      g8v8ab)  # the miss server's default (variant 6: thread 0's prep and a barrier at each bell) against every
               # thread starting each layer at its bell (8), in one process: 6 / 8 / 6
        bench proof48_g8v8ab ${P48ABSECS:-420} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB \
          --compare "v8:MOETIER_MISS_VARIANT=8" --compare "default2:" ;;
      g8base) MOETIER_STAMP=1 MOETIER_RING_Q8=0 MOETIER_WAIT_ADD_NORM=0 \
        bench proof48_g8base ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8q8) MOETIER_STAMP=1 MOETIER_RING_Q8=1 MOETIER_WAIT_ADD_NORM=0 \
        bench proof48_g8q8 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8wan) MOETIER_STAMP=1 MOETIER_WAIT_ADD_NORM=1 MOETIER_RING_Q8=0 \
        bench proof48_g8wan ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8fused) MOETIER_STAMP=1 MOETIER_RING_Q8=1 MOETIER_WAIT_ADD_NORM=1 \
        bench proof48_g8fused ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      allxab)  # all on the GPU: the expert pair without x's quantizer launch (v5qx: gate_up's programs quantize x)
               # against the default (v5q), in one process: default / v5qx / default
        bench proof48_allxab ${P48ABSECS:-420} $M --prompt-len 512 --gen 48 \
          --compare "v5qx:MOETIER_DECODE_VARIANT=v5qx" --compare "default2:" ;;
      allanab)  # all on the GPU: the residual add after the MoE making the next block's input norm (the default since
                # session 29) against a torch add then the norm's launch (MOETIER_ADD_NORM_Q8=0), in one process:
                # default / off / default / off
        bench proof48_allanab ${P48ABSECS:-420} $M --prompt-len 512 --gen 48 \
          --compare "off:MOETIER_ADD_NORM_Q8=0" --compare "default2:" --compare "off2:MOETIER_ADD_NORM_Q8=0" ;;
      allsample) bench proof48_allsample ${P48SECS:-150} $M --prompt-len 512 --gen 48 --decode sample ;;
      allsample0) MOETIER_SAMPLER_GRAPH=0 bench proof48_allsample0 ${P48SECS:-150} $M --prompt-len 512 --gen 48 \
        --decode sample ;;
      allsampletri) MOETIER_SAMPLER=triton bench proof48_allsampletri ${P48SECS:-150} $M --prompt-len 512 --gen 48 \
        --decode sample ;;
      g8sample) bench proof48_g8sample ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB --decode sample ;;
      allold) MOETIER_ROUTER_ADD_NORM=0 bench proof48_allold ${P48SECS:-150} $M --prompt-len 512 --gen 48 ;;
      allnopipe) MOETIER_PIPELINE=0 bench proof48_allnopipe ${P48SECS:-150} $M --prompt-len 512 --gen 48 ;;
      g8t14) bench proof48_g8t14 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB --cpu-threads 14 ;;
      g8b) bench proof48_g8b ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8v5) MOETIER_MISS_VARIANT=5 bench proof48_g8v5 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g9v5) MOETIER_MISS_VARIANT=5 bench proof48_g9v5 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 9GiB ;;
      g8c8) MOETIER_MISS_CHUNKS=8 bench proof48_g8c8 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8c16) MOETIER_MISS_CHUNKS=16 bench proof48_g8c16 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8v4) MOETIER_MISS_VARIANT=4 bench proof48_g8v4 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g8rows) MOETIER_X8_BANK=0 bench proof48_g8rows ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g9rows) MOETIER_X8_BANK=0 bench proof48_g9rows ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 9GiB ;;
      cpumoe0) bench proof48_cpumoe0 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --cpu-moe --pcie-share 0 ;;
      cpumoe) bench proof48_cpumoe ${P48SECS:-150} $M --prompt-len 512 --gen 48 --cpu-moe ;;
      g8v2) MOETIER_MISS_VARIANT=2 bench proof48_g8v2 ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 8GiB ;;
      g5shareab)  # 5 GiB (~75% of the routes from RAM, a share of ~0.09 by plan.prefetch_share's line): the default
                  # against --pcie-share 0, default / 0 / default / 0 in one process (the line between 60% and 100%
                  # of the routes from RAM is interpolated, not measured: perf-log session 31, Next item 3)
        bench proof48_g5shareab ${P48ABSECS:-480} $M --prompt-len 512 --gen 48 --gpu-mem 5GiB \
          --compare "share0:--pcie-share 0" --compare "default2:" --compare "share02:--pcie-share 0" ;;
      g14pfoff) bench proof48_g14pfoff ${P48SECS:-150} $M --prompt-len 512 --gen 48 --gpu-mem 14GiB --prefetch off ;;
      g14pfoffab)  # 14 GiB without the CPU's prefetch (15% of the routes from RAM): the default PCIe share, which
                   # may read no expert an average layer, against --pcie-share 0: default / 0 / default / 0, one
                   # process (whether plan.prefetch_share's "reads nothing" rule should hold with --prefetch off too)
        bench proof48_g14pfoffab ${P48ABSECS:-480} $M --prompt-len 512 --gen 48 --gpu-mem 14GiB --prefetch off \
          --compare "share0:--pcie-share 0 --prefetch off" --compare "default2:" \
          --compare "share02:--pcie-share 0 --prefetch off" ;;
      g8shareab)  # 8 GiB with an 8K prompt (61% of the routes from RAM): the default (a PCIe share that would read
                  # no expert is now 0) / the share it had before (0.005) / default / 0.005, in one process
        bench proof48_g8shareab ${P48ABSECS:-480} $M --prompt-len 512,8192 --gen 48 --gpu-mem 8GiB \
          --compare "old:--pcie-share 0.005" --compare "default2:" --compare "old2:--pcie-share 0.005" ;;
      esac
    done
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  gpu48)
    # everything on the GPU, decode kernels v2 (default) vs v3 (MOETIER_DECODE_VARIANT)
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    bench gpu48 ${G48SECS:-100} $M --prompt-len 512 --gen ${G48GEN:-64}
    MOETIER_DECODE_VARIANT=${G48V:-v3} bench gpu48_v3 ${G48SECS:-100} $M --prompt-len 512 --gen ${G48GEN:-64}
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  decode48)
    # kernels of one decode token (torch.profiler over graph replays): all on the GPU and with all experts in RAM
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    for F in ${PDF:-all --cpu-moe}; do
      timeout ${PDSECS:-100} python3 bench/profile_decode.py $M ${F/all/} --gen 32 > "$OUT/decode48_$F.txt" 2>&1
      head -c 4000 "$OUT/decode48_$F.txt"; echo
    done
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  chain12)
    # one decode layer's chain of kernels in order (profile_decode --timeline) on 12 layers of the same shapes: all
    # on the GPU and tiered (C12F, default --gpu-mem 2600MiB: about 8 GiB's share of the experts at 48 layers)
    M=$DATA/q30-Q4_0-12.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 12 0 $M 90
    for F in all "${C12F:---gpu-mem 2600MiB}"; do
      timeout ${C12SECS:-120} python3 bench/profile_decode.py $M ${F/all/} --gen 32 --timeline ${C12N:-60} \
        > "$OUT/chain12_${F// /_}.txt" 2>&1
      python3 - "$OUT/chain12_${F// /_}.txt" <<'PY'
import json, sys
t = open(sys.argv[1]).read()
try:
    d = json.loads(t[t.index("{"):])
except ValueError:
    print(t[-3000:]); sys.exit()
print({k: d[k] for k in ("decode_tok_s", "ms_per_token") if k in d}, d.get("graph"))
print("\n".join(d.get("timeline", [])))
print("\n".join(f"{r['us_per_call']:7.2f} us x {r['calls_per_token']:6.2f} {r['kernel']}" for r in d.get("kernels", [])[:25]))
PY
    done ;;
  vram48)
    # what is live on the GPU at the peak of a --gpu-mem 8GiB run (the budget is a hard limit)
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    timeout ${VSECS:-150} python3 bench/vram_peak.py $M ${VFLAGS:---gpu-mem 8GiB} > "$OUT/vram48.json" 2> "$OUT/vram48.err"
    tail -3 "$OUT/vram48.err"; head -c 3500 "$OUT/vram48.json"; echo
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  prefill48)
    # where the 8K prefill goes with experts in RAM (target 9,000 tok/s): GPU kernels vs H2D copies vs idle
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120   # KEEP48=1 pcie48 leaves it
    for F in ${PPF:---cpu-moe --gpu-mem=8GiB}; do     # (all: everything on the GPU)
      FF=${F/all/}
      timeout ${PPSECS:-150} python3 bench/profile_prefill.py $M ${FF/=/ } --prompt-len ${PPLEN:-8192} > "$OUT/prefill48_$F.txt" 2>&1
      head -${PPHEAD:-40} "$OUT/prefill48_$F.txt"
    done
    # the bench's own figure: prefill of an 8K prompt with all experts in RAM (target 9,000 tok/s), and at 8 GiB
    [ -n "${PPBENCH:-}" ] && bench prefill48_bench ${PPBSECS:-200} $M --prompt-len 8192 --gen 16 --cpu-moe \
      --compare g8:--gpu-mem=8GiB
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  prefillhost)
    # a short prefill all on the GPU (llama.cpp pp512 7,991 tok/s): the host's enqueue against the synced forward,
    # the forward captured in a CUDA graph, one layer's MoE by both prefill paths (bench/prefill_host.py)
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    for L in ${PHLEN:-512}; do
      timeout ${PHSECS:-150} python3 bench/prefill_host.py $M --prompt-len $L ${PHFLAGS:-} \
        > "$OUT/prefillhost_$L.json" 2> "$OUT/prefillhost_$L.err"
      tail -3 "$OUT/prefillhost_$L.err"; cat "$OUT/prefillhost_$L.json"
    done
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  pp512)
    # llama.cpp's pp512 placement (all on the GPU, 7,991 tok/s): the bench's 512-token prefill with the prefill
    # graphs (default) against eager prefill (MOETIER_PREFILL_GRAPH_MAX=0), one process; PPLENS more lengths
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    if [ -n "${PPNOCMP:-}" ]; then bench pp512 ${PPSECS:-200} $M --prompt-len ${PPLENS:-512} --gen 16
    else bench pp512 ${PPSECS:-200} $M --prompt-len ${PPLENS:-512} --gen 16 \
      --compare "eager:MOETIER_PREFILL_GRAPH_MAX=0" --compare "graph2:"; fi
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  chatturns)
    # 48 layers Q4_0 all on the GPU: a chat's next turns' TTFT, continuation prefill graphs vs eager, one engine
    # (bench/chat_turns.py; CTLENS first-prompt lengths, CTNEW new tokens a turn)
    M=$DATA/q30-Q4_0-48.gguf
    [ -f $M ] || synth qwen3-30b-a3b Q4_0 48 ${SKEW48:-0} $M 120
    timeout ${CTSECS:-240} python3 bench/chat_turns.py $M --prompt-len ${CTLENS:-1500,6000} --new ${CTNEW:-40} \
      > "$OUT/chatturns.json" 2> "$OUT/chatturns.err"; grep -v Warning "$OUT/chatturns.err" | tail -8
    [ -n "${KEEP48:-}" ] || rm -f $M ;;
  deqtiles)
    # the prefill's expert dequantizer at several tiles (bench/dequant_tiles.py; DQFMT formats)
    for F in ${DQFMT:-Q4_0}; do
      timeout ${DQSECS:-120} python3 bench/dequant_tiles.py --fmt $F > "$OUT/deqtiles_$F.json" 2> "$OUT/deqtiles_$F.err"
      cat "$OUT/deqtiles_$F.err" | tail -22
    done ;;
  g8skew)
    M=$DATA/q30-Q4_0-48-skew.gguf
    synth qwen3-30b-a3b Q4_0 48 0.5 $M 120
    bench g8skew ${G8SECS:-200} $M --prompt-len 512 --gen 64 --gpu-mem 8GiB --compare "lfu:--gpu-mem 8GiB --cache-policy lfu"
    rm -f $M ;;
  longctx)
    Q=$DATA/qnext-4.gguf
    synth qwen3-next-80b-a3b Q4_0 4 0.5 $Q 40
    timeout 80 python3 bench/bench_long_context.py $Q --prompt-len 4096,32768 --gen 32 --chunk 4096 \
      --snapshot-every 16384 > "$OUT/long_ctx.json" 2> "$OUT/long_ctx.err"
    tail -4 "$OUT/long_ctx.err"; head -c 2500 "$OUT/long_ctx.json"; echo
    timeout 70 python3 bench/bench_long_context.py $Q --prompt-len 131072 --gen 16 --chunk 8192 --warmup 256 \
      > "$OUT/long_ctx_128k.json" 2> "$OUT/long_ctx_128k.err"
    tail -3 "$OUT/long_ctx_128k.err"; head -c 1500 "$OUT/long_ctx_128k.json"; echo
    rm -f $Q ;;
  uniform12)
    for S in ${SKEWS:-0 0.5}; do
      synth qwen3-30b-a3b Q4_0 12 $S $DATA/q30-12-skew$S.gguf 40
      bench uniform12_skew$S 45 $DATA/q30-12-skew$S.gguf --prompt-len 512 --gen 40 --gpu-mem 3GiB
    done ;;
  default)
    # bf16 on CUDA: dense + lm_head 9 MiB + KV (1024 tokens) 2 MiB + prefill workspace 238 MiB, experts 32 x 576 KiB:
    # 262 MiB caches 20 of 32 (5 a layer), 256 MiB 9 (`moetier plan moetier/assets/default --device cuda --ctx 1024`)
    TEXT="$(head -c 1800 docs/perf-log.md | tr '\n' ' ')"
    for G in none 262MiB 256MiB; do
      B=""; [ $G != none ] && B="--gpu-mem $G"
      timeout 60 python3 -m moetier run --device cuda --ctx 1024 --max-tokens 200 --temperature 0 $B $FLAGS --json \
        --prompt "$TEXT" > "$OUT/default_$G.json" 2> "$OUT/default_$G.err"
      tail -2 "$OUT/default_$G.err"
      python3 - "$OUT/default_$G.json" "$G" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "no json:", e); sys.exit()
s = d.get("stats", {}); m = s.get("memory") or {}
print(sys.argv[2], {k: s.get(k) for k in ("prompt_tokens", "completion_tokens", "decode_tok_s", "prefill_tok_s", "decode_path")},
      {k: m.get(k) for k in ("hit_rate", "graph", "slots", "hits", "misses", "cpu_ms", "gpu_ms", "copy_ms")})
PY
    done ;;
  sampling)
    timeout 120 python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_sampling.py -k cuda --tb=short 2>&1 | tail -25
    timeout ${SSECS:-120} python3 bench/bench_sampling.py --device cuda --rounds 3 --calls 50 > "$OUT/sampling.json" \
      2> "$OUT/sampling.err"
    tail -30 "$OUT/sampling.err" | cut -c1-300 ;;
  kernels)
    # (KONLY: those variants only, e.g. v5q,v5pdl)
    timeout ${KSECS:-120} python3 bench/bench_gpu_kernels.py --variants --budget ${KBUDGET:-40} --only "${KONLY:-}" \
      --fmt ${KFMT:-dense,Q8_0,Q4_0,Q4_K,Q5_K,Q6_K,MXFP4,IQ3_XXS} > "$OUT/gpu_kernels.json" 2> "$OUT/gpu_kernels.err"
    grep -E "shipped tiles|best|v5|variants:" "$OUT/gpu_kernels.err" | tail -40 ;;
  qlinear)
    # dense GEMVs on GGUF blocks (QuantLinear) at the attention / lm_head shapes vs cuBLAS bf16, tiles; then Q4_K_M's
    # mixed qkv (Q4_K q + k, Q6_K v): a quantizer + GEMV per part and a cat vs ops.qlinear_parts (session 22)
    # (QSHAPES: those shapes only, e.g. qkv,o; each tile with its quantizer and with x's int8 copy given: "pre")
    timeout ${QSECS:-180} python3 bench/bench_gpu_kernels.py --qlinear --budget ${QBUDGET:-90} --fmt ${QFMT:-Q4_0,Q8_0,Q4_K,Q6_K} \
      --only "${QSHAPES:-}" > "$OUT/qlinear.json" 2> "$OUT/qlinear.err"
    grep -E "qlinear|qkv mixed" "$OUT/qlinear.err" | cut -c1-160 | tail -${QLINES:-60} ;;
  missbench)
    # the C miss server alone (no GPU): GB/s of expert bytes against the RAM read taken around each round.
    # MVARIANTS (default 6,0): 0 the phases with barriers, 1 the old loops, 2 down over the experts' rows, 3 variant
    # 0's reads without the math;
    # MPF="4096 8192": one process per software-prefetch distance (MOETIER_PREFETCH_AHEAD); MMISSES misses a layer;
    # MPOOLS=plain,x8: the pool's GGML rows and the same rows interleaved by 8
    for PF in ${MPF:-default}; do
      [ "$PF" = default ] && unset MOETIER_PREFETCH_AHEAD || export MOETIER_PREFETCH_AHEAD=$PF
      timeout ${MSECS:-150} python3 bench/bench_miss_server.py --threads ${MTHREADS:-16} --gib ${MGIB:-12} \
        --types ${MTYPES:-Q4_0,Q8_0,Q4_K} --variants ${MVARIANTS:-6,0} --rounds ${MROUNDS:-3} --misses ${MMISSES:-5} --pools ${MPOOLS:-plain} \
        > "$OUT/missbench_$PF.json" 2> "$OUT/missbench_$PF.err"
      tail -3 "$OUT/missbench_$PF.err"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('pf', sys.argv[2], d['rounds'], [(r['qtype'], r['variant'], r['gbps_best']) for r in d['results']])" "$OUT/missbench_$PF.json" $PF
    done
    unset MOETIER_PREFETCH_AHEAD ;;
  layout)
    # GGUF rows vs rows interleaved by 8 in the C int8 matvec, in cache and from RAM (bench/bench_cpu_layout.py)
    timeout ${LSECS:-200} python3 bench/bench_cpu_layout.py --threads ${LTHREADS:-1,15} --gib ${LGIB:-2} \
      --types ${LTYPES:-Q4_0,Q8_0} --rounds ${LROUNDS:-3} > "$OUT/layout.json" 2> "$OUT/layout.err"
    tail -3 "$OUT/layout.err"; grep -v '^{"machine' "$OUT/layout.json" ;;
  rawq)
    # the formats the GPU reads as stored (kernels/triton_rawq.py: Q2_K, Q3_K, IQ4_XS, IQ2_*, IQ3_S, IQ1_*): their GPU
    # tests (the Qwen3-shape test's libgguf packing of 25M i-quant weights is slow: the bench's pair checks those shapes
    # against the twin), then the decode pair (v2: element gathers) at Qwen3-30B-A3B's shapes against Q4_0's pairs
    # (session 41: both files ran out of 200 s after 3 tests; the tests step's cuda_module covers test_quant_experts)
    timeout ${RQTSECS:-300} python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_kernels_triton.py \
      --tb=short -k "${RQK:-(Q2_K or Q3_K or IQ4_XS or IQ2_ or IQ3_S or IQ1_) and not qwen3_shapes}" \
      > "$OUT/rawq_tests.txt" 2>&1
    grep -E "^E |passed|failed|FAILED" "$OUT/rawq_tests.txt" | tail -14
    timeout ${RQBSECS:-240} python3 bench/bench_gpu_kernels.py --variants --only ${RQONLY:-v2,v5qx} \
      --fmt ${RQFMT:-Q4_0,Q2_K,Q3_K,IQ4_XS,IQ2_XXS,IQ2_XS,IQ2_S,IQ3_S,IQ1_S,IQ1_M} --budget ${RQBUDGET:-200} \
      --out "$OUT/rawq.json" 2> "$OUT/rawq.err" > /dev/null
    grep "gate_up + down" "$OUT/rawq.err" | cut -c1-200 ;;
  v5new)
    # the v5 kernels no GPU had run (session 15: MXFP4, Q5_K, IQ3_XXS; Q4_K's math moved): their GPU tests, then
    # their pairs against v2 (the log goes to $OUT as it runs: the first compiles of ~40 kernels take minutes)
    timeout ${V5TSECS:-300} python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_kernels_triton.py \
      tests/test_quant_linear.py -k "${V5K:-v5 or MXFP4 or Q5_K or IQ3}" --tb=short > "$OUT/v5new_tests.txt" 2>&1
    grep -E "^E |passed|failed|FAILED" "$OUT/v5new_tests.txt" | tail -14
    timeout ${V5BSECS:-300} python3 bench/bench_gpu_kernels.py --variants --only v2,v5pdl \
      --fmt ${V5FMT:-MXFP4,Q5_K,IQ3_XXS,Q4_K} --budget ${V5BUDGET:-270} --out "$OUT/v5new.json" 2> "$OUT/v5new.err"
    grep -E "pair" "$OUT/v5new.err" | cut -c1-220 | tail -12 ;;
  v5ab)
    # the decode pairs of this tree against a snapshot in .run (e.g. HEAD: `git archive HEAD | tar -x -C .run`,
    # carried), interleaved new / old / new in one call: ABFMT formats, ABONLY variants
    for R in new old new; do
      D=.; [ $R = old ] && D=.run
      [ -d $D ] || continue
      (cd $D && PYTHONPATH=$PWD:/tmp/site timeout ${ABSECS:-150} python3 bench/bench_gpu_kernels.py --variants --only ${ABONLY:-v5pdl} \
        --fmt ${ABFMT:-Q4_0,Q8_0,MXFP4} --budget 120 2> "$OUT/v5ab_$R.err" > /dev/null)
      grep "shipped tiles" "$OUT/v5ab_$R.err" | sed "s/^/$R /" | cut -c1-200
    done ;;
  v5qtiles)
    # v5pdl and v5q at the shipped tiles, then v5q at bench_gpu_kernels.PAIR_TILES_V5Q (from 32 gate_up rows, h
    # quantized in registers) (TFMT formats)
    timeout ${TLSECS:-280} python3 bench/bench_gpu_kernels.py --variants --only v5pdl,v5q,v5qtiles \
      --fmt ${TFMT:-Q4_0,MXFP4} --budget ${TLBUDGET:-250} --out "$OUT/v5qtiles.json" 2> "$OUT/v5qtiles.err" \
      > /dev/null
    grep "gate_up + down" "$OUT/v5qtiles.err" \
      | grep -oE "^ *[A-Z0-9_]+ v5[a-z]* gate_up \+ down, [^:]*: \{'us': [0-9.]+" ;;
  v5qx)
    # v5q against v5qx (gate_up's programs quantize x themselves: no quantizer launch in the pair), two runs
    for R in 1 2; do
      timeout ${TLSECS:-150} python3 bench/bench_gpu_kernels.py --variants --only v5q,v5qx \
        --fmt ${TFMT:-Q4_0,Q4_K,Q6_K} --budget ${TLBUDGET:-120} --out "$OUT/v5qx$R.json" 2> "$OUT/v5qx$R.err" > /dev/null
      grep "gate_up + down" "$OUT/v5qx$R.err" \
        | grep -oE "^ *[A-Z0-9_]+ v5qx? gate_up \+ down, [^:]*: \{'us': [0-9.]+, 'GBps': [0-9.]+, 'frac_of_copy': [0-9.]+"
    done ;;
  v5qxtiles)
    # v5q and v5qx at the shipped tiles, then v5qx at bench_gpu_kernels.PAIR_TILES_V5Q (session 30: v5qx slowed Q4_K's
    # 8-row tile, whose 768 programs each copy x)
    timeout ${TLSECS:-280} python3 bench/bench_gpu_kernels.py --variants --only v5q,v5qx,v5qxtiles \
      --fmt ${TFMT:-Q4_0,Q4_K,Q6_K} --budget ${TLBUDGET:-250} --out "$OUT/v5qxtiles.json" 2> "$OUT/v5qxtiles.err" \
      > /dev/null
    grep "gate_up + down" "$OUT/v5qxtiles.err" \
      | grep -oE "^ *[A-Z0-9_]+ v5qx? gate_up \+ down, [^:]*: \{'us': [0-9.]+, 'GBps': [0-9.]+, 'frac_of_copy': [0-9.]+" ;;
  v5qxdown)
    # v5qx's gate_up with the down tiles of bench_gpu_kernels.PAIR_TILES_V5QX_DOWN, and the registers the JIT gave
    # each kernel (bench/kernel_regs.py compiles without the launch's pointer alignment: session 35)
    timeout ${TLSECS:-280} python3 bench/bench_gpu_kernels.py --variants --only ${V5QXONLY:-v5qx,v5qxdown} \
      --fmt ${TFMT:-Q4_0} --budget ${TLBUDGET:-250} --out "$OUT/v5qxdown.json" 2> "$OUT/v5qxdown.err" > /dev/null
    grep -E "gate_up \+ down|compiled|MOETIER_V5_SPLIT" "$OUT/v5qxdown.err" | cut -c1-400 ;;
  gluon)
    # the Gluon gate_up experiment (TMA ring, ~one persistent program an SM): error against v5pdl's gate_up, times
    timeout ${TLSECS:-200} python3 bench/gluon_gate_up.py --ns ${GNS:-3,4,6} --nprog ${GNPROG:-132,264} \
      > "$OUT/gluon.json" 2> "$OUT/gluon.err"; tail -${GLINES:-12} "$OUT/gluon.err"; head -c 600 "$OUT/gluon.json" ;;
  v5qwave)
    # v5q at the shipped tiles, then at bench_gpu_kernels.PAIR_TILES_WAVE (tiles of about whole waves without spills)
    timeout ${TLSECS:-200} python3 bench/bench_gpu_kernels.py --variants --only v5q,v5qwave \
      --fmt ${TFMT:-Q4_0,Q4_K,Q6_K} --budget ${TLBUDGET:-170} --out "$OUT/v5qwave.json" 2> "$OUT/v5qwave.err" \
      > /dev/null
    grep "gate_up + down" "$OUT/v5qwave.err" \
      | grep -oE "^ *[A-Z0-9_]+ v5q gate_up \+ down, [^:]*: \{'us': [0-9.]+, 'GBps': [0-9.]+, 'frac_of_copy': [0-9.]+" ;;
  v5tiles)
    # the v5pdl pair at the tile combinations of bench_gpu_kernels.PAIR_TILES_V5 (TFMT formats), shipped tiles first
    timeout ${TLSECS:-280} python3 bench/bench_gpu_kernels.py --variants --only v5pdl,v5tiles --fmt ${TFMT:-Q4_0,MXFP4} \
      --budget ${TLBUDGET:-250} --out "$OUT/v5tiles.json" 2> "$OUT/v5tiles.err" > /dev/null
    grep "gate_up + down" "$OUT/v5tiles.err" | grep -oE "^ *[A-Z0-9_]+ v5pdl gate_up \+ down, [^:]*: \{'us': [0-9.]+" ;;
  pairprof)
    # where the T=1 decode pair's time goes: each kernel's device time, the gaps, one launch's read ceiling
    timeout ${PPRSECS:-150} python3 bench/bench_gpu_kernels.py --profile-pair --fmt ${KFMT:-Q4_0,Q8_0,Q4_K,Q6_K} \
      --only ${PPONLY:-v5pdl} > "$OUT/pairprof.json" 2> "$OUT/pairprof.err"
    tail -8 "$OUT/pairprof.err" | cut -c1-900 ;;
  timeline)
    # the T=1 decode pair program by program: waves, spans, down's start and end (bench/pair_timeline.py; KFMT)
    timeout ${TLSECS:-150} python3 bench/pair_timeline.py --fmt ${KFMT:-Q4_0,Q4_K,Q6_K,Q8_0} \
      --out "$OUT/timeline.json" 2> "$OUT/timeline.err" > /dev/null
    cut -c1-1500 "$OUT/timeline.err" | tail -${TLLINES:-16} ;;
  graphcheck)
    # where graph replays and eager steps part, and whether replays of one graph agree (bench/graph_check.py)
    for i in $(seq ${GCRUNS:-2}); do
      for F in --dequantize-dense ""; do
        timeout ${GCSECS:-120} python3 bench/graph_check.py $F > "$OUT/graphcheck_${i}${F}.json" 2> "$OUT/graphcheck_${i}${F}.err"
        tail -c 1500 "$OUT/graphcheck_${i}${F}.json"; echo; tail -3 "$OUT/graphcheck_${i}${F}.err"
      done
    done ;;
  doorbell12)
    for Q in Q4_0 BF16; do
      M=$DATA/q30-$Q; [ $Q != BF16 ] && M=$M.gguf
      synth qwen3-30b-a3b $Q 12 0.5 $M 150
      bench doorbell12_$Q 180 $M --prompt-len 512 --gen 64 --gpu-mem 3GiB --compare "eager:--no-cuda-graph"
    done ;;
  esac
done
# the device tool returns only a few files: one archive of everything
(cd "$OUT" && tar czf /tmp/session.tgz . && rm -rf ./* && mv /tmp/session.tgz .)
