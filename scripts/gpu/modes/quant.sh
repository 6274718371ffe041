# gpu_check.sh's modes for quantized weights and the fp8 KV cache (sourced by scripts/gpu/gpu_check.sh, which sets
# MODE, OUT and status).
# quant (one GPU) = quant-tests (the quantized kernels' and engines' GPU tests, per-M timings of the
# int4 paths and of cuBLAS vs Triton block FP8) + quant-bench (the 8B and A3B shapes in bf16, FP8 blocks and
# GPTQ int4 g128: cold TTFT 8K/32K, decode ITL b1@32K and b64@4K, weight GiB and KV tokens, ratios to bf16).
# kvfp8 (one GPU): the fp8 KV cache's GPU tests (Triton kernels on e4m3 pages, engine with graphs,
# chunks and prefix hits against the reference, fp8 vs auto), the attention GPU tests again, and the 8B shape
# with --kv-cache-dtype fp8 against auto: KV tokens that fit and decode at batch 64 (4K contexts), plus b1@32K.
# switches (one GPU): the int4 paths per M timed as CUDA graphs and the 8B int4 decode through each of them; the
# cost of fp32 accumulation in the fp8 GEMMs.
# quant-decode (one GPU, ~8 min): the decode GEMVs of issue 18: the per-M kernel times
# (int4 GEMV, block and per-channel FP8 GEMVs against their GEMMs, as CUDA graphs), then the 8B shape's int4,
# block-FP8 and per-channel FP8 decode with each GEMV off and on (WNA16_GEMV_MAX_TOKENS, FP8_GEMV_MAX_TOKENS 0
# against 16).
# raw-hi (one GPU, ~4 min): the int4 GEMVs' unmasked high value (int4_gemv.INT4_GEMV_RAW_HI, on since this ran:
# 4.18 -> 3.76 sm90 instructions a weight) off and on: the one-row and experts' GPU tests with their times, the
# 8B int4 decode at batch 1 (32K) and the A3B int4 decode at batch 1 (32K) and 8 (4K; the routed GEMV).
# gemv-tune (one GPU, ~6 min): the 8B FP8 and int4 decode at batch 1, python -m longserve.kernels.tune_gemv (the
# decode GEMVs' tile tables for the 8B and A3B projections), the same decode again with the tables.
# silu-quant (one GPU, ~5 min): the FP8 activations' quantization, as it was (one group of 128 a program, then
# silu_and_mul + per_token_group_quant for the down projection), with 8 groups a program
# (quant_tiles.QUANT_VALUES_PER_PROGRAM) and with the down projection's input made and quantized in one pass too
# (FUSE_SILU_AND_MUL_QUANT; both on by default): the GPU tests of the fp8 kernels, then the 8B FP8 shape's cold 8K
# / 32K and decode at batch 64 (4K) under each.
# serial-reduce (one GPU, ~5 min): the split-K decode GEMVs summing their partials in the last program of each
# tile (split_k.SPLIT_K_SERIAL_REDUCE) against a splitk_reduce launch after them: the GPU tests (bit-equal,
# counters back at zero, CUDA graphs, PDL; each 8B projection's time both ways), then the 8B FP8-block and GPTQ
# int4 decode at batch 1 (32K) and 64 (4K) off and on, one process each (at batch 64 the last program of a tile
# sums 64 rows of partials: the 8B int4 b64 decode went 16.64 -> 18.20 ms between 0949067 and 11fea55, after the
# serial sums landed, measured only at batch 1).
# fp8-acc (one GPU, ~8 min): the 8B and A3B FP8 cold TTFT with the fp8 dots' fp32 promotion after every wgmma (0,
# the default), every other (64) or never within a tile (None), and the fp8 kernel and engine tests under 64 and
# None.
# int4-dequant (one GPU, ~8 min): the int4 weights' dequantization by rows of packed bytes (quant_gemm.DEQUANT_ROWS,
# off): its GPU test, the kernels alone (scripts/probes/sweep_dequant.py), the A3B int4 cold 32K profiled beside
# bf16's, the A3B and 8B int4 cold 8K / 32K off and on (issue 18: A3B int4 cold 32K 1.12x bf16 on an H100, <= 1.1).
# int4-fused-prefill (one GPU, ~6 min): the A3B int4 prefill through fused_moe's int path by rows instead
# (moe_wna16.MOE_WNA16_PREFILL "fused", moe_gemm.INT_ROWS), at the untuned tiles and at tune_moe's, profiled.
# int4-mid-steps (one GPU, ~6 min): the 4-bit experts' steps of 257-4,096 tokens through fused_moe's int path by rows
# (moe_wna16.MOE_WNA16_ROWS_MAX_PER_EXPERT: 256 rows an expert, the A3B's 4,096 tokens; on since the thirty-ninth
# session from one layer's timings, in tokens until the fifty-third) against the
# dequantized experts (0): the MoE paths' GPU tests (every path timed at 1-4,096 tokens), the quantized engines'
# GPTQ MoE test, then the A3B int4 cold 512 / 1K / 2K / 4K (one step each, piecewise CUDA graphs) off, on, off, on.
# int4-dense-rows (one GPU, ~7 min): the fused W4A16 kernel by rows (quant_gemm.WNA16_INT_ROWS) against dequantize +
# cuBLAS past the GEMV's 64 rows (scripts/probes/sweep_int4_fused.py: the 8B projections, tiles, the crossover), then
# the 8B int4 decode at batch 128 (4K) and cold 512 / 2K with quant_gemm.WNA16_FUSED_MAX_TOKENS 0 (off) and 4096.
# lone-chunks (one GPU, ~7 min): the A3B cold 8K / 32K in bf16 and int4 (GPTQ g128) with a lone prompt's steps of
# 8K (off), 16K and 32K tokens (--lone-prefill-chunk-size): the int4 prefill dequantizes every expert once a step
# (1.2 GB written a layer; at 3352078 on an H100, 1.107x bf16 at 32K in 8K steps, 1.021x in 32K steps, which are
# the integer weights' default since 329c6fc); then, if time is left, the 8B bf16 cold 32K / 128K at 8K and 32K
# (at 128K the lone chunks past 32K are bounded since 513912e: sched/chunk_size.py).
# lone-long (one GPU, ~5 min): the 8B cold 128K in bf16 (8K chunks against lone steps of 32K) and in int4 (GPTQ g128:
# its default lone steps of 32K against 8K chunks): the lone chunks past the first in cuDNN pieces since 3f179ff
# (before, in Triton: bf16 16.05 s against 10.21 in 8K chunks on an H100, forty-first session).
# a3b-fp8-prefill (one GPU, ~7 min): the A3B cold 32K in bf16 and in block FP8 under the profiler, their top kernels
# (issue 18: FP8 cold 32K <= 0.85x bf16; 1.14x at 11fea55, the FP8 expert GEMMs ~40% slower than bf16's at prefill
# sizes where they could be ~2x faster), and in FP8 with the dots at FP8_DOT_MAX_IMPRECISE_ACC 32 after the fp8
# engine tests at 32 (the default 0 takes no FP8 tensor core: scripts/dev/count_moe_sass.py), and at None (no
# promotion inside a K block: what the kernel's scales a tile (66d642c) give at the fewest instructions).
# tune-fp8-moe-acc32 (one GPU, ~7 min; after a3b-fp8-prefill, if the fp8 engine tests pass at 32): the FP8 MoE
# kernel's prefill tiles retuned with its dots at FP8_DOT_MAX_IMPRECISE_ACC 32 (TUNE_FP8_ACC=None: unpromoted, if
# fp8-acc-quality says so; tune_moe writes the table into the package, tarred into $OUT), then the A3B cold 32K at
# that accumulation with that table beside bf16.
# fp8-acc-quality (one GPU, ~4 min): what the fp8 dots' accumulation costs a user in quality: `bench accuracy`
# (scripts/gpu/bench_quant_accuracy.py) of the dense FP8 formats (fp8-block, ct-fp8-dynamic; hidden 1024) and of
# FP8 experts (qwen3_moe, 32 x 32 blocks) against their bf16 original at FP8_DOT_MAX_IMPRECISE_ACC 0 (the default),
# 32 and None: top-1 agreement and KL beside the quantization's own. The GPU tests' check (first-token logprobs
# within 0.1 of the fp32 reference path's) failed at None (seventeenth session), where the MoE kernel builds 175
# instructions a loop against 526 at 0 (count_moe_sass.py).
# kvfp8-f16 (one GPU, ~7 min): the fp8 KV GPU tests, then the A3B and 8B decode at batch 64 (4K) on a bf16 cache and
# on an fp8 one with the decode kernel's dots in bf16 and in fp16 (decode_attention.KV_FP8_AS_F16), and in fp16 at
# 2 pipeline stages (issue 18: fp8 KV <= 1.05x bf16's, the A3B at 1.06x in the eighth session).
# shellcheck shell=bash

