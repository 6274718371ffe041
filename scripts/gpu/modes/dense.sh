# gpu_check.sh's modes for the dense models (sourced by scripts/gpu/gpu_check.sh, which sets MODE, OUT and status):
# the GPU tests, the Llama-3.1-8B shape's latency against HF transformers and vLLM, tensor parallelism, the
# probes and the switches of the dense path.
# tests (one GPU; quick: the same): the GPU tests in five processes and the CPU e2e suite on CUDA; bench: the
# kernel microbenchmarks; all = tests + bench. tp, tp2, tp32: two GPUs.
# chunks (one GPU): a lone cold prompt in chunks of 8K, 16K, 32K.
# piecewise (one GPU): the piecewise graphs' GPU test, then step_timeline.py, cold 512-4096 and 32K, and 32K +
# 64 / 512 / 1024 hits (issue 19's >= 100x: 95.6x eager) with --piecewise-cuda-graph-max-tokens 0 and 4096.
# pdl (one GPU, ~8 min): programmatic dependent launch off and on: its GPU tests (outputs unchanged, the kernels
# compiled for it), the 8B shape's decode (bf16 at batch 1 (32K) and 64 (4K), FP8 blocks and GPTQ int4 at batch 1).
# decode-merge (one GPU, ~3 min): the decode attention's splits merged by each (request, kv head)'s last program
# instead of a merge launch (decode_attention.DECODE_SERIAL_MERGE_MAX_SPLITS, 8 since 854fbd1 was measured): its
# GPU test (the 8B shapes, graphs, PDL, both times), then the 8B decode at batch 1 (32K), 16 (8K) and 64 (4K) in
# bf16 and at batch 1 in FP8 blocks, never (0) and up to 8 splits, one process each.
# early-loads (one GPU, ~5 min): the norms', RoPE's and the decode attention's loads of what no kernel of the step
# writes issued before their PDL wait (launch.PDL_EARLY_LOADS) off and on: the PDL GPU tests, then the 8B decode at
# batch 1 (32K) in bf16, GPTQ int4 and FP8 blocks, and at batch 64 (4K) in bf16, one process each.
# dense-gemm (one GPU, ~6 min): kernels/dense_gemm.py's Triton GEMM for the unquantized linears at 16-128 tokens
# (DENSE_GEMM_TRITON_MAX_TOKENS, off): its GPU tests, per 8B projection against cuBLAS with a small tile sweep
# (scripts/gpu/bench_dense_gemm.py, weights from HBM), then the 8B decode at batch 16 (8K) and 64 (4K) off and on.
# dense-tables (one GPU, ~8 min): kernels/dense_gemm.py's tuned tables (DENSE_GEMM_TABLES): its GPU tests, then
# `tune_gemv --kernels dense,dense_gated` over the seed's bf16 products at 1-64 rows (each shape where a Triton tile
# beats cuBLAS gets an entry; the gated table, the down projections made from gate|up, against silu_and_mul +
# cuBLAS), then the seed's decode b1@32K, b8@8K, b64@4K with the tables off and on, then the b1 step profiled off
# and on. In the fiftieth session, with one table serving the down projections gated too (a variant the tuner had
# not timed), b1 went 3.50 -> 3.64 ms. dense-tables-8b (~5 min): the same for the Llama-3.1-8B (1, 16, 64 rows;
# decode b1@32K, b16@8K, b64@4K: issue 19's decode cells; b1 7.43 -> 8.43 ms with that one table).
# gemm-tunable (one GPU, ~1 min): every 8B projection at 16 / 64 / 128 tokens with cuBLAS's default heuristics and
# with TunableOp's pick (scripts/probes/probe_tunableop.py).
# swiglu-gemm (one GPU, ~2 min): the 8B gate/up GEMM at 8K / 32K tokens writing silu(gate) * up from its epilogue
# (a persistent TMA Triton GEMM, scripts/probes/probe_swiglu_gemm.py) against cuBLAS's gate|up + silu_and_mul: the
# round trip it saves is ~40 ms of an H100's cold 32K, if it runs at cuBLAS's rate.
# dense-gated (one GPU, ~5 min): the bf16 MLP's down projection at decode batches made from gate|up on its loads
# (dense_gemm.DENSE_GEMM_GATED_MAX_TOKENS, off): its GPU tests, then the 8B decode b1@32K, b16@8K, b64@4K off, on,
# off, on: one silu_and_mul launch a layer less, if the Triton GEMM reads the down weight at cuBLAS's rate.
# dense-lone (one GPU, ~3 min): the 8B bf16 cold 32K in one lone step of 32K against the default 8K chunks, twice
# each, and the SM clock each run held (H100: the lone step 1.4% faster in the forty-first session, 0.8% in the
# forty-second; the 128K's lone steps are quant.sh's lone-long).
# granule (one GPU, ~3 min): the 8B with 16,400 tokens cached and 40,000 new, its chunks on the prefix granule or not.
# swiglu-engine (one GPU, ~5 min): kernels/swiglu_gemm.py in the engine (SWIGLU_GEMM_MIN_TOKENS, on from 1K tokens):
# its GPU tests, then the 8B bf16 cold 1K / 8K / 32K off, on, off, on (SWIGLU_CONFIG, a dict literal, sets a tile).
# decode-splits (one GPU, ~4 min): the 8B decode at batch 1 / 16 / 64 with 2, 3 and 4 programs an SM for the
# decode attention's key splits (decode_attention.PROGRAMS_PER_SM; 4 is the default). decode-tile (~5 min): the
# same decodes with fewer, longer key splits merged in the kernel, and 128-key tiles for them.
# fusions (one GPU): the prefix-as-view and fused K/V-store switches off, each against both on (fusions-a3b, the
# A3B shape's, is in moe.sh).
# The prefix-hit and host-time modes (hit, hit-*, paged-cudnn, host, launch, turns, short-plans) are in
# prefix_hit.sh, the attention kernels' (fa3, gluon, gluon-extend, gluon-ncu, fa3-engine) in attention.sh.
# shellcheck shell=bash

