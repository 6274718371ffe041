# gpu_check.sh's modes for the block-FP8 decode GEMV on the tensor cores (TMA + wgmma) at one to a few rows and the
# switches around it (sourced by scripts/gpu/gpu_check.sh, which sets MODE, OUT and status). issue 18's b1 modes
# that measure it beside int4 (ahead-decodes, b1-stack, norm-profile, norm-epilogue) are in int4_gemv.sh.
# fp8-wgmma (one GPU, ~8 min): the FP8 GEMV on the tensor cores (kernels/fp8_wgmma_gemv.py, TMA ring + wgmma;
# quant_fp8.FP8_WGMMA_GEMV, off; FP8_WGMMA_CHANNEL, on from 2 rows): its GPU tests with each 8B projection's time at
# 1-32 rows against what serves without it (block and per-channel scales), the times again with 4 and 6 weight tiles
# in flight (STAGES, 2 by default) and with
# no promotion inside a K block (FP8_DOT_MAX_IMPRECISE_ACC=None), the FP8 engines' GPU tests with it on, then the
# 8B decode at batch 1 (32K), 8 (4K), 16 (8K) and 32 (4K) in bf16 and in block FP8 with it off and on (issue 18:
# FP8 b1 <= 0.7x bf16's; 0.74x at 11fea55), and per channel (`--quantization fp8`) at b1 and b16 off and on.
# fp8-wgmma-moe (one GPU, ~5 min): the FP8 experts' routed GEMV by TMA + wgmma (fp8_wgmma_gemv.routed_gemv, under
# FP8_WGMMA_GEMV): its GPU tests and the A3B expert block's time off and on, then the A3B FP8 decode at batch 1 (32K)
# and 8 (4K) off and on.
# fp8-block-decode (one GPU, ~5 min): the 8B decode in bf16 and in block FP8 with FP8_WGMMA_GEMV off and on (at
# fp8_wgmma_gemv.STAGES 2) at batch 1 (32K), 8 (4K), 16 (8K) and 32 (4K): fp8-wgmma's latency lines alone.
# fp8-profile (one GPU, ~2 min): the 8B block FP8 decode at b1@32K under the profiler, its top kernels (issue 18: 0.72x
# bf16 with the wgmma GEMV on, target 0.7x; where the 1.12 ms over its 2.935 ms floor goes).
# fp8-gated (one GPU, ~8 min): the block FP8 down projection's silu(gate) * up made inside the wgmma GEMV
# (quant_fp8.FP8_WGMMA_GATED): the GEMV's GPU tests, the fp8 engines' with it on, then the 8B block FP8 decode at
# b1@32K, b8@4K and b16@8K off and on, and with the GEMV's splits of at least 2 and 4 K blocks (MIN_SPLIT_BLOCKS)
# (issue 18: FP8 b1 <= 0.7x bf16; 0.721x at 0aed29a).
# fp8-ahead (one GPU, ~5 min): block FP8's activations two K blocks ahead and weight scales one in the wgmma GEMV's
# loop (fp8_wgmma_gemv.AHEAD, up to 8 rows): the 8B decode b1@32K off / on beside bf16 (issue 18: 0.721x, target
# 0.7x), then the kernel's GPU tests with it (every row count it takes; AHEAD acts up to 8).
# shellcheck shell=bash