if [[ $MODE == kvfp8 ]]; then  # one GPU: fp8 KV cache; target: 2x KV tokens, b64 decode <= 1.05x auto
  python3 -m pytest -q -m gpu tests/gpu/test_kv_fp8_gpu.py tests/gpu/test_attention_gpu.py tests/gpu/test_engine_gpu.py \
    -p no:cacheprovider -o faulthandler_timeout=300 2>&1 | tee "$OUT/gpu_kvfp8_tests.log" | tail -8 || status=1
  for kv in auto fp8; do
    base=(--config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3 --kv-cache-dtype $kv)
    python3 -m longserve.bench.latency "${base[@]}" --decode-batch-sizes 64 --decode-context-len 4096 \
      --output-json "$OUT/latency_kvfp8_8b_${kv}_b64.json" 2>&1 | tee "$OUT/latency_kvfp8_8b_${kv}_b64.log" | tail -3
    python3 -m longserve.bench.latency "${base[@]}" --prompt-lens 32768 --decode-batch-sizes 1 \
      --decode-context-len 32768 --output-json "$OUT/latency_kvfp8_8b_${kv}.json" 2>&1 \
      | tee "$OUT/latency_kvfp8_8b_${kv}.log" | tail -3
    python3 scripts/gpu/quant_memory.py --config llama-3.1-8b --variant bf16 --kv-cache-dtype $kv \
      --output-json "$OUT/memory_kvfp8_8b_${kv}.json" 2>&1 | tail -1
  done
  python3 - <<'PY'