if [[ $MODE == all || $MODE == tests || $MODE == quick ]]; then
  # five processes at once (Triton's JIT is CPU-bound: the whole directory one file at a time took over 280 s
  # with cold caches, three groups at once 152 s, 2026-12-02): kernels, three engine groups, the CPU e2e suite
  # on CUDA; each group's log kept, so a call cut short still reports what finished; faulthandler prints
  # where a stuck test waits. At c2dd2fd the kernels group took 161 s and the MoE/quantized group had not
  # finished at 260 s beside the others (49 s alone); at 854fbd1, with every CUDA engine capturing piecewise
  # graphs at start, that group took 525 s and the mode 543 s; test_pdl_gpu.py builds 30-odd engines (6 of its
  # 16 tests took 98 s at 7da0d31, so perhaps half of it): it runs as a process of its own now (212 s at 028ec0c,
  # on an H100, where the MoE / quantized / rest group took 531 s and the mode 549 s: each log now ends with its
  # slowest tests, --durations)
  gpu_group() {  # name, files...
    python3 -m pytest -q -m gpu "${@:2}" -p no:cacheprovider -o faulthandler_timeout=300 --tb=short -rfE \
      --durations=12 > "$OUT/gpu_tests_$1.log" 2>&1
  }
  gpu_group kernels tests/gpu/test_attention_gpu.py tests/gpu/test_fused_ops_gpu.py tests/gpu/test_fused_moe_gpu.py \
    tests/gpu/test_quant_kernels_gpu.py & p1=$!
  gpu_group engine tests/gpu/test_engine_gpu.py tests/gpu/test_overlap_gpu.py tests/gpu/test_kv_fp8_gpu.py \
    tests/gpu/test_structured_gpu.py & p2=$!
  gpu_group pdl tests/gpu/test_pdl_gpu.py & p5=$!
  # the quantized engines apart: at 4804d36 (H100) the group that held them took 574 s (their five reference-token
  # tests 217 s of it) against 171 s for the kernels', and the mode ran past queue.sh's 585 s
  gpu_group quant_engine tests/gpu/test_quant_engine_gpu.py & p6=$!
  # the hybrid models' kernels and engines apart: at 23a7f23 (H100) the float32-state delta rule made an illegal
  # memory access in the MoE/rest group's process, and the 88 tests after it failed on the poisoned context
  gpu_group hybrid tests/gpu/test_gated_delta_gpu.py tests/gpu/test_hybrid_engine_gpu.py & p7=$!
  # the MoE engines, and any file no group names (a new one is not skipped silently)
  rest=(); for f in tests/gpu/test_*.py; do
    [[ $f =~ test_(attention|fused_ops|fused_moe|quant_kernels|engine|overlap|kv_fp8|structured|pdl|quant_engine|tensor_parallel|gated_delta|hybrid_engine)_gpu ]] \
      && continue
    rest+=("$f")
  done
  # (the Gluon GEMVs' per-projection times, over 256 MB of weight copies, run in their own modes: int4-mma, fp8-wgmma)
  gpu_group moe_rest "${rest[@]}" -k "not test_times" & p3=$!
  LONGSERVE_TEST_DEVICE=cuda python3 -m pytest -q tests/e2e/test_engine.py -p no:cacheprovider \
    > "$OUT/e2e_cuda.log" 2>&1 & p4=$!
  for p in $p1 $p2 $p3 $p4 $p5 $p6 $p7; do wait $p || status=1; done
  for f in "$OUT"/gpu_tests_*.log "$OUT/e2e_cuda.log"; do
    echo "== $f"; grep -E "passed|failed|^FAILED|^ERROR" "$f" | tail -12
  done
