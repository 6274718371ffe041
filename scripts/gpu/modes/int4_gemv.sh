# gpu_check.sh's modes for the int4 decode GEMV on the tensor cores (the int4 ring at one to a few rows), the
# switches around it, and issue 18's b1 cells that measure it beside block FP8 (ahead-decodes, b1-stack,
# norm-profile, norm-epilogue) (sourced by scripts/gpu/gpu_check.sh, which sets MODE, OUT and status). The
# block-FP8 wgmma GEMV's own modes are in fp8_gemv.sh.
# int4-mma (one GPU, ~5 min): the int4 GEMV on the tensor cores (kernels/int4_mma_gemv.py, quant_gemv.INT4_MMA_GEMV,
# off): its GPU tests with each 8B projection's time against the CUDA-core kernels (weights from HBM), the times
# again at 2 tiles a warp (int4_mma_gemv.REPS), two steps a loop turn (UNROLL, at REPS 4 and 2), through the shared
# ring (STAGES) and with quant_gemv's split-K choice instead of one wave (WAVE_SPLITS); each variant's time test
# checks its output against the CUDA-core kernels' first. int4-mma-decode (one GPU, ~5 min): the quantized engines' GPU tests with
# it on, then the 8B decode at batch 1 (32K), 8 (4K), 16 (8K) and 64 (4K: 4 blocks of 16 rows) in bf16 and in GPTQ
# int4 with it off and on (issue 18: int4 b1 <= 0.6x bf16's; b64 1.40x bf16 at 11fea55). int4-mma-moe (one GPU, ~7 min): the A3B int4 experts' GPU tests (each path's time) and the A3B
# int4 decode at batch 1 (32K) and 8 (4K), with it off and on (the routed expert GEMV on the tensor cores).
# int4-reps2 (one GPU, ~4 min): the 8B GPTQ int4 decode at b1@32K, b16@8K and b64@4K with the defaults (the mma GEMV
# from 2 rows, 4 tiles a warp) and with 2 tiles a warp from one row (int4_mma_gemv.REPS=2,
# quant_gemv.INT4_MMA_MIN_ROWS=1: per projection 58.6 against 76.8 us a layer at one row, twenty-fifth session).
# int4-profile (one GPU, ~3 min): the 8B GPTQ int4 decode at b1@32K under the profiler (its top kernels) with the
# CUDA-core GEMV at one row (the default), the mma GEMV from one row, and the mma GEMV at 2 tiles a warp: per
# projection the mma GEMV at REPS 2 wins (58.6 against 76.8 us a layer) but the engine lost (4.64 against 4.14 ms,
# twenty-sixth session): which kernels take the difference.
# gemv-prefetch (one GPU, ~5 min): the int4 GEMVs asking L2 for their weights ahead (int4_gemv.INT4_GEMV_PREFETCH,
# int4_mma_gemv.PREFETCH: tiles ahead, the first before the PDL wait): the mma kernel's GPU tests with 2, each 8B
# projection's time at 1 and 16 rows with 0, 2 and 4, then the 8B int4 decode at b1@32K and b16@8K with 0 and 2.
# int4-wave (one GPU, ~5 min): why the mma GEMV is slower in the decode than alone (twenty-sixth session's profile:
# 102 against 84.3 us a layer at REPS 4, 92.7 against 58.6 at REPS 2; the CUDA-core kernel 76.8 in both): the 8B
# int4 decode at b1@32K from one row at REPS 2 with the grid sized for 6 (one wave by registers), 4 and 3 programs
# an SM (`_RESIDENT`), with programmatic dependent launch off, and with splits of at least 4 and 8 steps
# (`MIN_SPLIT_STEPS`), beside the defaults.
# int4-tma (one GPU, ~7 min): the int4 mma GEMV's words by a TMA ring (int4_mma_gemv.STAGES past 0): its GPU tests at
# 2 stages (and the routed experts' through it), the 8B projections alone at 2, 3 and 4 stages and at REPS 2 with 4,
# then the 8B int4 decode (b1@32K, b16@8K) on the mma GEMV at 0 (the registers), 2 and 4 stages at every row count
# beside the defaults (since 6f283db ONE_ROW's ring at one row) and bf16. Issue 18: int4 b1 <= 0.6x bf16 (0.73x at
# 0aed29a); the kernel alone was 2.2-2.6x its HBM floor at one row (bytes in flight).
# int4-ncu (one GPU, ~2 min): Nsight Compute on the 8B int4 GEMVs at one row, the mma GEMV by its TMA ring and the
# CUDA-core kernel (scripts/probes/int4_ncu.py): HBM throughput, occupancy and the warps' stall reasons, for what
# holds gate_up at 24.3 us against 14 and qkv at 8.5 against 3 (issue 18's int4 b1 at 0.651x bf16, target 0.6x).
# tma-stream (one GPU, ~1 min): GB/s of TMA streaming 256 MB of 2 KB rows by box shape, and of the same bytes in
# contiguous tiles (scripts/probes/tma_stream.py): whether the int4 ring's 64 bytes a row a step hold it below HBM's
# rate (its gate_up 24.3 us against 14 of bytes), as a guide to repacking the int4 weights by tile.
# int4-slots (one GPU, ~5 min): the int4 ring's slots of 2 steps (int4_mma_gemv.STAGE_STEPS 2: 128 bytes of each row
# a box, against 64): the kernel's GPU tests with it (and STAGES 2 at every row count), the 8B projections alone at
# one row at 1 and 2, the 8B int4 decode b1@32K at 1 and 2 beside bf16. After tma-stream, which says whether it can.
# int4-ahead (one GPU, ~8 min): the int4 ring's x and group scales asked for a step ahead (int4_mma_gemv.AHEAD): the
# 8B int4 decode b1@32K off / on beside bf16 and on at rings of 3 and 4 stages, the kernel's GPU tests with it (the
# ring at every row count, the routed experts), the 8B projections alone at one row off and on, and ncu's PC sampling
# of the gate_up by the ring off and on (which instructions its warps wait at: the counters said long scoreboard,
# twenty-ninth session).
# ahead-decodes (one GPU, ~5 min): int4-ahead's and fp8-ahead's decodes alone (no tests, no ncu), for a short call;
# bf16 and FP8 at b8@8K too (FP8's AHEAD acts up to 8 rows).
# b1-stack (one GPU, ~8 min): issue 18's two batch-1 cells (8B int4 <= 0.6x, block FP8 <= 0.7x bf16 at b1@32K) at the
# defaults, then with each switch turned on in the thirty-first session off alone, to see what each gives on the card
# (measured on an H100): the loads before the PDL wait (launch.PDL_EARLY_LOADS; bf16 too), silu(gate) * up inside the
# GEMV (quant_gemv.INT4_MMA_GATED / quant_fp8.FP8_WGMMA_GATED), FP8's splits of at least 4 K blocks
# (fp8_wgmma_gemv.MIN_SPLIT_BLOCKS). Decodes only, packed after each run.
# norm-profile (one GPU, ~4 min): the 8B int4 and FP8 decode b1@32K with NORM_EPILOGUE off and on under --profile
# (each kernel's time past the ones before it): where the 0.22 ms it lost at int4 b1 (thirty-first session) goes.
# norm-epilogue (one GPU, ~6 min): the next RMSNorm in the one-row int4 and FP8 GEMVs' epilogue
# (gluon_gemv.NORM_EPILOGUE): the kernels' GPU tests against fused_add_rms_norm after the product, the engine's
# (AWQ, FP8 blocks: first steps agree off / on), then the 8B decode b1@32K int4 and FP8 off / on beside bf16.
# int4-gated (one GPU, ~6 min): silu(gate) * up inside the int4 mma GEMV at one row (quant_gemv.INT4_MMA_GATED): its
# GPU test (the silu-first route's sums, a CUDA graph), then the 8B int4 decode b1@32K off / on beside bf16, and off /
# on with int4_mma_gemv.AHEAD: on if b1 gains (the SiLU launch was 0.081 ms of the 3.71 ms step).
# shellcheck shell=bash

