# gpu_check.sh's modes for the mixture-of-experts models (sourced by scripts/gpu/gpu_check.sh, which sets MODE, OUT
# and status). Each prints the floor of every case and the measured/floor ratio.
# moe (one GPU) = moe-tests (the MoE kernel and engine GPU tests, the kernel's TFLOP/s and GB/s) +
# moe-bench (the Qwen3-30B-A3B shape's cases against HF, profiled, with their floors); moe-long: 128K cold
# against HF and the Mixtral-8x7B shape; moe-tp (two GPUs): the TP=2 / expert-parallel tests and the A3B shape
# at TP=2 and EP=2.
# fusions-a3b (one GPU): the A3B shape's decode with the q/k norms or the K/V store out of the rotary kernel,
# against both in.
# moe-gemv (one GPU): the small-batch MoE kernels' and the k-sum kernel's GPU tests (their times beside
# fused_moe's and torch.sum's), then the A3B decode as it is and with MOE_SUM_TRITON_MAX_TOKENS 64.
# tune-int-moe (one GPU, ~6 min): the 8-bit experts' paths timed, tune_moe --weights int8 on the A3B shape at
# 1 / 8 / 64 tokens (fused_moe's int path tiles), the paths timed again with the table.
# moe-grouped (one GPU, ~5 min): the int4 experts' paths per token count (the grouped kernel's time among them),
# then the A3B int4 decode at batch 8 and 64 through the routed GEMV (grouped off) and through the grouped kernel.
# pdl-moe (one GPU, ~6 min): programmatic dependent launch (kernels/launch.PDL, on since 0949067) now also in the
# MoE step's kernels (router top-k, alignment, grouped GEMMs, sum over k, the activations' FP8 quantization): its
# GPU tests (outputs unchanged with 16-bit and FP8 experts; the kernels compiled for it), then the A3B decode at
# batch 1 (32K) in bf16, FP8 blocks and GPTQ int4, PDL off and on, one process each.
# fp8-moe-gemv (one GPU, ~2 min): the block-FP8 experts through the routed GEMVs at decode sizes
# (fused_moe.FP8_MOE_GEMV_MAX_TOKENS, 8 since 854fbd1 was measured): their GPU test (the A3B shape at 1 / 4 / 16
# tokens, both paths' times), then the A3B FP8 decode at batch 1 (32K) and 8 (4K), off and on, one process each.
# tune-moe-tables (one GPU, ~8 min): this GPU's own MoE tables for the A3B shape (a GPU with none reads its
# architecture's reference part's, the H200's: `moe_config.ARCH_TABLE_DEVICES`), written by tune_moe into the
# package and tarred into $OUT (moe_configs_tuned.tgz) to be committed: bf16 at decode sizes and, with 256-row blocks
# among the candidates since the thirty-seventh session, at prefill sizes; block FP8 at prefill sizes; int8 at decode
# sizes. The A3B bf16 and FP8 cold 8K / 32K and the bf16 decode at batch 1 (32K) before and after.
# shellcheck shell=bash