fi

if [[ $MODE == all || $MODE == bench ]]; then
  python3 - <<'PY' 2>&1 | tee "$OUT/kernels.log"
import json, os
from longserve.bench.kernels.attention import bench_attention
from longserve.bench.kernels.fused_ops import bench_fused_ops
rows = bench_attention() + bench_fused_ops()
json.dump(rows, open(os.path.join(os.environ["OUT"], "kernels.json"), "w"), indent=1)
for r in rows:
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
PY
  common=(--config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3)
  python3 -m longserve.bench.latency "${common[@]}" --prompt-lens 8192,32768 --prefix-hit 32768:64 \
    --decode-batch-sizes 1 --decode-context-len 32768 --compare-hf --output-json "$OUT/latency_8b.json" \
    2>&1 | tee "$OUT/latency_8b.log" | tail -12
  python3 -m longserve.bench.latency "${common[@]}" --decode-batch-sizes 64 --decode-context-len 4096 \
    --output-json "$OUT/latency_8b_decode64.json" 2>&1 | tee "$OUT/latency_8b_decode64.log" | tail -6
fi

if [[ $MODE == long ]]; then
  python3 -m longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 0 \
    --repeat 1 --prompt-lens 131072 --compare-hf --output-json "$OUT/latency_8b_128k.json" \
    2>&1 | tee "$OUT/latency_8b_128k.log" | tail -6
fi

if [[ $MODE == tp ]]; then  # needs two GPUs: TP tests, the 8B shape at TP=2
  python3 -m pytest -q -m gpu tests/gpu/test_tensor_parallel_gpu.py -p no:cacheprovider -o faulthandler_timeout=150 -x 2>&1 \
    | tee "$OUT/gpu_tp_tests.log" | tail -8 || status=1
  python3 -m longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --tp-size 2 \
    --tp-overlap-min-tokens 4096 --profile --warmup 1 --repeat 3 --prompt-lens 8192,32768 \
    --output-json "$OUT/latency_tp2_8b.json" 2>&1 \
    | tee "$OUT/latency_tp2_8b.log" | tail -6
  python3 -m longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --tp-size 2 \
    --tp-overlap-min-tokens 0 --warmup 1 --repeat 3 --prompt-lens 32768 \
    --output-json "$OUT/latency_tp2_8b_no_overlap.json" 2>&1 | tee "$OUT/latency_tp2_8b_no_overlap.log" | tail -4
fi

if [[ $MODE == tp32 ]]; then  # two GPUs: the Qwen2.5-32B shape at TP=2
  tp=(--config qwen2.5-32b --load-format dummy --dtype bfloat16 --tp-size 2)
  python3 -m longserve.bench.latency "${tp[@]}" --profile --warmup 1 --repeat 2 --prompt-lens 8192,32768 \
    --prefix-hit 32768:64 --decode-batch-sizes 1,32 --decode-context-len 8192 \
    --output-json "$OUT/latency_tp2_32b.json" 2>&1 | tee "$OUT/latency_tp2_32b.log" | tail -8
  python3 -m longserve.bench.latency "${tp[@]}" --warmup 0 --repeat 1 --prompt-lens 131072 \
    --output-json "$OUT/latency_tp2_32b_128k.json" 2>&1 | tee "$OUT/latency_tp2_32b_128k.log" | tail -4
fi

if [[ $MODE == tp2 ]]; then  # two GPUs: TP tests, then overlap off against on at 32K for both shapes
  python3 -m pytest -q -m gpu tests/gpu/test_tensor_parallel_gpu.py -p no:cacheprovider -o faulthandler_timeout=150 2>&1 \
    | tee "$OUT/gpu_tp_tests.log" | tail -8 || status=1
  for shape in llama-3.1-8b qwen2.5-32b; do
    for overlap in 0 4096; do
      prof=(); [[ $overlap == 4096 ]] && prof=(--profile)
      python3 -m longserve.bench.latency --config $shape --load-format dummy --dtype bfloat16 --tp-size 2 \
        --tp-overlap-min-tokens $overlap ${prof[@]+"${prof[@]}"} --warmup 1 --repeat 2 --prompt-lens 32768 \
        --output-json "$OUT/latency_tp2_${shape}_overlap$overlap.json" 2>&1 \
        | tee "$OUT/latency_tp2_${shape}_overlap$overlap.log" | tail -3
    done
  done
fi