if [[ $MODE == int4-mma ]]; then  # one GPU (~5 min): the tensor-core int4 GEMV, its tests and variants' times
  timeout 240 python3 -m pytest -q -s -m gpu tests/gpu/test_int4_mma_gemv_gpu.py -p no:cacheprovider --tb=short \
    -rfE 2>&1 | tee "$OUT/gpu_tests_int4_mma.log" | grep -E "int4 mma|passed|failed" || status=1
  # the default (REPS=4 STAGES=0 WAVE_SPLITS=True) ran above
  for variant in "REPS=2" "UNROLL=2" "REPS=2 UNROLL=2" "STAGES=2" "WAVE_SPLITS=False"; do
    consts=(); for c in $variant; do consts+=("longserve.kernels.int4_mma_gemv.$c"); done
    timeout 120 python3 scripts/probes/with_constants.py "${consts[@]}" -- pytest -q -s -m gpu \
      tests/gpu/test_int4_mma_gemv_gpu.py::test_times[1] tests/gpu/test_int4_mma_gemv_gpu.py::test_times[16] \
      tests/gpu/test_int4_mma_gemv_gpu.py::test_times[64] -p no:cacheprovider --tb=short -rfE 2>&1 \
      | tee "$OUT/gpu_tests_int4_mma_${variant// /_}.log" | grep -E "int4 mma|passed|failed" | sed "s/^/$variant: /" \
      || status=1
  done