import json, os
out = os.environ["OUT"]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
def decode_ms(records):
    # bench latency's --output-json: a list of records; the decode case's median inter-token latency
    for r in records:
        if isinstance(r, dict) and r.get("itl_ms_median") is not None:
            return r["itl_ms_median"]
    return None
auto, fp8 = load("latency_kvfp8_8b_auto_b64.json"), load("latency_kvfp8_8b_fp8_b64.json")
ma, mf = load("memory_kvfp8_8b_auto.json"), load("memory_kvfp8_8b_fp8.json")
if ma and mf:
    ta, tf = ma.get("kv_pool_tokens"), mf.get("kv_pool_tokens")
    print(f"KV tokens: auto {ta} fp8 {tf} ratio {tf / ta if ta and tf else float('nan'):.3f} (target 2.0)")
if auto and fp8:
    a, f = decode_ms(auto), decode_ms(fp8)
    print(f"decode b64@4K ITL ms: auto {a} fp8 {f}" + (f" ratio {f / a:.3f} (target <= 1.05)" if a and f else ""))
PY
fi

if [[ $MODE == quant || $MODE == quant-tests ]]; then  # one GPU: quantized kernels and engines
  python3 -m pytest -q -m gpu tests/gpu/test_quant_kernels_gpu.py tests/gpu/test_quant_engine_gpu.py \
    -p no:cacheprovider -o faulthandler_timeout=300 2>&1 | tee "$OUT/gpu_quant_tests.log" | tail -8 || status=1
  # per M: fused int4 vs dequantize+cuBLAS (quant_gemm.WNA16_DEQUANT_MIN_TOKENS), cuBLAS vs Triton block FP8
  python3 scripts/gpu/bench_quant_kernels.py --output-json "$OUT/kernels_quant.json" 2>&1 \
    | tee "$OUT/kernels_quant.log" | grep -E "crossover|beats" || status=1
fi

if [[ $MODE == quant || $MODE == quant-bench ]]; then  # one GPU: the 8B and A3B shapes in bf16, FP8, INT4
  # FP8 (block): the official FP8 checkpoints' quantization_config on dummy weights; INT4: GPTQ g128 sym
  # QUANT_SHAPES: the shapes in order (default both), QUANT_MEMORY_SHAPES those whose memory is measured too;
  # each case one process (timeouts: a stuck case loses only itself)
  # QUANT_VARIANTS: which of bf16, fp8, int4 and kvfp8 (bf16 weights, --kv-cache-dtype fp8) run (default the first three)
  for shape in ${QUANT_SHAPES:-llama-3.1-8b qwen3-30b-a3b}; do
    for variant in ${QUANT_VARIANTS:-bf16 fp8 int4}; do
      q=(); [[ $variant == fp8 ]] && q=(--hf-overrides "$fp8"); [[ $variant == int4 ]] && q=(--quantization gptq)
      [[ $variant == kvfp8 ]] && q=(--kv-cache-dtype fp8)
      base=(--config $shape --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3 ${q[@]+"${q[@]}"})
      timeout 180 python3 -m longserve.bench.latency "${base[@]}" --prompt-lens 8192,32768 \
        --decode-batch-sizes 1@32768,64@4096 --output-json "$OUT/latency_quant_${shape}_${variant}.json" 2>&1 \
        | tee "$OUT/latency_quant_${shape}_${variant}.log" | grep -E "^(cold|decode)"
      [[ " ${QUANT_MEMORY_SHAPES:-llama-3.1-8b qwen3-30b-a3b} " == *" $shape "* ]] || continue
      m=(--variant $variant); [[ $variant == kvfp8 ]] && m=(--variant bf16 --kv-cache-dtype fp8)
      timeout 90 python3 scripts/gpu/quant_memory.py --config $shape "${m[@]}" \
        --output-json "$OUT/memory_quant_${shape}_${variant}.json" 2>&1 | tail -1
    done
  done
  python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]
def rec(shape, variant, name, suffix=""):
    path = os.path.join(out, f"latency_quant_{shape}_{variant}{suffix}.json")
    if not os.path.exists(path):
        return None
    return next((r for r in json.load(open(path)) if r["name"] == name and not r.get("skipped")), None)
targets = {("int4", "decode-b1-c32768"): 0.6, ("fp8", "decode-b1-c32768"): 0.7, ("fp8", "cold-32768"): 0.85,
           ("int4", "cold-32768"): 1.1, ("kvfp8", "decode-b64-c4096"): 1.05}