if [[ $MODE == profile ]]; then  # one GPU: where the time of the 8B shape's cold and prefix-hit cases goes
  python3 scripts/probes/sweep_decode.py 2>&1 | tee "$OUT/sweep_decode.log" | grep -v failed | tail -4
  python3 -m longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 \
    --repeat 3 --prompt-lens 8192,32768 --prefix-hit 32768:64 --decode-batch-sizes 1 --decode-context-len 32768 \
    --profile --output-json "$OUT/latency_8b_profile.json" 2>&1 | tee "$OUT/latency_8b_profile.log" | tail -8
fi

if [[ $MODE == latency ]]; then  # one GPU: tests, short-suffix extend sweep, the 8B shape's cases against HF
  python3 -m pytest -q -m gpu tests/gpu/test_engine_gpu.py tests/gpu/test_attention_gpu.py -p no:cacheprovider \
    -o faulthandler_timeout=150 2>&1 | tee "$OUT/gpu_tests.log" | tail -6 || status=1
  python3 scripts/probes/sweep_short_extend.py 2>&1 | tee "$OUT/sweep_short_extend.log" | grep -v failed | tail -3
  base=(--config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3)
  python3 -m longserve.bench.latency "${base[@]}" --prompt-lens 8192,32768 --prefix-hit 32768:64,32768:256 \
    --decode-batch-sizes 1 --decode-context-len 32768 --compare-hf --profile --output-json "$OUT/latency_8b.json" \
    2>&1 | tee "$OUT/latency_8b.log" | tail -8
  python3 -m longserve.bench.latency "${base[@]}" --decode-batch-sizes 64 --decode-context-len 4096 --profile \
    --output-json "$OUT/latency_8b_decode64.json" 2>&1 | tee "$OUT/latency_8b_decode64.log" | tail -3
  python3 -m longserve.bench.latency "${base[@]}" --prefix-hit 32768:64 --cuda-graph-max-prefill-tokens 0 \
    --output-json "$OUT/latency_8b_no_prefill_graphs.json" 2>&1 | tee "$OUT/latency_8b_no_prefill_graphs.log" | tail -3
fi

if [[ $MODE == swiglu-gemm ]]; then  # one GPU (~2 min): a fused gate/up + SiLU GEMM against cuBLAS + silu_and_mul
  timeout 240 python3 scripts/probes/probe_swiglu_gemm.py --tokens ${PROBE_TOKENS:-8192,32768} 2>&1 \
    | tee "$OUT/swiglu_gemm.log" || status=1
fi

if [[ $MODE == dense-gated ]]; then  # one GPU (~5 min): the bf16 down projection gated at decode batches
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_dense_gemm_gpu.py -k gated -p no:cacheprovider --tb=short \
    -rfE 2>&1 | tee "$OUT/gpu_tests_dense_gated.log" | tail -3 || status=1
  for run in off1 on1 off2 on2; do
    v=0; [[ $run == on* ]] && v=64
    LATENCY_TIMEOUT=100 latency_with "8b_gated_$run" "8B gated<=$v" \
      "longserve.kernels.dense_gemm.DENSE_GEMM_GATED_MAX_TOKENS=$v" -- --config llama-3.1-8b "${dummy[@]}" \
      --repeat 3 --prompt-lens 128 --decode-batch-sizes 1@32768,16@8192,64@4096
  done
fi

if [[ $MODE == dense-lone ]]; then  # one GPU (~3 min): the 8B bf16 cold 32K in lone steps of 32K or 8K chunks
  # (4 stages of the fused SwiGLU GEMM for lone steps gained nothing here at a01eadb: dropped)
  for run in chunk1 lone1 chunk2 lone2; do
    lone=(); [[ $run != chunk* ]] && lone=(--lone-prefill-chunk-size 32768)
    LATENCY_TIMEOUT=100 latency_with "8b_$run" "8B $run" -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
      --prompt-lens 32768 ${lone[@]+"${lone[@]}"}
  done
  python3 scripts/dev/clocks_by_case.py "$OUT"  # the SM clock each run held (it moves with the data at 700 W)
fi

if [[ $MODE == granule ]]; then  # one GPU (~3 min): a long new turn behind a cached prefix off the chunk granule
  # (sdpa_shapes.CHUNKS_ON_GRANULE: its 8K chunks after the first on the granule, or 16 keys past it, each
  # then padding its causal call by 1,024 rows), off / on twice, and the SM clock each run held
  for run in off1 on1 off2 on2; do
    v=False; [[ $run == on* ]] && v=True
    LATENCY_TIMEOUT=100 latency_with "8b_granule_$run" "on granule $v" longserve.attention.sdpa_shapes.CHUNKS_ON_GRANULE=$v \
      -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 --prefix-hit 16400:40000
  done
  python3 scripts/dev/clocks_by_case.py "$OUT"
fi