fi

if [[ $MODE == int4-mma-decode ]]; then  # one GPU (~5 min): the quantized engines with it on, the 8B decode
  timeout 300 python3 scripts/probes/with_constants.py longserve.kernels.quant_gemv.INT4_MMA_GEMV=True -- \
    pytest -q -m gpu tests/gpu/test_quant_engine_gpu.py -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_int4_mma_engines.log" | tail -4 || status=1
  # bf16 in the same call: issue 18's ratio (int4 decode b1@32K <= 0.6x bf16's)
  latency_with int4_mma_bf16 "bf16" -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
    --decode-batch-sizes 1@32768,8@4096,16@8192,64@4096
  for on in False True; do
    latency_with int4_mma_$on "int4 INT4_MMA_GEMV=$on" longserve.kernels.quant_gemv.INT4_MMA_GEMV=$on -- \
      --config llama-3.1-8b "${dummy[@]}" --repeat 3 --quantization gptq \
      --decode-batch-sizes 1@32768,8@4096,16@8192,64@4096
  done
fi

if [[ $MODE == int4-mma-moe ]]; then  # one GPU (~7 min): the routed expert GEMV on the tensor cores, the A3B decode
  for on in False True; do
    timeout 150 python3 scripts/probes/with_constants.py longserve.kernels.quant_gemv.INT4_MMA_ROUTED=$on -- \
      pytest -q -s -m gpu tests/gpu/test_quant_kernels_gpu.py -k int4_experts -p no:cacheprovider --tb=short -rfE \
      2>&1 | tee "$OUT/gpu_tests_int4_experts_mma$on.log" | grep -E "int4 experts|passed|failed" | sed "s/^/mma=$on: /"
  done
  for on in False True; do
    LATENCY_TIMEOUT=150 latency_with a3b_int4_mma_$on "A3B int4 INT4_MMA_ROUTED=$on" \
      longserve.kernels.quant_gemv.INT4_MMA_ROUTED=$on -- --config qwen3-30b-a3b "${dummy[@]}" --repeat 3 \
      --quantization gptq --decode-batch-sizes 1@32768,8@4096,16@8192
  done
fi

if [[ $MODE == int4-reps2 ]]; then  # one GPU (~4 min): the int4 mma GEMV at 2 tiles a warp from one row, in the decode
  latency_with int4_defaults "int4 defaults" -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 --quantization gptq \
    --decode-batch-sizes 1@32768,16@8192,64@4096
  latency_with int4_reps2 "int4 REPS=2 MIN_ROWS=1" longserve.kernels.int4_mma_gemv.REPS=2 \
    longserve.kernels.int4_mma_gemv.ONE_ROW=None \
    longserve.kernels.quant_gemv.INT4_MMA_MIN_ROWS=1 -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
    --quantization gptq --decode-batch-sizes 1@32768,16@8192,64@4096
fi