for shape in ("llama-3.1-8b", "qwen3-30b-a3b"):
    print(f"--- {shape}: variant, cold 8K / 32K TTFT s, decode b1@32K / b64@4K ITL ms, weights GiB, KV tokens that fit")
    base = {}
    for variant in ("bf16", "fp8", "int4", "kvfp8"):
        cells = []
        for name, suffix, key in (("cold-8192", "", "ttft_s"), ("cold-32768", "", "ttft_s"),
                                  ("decode-b1-c32768", "", "itl_ms_median"), ("decode-b64-c4096", "", "itl_ms_median")):
            r = rec(shape, variant, name, suffix)
            value = r[key] if r else None
            if variant == "bf16":
                base[name] = value
            ratio = f" ({value / base[name]:.2f}x" + (f", target <= {targets[(variant, name)]}" if (variant, name) in targets else "") + ")" if value and base.get(name) and variant != "bf16" else ""
            cells.append("-" if value is None else f"{value:.4g}{ratio}")
        mem = os.path.join(out, f"memory_quant_{shape}_{variant}.json")
        m = json.load(open(mem)) if os.path.exists(mem) else {}
        if all(c == "-" for c in cells) and not m:
            continue  # a variant not run (QUANT_VARIANTS)
        cells.append(f"{m.get('weight_gib', float('nan')):.2f} GiB, {m.get('kv_pool_tokens', 0):,} tokens")
        print(f"{variant:<5} " + " | ".join(cells))
PY
fi

if [[ $MODE == quant-decode ]]; then  # one GPU, ~8 min: the int4 and FP8 decode GEMVs against their GEMMs
  timeout 100 python3 scripts/gpu/bench_quant_kernels.py --tokens 1,2,4,8,16 \
    --output-json "$OUT/kernels_quant_decode.json" 2>&1 | tee "$OUT/kernels_quant_decode.log" | grep -E "crossover|beats"
  for limit in 0 16; do
    LATENCY_TIMEOUT=80 latency_with int4_gemv$limit "" longserve.kernels.quant_gemm.WNA16_GEMV_MAX_TOKENS=$limit -- \
      --config llama-3.1-8b "${dummy[@]}" --quantization gptq --repeat 3 \
      --decode-batch-sizes 1@32768,64@4096 || status=1
    LATENCY_TIMEOUT=80 latency_with fp8_gemv$limit "" longserve.kernels.quant_fp8.FP8_GEMV_MAX_TOKENS=$limit -- \
      --config llama-3.1-8b "${dummy[@]}" --hf-overrides "$fp8" --repeat 3 \
      --decode-batch-sizes 1@32768,64@4096 || status=1
    # per-channel FP8 (--quantization fp8: the bf16 weights quantized at load, as vLLM does), batch 1
    LATENCY_TIMEOUT=70 latency_with fp8ch_gemv$limit "" longserve.kernels.quant_fp8.FP8_GEMV_MAX_TOKENS=$limit -- \
      --config llama-3.1-8b "${dummy[@]}" --quantization fp8 --repeat 3 \
      --decode-batch-sizes 1@32768 || status=1
  done
fi

if [[ $MODE == raw-hi ]]; then  # one GPU, ~4 min: the int4 GEMVs' unmasked high value (INT4_GEMV_RAW_HI)
  for raw in False True; do
    timeout 150 python3 scripts/probes/with_constants.py longserve.kernels.int4_gemv.INT4_GEMV_RAW_HI=$raw -- \
      pytest -q -m gpu tests/gpu/test_quant_kernels_gpu.py -k "int4_fast or int4_experts" -s -p no:cacheprovider \
      --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_raw_hi$raw.log" | grep -E "one-row|int4 experts|passed|failed" \
      | sed "s/^/raw_hi=$raw: /"
    for run in "llama-3.1-8b 1@32768" "qwen3-30b-a3b 1@32768,8@4096"; do
      read -r shape sizes <<< "$run"
      LATENCY_TIMEOUT=120 latency_with ${shape}_int4_raw_hi$raw "$shape raw_hi=$raw:" \
        longserve.kernels.int4_gemv.INT4_GEMV_RAW_HI=$raw -- --config $shape "${dummy[@]}" \
        --quantization gptq --repeat 3 --decode-batch-sizes $sizes
    done
  done
fi

if [[ $MODE == gemv-tune ]]; then  # one GPU, ~6 min: the decode GEMVs' tile tables (kernels/gemv_tables.py)
  # the 8B decode at batch 1 (32K) in FP8 blocks and GPTQ int4 with the default tiles, then tune_gemv writes
  # the tables into the package (tarred into $OUT: their names hold '=' and ','), then the same runs with them
  gemv_decode() {  # tag
    for v in fp8 int4; do
      q=(--quantization gptq); [[ $v == fp8 ]] && q=(--hf-overrides "$fp8")
      timeout 100 python3 -m longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 \
        "${q[@]}" --warmup 1 --repeat 3 --decode-batch-sizes 1@32768 --output-json "$OUT/latency_8b_${v}_$1.json" \
        2>&1 | tee "$OUT/latency_8b_${v}_$1.log" | grep -E "^decode" | sed "s/^/$v $1: /"
    done
  }
  gemv_decode default
  timeout 300 python3 -m longserve.kernels.tune_gemv --shapes llama-3.1-8b,qwen3-30b-a3b 2>&1 \
    | tee "$OUT/tune_gemv.log" | grep -E "^(llama|qwen)|wrote" || status=1
  tar czf "$OUT/gemv_configs.tgz" longserve/kernels/gemv_configs 2>/dev/null
  gemv_decode tuned
fi