if [[ $MODE == swiglu-engine ]]; then  # one GPU (~5 min): the fused gate/up + SiLU GEMM in the 8B's prefill
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_swiglu_gemm_gpu.py -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_swiglu_gemm.log" | tail -3 || status=1
  tile=(); [[ -n ${SWIGLU_CONFIG:-} ]] && tile=("longserve.kernels.swiglu_gemm.SWIGLU_GEMM_CONFIG=$SWIGLU_CONFIG")
  for run in off1 on1 off2 on2; do
    v=0; [[ $run == on* ]] && v=1024
    LATENCY_TIMEOUT=100 latency_with "8b_swiglu_$run" "8B swiglu>=$v" ${tile[@]+"${tile[@]}"} \
      "longserve.kernels.swiglu_gemm.SWIGLU_GEMM_MIN_TOKENS=$v" -- --config llama-3.1-8b "${dummy[@]}" \
      --repeat 3 --prompt-lens 1024,8192,32768
  done
fi

if [[ $MODE == gemm-tunable ]]; then  # one GPU (~1 min): the 8B projections, cuBLAS's default against TunableOp's
  timeout 150 python3 scripts/probes/probe_tunableop.py 2>&1 | tee "$OUT/probe_tunableop.log" | tail -30 || status=1
fi

if [[ $MODE == dense-gemm ]]; then  # one GPU (~6 min): the Triton skinny GEMM against cuBLAS, then end to end
  python3 -m pytest -q -m gpu tests/gpu/test_dense_gemm_gpu.py -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_dense_gemm.log" | tail -3 || status=1
  timeout 240 python3 scripts/gpu/bench_dense_gemm.py --tokens 16,64,128 --json "$OUT/bench_dense_gemm.json" 2>&1 \
    | tee "$OUT/bench_dense_gemm.log" | grep -E "^M=" || status=1
  for max in 0 128; do
    LATENCY_TIMEOUT=200 latency_with dense_gemm_$max "DENSE_GEMM_TRITON_MAX_TOKENS=$max" \
      longserve.kernels.dense_gemm.DENSE_GEMM_TRITON_MAX_TOKENS=$max -- \
      --config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 16@8192,64@4096
  done
fi

if [[ $MODE == dense-tables || $MODE == dense-tables-8b ]]; then
  if [[ $MODE == dense-tables ]]; then
    timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_dense_gemm_gpu.py -k "narrow or tables" -p no:cacheprovider \
      --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_dense_tables.log" | tail -3 || status=1
    shape=qwen3.5-35b-a3b tokens=1,2,4,8,16,32,64 sizes=1@32768,8@8192,64@4096 name=a3b35_gptq
    model=(--config qwen3.5-35b-a3b "${dummy[@]}" --hf-overrides "$seed_gptq")
  else
    shape=llama-3.1-8b tokens=1,16,64 model=(--config llama-3.1-8b "${dummy[@]}") sizes=1@32768,16@8192,64@4096 name=8b
  fi
  # the table lands in the package's gemv_configs/ (the engine runs below read it) and in $OUT
  timeout 330 python3 -m longserve.kernels.tune_gemv --shapes $shape --kernels dense,dense_gated --tokens $tokens \
    2>&1 | tee "$OUT/tune_dense_$name.log" | grep -E "^$shape|^wrote" || status=1
  for f in longserve/kernels/gemv_configs/kernel=dense_gemm*; do  # ('=' and ',' do not come back from a call)
    [[ -e $f ]] && cp "$f" "$OUT/table_$(basename "$f" | tr '=,' '__')"
  done
  for tables in False True; do
    LATENCY_TIMEOUT=150 latency_with "dense_tables_${name}_$tables" "tables $tables" \
      longserve.kernels.dense_gemm.DENSE_GEMM_TABLES=$tables -- "${model[@]}" --decode-batch-sizes $sizes --repeat 2
  done
  # where the tables' loss lies (fiftieth session: the same kernels slower in the step than back to back): the b1
  # step's kernels, profiled, with and without
  for tables in False True; do
    LATENCY_TIMEOUT=150 latency_with "dense_tables_${name}_prof_$tables" "profiled, tables $tables" \
      longserve.kernels.dense_gemm.DENSE_GEMM_TABLES=$tables -- "${model[@]}" --decode-batch-sizes 1@32768 \
      --repeat 1 --profile
    top_ops "$OUT/latency_dense_tables_${name}_prof_$tables.json" > "$OUT/top_ops_${name}_$tables.txt"
    grep -A14 "^decode" "$OUT/top_ops_${name}_$tables.txt" | sed "s/^/tables $tables /"
  done
fi