if [[ $MODE == fusions-a3b ]]; then  # one GPU: the Qwen3-30B-A3B shape's decode (q/k norm, launch-bound at
  # batch 1) with the q/k norms and the K/V store fused into the rotary kernel, each off against both on
  for c in longserve.models.rope.FUSE_QK_NORM=False longserve.models.rope.FUSE_KV_STORE=False \
           longserve.models.rope.FUSE_KV_STORE=True; do
    latency_with a3b_${c##*.} "" $c -- --config qwen3-30b-a3b "${dummy[@]}" --repeat 3 --decode-batch-sizes \
      1@4096,64@4096
  done
fi

if [[ $MODE == moe || $MODE == moe-tests ]]; then  # one GPU: MoE kernel + engine tests, the kernel's roofline
  python3 -m pytest -q -m gpu tests/gpu/test_fused_moe_gpu.py tests/gpu/test_moe_engine_gpu.py -p no:cacheprovider \
    -o faulthandler_timeout=300 2>&1 | tee "$OUT/gpu_tests.log" | tail -8 || status=1
  python3 -m longserve.bench.kernels.moe --tokens 1,8,64,512,8192 --output-json "$OUT/kernels_moe.json" 2>&1 \
    | tee "$OUT/kernels_moe.log" | tail -14
fi

if [[ $MODE == moe || $MODE == moe-bench ]]; then  # one GPU: the Qwen3-30B-A3B shape's cases against HF
  a3b=(--config qwen3-30b-a3b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3)
  python3 -m longserve.bench.latency "${a3b[@]}" --prompt-lens 8192,32768 --prefix-hit 32768:64 \
    --decode-batch-sizes 1 --decode-context-len 32768 --compare-hf --profile \
    --output-json "$OUT/latency_moe_a3b.json" 2>&1 | tee "$OUT/latency_moe_a3b.log" | tail -12
  python3 -m longserve.bench.latency "${a3b[@]}" --decode-batch-sizes 64 --decode-context-len 4096 --profile \
    --output-json "$OUT/latency_moe_a3b_decode64.json" 2>&1 | tee "$OUT/latency_moe_a3b_decode64.log" | tail -5
fi

if [[ $MODE == moe-long ]]; then  # one GPU: the A3B shape's 128K cold prompt against HF, then Mixtral-8x7B
  python3 -m longserve.bench.latency --config qwen3-30b-a3b --load-format dummy --dtype bfloat16 --warmup 0 \
    --repeat 1 --prompt-lens 131072 --compare-hf --profile --output-json "$OUT/latency_moe_a3b_128k.json" 2>&1 \
    | tee "$OUT/latency_moe_a3b_128k.log" | tail -5
  python3 -m longserve.bench.latency --config mixtral-8x7b --load-format dummy --dtype bfloat16 --warmup 1 \
    --repeat 2 --prompt-lens 8192,32768 --decode-batch-sizes 1,64 --decode-context-len 4096 --compare-hf --profile \
    --output-json "$OUT/latency_moe_mixtral.json" 2>&1 | tee "$OUT/latency_moe_mixtral.log" | tail -10
fi

if [[ $MODE == moe-tp ]]; then  # two GPUs: MoE TP / EP tests, the A3B shape at TP=2 and at EP=2
  python3 -m pytest -q -m gpu tests/gpu/test_moe_engine_gpu.py -k two_gpus -p no:cacheprovider \
    -o faulthandler_timeout=300 2>&1 | tee "$OUT/gpu_tp_tests.log" | tail -6 || status=1
  for par in "--tp-size 2" "--tp-size 2 --enable-expert-parallel"; do
    tag=$(echo "$par" | tr -d ' -')
    python3 -m longserve.bench.latency --config qwen3-30b-a3b --load-format dummy --dtype bfloat16 $par \
      --warmup 1 --repeat 3 --prompt-lens 8192,32768 --decode-batch-sizes 1,64 --decode-context-len 4096 --profile \
      --output-json "$OUT/latency_moe_a3b_$tag.json" 2>&1 | tee "$OUT/latency_moe_a3b_$tag.log" | tail -8
  done
fi

if [[ $MODE == tune-int-moe ]]; then  # one GPU, ~6 min: fused_moe's int path tiles for 8-bit experts (A3B shape)
  # 8-bit experts take fused_moe's int path at decode sizes (moe_wna16's kernels are 4-bit); its untuned
  # gate+up tile spills on sm90 (255 registers and a 528-byte stack at BLOCK_N 32, BLOCK_K 128). The int8
  # experts' paths timed, tune_moe --weights int8 writes its table into the package (tarred into $OUT), timed again
  python3 -m pytest -q -m gpu tests/gpu/test_quant_kernels_gpu.py -k "int8_experts" -s -p no:cacheprovider \
    --tb=short 2>&1 | grep -E "int8 experts|passed|failed" | sed "s/^/untuned: /"
  timeout 300 python3 -m longserve.kernels.tune_moe --num-experts 128 --top-k 8 --hidden 2048 --intermediate 768 \
    --weights int8 --batch-sizes 1,8,64 2>&1 | tee "$OUT/tune_int8.log" | tr '\r' '\n' | grep -E "^T=|wrote|Error"
  tar czf "$OUT/moe_configs_int8.tgz" longserve/kernels/moe_configs 2>/dev/null
  python3 -m pytest -q -m gpu tests/gpu/test_quant_kernels_gpu.py -k "int8_experts" -s -p no:cacheprovider \
    --tb=short 2>&1 | grep -E "int8 experts|passed|failed" | sed "s/^/tuned: /"
fi

if [[ $MODE == moe-grouped ]]; then  # one GPU, ~5 min: the grouped int4 MoE kernel (moe_wna16, from 16 tokens)
  python3 -m pytest -q -m gpu tests/gpu/test_quant_kernels_gpu.py -k "int4_experts" -s -p no:cacheprovider \
    --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "int4 experts|passed|failed" || status=1
  for grouped in None 2; do  # the A3B int4 decode at batch 8 and 64 (4K) through the GEMV, then grouped
    LATENCY_TIMEOUT=120 latency_with a3b_int4_grouped$grouped "" \
      longserve.kernels.moe_wna16.MOE_WNA16_GROUPED_MIN_TOKENS=$grouped -- \
      --config qwen3-30b-a3b --load-format dummy --dtype bfloat16 --quantization gptq --warmup 1 --repeat 3 \
      --decode-batch-sizes 8@4096,64@4096 || status=1
  done
fi

if [[ $MODE == moe-gemv ]]; then  # one GPU, ~4 min: the small-batch MoE kernels and the k-sum kernel
  python3 -m pytest -q -m gpu tests/gpu/test_fused_moe_gpu.py -k "small_batch or sum_over_k" -s -p no:cacheprovider \
    --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "moe_gemv|sum over k|passed|failed" || status=1
  a3b=(--config qwen3-30b-a3b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3
       --decode-batch-sizes 1@32768,1@4096,8@4096)
  for switch in MOE_GEMV_MAX_TOKENS=0 MOE_SUM_TRITON_MAX_TOKENS=64; do
    LATENCY_TIMEOUT=150 latency_with a3b_${switch%%=*} "" longserve.kernels.fused_moe.$switch -- "${a3b[@]}"
  done
fi

if [[ $MODE == pdl-moe ]]; then  # one GPU (~6 min): PDL off/on for the A3B decode (the MoE kernels take it too)
  python3 -m pytest -q -m gpu tests/gpu/test_pdl_gpu.py -k "moe" -p no:cacheprovider -o faulthandler_timeout=300 \
    --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_pdl_moe.log" | tail -4 || status=1
  for variant in bf16 fp8 int4; do
    q=(); [[ $variant == fp8 ]] && q=(--hf-overrides "$fp8"); [[ $variant == int4 ]] && q=(--quantization gptq)
    for pdl in False True; do
      latency_with pdl_a3b_${variant}_$pdl "A3B $variant PDL=$pdl" longserve.kernels.launch.PDL=$pdl -- --config \
        qwen3-30b-a3b "${dummy[@]}" --repeat 3 ${q[@]+"${q[@]}"} --decode-batch-sizes 1@32768
    done
  done
fi

if [[ $MODE == fp8-moe-gemv ]]; then  # one GPU (~5 min): the FP8 experts' routed GEMVs, off and on
  python3 -m pytest -q -s -m gpu tests/gpu/test_quant_kernels_gpu.py -k fp8_experts_routed -p no:cacheprovider \
    --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_fp8_moe_gemv.log" | grep -E "routed GEMV|passed|failed" || status=1
  for limit in 0 16; do
    latency_with a3b_fp8_moe_gemv$limit "FP8_MOE_GEMV_MAX_TOKENS=$limit" \
      longserve.kernels.fused_moe.FP8_MOE_GEMV_MAX_TOKENS=$limit -- --config qwen3-30b-a3b "${dummy[@]}" --repeat 3 \
      --hf-overrides "$fp8" --decode-batch-sizes 1@32768,8@4096
  done
fi

if [[ $MODE == tune-moe-tables ]]; then  # one GPU (~8 min): this GPU's own A3B MoE tables, timed before and after
  a3b_runs() {  # $1: before | after
    LATENCY_TIMEOUT=100 latency_with a3b_bf16_$1 "A3B bf16 $1" -- --config qwen3-30b-a3b "${dummy[@]}" --repeat 2 \
      --prompt-lens 8192,32768 --decode-batch-sizes 1@32768
    LATENCY_TIMEOUT=100 latency_with a3b_fp8_$1 "A3B FP8 $1" -- --config qwen3-30b-a3b "${dummy[@]}" --repeat 2 \
      --hf-overrides "$fp8" --prompt-lens 8192,32768
  }
  a3b_runs before
  shape=(--num-experts 128 --top-k 8 --hidden 2048 --intermediate 768)
  for args in "--batch-sizes 1,2,4,8,16,32,64 --space quick" "--batch-sizes 2048,8192 --space prefill" \
      "--weights fp8_e4m3 --fp8-block 128 --batch-sizes 2048,8192 --space fp8-prefill" \
      "--weights int8 --batch-sizes 1,8,64"; do
    # shellcheck disable=SC2086  # args is several options
    timeout 240 python3 -m longserve.kernels.tune_moe "${shape[@]}" $args 2>&1 | tee -a "$OUT/tune_moe_tables.log" \
      | tr '\r' '\n' | grep -E "^T=|wrote|Error" || status=1
  done
  tar czf "$OUT/moe_configs_tuned.tgz" longserve/kernels/moe_configs 2>/dev/null
  a3b_runs after
fi

# tune-moe-hybrid (one GPU, ~8 min): the Qwen3.5-35B-A3B shape's bf16 MoE tables (256 experts of 512, top 8: none
# shipped, so its experts ran the untuned default tiles; the 12-layer Qwen3-Next shape's cold 8K spent 35.6 of its
# 63.2 ms of kernels in the MoE, ~170 TFLOP/s, on an H100 in the forty-seventh session), decode and prefill sizes,
# written into the package and tarred into $OUT; the 35B-A3B shape (20 of 40 layers) cold 8K / 32K and decode at
# batch 1 (32K) before and after.
if [[ $MODE == tune-moe-hybrid ]]; then
  a3b35_runs() {  # $1: before | after
    LATENCY_TIMEOUT=150 latency_with a3b35_$1 "35B-A3B $1" -- --config qwen3.5-35b-a3b "${dummy[@]}" --repeat 2 \
      --hf-overrides '{"num_hidden_layers": 20}' --prompt-lens 8192,32768 --decode-batch-sizes 1@32768
  }
  a3b35_runs before
  shape=(--num-experts 256 --top-k 8 --hidden 2048 --intermediate 512)
  for args in "--batch-sizes 1,2,4,8,16,32,64 --space quick" "--batch-sizes 2048,8192 --space prefill"; do
    # shellcheck disable=SC2086  # args is several options
    timeout 240 python3 -m longserve.kernels.tune_moe "${shape[@]}" $args 2>&1 | tee -a "$OUT/tune_moe_hybrid.log" \
      | tr '\r' '\n' | grep -E "^T=|wrote|Error" || status=1
  done
  tar czf "$OUT/moe_configs_tuned.tgz" longserve/kernels/moe_configs 2>/dev/null
  a3b35_runs after
fi

# moe-inputs (one GPU, ~5 min): the MoE block's router, shared gate and shared gate|up as one GEMM
# (moe_block.STACKED_INPUTS_MAX_TOKENS, off by default) against three, one process each: decode at batch 1 (32K)
# and 64 (4K) on the seed's model as released (GPTQ-int4 35B-A3B, 40 layers) and on the bf16 35B-A3B's first 20
# layers; the GPU test of its tokens first
if [[ $MODE == moe-inputs ]]; then
  if python3 -c "import pytest" 2> /dev/null; then
    timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_moe_engine_gpu.py -k stacked -p no:cacheprovider \
      --tb=short 2>&1 | tail -3 || status=1
  fi
  for stack in 0 256; do
    LATENCY_TIMEOUT=150 latency_with a3b35_gptq_stack$stack "int4 stacked<=$stack" \
      longserve.models.moe_block.STACKED_INPUTS_MAX_TOKENS=$stack -- --config qwen3.5-35b-a3b "${dummy[@]}" \
      --hf-overrides "$seed_gptq" --decode-batch-sizes 1@32768,64@4096 --repeat 2
    LATENCY_TIMEOUT=120 latency_with a3b35_half_stack$stack "bf16 20 layers stacked<=$stack" \
      longserve.models.moe_block.STACKED_INPUTS_MAX_TOKENS=$stack -- --config qwen3.5-35b-a3b "${dummy[@]}" \
      --hf-overrides '{"num_hidden_layers": 20}' --decode-batch-sizes 1@32768,64@4096 --repeat 2
  done
fi

# int4-rows-a3b35 (one GPU, ~2 min): the seed's model as released (GPTQ-int4 35B-A3B: 256 experts, top 8) at cold 8K
# and 32K with its 4-bit experts by rows (fused_moe's int path) up to 128, 256 (the default since the fifty-third
# session, which measured this mode in tokens: 4,096, 8,192, 32,768) and 1,024 rows an expert (4,096, 8,192 and
# 32,768 tokens a step), against dequantized whole past that (the dequantization took 36 of the cold 8K's 209 ms,
# forty-eighth session)
if [[ $MODE == int4-rows-a3b35 ]]; then
  for rows in 128 256 1024; do
    LATENCY_TIMEOUT=150 latency_with a3b35_gptq_rows$rows "int4 rows<=$rows an expert" \
      longserve.kernels.moe_wna16.MOE_WNA16_ROWS_MAX_PER_EXPERT=$rows -- --config qwen3.5-35b-a3b "${dummy[@]}" \
      --hf-overrides "$seed_gptq" --prompt-lens 8192,32768 --repeat 3
  done
fi