if [[ $MODE == fp8-acc ]]; then  # one GPU, ~8 min: what full-fp32 accumulation costs the fp8 prefill
  # FP8_DOT_MAX_IMPRECISE_ACC 0 builds the fp8 dots as mma.sync on fp16 operands (Triton 3.6; scripts/dev/
  # count_moe_sass.py); 64 promotes the wgmma's partial sums every other k32; None (Triton's default, vLLM's Triton
  # block-FP8 kernel's) never within a dot (one BLOCK_K = 128 tile). Per value: the 8B and A3B FP8 cold TTFT (A3B 0.212 / 0.181 / 0.173 s at 8K, RESULTS.md
  # eighth session), the block GEMM against its fp32 reference at the 8B shapes (the error at a real K), and
  # the fp8 engine tests (their tiny models' blocks of 32-64 make 64 and None the same there)
  for acc in 0 64 None; do
    for shape in llama-3.1-8b qwen3-30b-a3b; do
      LATENCY_TIMEOUT=150 latency_with ${shape}_fp8_acc_$acc "" \
        longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=$acc -- \
        --config $shape "${dummy[@]}" --hf-overrides "$fp8" --repeat 3 \
        --prompt-lens 8192,32768
    done
    [[ $acc == 0 ]] && continue
    timeout 150 python3 scripts/probes/with_constants.py longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=$acc \
      -- pytest -q -m gpu tests/gpu/test_quant_engine_gpu.py tests/gpu/test_quant_kernels_gpu.py \
      -k "(fp8 or ct-int8) and not gemv" -p no:cacheprovider --tb=short -rfE 2>&1 \
      | tee "$OUT/gpu_tests_fp8_acc_$acc.log" | grep -E "^(FAILED|E  )|passed|failed" | tail -24
  done
fi

if [[ $MODE == switches ]]; then  # one GPU, ~6 min: the evidence for the switches still unmeasured or unverified
  # the int4 paths per M as CUDA-graph replays (decode's timing): WNA16_DEQUANT_MIN_TOKENS, WNA16_GEMV_MAX_TOKENS
  timeout 150 python3 scripts/gpu/bench_quant_kernels.py --tokens 1,2,4,8,16,32,64,256 \
    --output-json "$OUT/kernels_quant_graphs.json" 2>&1 | tee "$OUT/kernels_quant_graphs.log" | grep -E "crossover|beats"
  # the 8B int4 decode through each path: dequantize+cuBLAS (today), the fused kernel, the GEMV
  for path in dequant fused gemv; do
    c=(); [[ $path == fused ]] && c=(longserve.kernels.quant_gemm.WNA16_DEQUANT_MIN_TOKENS=65)
    [[ $path == gemv ]] && c=(longserve.kernels.quant_gemm.WNA16_GEMV_MAX_TOKENS=16)
    LATENCY_TIMEOUT=100 latency_with int4_$path "" ${c[@]+"${c[@]}"} -- --config llama-3.1-8b "${dummy[@]}" \
      --quantization gptq --repeat 3 --decode-batch-sizes 1,64 --decode-context-len 4096 \
      || status=1
  done
  # what fp32 accumulation (FP8_DOT_MAX_IMPRECISE_ACC=0, the default since 73be6a4: the engine tests fail with
  # Triton's own, None) costs the fp8 GEMMs and the 8B FP8 shape's prefill and decode
  for acc in 0 None; do
    LATENCY_TIMEOUT=120 latency_with fp8_acc_$acc "" longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=$acc \
      -- \
      --config llama-3.1-8b "${dummy[@]}" --hf-overrides "$fp8" --repeat 3 \
      --prompt-lens 8192 --decode-batch-sizes 1@32768,64@4096
  done
fi