if [[ $MODE == decode-merge ]]; then  # one GPU (~3 min): the decode attention's merge in the kernel, off and on
  python3 -m pytest -q -s -m gpu tests/gpu/test_attention_gpu.py -k serial_merge -p no:cacheprovider --tb=short -rfE \
    2>&1 | tee "$OUT/gpu_tests_decode_merge.log" | grep -E "in-kernel merge|passed|failed" || status=1
  for variant in bf16 fp8; do
    q=(); sizes=1@32768,16@8192,64@4096
    [[ $variant == fp8 ]] && { q=(--hf-overrides "$fp8"); sizes=1@32768; }
    for serial in 0 8; do
      latency_with merge_${variant}_$serial "$variant SERIAL_MERGE_MAX_SPLITS=$serial" \
        longserve.kernels.decode_attention.DECODE_SERIAL_MERGE_MAX_SPLITS=$serial -- \
        --config llama-3.1-8b "${dummy[@]}" --repeat 3 ${q[@]+"${q[@]}"} --decode-batch-sizes $sizes
    done
  done
fi

if [[ $MODE == early-loads ]]; then  # one GPU (~5 min): launch.PDL_EARLY_LOADS off and on
  timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_pdl_gpu.py -k "changes_no_output" -p no:cacheprovider \
    --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_early_loads.log" | tail -2 || status=1
  for variant in bf16 int4 fp8; do
    q=(); sizes=1@32768,64@4096
    [[ $variant == int4 ]] && { q=(--quantization gptq); sizes=1@32768; }
    [[ $variant == fp8 ]] && { q=(--hf-overrides "$fp8"); sizes=1@32768; }
    for on in False True; do
      LATENCY_TIMEOUT=130 latency_with "early_${variant}_$on" "$variant PDL_EARLY_LOADS=$on" \
        longserve.kernels.launch.PDL_EARLY_LOADS=$on -- \
        --config llama-3.1-8b "${dummy[@]}" --repeat 3 ${q[@]+"${q[@]}"} --decode-batch-sizes $sizes
    done
  done
fi

if [[ $MODE == chunk-decodes ]]; then  # one GPU (~4 min): a 16K prompt's TTFT beside 0/1/4/8 decoding requests, with the
  # budget as served and lowered by d, as before (scripts/probes/probe_chunk_beside_decodes.py; multi-turn P95)
  timeout 230 python3 scripts/probes/probe_chunk_beside_decodes.py 2>&1 | tee "$OUT/probe_chunk_beside_decodes.log" | tail -12
fi

if [[ $MODE == prompt-step ]]; then  # one GPU (~4 min): what a 1-2K prompt step beside decodes costs the device (the
  # HTTP random workload's P95, RESULTS.md nineteenth session): the GPU test of the padding read in place, cold
  # 768-2,048-token attention in Triton against cuDNN (where sdpa_shapes.MIN_COLD_QUERY belongs), then step_timeline's
  # mixed step (its kernels under the profiler, and the plain timeline) with the padding in place on and off
  python3 -m pytest -q -m gpu tests/gpu/test_engine_gpu.py -k cold_cudnn -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_test_cold_cudnn.log" | tail -3 || status=1
  timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/cold_short_attention.log"
from longserve.bench.kernels.attention import BenchCase, bench_attention  # (its warm-up calls build the plans)
for r in bench_attention([BenchCase(f"cold_{n}", 0, n) for n in (768, 1024, 1280, 1536, 1792, 2048)], repeats=10):
    print(f"{r['case']:>10} {r['impl']:>7} {r['ms']:7.3f} ms {r['tflops']:5.0f} TFLOP/s (one layer, 8B heads)")
PY
  for pad in True False; do
    PROBE_PROFILE=1 timeout 150 python3 scripts/probes/with_constants.py longserve.attention.sdpa.PAD_IN_PLACE=$pad -- \
      scripts.probes.step_timeline 2>&1 | grep -vE "^\[bench|INFO|WARNING" > "$OUT/step_timeline_pad_in_place_$pad.log"
    grep -E "sum [0-9.]+ ms|FillFunctor|elementwise_kernel|Memcpy DtoD" "$OUT/step_timeline_pad_in_place_$pad.log" \
      | sed "s/^/PAD_IN_PLACE=$pad /"
    grep -A12 "^overlapped, handed" "$OUT/step_timeline_pad_in_place_$pad.log" | tail -11 | sed "s/^/PAD_IN_PLACE=$pad /"
  done
fi

if [[ $MODE == structured ]]; then  # one GPU: the grammar mask on the device, and what it costs decode at batch 64
  python3 -m pytest -q -m gpu tests/gpu/test_structured_gpu.py -p no:cacheprovider -o faulthandler_timeout=300 2>&1 \
    | tee "$OUT/gpu_structured_tests.log" | tail -4 || status=1
  python3 scripts/gpu/bench_structured.py --config llama-3.1-8b --batch-size 64 --output-len 256 \
    --output-json "$OUT/structured_8b_b64.json" 2>&1 | tee "$OUT/structured_8b_b64.log" | tail -8