if [[ $MODE == int4-profile ]]; then  # one GPU (~3 min): where the int4 mma GEMV's engine time at one row goes
  for v in "" "longserve.kernels.quant_gemv.INT4_MMA_MIN_ROWS=1" \
    "longserve.kernels.quant_gemv.INT4_MMA_MIN_ROWS=1 longserve.kernels.int4_mma_gemv.REPS=2 longserve.kernels.int4_mma_gemv.ONE_ROW=None"; do
    name=int4_profile_$(( ${#v} ? $(wc -w <<< "$v") : 0 ))
    # shellcheck disable=SC2086
    LATENCY_TIMEOUT=120 latency_with "$name" "${v:-defaults}" $v -- --config llama-3.1-8b "${dummy[@]}" \
      --repeat 3 --quantization gptq --decode-batch-sizes 1@32768 --profile
    top_ops "$OUT/latency_$name.json"
  done
fi

if [[ $MODE == gemv-prefetch ]]; then  # one GPU (~5 min): the int4 GEMVs' L2 prefetch, per projection and in the decode
  pf() { echo "longserve.kernels.int4_gemv.INT4_GEMV_PREFETCH=$1 longserve.kernels.int4_mma_gemv.PREFETCH=$1"; }
  # shellcheck disable=SC2046
  timeout 150 python3 scripts/probes/with_constants.py $(pf 2) -- pytest -q -m gpu tests/gpu/test_int4_mma_gemv_gpu.py \
    -k "not times" -p no:cacheprovider --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_int4_prefetch.log" | tail -3 \
    || status=1
  for n in 0 2 4; do
    # shellcheck disable=SC2046
    timeout 100 python3 scripts/probes/with_constants.py $(pf $n) -- pytest -q -s -m gpu \
      tests/gpu/test_int4_mma_gemv_gpu.py::test_times[1] tests/gpu/test_int4_mma_gemv_gpu.py::test_times[16] \
      -p no:cacheprovider --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_int4_prefetch_$n.log" \
      | grep -E "int4 mma|passed|failed" || status=1
  done
  for n in 0 2; do
    # shellcheck disable=SC2046
    latency_with int4_prefetch_$n "int4 PREFETCH=$n" $(pf $n) -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
      --quantization gptq --decode-batch-sizes 1@32768,16@8192
  done
fi

if [[ $MODE == int4-wave ]]; then  # one GPU (~5 min): the mma GEMV's wave and PDL in the decode
  mma=(longserve.kernels.quant_gemv.INT4_MMA_MIN_ROWS=1 longserve.kernels.int4_mma_gemv.REPS=2
       longserve.kernels.int4_mma_gemv.ONE_ROW=None)
  # programs an SM the grid is sized for at REPS 2 (one token tile): 6 fill every place (one wave by registers)
  # (its min_steps variants: each program at least 4 or 8 of the K steps, MIN_SPLIT_STEPS)
  for v in defaults mma6 mma4 mma3 mma6_nopdl mma6_min4 mma6_min8; do
    consts=()
    [[ $v == mma* ]] && consts=("${mma[@]}")
    [[ $v == mma[0-9]* ]] && consts+=("longserve.kernels.int4_mma_gemv._RESIDENT={(4, 1): 3, (2, 1): ${v:3:1}, (4, 2): 2, (2, 2): 3}")
    [[ $v == *_nopdl ]] && consts+=(longserve.kernels.launch.PDL=False)
    [[ $v == *_min* ]] && consts+=("longserve.kernels.int4_mma_gemv.MIN_SPLIT_STEPS=${v##*_min}")
    LATENCY_TIMEOUT=100 latency_with "int4_wave_$v" "$v" "${consts[@]}" -- --config llama-3.1-8b "${dummy[@]}" \
      --repeat 3 --quantization gptq --decode-batch-sizes 1@32768
  done
fi

if [[ $MODE == int4-tma ]]; then  # one GPU (~7 min): the int4 mma GEMV fed by a TMA ring
  ring=longserve.kernels.int4_mma_gemv.STAGES
  timeout 150 python3 scripts/probes/with_constants.py $ring=2 longserve.kernels.int4_mma_gemv.ONE_ROW=None -- \
    pytest -q -s -m gpu \
    tests/gpu/test_int4_mma_gemv_gpu.py -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_int4_tma.log" | grep -E "int4 mma|passed|failed" || status=1
  timeout 100 python3 scripts/probes/with_constants.py $ring=2 longserve.kernels.quant_gemv.INT4_MMA_ROUTED=True \
    -- pytest -q -m gpu tests/gpu/test_quant_kernels_gpu.py -k int4_experts -p no:cacheprovider --tb=short -rfE \
    2>&1 | tee "$OUT/gpu_tests_int4_tma_experts.log" | tail -3 || status=1
  for variant in "STAGES=3" "STAGES=4" "REPS=2 STAGES=4"; do
    consts=(longserve.kernels.int4_mma_gemv.ONE_ROW=None)
    for c in $variant; do consts+=("longserve.kernels.int4_mma_gemv.$c"); done
    timeout 90 python3 scripts/probes/with_constants.py "${consts[@]}" -- pytest -q -s -m gpu \
      tests/gpu/test_int4_mma_gemv_gpu.py::test_times[1] tests/gpu/test_int4_mma_gemv_gpu.py::test_times[16] \
      -p no:cacheprovider --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_int4_tma_${variant// /_}.log" \
      | grep -E "int4 mma|passed|failed" | sed "s/^/$variant: /" || status=1
  done
  cases=(--config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 1@32768,16@8192)
  LATENCY_TIMEOUT=100 latency_with int4_tma_bf16 "bf16" -- "${cases[@]}"
  for v in defaults 0 2 4; do
    consts=()
    [[ $v != defaults ]] && consts=(longserve.kernels.int4_mma_gemv.ONE_ROW=None "$ring=$v")
    LATENCY_TIMEOUT=100 latency_with "int4_tma_$v" "int4 stages=$v" "${consts[@]}" -- "${cases[@]}" \
      --quantization gptq
  done
fi

if [[ $MODE == int4-ncu ]]; then  # one GPU (~2 min): where the int4 GEMVs' time goes at one row, by the counters
  ncu_bin=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2> /dev/null | head -1)}
  stalls=$(python3 -c "import sys; sys.path.insert(0, 'scripts/probes'); import int4_ncu; print(','.join(int4_ncu.STALLS))")
  PYTHONPATH=$PWD timeout 240 "$ncu_bin" --clock-control none --profile-from-start off --csv --page details \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --metrics "$stalls" \
    python3 scripts/probes/int4_ncu.py > "$OUT/int4_ncu.csv" 2> "$OUT/int4_ncu.log" || status=1
  python3 scripts/probes/int4_ncu.py --summary "$OUT/int4_ncu.csv" | tee "$OUT/int4_ncu_summary.txt"
fi

if [[ $MODE == tma-stream ]]; then  # one GPU (~1 min): HBM's rate by TMA box shape
  PYTHONPATH=$PWD timeout 120 python3 scripts/probes/tma_stream.py 2>&1 | tee "$OUT/tma_stream.log" | grep -E '^\{|Error' \
    || status=1
fi

if [[ $MODE == int4-slots ]]; then  # one GPU (~5 min): the int4 ring's boxes of 128 bytes a row
  mma=longserve.kernels.int4_mma_gemv
  timeout 120 python3 scripts/probes/with_constants.py $mma.STAGE_STEPS=2 $mma.STAGES=2 -- pytest -q -m gpu \
    tests/gpu/test_int4_mma_gemv_gpu.py -k "not times" -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_int4_slots.log" | tail -3 || status=1
  for n in 1 2; do
    timeout 60 python3 scripts/probes/with_constants.py $mma.STAGE_STEPS=$n -- pytest -q -s -m gpu \
      "tests/gpu/test_int4_mma_gemv_gpu.py::test_times[1]" -p no:cacheprovider --tb=short -rfE 2>&1 \
      | tee "$OUT/gpu_tests_int4_slots_times$n.log" | grep -E "int4 mma|passed|failed" | sed "s/^/steps a slot $n: /"
  done
  cases=(--config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 1@32768)
  LATENCY_TIMEOUT=100 latency_with int4_slots_bf16 "bf16" -- "${cases[@]}"
  for n in 1 2; do
    LATENCY_TIMEOUT=100 latency_with "int4_slots_$n" "int4 steps a slot $n" $mma.STAGE_STEPS=$n -- "${cases[@]}" \
      --quantization gptq
  done
fi

if [[ $MODE == int4-gated ]]; then  # one GPU (~4 min): silu(gate) * up inside the int4 GEMV at one row
  timeout 90 python3 -m pytest -q -s -m gpu tests/gpu/test_int4_mma_gemv_gpu.py -k gated -p no:cacheprovider \
    --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_int4_gated.log" | grep -E "int4 gated|passed|failed" || status=1
  cases=(--config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 1@32768)
  LATENCY_TIMEOUT=100 latency_with int4_gated_bf16 "bf16" -- "${cases[@]}"
  for on in False True; do
    LATENCY_TIMEOUT=100 latency_with "int4_gated_$on" "int4 INT4_MMA_GATED=$on" \
      longserve.kernels.quant_gemv.INT4_MMA_GATED=$on -- "${cases[@]}" --quantization gptq
  done
  # off and on again with each step's x (gated: gate and up) and scales asked for a step ahead (int4_mma_gemv.AHEAD)
  for on in False True; do
    LATENCY_TIMEOUT=100 latency_with "int4_gated_ahead_$on" "int4 AHEAD, INT4_MMA_GATED=$on" \
      longserve.kernels.int4_mma_gemv.AHEAD=True \
      longserve.kernels.quant_gemv.INT4_MMA_GATED=$on -- "${cases[@]}" --quantization gptq
  done
fi

if [[ $MODE == int4-ahead ]]; then  # one GPU (~8 min): the int4 ring's x and scales asked for a step ahead
  mma=longserve.kernels.int4_mma_gemv
  # the decode first (a call cut short keeps it)
  cases=(--config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 1@32768)
  LATENCY_TIMEOUT=100 latency_with int4_ahead_bf16 "bf16" -- "${cases[@]}"
  for on in False True; do
    LATENCY_TIMEOUT=100 latency_with "int4_ahead_$on" "int4 AHEAD=$on" $mma.AHEAD=$on -- "${cases[@]}" \
      --quantization gptq
  done
  # deeper rings with it: 3 and 4 stages lost before (twenty-eighth session), when each step also waited on x
  for stages in 3 4; do
    LATENCY_TIMEOUT=100 latency_with "int4_ahead_s$stages" "int4 AHEAD (2, $stages)" $mma.AHEAD=True \
      "$mma.ONE_ROW=(2, $stages)" -- "${cases[@]}" --quantization gptq
  done
  timeout 120 python3 scripts/probes/with_constants.py $mma.AHEAD=True $mma.STAGES=2 -- pytest -q -m gpu \
    tests/gpu/test_int4_mma_gemv_gpu.py -k "not times" -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_int4_ahead.log" | tail -3 || status=1
  timeout 90 python3 scripts/probes/with_constants.py $mma.AHEAD=True $mma.STAGES=2 \
    longserve.kernels.quant_gemv.INT4_MMA_ROUTED=True -- pytest -q -m gpu tests/gpu/test_quant_kernels_gpu.py \
    -k int4_experts -p no:cacheprovider --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_int4_ahead_experts.log" \
    | tail -3 || status=1
  for on in False True; do
    timeout 60 python3 scripts/probes/with_constants.py $mma.AHEAD=$on -- pytest -q -s -m gpu \
      "tests/gpu/test_int4_mma_gemv_gpu.py::test_times[1]" -p no:cacheprovider --tb=short -rfE 2>&1 \
      | tee "$OUT/gpu_tests_int4_ahead_times_$on.log" | grep -E "int4 mma|passed|failed" | sed "s/^/AHEAD=$on: /"
  done
  # where the ring's warps wait, instruction by instruction (PC sampling), for the 8B gate_up at one row
  ncu_bin=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2> /dev/null | head -1)}
  for v in "mma ring" "mma ring ahead"; do
    PYTHONPATH=$PWD timeout 100 "$ncu_bin" --clock-control none --profile-from-start off --section SourceCounters \
      --page source --csv --print-source sass python3 scripts/probes/int4_ncu.py --only "gate_up $v" \
      > "$OUT/int4_source_${v// /_}.csv" 2> "$OUT/int4_source_${v// /_}.log" || status=1
    echo "== gate_up $v"
    python3 scripts/probes/int4_ncu.py --source-summary "$OUT/int4_source_${v// /_}.csv" | head -24 \
      | tee "$OUT/int4_source_${v// /_}.txt"
  done