if [[ $MODE == silu-quant ]]; then  # one GPU (~5 min): the FP8 activation-quantization changes, each off and on
  python3 -m pytest -q -m gpu tests/gpu/test_quant_kernels_gpu.py -k "gated or fp8" -p no:cacheprovider --tb=short \
    -rfE 2>&1 | tee "$OUT/gpu_tests_silu_quant.log" | tail -3 || status=1
  # before both (one group a program, no fusion), the wider programs alone, both (the default)
  for setting in "QUANT_VALUES_PER_PROGRAM=128 FUSE_SILU_AND_MUL_QUANT=False" "FUSE_SILU_AND_MUL_QUANT=False" \
                 "FUSE_SILU_AND_MUL_QUANT=True"; do
    c=(); for kv in $setting; do
      m=quant_fp8; [[ $kv == QUANT_VALUES_PER_PROGRAM=* ]] && m=quant_tiles; c+=("longserve.kernels.$m.$kv")
    done
    name=${setting// /_}
    LATENCY_TIMEOUT=200 latency_with fp8_${name//=/-} "$setting:" "${c[@]}" -- --config llama-3.1-8b "${dummy[@]}" \
      --hf-overrides "$fp8" --repeat 3 --prompt-lens 8192,32768 \
      --decode-batch-sizes 64@4096
  done
fi

if [[ $MODE == serial-reduce ]]; then  # one GPU (~5 min): split-K partials summed inside the GEMV, off and on
  python3 -m pytest -q -s -m gpu tests/gpu/test_quant_kernels_gpu.py -k serial -p no:cacheprovider --tb=short -rfE \
    2>&1 | tee "$OUT/gpu_tests_serial_reduce.log" | grep -E "splitk_reduce|passed|failed" || status=1
  for variant in fp8 int4; do
    q=(--hf-overrides "$fp8"); [[ $variant == int4 ]] && q=(--quantization gptq)
    for serial in False True; do
      latency_with serial_${variant}_$serial "$variant SERIAL=$serial" \
        longserve.kernels.split_k.SPLIT_K_SERIAL_REDUCE=$serial -- \
        --config llama-3.1-8b "${dummy[@]}" --repeat 3 "${q[@]}" --decode-batch-sizes 1@32768,64@4096
    done
  done
fi

if [[ $MODE == kvfp8-f16 ]]; then  # one GPU (~7 min): the fp8 KV decode's fp16 dots against its bf16 ones
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kv_fp8_gpu.py -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_kvfp8_f16.log" | tail -3 || status=1
  for shape in qwen3-30b-a3b llama-3.1-8b; do
    LATENCY_TIMEOUT=120 latency_with "kvfp8_${shape}_auto" "$shape bf16 KV" -- --config $shape "${dummy[@]}" \
      --repeat 3 --decode-batch-sizes 64@4096
    # the fp16 dots off and on, then on with 2 pipeline stages (the fp8 bytes come from shared memory by LDS:
    # 1,189 SASS instructions a step at 2 stages against 1,235 at 3, the default)
    for v in "KV_FP8_AS_F16=False" "KV_FP8_AS_F16=True" "KV_FP8_AS_F16=True DECODE_NUM_STAGES=2"; do
      consts=(); for c in $v; do consts+=("longserve.kernels.decode_attention.$c"); done
      LATENCY_TIMEOUT=120 latency_with "kvfp8_${shape}_${v// /_}" "$shape fp8 KV $v" "${consts[@]}" -- \
        --config $shape "${dummy[@]}" --repeat 3 --kv-cache-dtype fp8 --decode-batch-sizes 64@4096
    done
  done
fi

if [[ $MODE == int4-dequant ]]; then  # one GPU (~7 min): the int4 weights' dequantization by rows (DEQUANT_ROWS)
  # its GPU test (both kernels bit for bit at the 8B and A3B shapes), the kernels alone (sweep_dequant.py), the A3B
  # int4 cold prefill under the profiler beside bf16's, then the A3B and 8B int4 cold 8K / 32K with the switch off
  # and on, one process each
  rows=longserve.kernels.quant_gemm.DEQUANT_ROWS
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_quant_kernels_gpu.py -k "dequantize_rows or wna16_gemm_matches" \
    -p no:cacheprovider --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_dequant.log" | tail -3 || status=1
  timeout 150 python3 scripts/probes/sweep_dequant.py 2>&1 | tee "$OUT/sweep_dequant.log" | grep -E "best|Error"
  for v in bf16 int4; do
    q=(); [[ $v == int4 ]] && q=(--quantization gptq)
    LATENCY_TIMEOUT=120 latency_with a3b_prefill_$v "A3B $v" -- --config qwen3-30b-a3b "${dummy[@]}" --repeat 1 \
      ${q[@]+"${q[@]}"} --prompt-lens 32768 --profile
    top_ops "$OUT/latency_a3b_prefill_$v.json" | head -8
  done
  # the rows kernel's fastest setting over the A3B experts' two shapes in the sweep (64 rows, 4 warps without one)
  read -r r w < <(python3 - "$OUT/sweep_dequant.json" <<'PY' 2>/dev/null || echo 64 4
import collections, json, sys
total = collections.Counter()
for row in json.load(open(sys.argv[1])):
    if row["kernel"] == "rows" and row["shape"].startswith("a3b"):
        total[(row["rows"], row["warps"])] += row["ms"]
print(*min(total, key=total.get))
PY
)
  echo "rows kernel in the engine: DEQUANT_ROWS_BLOCK_N=$r DEQUANT_ROWS_WARPS=$w"
  for on in False True; do
    set=("$rows=$on"); [[ $on == True ]] && set+=("$rows""_BLOCK_N=$r" "$rows""_WARPS=$w")
    for shape in qwen3-30b-a3b llama-3.1-8b; do
      LATENCY_TIMEOUT=120 latency_with ${shape}_int4_rows$on "$shape DEQUANT_ROWS=$on" "${set[@]}" -- --config $shape \
        "${dummy[@]}" --repeat 3 --quantization gptq --prompt-lens 8192,32768
    done
  done
fi

if [[ $MODE == int4-fused-prefill ]]; then  # one GPU (~6 min): the A3B int4 prefill through fused_moe's int path
  # (moe_wna16.MOE_WNA16_PREFILL "fused": no experts dequantized whole) with its tiles by rows (moe_gemm.INT_ROWS):
  # its GPU test (bit for bit against the column tiles, timed beside the dequantized experts), the engine at the
  # untuned prefill tiles (sm90 builds spill at 128 x 128, count_moe_sass.py), then tune_moe's int4 prefill tiles
  # by rows (into $OUT and, for this call only, the package's moe_configs/) and the engine again; each under the
  # profiler: the int path's GEMMs against the dequantization + bf16 GEMMs of the default
  fused=("longserve.kernels.moe_wna16.MOE_WNA16_PREFILL='fused'" longserve.kernels.moe_gemm.INT_ROWS=True)
  timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_quant_kernels_gpu.py -k "int_rows" -s -p no:cacheprovider \
    --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_int_rows.log" | grep -E "experts T=|passed|failed" || status=1
  for step in default untuned tuned; do
    if [[ $step == tuned ]]; then
      timeout 240 python3 scripts/probes/with_constants.py longserve.kernels.moe_gemm.INT_ROWS=True -- \
        longserve.kernels.tune_moe --num-experts 128 --top-k 8 --hidden 2048 --intermediate 768 --weights int4 \
        --batch-sizes 2048,8192 --space prefill --output-dir "$OUT/int4_table" 2>&1 | tee "$OUT/tune_int4.log" \
        | tr '\r' '\n' | grep -E "^T=|wrote|Error"
      cp "$OUT"/int4_table/*.json longserve/kernels/moe_configs/ 2> /dev/null || { echo "no int4 table"; break; }
    fi
    consts=(); [[ $step != default ]] && consts=("${fused[@]}")
    LATENCY_TIMEOUT=150 latency_with a3b_int4_$step "A3B int4 $step" ${consts[@]+"${consts[@]}"} -- \
      --config qwen3-30b-a3b "${dummy[@]}" --repeat 2 --quantization gptq --prompt-lens 8192,32768 --profile
    top_ops "$OUT/latency_a3b_int4_$step.json" | head -6
  done
  git ls-files --error-unmatch longserve/kernels/moe_configs/*dtype=int4.json > /dev/null 2>&1 \
    || rm -f longserve/kernels/moe_configs/*dtype=int4.json  # the call's table goes back with $OUT only
fi

if [[ $MODE == int4-mid-steps ]]; then  # one GPU (~6 min): 4-bit experts' mid-sized steps by rows or dequantized
  # the engine test: the tiny GPTQ MoE model's 274-token prefill now by rows, under piecewise graphs (~60 s)
  timeout 240 python3 -m pytest -q -s -m gpu tests/gpu/test_quant_kernels_gpu.py tests/gpu/test_quant_engine_gpu.py \
    -k "int4_experts_paths or int_rows or test_kernels_give_the_reference_tokens and gptq-moe" -p no:cacheprovider \
    --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_mid_steps.log" | grep -E "experts T=|passed|failed" || status=1
  for run in off1 on1 off2 on2; do
    v=0; [[ $run == on* ]] && v=256
    LATENCY_TIMEOUT=100 latency_with "a3b_int4_mid_$run" "A3B int4 rows<=$v an expert" \
      "longserve.kernels.moe_wna16.MOE_WNA16_ROWS_MAX_PER_EXPERT=$v" -- --config qwen3-30b-a3b "${dummy[@]}" \
      --repeat 5 --quantization gptq --prompt-lens 512,1024,2048,4096
  done
fi

if [[ $MODE == int4-dense-rows ]]; then  # one GPU (~7 min): dense int4 past the GEMV, fused by rows or dequantized
  timeout 200 python3 scripts/probes/sweep_int4_fused.py 2>&1 | tee "$OUT/sweep_int4_fused.log" \
    | grep -E "^(all four|WNA16|NVIDIA)" || status=1
  for run in off1 on1 off2 on2; do
    v=0; [[ $run == on* ]] && v=4096
    LATENCY_TIMEOUT=90 latency_with "8b_int4_rows_$run" "8B int4 fused<=$v" \
      "longserve.kernels.quant_gemm.WNA16_FUSED_MAX_TOKENS=$v" -- --config llama-3.1-8b "${dummy[@]}" \
      --repeat 3 --quantization gptq --prompt-lens 512,2048 --decode-batch-sizes 128@4096
  done
fi

if [[ $MODE == lone-long ]]; then  # one GPU (~5 min): the 8B cold 128K in lone steps against 8K chunks
  for run in bf16_chunk bf16_lone int4_lone int4_chunk; do
    a=(--lone-prefill-chunk-size 8192); [[ $run == bf16_lone ]] && a=(--lone-prefill-chunk-size 32768)
    [[ $run == int4_lone ]] && a=()  # the integer weights' default: 32K
    [[ $run == int4* ]] && a+=(--quantization gptq)
    LATENCY_TIMEOUT=110 latency_with 8b_$run "8B $run" -- --config llama-3.1-8b "${dummy[@]}" --repeat 2 \
      --prompt-lens 131072 "${a[@]}"
  done
  python3 scripts/dev/clocks_by_case.py "$OUT"  # int4 held ~17% more SM clock than bf16 at a01eadb (one scale a tensor)
fi

if [[ $MODE == lone-chunks ]]; then  # one GPU (~7 min): the A3B's cold prompts in larger lone steps, bf16 and int4
  for lone in 8192 16384 32768; do
    for v in bf16 int4; do
      q=(); [[ $v == int4 ]] && q=(--quantization gptq)
      LATENCY_TIMEOUT=110 latency_with a3b_${v}_lone$lone "A3B $v lone $lone" -- --config qwen3-30b-a3b "${dummy[@]}" \
        --repeat 3 ${q[@]+"${q[@]}"} --prompt-lens 8192,32768 --lone-prefill-chunk-size $lone
    done
  done
  # a dense model, where the chunk size moved cold 32K / 128K by 0.3% (seventeenth session), if time is left
  for lone in 8192 32768; do
    (( SECONDS < 420 )) || { echo "8B lone $lone: skipped (${SECONDS} s in)"; continue; }
    LATENCY_TIMEOUT=100 latency_with 8b_lone$lone "8B bf16 lone $lone" -- --config llama-3.1-8b "${dummy[@]}" \
      --repeat 2 --prompt-lens 32768,131072 --lone-prefill-chunk-size $lone
  done
  python3 - "$OUT" <<'PY'
import json, os, sys
def ttft(name):
    path = os.path.join(sys.argv[1], f"latency_{name}.json")
    if not os.path.exists(path):
        return {}
    return {r["name"]: r["ttft_s"] for r in json.load(open(path)) if r.get("ttft_s")}
for lone in (8192, 16384, 32768):
    bf16, int4 = ttft(f"a3b_bf16_lone{lone}"), ttft(f"a3b_int4_lone{lone}")
    for case in sorted(set(bf16) & set(int4)):
        print(f"lone {lone:>5} {case:<12} bf16 {bf16[case]:.4f} s  int4 {int4[case]:.4f} s  int4/bf16 {int4[case] / bf16[case]:.3f}")
PY
fi

if [[ $MODE == a3b-fp8-prefill ]]; then  # one GPU (~6 min): where the A3B FP8 cold prefill's time goes
  # the fp8 dots at max_num_imprecise_acc 32 (wgmma promoted after each k32, as fp8_wgmma_gemv does; 0, the
  # default, builds mma.sync on fp16 operands: scripts/dev/count_moe_sass.py): the fp8 engine tests first
  acc32=longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=32
  timeout 200 python3 scripts/probes/with_constants.py $acc32 -- pytest -q -m gpu tests/gpu/test_quant_engine_gpu.py \
    -k "fp8 or ct-int8" -p no:cacheprovider --tb=line -rfE 2>&1 | tee "$OUT/gpu_tests_fp8_acc32.log" | tail -6
  for v in bf16 fp8 fp8_acc32 fp8_accNone; do
    over=(); consts=()
    [[ $v == fp8* ]] && over=(--hf-overrides "$fp8")
    [[ $v == fp8_acc32 ]] && consts=("$acc32")
    [[ $v == fp8_accNone ]] && consts=(longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=None)
    LATENCY_TIMEOUT=150 latency_with "a3b_prefill_$v" "A3B $v" "${consts[@]}" -- --config qwen3-30b-a3b \
      "${dummy[@]}" --repeat 2 "${over[@]}" --prompt-lens 32768 --profile
    top_ops "$OUT/latency_a3b_prefill_$v.json"
  done
fi

if [[ $MODE == fp8-acc-quality ]]; then  # one GPU (~4 min): bench accuracy of the FP8 formats at each accumulation
  for acc in 0 32 None; do
    for arch in qwen3 qwen3_moe; do
      if [[ $arch == qwen3 ]]; then shape=(--variants fp8-block,ct-fp8-dynamic); else shape=(--variants fp8-block --hidden 128); fi
      # the checkpoints stay on the machine (/tmp); the tables and reports come back
      dir=/tmp/fp8_quality/${arch}_acc$acc
      timeout 150 python3 scripts/probes/with_constants.py longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=$acc -- \
        scripts/gpu/bench_quant_accuracy.py --arch $arch "${shape[@]}" --output-dir "$dir" \
        2>"$OUT/fp8_quality_${arch}_acc$acc.log" | tail -4 || status=1
      mkdir -p "$OUT/fp8_quality/${arch}_acc$acc"
      cp -r "$dir/quant_accuracy.json" "$dir/reports" "$OUT/fp8_quality/${arch}_acc$acc/" 2>/dev/null
    done
  done
fi

if [[ $MODE == tune-fp8-moe-acc32 ]]; then  # one GPU (~7 min): the FP8 MoE tiles at wgmma's accumulation
  # TUNE_FP8_ACC: the max_num_imprecise_acc tuned for (32 by default: promoted each k32; None: unpromoted)
  acc=${TUNE_FP8_ACC:-32}
  accset=longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=$acc
  timeout 300 python3 scripts/probes/with_constants.py $accset -- longserve.kernels.tune_moe --num-experts 128 \
    --top-k 8 --hidden 2048 --intermediate 768 --weights fp8_e4m3 --fp8-block 128 --batch-sizes 2048,8192 \
    --space fp8-prefill 2>&1 | tee "$OUT/tune_fp8_acc$acc.log" | tr '\r' '\n' | grep -E "^T=|wrote|Error"
  tar czf "$OUT/moe_configs_fp8_acc$acc.tgz" longserve/kernels/moe_configs 2>/dev/null
  LATENCY_TIMEOUT=150 latency_with a3b_prefill_bf16 "A3B bf16" -- --config qwen3-30b-a3b "${dummy[@]}" --repeat 2 \
    --prompt-lens 32768
  LATENCY_TIMEOUT=150 latency_with a3b_prefill_fp8_acc${acc}_tuned "A3B FP8 acc $acc, tuned" $accset -- \
    --config qwen3-30b-a3b "${dummy[@]}" --repeat 2 --hf-overrides "$fp8" --prompt-lens 32768
fi