fi

if [[ $MODE == vllm ]] && ! unpack_vllm; then  # without vLLM the mode would time longserve alone
  status=1
elif [[ $MODE == vllm ]]; then  # one GPU: the 8B shape, longserve then vLLM 0.24 in the same call
  base=(--config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1)
  # one engine (one model load) for every case; 64K, 32K + 1024 and b16@8K too, as issue 19 asks. Three runs a
  # case on both sides: one in five to nine cold 8K runs is 7-11% slow (the chip at its power limit; RESULTS.md
  # twentieth session), which a median of two averages in and one run may be
  python3 -m longserve.bench.latency "${base[@]}" --repeat 3 --prompt-lens 8192,32768,65536,131072 \
    --prefix-hit 32768:64,32768:1024 --decode-batch-sizes 1@32768,64@4096,16@8192 \
    --output-json "$OUT/latency_8b_vs_vllm.json" 2>&1 | tee "$OUT/latency_8b_vs_vllm.log" | tail -12
  BENCH_REPEAT=3 PYTHONPATH=/tmp/site python3 .anchor/bench_vllm.py --configs default --lengths 8192,32768,65536,131072 2>&1 | tee "$OUT/vllm_prefill.log" \
    | grep '"kind": "result"' | cut -c1-160
  PYTHONPATH=/tmp/site python3 .anchor/vllm_decode.py 2>&1 | tee "$OUT/vllm_decode.log" | grep decode_itl
  # the cases the anchors lack: 32K cached + 1024 new, decode b16@8K (and b1@32K, b64@4K again)
  PYTHONPATH=/tmp/site python3 scripts/gpu/vllm_extra_cases.py 2>&1 | tee "$OUT/vllm_extra.log" \
    | grep '"engine"' | cut -c1-280
  python3 scripts/dev/vllm_table.py "$OUT" | tee "$OUT/vllm_table.md"  # issue 19's ratios, medians of both sides
fi

if [[ $MODE == chunks ]]; then  # one GPU: a lone cold prompt in chunks of 8K, 16K and 32K (issue 19's 32K/128K gap)
  for chunk in 8192 16384 32768; do
    python3 -m longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 \
      --repeat 2 --prompt-lens 32768,131072 --chunked-prefill-size $chunk --output-json "$OUT/latency_8b_chunk$chunk.json" \
      2>&1 | tee "$OUT/latency_8b_chunk$chunk.log" | grep -E "^cold"
  done
  python3 -m longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 \
    --repeat 1 --prompt-lens 32768 --profile --output-json "$OUT/latency_8b_cold_profile.json" 2>&1 \
    | tee "$OUT/latency_8b_cold_profile.log" | tail -4
fi