fi

if [[ $MODE == ahead-decodes ]]; then  # one GPU (~5 min): int4-ahead's and fp8-ahead's decodes alone, one bf16 beside
  cases=(--config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 1@32768)
  # FP8's AHEAD acts up to 8 rows: b8 too (bf16 beside it)
  cases8=(--config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 1@32768,8@8192)
  # packed after each run (a call cut short by the device's time keeps what ran): int4 first, then FP8
  pack() { (cd "$OUT/.." && tar czf "$(basename "$OUT").tgz" "$(basename "$OUT")"); }
  LATENCY_TIMEOUT=130 latency_with ahead_bf16 "bf16" -- "${cases8[@]}"
  pack
  for on in False True; do
    LATENCY_TIMEOUT=100 latency_with "int4_ahead_$on" "int4 AHEAD=$on" longserve.kernels.int4_mma_gemv.AHEAD=$on \
      -- "${cases[@]}" --quantization gptq
    pack
  done
  for on in False True; do
    LATENCY_TIMEOUT=130 latency_with "fp8_ahead_$on" "FP8 blocks AHEAD=$on" longserve.kernels.fp8_wgmma_gemv.AHEAD=$on \
      -- "${cases8[@]}" --hf-overrides "$fp8"
    pack
  done
fi

if [[ $MODE == b1-stack ]]; then  # one GPU (~3 min): issue 18's b1 cells at the defaults, each switch off beside
  cases=(--config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 1@32768)
  pack() { (cd "$OUT/.." && tar czf "$(basename "$OUT").tgz" "$(basename "$OUT")"); }
  early=longserve.kernels.launch.PDL_EARLY_LOADS=False
  for variant in bf16 int4 fp8; do
    q=(); offs=()
    [[ $variant == int4 ]] && { q=(--quantization gptq); offs=(longserve.kernels.quant_gemv.INT4_MMA_GATED=False); }
    [[ $variant == fp8 ]] && { q=(--hf-overrides "$fp8"); offs=(longserve.kernels.quant_fp8.FP8_WGMMA_GATED=False
      longserve.kernels.fp8_wgmma_gemv.MIN_SPLIT_BLOCKS=1); }
    LATENCY_TIMEOUT=100 latency_with "stack_${variant}_defaults" "$variant defaults" -- "${cases[@]}" ${q[@]+"${q[@]}"}
    pack
    for off in $early ${offs[@]+"${offs[@]}"}; do
      name=${off#longserve.kernels.}
      LATENCY_TIMEOUT=100 latency_with "stack_${variant}_${name%%=*}" "$variant $name" "$off" -- "${cases[@]}" \
        ${q[@]+"${q[@]}"}
      pack
    done
  done
fi

if [[ $MODE == norm-profile ]]; then  # one GPU (~4 min): where the norm epilogue's b1 time goes, off / on
  for variant in int4 fp8; do
    q=(--quantization gptq)
    [[ $variant == fp8 ]] && q=(--hf-overrides "$fp8")
    for on in False True; do
      LATENCY_TIMEOUT=120 latency_with "norm_profile_${variant}_$on" "$variant NORM_EPILOGUE=$on" \
        longserve.kernels.gluon_gemv.NORM_EPILOGUE=$on -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
        --decode-batch-sizes 1@32768 --profile "${q[@]}"
      top_ops "$OUT/latency_norm_profile_${variant}_$on.json"
    done
  done
fi

if [[ $MODE == norm-epilogue ]]; then  # one GPU (~6 min): the next RMSNorm in the one-row GEMVs' epilogue
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_int4_mma_gemv_gpu.py tests/gpu/test_fp8_wgmma_gemv_gpu.py \
    -k norm_in_the_epilogue -p no:cacheprovider --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_norm_epilogue.log" \
    | tail -3 || status=1
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_quant_engine_gpu.py -k norm_in_the_gemv \
    -p no:cacheprovider --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_norm_epilogue_engine.log" | tail -3 || status=1
  cases=(--config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 1@32768)
  LATENCY_TIMEOUT=100 latency_with norm_bf16 "bf16" -- "${cases[@]}"
  for variant in int4 fp8; do
    q=(--quantization gptq)
    [[ $variant == fp8 ]] && q=(--hf-overrides "$fp8")
    for on in False True; do
      LATENCY_TIMEOUT=100 latency_with "norm_${variant}_$on" "$variant NORM_EPILOGUE=$on" \
        longserve.kernels.gluon_gemv.NORM_EPILOGUE=$on -- "${cases[@]}" "${q[@]}"
    done
  done
fi