if [[ $MODE == fp8-wgmma ]]; then  # one GPU (~8 min): the FP8 GEMVs by TMA + wgmma, tests, times, the 8B decode
  timeout 240 python3 -m pytest -q -s -m gpu tests/gpu/test_fp8_wgmma_gemv_gpu.py -p no:cacheprovider --tb=short \
    -rfE 2>&1 | tee "$OUT/gpu_tests_fp8_wgmma.log" | grep -E "fp8 wgmma|passed|failed" || status=1
  for variant in "longserve.kernels.fp8_wgmma_gemv.STAGES=4" "longserve.kernels.fp8_wgmma_gemv.STAGES=6" \
    "longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=None"; do
    timeout 90 python3 scripts/probes/with_constants.py "$variant" -- pytest -q -s -m gpu \
      tests/gpu/test_fp8_wgmma_gemv_gpu.py::test_times[1] tests/gpu/test_fp8_wgmma_gemv_gpu.py::test_times[16] \
      -p no:cacheprovider --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_fp8_wgmma_${variant##*.}.log" \
      | grep -E "fp8 wgmma|passed|failed" | sed "s/^/${variant##*.}: /" || status=1
  done
  timeout 200 python3 scripts/probes/with_constants.py longserve.kernels.quant_fp8.FP8_WGMMA_GEMV=True -- \
    pytest -q -m gpu tests/gpu/test_quant_engine_gpu.py -k fp8 -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_fp8_wgmma_engines.log" | tail -4 || status=1
  latency_with fp8_wgmma_bf16 "bf16" -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
    --decode-batch-sizes 1@32768,8@4096,16@8192,32@4096
  for on in False True; do
    latency_with fp8_wgmma_$on "FP8 blocks FP8_WGMMA_GEMV=$on" longserve.kernels.quant_fp8.FP8_WGMMA_GEMV=$on -- \
      --config llama-3.1-8b "${dummy[@]}" --repeat 3 --hf-overrides "$fp8" \
      --decode-batch-sizes 1@32768,8@4096,16@8192,32@4096
    latency_with fp8_wgmma_channel_$on "FP8 per channel FP8_WGMMA_CHANNEL=$on" \
      longserve.kernels.quant_fp8.FP8_WGMMA_CHANNEL=$on -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
      --quantization fp8 --decode-batch-sizes 1@32768,16@8192
  done
fi

if [[ $MODE == fp8-wgmma-moe ]]; then  # one GPU (~5 min): the FP8 experts' routed GEMV on the tensor cores, the A3B decode
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_fp8_wgmma_gemv_gpu.py -k routed -p no:cacheprovider \
    --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_fp8_wgmma_routed.log" | tail -3 || status=1
  for on in False True; do
    timeout 120 python3 scripts/probes/with_constants.py longserve.kernels.quant_fp8.FP8_WGMMA_GEMV=$on -- \
      pytest -q -s -m gpu tests/gpu/test_quant_kernels_gpu.py -k fp8_experts_routed -p no:cacheprovider --tb=short \
      -rfE 2>&1 | tee "$OUT/gpu_tests_fp8_experts_wgmma$on.log" | grep -E "fp8 experts|passed|failed" \
      | sed "s/^/wgmma=$on: /"
  done
  for on in False True; do
    LATENCY_TIMEOUT=150 latency_with a3b_fp8_wgmma_$on "A3B FP8 FP8_WGMMA_GEMV=$on" \
      longserve.kernels.quant_fp8.FP8_WGMMA_GEMV=$on -- --config qwen3-30b-a3b "${dummy[@]}" --repeat 3 \
      --hf-overrides "$fp8" --decode-batch-sizes 1@32768,8@4096
  done
fi

if [[ $MODE == fp8-profile ]]; then  # one GPU (~2 min): where the block FP8 decode's time at one row goes
  LATENCY_TIMEOUT=120 latency_with fp8_profile "FP8 blocks" -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
    --hf-overrides "$fp8" --decode-batch-sizes 1@32768 --profile
  top_ops "$OUT/latency_fp8_profile.json"
fi

if [[ $MODE == fp8-gated ]]; then  # one GPU (~6 min): silu(gate) * up inside the FP8 GEMV, tests and the decode
  gated=longserve.kernels.quant_fp8.FP8_WGMMA_GATED
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_fp8_wgmma_gemv_gpu.py -k "not times" -p no:cacheprovider \
    --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_fp8_gated.log" | tail -3 || status=1
  timeout 200 python3 scripts/probes/with_constants.py $gated=True -- pytest -q -m gpu tests/gpu/test_quant_engine_gpu.py \
    -k fp8 -p no:cacheprovider --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_fp8_gated_engines.log" | tail -4 || status=1
  for on in False True; do
    latency_with fp8_gated_$on "FP8 blocks FP8_WGMMA_GATED=$on" $gated=$on -- --config llama-3.1-8b "${dummy[@]}" \
      --repeat 3 --hf-overrides "$fp8" --decode-batch-sizes 1@32768,8@4096,16@8192
  done
  # the GEMV's splits of at least 2 and 4 K blocks (fp8_wgmma_gemv.MIN_SPLIT_BLOCKS; 1: the one wave's)
  for b in 2 4; do
    latency_with fp8_min_blocks_$b "FP8 blocks MIN_SPLIT_BLOCKS=$b" longserve.kernels.fp8_wgmma_gemv.MIN_SPLIT_BLOCKS=$b \
      -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 --hf-overrides "$fp8" --decode-batch-sizes 1@32768,8@4096,16@8192
  done
fi

if [[ $MODE == fp8-block-decode ]]; then  # one GPU (~5 min): the 8B block FP8 decode, the wgmma GEMV off and on
  latency_with fp8_block_bf16 "bf16" -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
    --decode-batch-sizes 1@32768,8@4096,16@8192,32@4096
  for on in False True; do
    latency_with fp8_block_wgmma_$on "FP8 blocks FP8_WGMMA_GEMV=$on" longserve.kernels.quant_fp8.FP8_WGMMA_GEMV=$on \
      -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 --hf-overrides "$fp8" \
      --decode-batch-sizes 1@32768,8@4096,16@8192,32@4096
  done
fi

if [[ $MODE == fp8-ahead ]]; then  # one GPU (~5 min): block FP8's activations and weight scales asked for ahead
  ahead=longserve.kernels.fp8_wgmma_gemv.AHEAD
  cases=(--config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 1@32768)
  LATENCY_TIMEOUT=100 latency_with fp8_ahead_bf16 "bf16" -- "${cases[@]}"
  for on in False True; do
    LATENCY_TIMEOUT=100 latency_with "fp8_ahead_$on" "FP8 blocks AHEAD=$on" $ahead=$on -- "${cases[@]}" \
      --hf-overrides "$fp8"
  done
  timeout 120 python3 scripts/probes/with_constants.py $ahead=True -- pytest -q -m gpu \
    tests/gpu/test_fp8_wgmma_gemv_gpu.py -p no:cacheprovider --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_fp8_ahead.log" \
    | grep -E "fp8 wgmma|passed|failed" || status=1
fi