if [[ $MODE == fusions ]]; then  # one GPU: the prefix read in place against gathered, and the rotary kernel
  # storing K/V against the backend's stores, each switched off against both on (one process per setting)
  for c in longserve.attention.sdpa.PREFIX_PAGES_AS_VIEW=False longserve.models.rope.FUSE_KV_STORE=False; do
    latency_with 8b_${c##*.} "" $c -- --config llama-3.1-8b "${dummy[@]}" --repeat 2 --prompt-lens 32768,131072 \
      --decode-batch-sizes 1@32768,64@4096
  done
  python3 -m longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 \
    --repeat 2 --prompt-lens 32768,131072 --decode-batch-sizes 1@32768,64@4096 \
    --output-json "$OUT/latency_8b_switches_on.json" 2>&1 | tee "$OUT/latency_8b_switches_on.log" | grep -E "^(cold|decode)"
fi

if [[ $MODE == pdl ]]; then  # one GPU (~8 min): programmatic dependent launch (kernels/launch.py PDL) off/on
  python3 -m pytest -q -m gpu tests/gpu/test_pdl_gpu.py -p no:cacheprovider -o faulthandler_timeout=300 --tb=short \
    -rfE 2>&1 | tee "$OUT/gpu_tests_pdl.log" | tail -4 || status=1
  # the 8B shape in bf16 (decode at batch 1 and 64), then FP8 blocks and GPTQ int4 at batch 1; one
  # process per setting, off then on, so each pair shares the machine's state
  for variant in bf16 fp8 int4; do
    q=(); [[ $variant == fp8 ]] && q=(--hf-overrides "$fp8"); [[ $variant == int4 ]] && q=(--quantization gptq)
    cases=(--decode-batch-sizes 1@32768); [[ $variant == bf16 ]] && cases=(--decode-batch-sizes 1@32768,64@4096)
    for pdl in False True; do
      latency_with pdl_${variant}_$pdl "$variant PDL=$pdl" longserve.kernels.launch.PDL=$pdl -- --config \
        llama-3.1-8b "${dummy[@]}" --repeat 2 ${q[@]+"${q[@]}"} "${cases[@]}"
    done
  done
fi

if [[ $MODE == decode-splits ]]; then  # one GPU (~4 min): the decode attention's key splits, fewer programs an SM
  # (decode_attention.PROGRAMS_PER_SM 2 / 3 against the default 4): at batch 64 (4K) 3 leaves one split (512
  # programs, no merge kernel) where 4 makes two (1,024 programs and a merge); at batch 1 (32K) 50 splits for 64
  for p in 2 3 4; do
    LATENCY_TIMEOUT=200 latency_with splits_$p "PROGRAMS_PER_SM=$p" longserve.kernels.decode_attention.PROGRAMS_PER_SM=$p \
      -- \
      --config llama-3.1-8b "${dummy[@]}" --repeat 3 --decode-batch-sizes 1@32768,16@8192,64@4096
  done
fi

if [[ $MODE == decode-tile ]]; then  # one GPU (~5 min): the decode attention's splits and tile in the engine
  # (decode_config: 64 keys, 3 stages, 2 warps up to 768 programs; splits of at least MIN_KEYS_PER_SPLIT keys, merged
  # in the kernel up to DECODE_SERIAL_MERGE_MAX_SPLITS, else by a launch). The thirty-sixth session's first run (H100,
  # one constant at a time: stages 2 / 4, 32 splits, 4 warps) moved b1@32K by at most 0.5%. Here fewer, longer splits
  # merged in the kernel (no merge launch: 0.11 ms of a b1@32K step at 64 splits, thirty-fifth session), and 128-key
  # tiles for them. One process a set, the default first and last
  d=longserve.kernels.decode_attention i=0
  for set in "" "$d.MIN_KEYS_PER_SPLIT=1024 $d.DECODE_SERIAL_MERGE_MAX_SPLITS=32" \
      "$d.MIN_KEYS_PER_SPLIT=2048 $d.DECODE_SERIAL_MERGE_MAX_SPLITS=16" \
      "$d.MIN_KEYS_PER_SPLIT=2048 $d.DECODE_SERIAL_MERGE_MAX_SPLITS=16 $d.DECODE_BLOCK_N=128" \
      "$d.MIN_KEYS_PER_SPLIT=2048 $d.DECODE_SERIAL_MERGE_MAX_SPLITS=16 $d.DECODE_BLOCK_N=128 $d.DECODE_FEW_PROGRAMS=0" ""; do
    i=$((i + 1)) label=${set//$d./}
    # shellcheck disable=SC2086  # a set is several constants
    LATENCY_TIMEOUT=200 latency_with tile_$i "${label:-default}" $set -- --config llama-3.1-8b "${dummy[@]}" \
      --repeat 5 --decode-batch-sizes 1@32768,16@8192,64@4096
  done
fi

if [[ $MODE == piecewise ]]; then  # one GPU, ~6 min: piecewise CUDA graphs (on by default) against eager steps
  python3 -m pytest -q -m gpu tests/gpu/test_engine_gpu.py -k piecewise -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -4 || status=1
  for pw in 0 4096; do  # mixed steps (step_timeline: A's first token) and lone short prompts, off and on
    timeout 150 python3 scripts/probes/step_timeline.py --config llama-3.1-8b --dtype bfloat16 \
      --piecewise-cuda-graph-max-tokens $pw 2>&1 | grep -vE "^\[bench|INFO|WARNING" > "$OUT/step_timeline_pw$pw.log"
    grep -A13 "^overlapped, handed" "$OUT/step_timeline_pw$pw.log"
    timeout 150 python3 -m longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 \
      --warmup 1 --repeat 3 --prompt-lens 512,1024,1236,2048,2500,4096,32768 --prefix-hit 32768:64,32768:512,32768:1024 \
      --piecewise-cuda-graph-max-tokens $pw --output-json "$OUT/latency_8b_pw$pw.json" 2>&1 \
      | tee "$OUT/latency_8b_pw$pw.log" | grep -E "^(cold|prefix)"
  done
  # a mixed step's short cold prompt in the Triton kernel with the decodes (one launch a layer) instead of
  # cuDNN beside a Triton sub-batch (padding copies, index_select/index_copy): host time against device time
  timeout 150 python3 scripts/probes/with_constants.py longserve.attention.sdpa_shapes.MIN_COLD_QUERY=4096 -- \
    scripts.probes.step_timeline --config llama-3.1-8b --dtype bfloat16 --piecewise-cuda-graph-max-tokens 4096 2>&1 \
    | grep -vE "^\[bench|INFO|WARNING" > "$OUT/step_timeline_pw4096_triton_cold.log"
  grep -A13 "^overlapped, handed" "$OUT/step_timeline_pw4096_triton_cold.log"
fi
