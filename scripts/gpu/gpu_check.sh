#!/usr/bin/env bash
# On a GPU machine, one command per MODE: GPU tests, the CPU e2e suite on CUDA, kernel microbenchmarks, the
# probes and the latency benchmark of the Llama-3.1-8B shape against HF transformers. Logs and JSON go to
# $OUT; a short table last. LONGSERVE_COMMIT is the commit the JSON metadata names: compute it where the tree
# is a git checkout (a copied tree's .git may be stale) and pass it as a literal, e.g.
#   LONGSERVE_COMMIT=abc1234 bash scripts/gpu/gpu_check.sh latency
#   usage: LONGSERVE_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu/gpu_check.sh [quick|tests|bench|all|long|tp|tp2|tp32|profile|latency|hit|host|launch|turns|moe|moe-tests|moe-bench|moe-long|moe-tp|quant|quant-tests|quant-bench|kvfp8|vllm|structured|switches|chunks|fusions|fusions-a3b|piecewise|moe-gemv|quant-decode|moe-grouped|fp8-acc|gemv-tune|short-plans|tune-int-moe|raw-hi|pdl|decode-splits]
# moe (one GPU) = moe-tests (the MoE kernel and engine GPU tests, the kernel's TFLOP/s and GB/s) +
# moe-bench (the Qwen3-30B-A3B shape's cases against HF, profiled, with their floors); moe-long: 128K cold
# against HF and the Mixtral-8x7B shape; moe-tp (two GPUs): the TP=2 / expert-parallel tests and the A3B shape
# at TP=2 and EP=2. Each prints the floor of every case and the measured/floor ratio.
# switches (one GPU): the int4 paths per M timed as CUDA graphs and the 8B int4 decode through each of them; the
# cost of fp32 accumulation in the fp8 GEMMs. chunks (one GPU): a lone cold prompt in chunks of 8K, 16K, 32K;
# moe-gemv (one GPU): the small-batch MoE kernels' and the k-sum kernel's GPU tests (their times beside
# fused_moe's and torch.sum's), then the A3B decode as it is and with MOE_SUM_TRITON_MAX_TOKENS 64.
# quant-decode (one GPU, ~8 min): the decode GEMVs of issue 18: the per-M kernel times
# (int4 GEMV, block and per-channel FP8 GEMVs against their GEMMs, as CUDA graphs), then the 8B shape's int4,
# block-FP8 and per-channel FP8 decode with each GEMV off and on (WNA16_GEMV_MAX_TOKENS, FP8_GEMV_MAX_TOKENS 0
# against 16).
# short-plans (one GPU, ~4 min): prefix hits of 64 / 1K / 2K / 4K new tokens over 32K (and 1K over 64K), and the
# start-up's cuDNN plan builds, without and with plans for 1-4K new tokens over any prefix (SHORT_QUERY_ROWS).
# raw-hi (one GPU, ~4 min): the int4 GEMVs' unmasked high value (int4_gemv.INT4_GEMV_RAW_HI, on since this ran:
# 4.18 -> 3.76 sm90 instructions a weight) off and on: the one-row and experts' GPU tests with their times, the
# 8B int4 decode at batch 1 (32K) and the A3B int4 decode at batch 1 (32K) and 8 (4K; the routed GEMV).
# gemv-tune (one GPU, ~6 min): the 8B FP8 and int4 decode at batch 1, python -m longserve.kernels.tune_gemv (the
# decode GEMVs' tile tables for the 8B and A3B projections), the same decode again with the tables.
# tune-int-moe (one GPU, ~6 min): the 8-bit experts' paths timed, tune_moe --weights int8 on the A3B shape at
# 1 / 8 / 64 tokens (fused_moe's int path tiles), the paths timed again with the table.
# moe-grouped (one GPU, ~5 min): the int4 experts' paths per token count (the grouped kernel's time among them),
# then the A3B int4 decode at batch 8 and 64 through the routed GEMV (grouped off) and through the grouped kernel.
# fp8-acc (one GPU, ~8 min): the 8B and A3B FP8 cold TTFT with the fp8 dots' fp32 promotion after every wgmma (0,
# the default), every other (64) or never within a tile (None), and the fp8 kernel and engine tests under 64 and
# None.
# piecewise (one GPU): the piecewise graphs' GPU test, then step_timeline.py, cold 512-4096 and 32K, and 32K +
# 64 / 512 / 1024 hits (issue 19's >= 100x: 95.6x eager) with --piecewise-cuda-graph-max-tokens 0 and 4096.
# pdl (one GPU, ~8 min): programmatic dependent launch off and on: its GPU tests (outputs unchanged, the kernels
# compiled for it), the 8B shape's decode (bf16 at batch 1/16/64, FP8 blocks and GPTQ int4 at batch 1) and cold 8K.
# decode-splits (one GPU, ~4 min): the 8B decode at batch 1 / 16 / 64 with 2, 3 and 4 programs an SM for the
# decode attention's key splits (decode_attention.PROGRAMS_PER_SM; 4 is the default).
# fusions (one GPU): the prefix-as-view and fused K/V-store switches off, each against both on; fusions-a3b:
# the A3B shape's decode with the q/k norms or the K/V store out of the rotary kernel, against both in.
# (tests, quant, kvfp8, structured, pdl: carry the wheels of scripts/gpu/fetch_test_wheels.sh and install them first)
# quant (one GPU) = quant-tests (the quantized kernels' and engines' GPU tests, per-M timings of the
# int4 paths and of cuBLAS vs Triton block FP8) + quant-bench (the 8B and A3B shapes in bf16, FP8 blocks and
# GPTQ int4 g128: cold TTFT 8K/32K, decode ITL b1@32K and b64@4K, weight GiB and KV tokens, ratios to bf16).
# kvfp8 (one GPU): the fp8 KV cache's GPU tests (Triton kernels on e4m3 pages, engine with graphs,
# chunks and prefix hits against the reference, fp8 vs auto), the attention GPU tests again, and the 8B shape
# with --kv-cache-dtype fp8 against auto: KV tokens that fit and decode at batch 64 (4K contexts), plus b1@32K.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-all}
OUT=${OUT:-/tmp/longserve-out}
mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} LONGSERVE_COMMIT=${LONGSERVE_COMMIT:-unknown}
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0

if [[ $MODE == all || $MODE == tests || $MODE == quick ]]; then
  # four processes at once (Triton's JIT is CPU-bound: the whole directory one file at a time took over 280 s
  # with cold caches, three groups at once 152 s, 2026-12-02): kernels, two engine groups, the CPU e2e suite
  # on CUDA; each group's log kept, so a call cut short still reports what finished; faulthandler prints
  # where a stuck test waits. At c2dd2fd the kernels group took 161 s and the MoE/quantized group had not
  # finished at 260 s beside the others (49 s alone): give the mode 400 s
  gpu_group() {  # name, files...
    python3 -m pytest -q -m gpu "${@:2}" -p no:cacheprovider -o faulthandler_timeout=300 --tb=short -rfE \
      > "$OUT/gpu_tests_$1.log" 2>&1
  }
  gpu_group kernels tests/gpu/test_attention_gpu.py tests/gpu/test_fused_ops_gpu.py tests/gpu/test_fused_moe_gpu.py \
    tests/gpu/test_quant_kernels_gpu.py & p1=$!
  gpu_group engine tests/gpu/test_engine_gpu.py tests/gpu/test_overlap_gpu.py tests/gpu/test_kv_fp8_gpu.py \
    tests/gpu/test_structured_gpu.py & p2=$!
  # the MoE and quantized engines, and any file no group names (a new one is not skipped silently)
  rest=(); for f in tests/gpu/test_*.py; do
    [[ $f =~ test_(attention|fused_ops|fused_moe|quant_kernels|engine|overlap|kv_fp8|structured|tensor_parallel)_gpu ]] \
      && continue
    rest+=("$f")
  done
  gpu_group moe_quant_rest "${rest[@]}" & p3=$!
  LONGSERVE_TEST_DEVICE=cuda python3 -m pytest -q tests/e2e/test_engine.py -p no:cacheprovider \
    > "$OUT/e2e_cuda.log" 2>&1 & p4=$!
  for p in $p1 $p2 $p3 $p4; do wait $p || status=1; done
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

if [[ $MODE == hit ]]; then  # one GPU: the prefix-hit cases alone (more runs), then cold 128K against HF
  base=(--config llama-3.1-8b --load-format dummy --dtype bfloat16)
  python3 -m longserve.bench.latency "${base[@]}" --warmup 1 --repeat 5 --prefix-hit 32768:64,32768:256 \
    --output-json "$OUT/latency_8b_hit.json" 2>&1 | tee "$OUT/latency_8b_hit.log" | tail -4
  python3 -m longserve.bench.latency "${base[@]}" --warmup 0 --repeat 1 --prompt-lens 131072 --compare-hf \
    --output-json "$OUT/latency_8b_128k.json" 2>&1 | tee "$OUT/latency_8b_128k.log" | tail -3
fi

if [[ $MODE == host ]]; then  # one GPU: where the host's time goes in a prefix hit and in decode steps
  base=(--config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3 --host-profile)
  python3 -m longserve.bench.latency "${base[@]}" --prefix-hit 32768:64,32768:256 --decode-batch-sizes 1 \
    --decode-context-len 32768 --output-json "$OUT/latency_8b_host.json" 2>&1 | tee "$OUT/latency_8b_host.log" \
    | grep -v "^\[bench" | tail -40
  python3 -m longserve.bench.latency "${base[@]}" --decode-batch-sizes 64 --decode-context-len 4096 \
    --output-json "$OUT/latency_8b_host64.json" 2>&1 | tee "$OUT/latency_8b_host64.log" | grep -v "^\[bench" | tail -20
fi

if [[ $MODE == launch ]]; then  # one GPU: host launch cost, Triton's launch against FastKernel, eager steps
  python3 -m pytest -q -m gpu tests/gpu/test_fused_ops_gpu.py tests/gpu/test_engine_gpu.py -p no:cacheprovider \
    -o faulthandler_timeout=150 2>&1 | tee "$OUT/gpu_tests.log" | tail -4 || status=1
  python3 scripts/probes/probe_launch.py 2>&1 | tee "$OUT/probe_launch.log"
  base=(--config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3 --cuda-graph-max-prefill-tokens 0)
  for fast in 0 1; do
    LONGSERVE_TRITON_FAST_LAUNCH=$fast python3 -m longserve.bench.latency "${base[@]}" --prefix-hit 32768:64,32768:512 \
      --output-json "$OUT/latency_8b_eager_fast$fast.json" 2>&1 | tee "$OUT/latency_8b_eager_fast$fast.log" | tail -3
  done
fi

if [[ $MODE == turns ]]; then  # one GPU: a conversation's next turn (tokenizer prefix cache; medium suffix hits)
  python3 scripts/dev/bench_tokenize.py --history 8192,32768,131072 --turns 6 --output-json "$OUT/bench_tokenize.json" \
    2>&1 | grep -v "Token indices" | tee "$OUT/bench_tokenize.log"
  python3 -m pytest -q -m gpu tests/gpu/test_engine_gpu.py tests/gpu/test_attention_gpu.py -p no:cacheprovider \
    -o faulthandler_timeout=150 2>&1 | tee "$OUT/gpu_tests.log" | tail -4 || status=1
  hits=(--config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3
        --prefix-hit 32768:256,32768:512,32768:768,8192:512)
  # the split rule before f1d6925 (cuDNN from 1024 new tokens only), then the current one, on the same machine
  python3 -c "import sys, longserve.attention.triton_backend as t; t.SPLIT_SDPA_MIN_QUERY_LONG_PREFIX = 1024
from longserve.bench.latency import main; sys.exit(main(sys.argv[1:]))" "${hits[@]}" \
    --output-json "$OUT/latency_8b_hits_old_rule.json" 2>&1 | tee "$OUT/latency_8b_hits_old_rule.log" | tail -6
  python3 -m longserve.bench.latency "${hits[@]}" --output-json "$OUT/latency_8b_hits.json" 2>&1 \
    | tee "$OUT/latency_8b_hits.log" | tail -6
fi

if [[ $MODE == structured ]]; then  # one GPU: the grammar mask on the device, and what it costs decode at batch 64
  python3 -m pytest -q -m gpu tests/gpu/test_structured_gpu.py -p no:cacheprovider -o faulthandler_timeout=300 2>&1 \
    | tee "$OUT/gpu_structured_tests.log" | tail -4 || status=1
  python3 scripts/gpu/bench_structured.py --config llama-3.1-8b --batch-size 64 --output-len 256 \
    --output-json "$OUT/structured_8b_b64.json" 2>&1 | tee "$OUT/structured_8b_b64.log" | tail -8
fi

if [[ $MODE == vllm ]]; then  # one GPU: the 8B shape, longserve then vLLM 0.24 in the same call
  # needs ../shared/anchors/* copied into .anchor/ (git-ignored) and carried: see that folder's README
  mkdir -p /tmp/site && python3 -c "import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site', filter='tar')" \
    < .anchor/vllm-0.24.0-h200-site.tar.xz || status=1
  base=(--config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1)
  # one engine (one model load) for every case; 64K, 32K + 1024 and b16@8K too, as issue 19 asks
  python3 -m longserve.bench.latency "${base[@]}" --repeat 2 --prompt-lens 8192,32768,65536,131072 \
    --prefix-hit 32768:64,32768:1024 --decode-batch-sizes 1@32768,64@4096,16@8192 \
    --output-json "$OUT/latency_8b_vs_vllm.json" 2>&1 | tee "$OUT/latency_8b_vs_vllm.log" | tail -12
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_CACHE_ROOT=/tmp/vllm_cache VLLM_ENABLE_V1_MULTIPROCESSING=0
  PYTHONPATH=/tmp/site python3 .anchor/bench_vllm.py --configs default --lengths 8192,32768,65536,131072 2>&1 | tee "$OUT/vllm_prefill.log" \
    | grep '"kind": "result"' | cut -c1-160
  PYTHONPATH=/tmp/site python3 .anchor/vllm_decode.py 2>&1 | tee "$OUT/vllm_decode.log" | grep decode_itl
  # the cases the anchors lack: 32K cached + 1024 new, decode b16@8K (and b1@32K, b64@4K again)
  PYTHONPATH=/tmp/site python3 scripts/gpu/vllm_extra_cases.py 2>&1 | tee "$OUT/vllm_extra.log" \
    | grep '"engine"' | cut -c1-200
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
    python3 scripts/probes/with_constants.py $c -- longserve.bench.latency --config llama-3.1-8b --load-format dummy \
      --dtype bfloat16 --warmup 1 --repeat 2 --prompt-lens 32768,131072 --decode-batch-sizes 1@32768,64@4096 \
      --output-json "$OUT/latency_8b_${c##*.}.json" 2>&1 | tee "$OUT/latency_8b_${c##*.}.log" | grep -E "^(cold|decode)"
  done
  python3 -m longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 \
    --repeat 2 --prompt-lens 32768,131072 --decode-batch-sizes 1@32768,64@4096 \
    --output-json "$OUT/latency_8b_switches_on.json" 2>&1 | tee "$OUT/latency_8b_switches_on.log" | grep -E "^(cold|decode)"
fi
if [[ $MODE == pdl ]]; then  # one GPU (~8 min): programmatic dependent launch (kernels/launch.py PDL) off/on
  python3 -m pytest -q -m gpu tests/gpu/test_pdl_gpu.py -p no:cacheprovider -o faulthandler_timeout=300 --tb=short \
    -rfE 2>&1 | tee "$OUT/gpu_tests_pdl.log" | tail -4 || status=1
  fp8='{"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}}'
  # the 8B shape in bf16 (decode at three batch sizes, cold 8K), then FP8 blocks and GPTQ int4 at batch 1; one
  # process per setting, off then on, so each pair shares the machine's state
  for variant in bf16 fp8 int4; do
    q=(); [[ $variant == fp8 ]] && q=(--hf-overrides "$fp8"); [[ $variant == int4 ]] && q=(--quantization gptq)
    cases=(--decode-batch-sizes 1@32768); [[ $variant == bf16 ]] && cases=(--prompt-lens 8192 --decode-batch-sizes 1@32768,16@8192,64@4096)
    for pdl in False True; do
      timeout 240 python3 scripts/probes/with_constants.py longserve.kernels.launch.PDL=$pdl -- longserve.bench.latency \
        --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3 ${q[@]+"${q[@]}"} "${cases[@]}" \
        --output-json "$OUT/latency_pdl_${variant}_$pdl.json" 2>&1 | tee "$OUT/latency_pdl_${variant}_$pdl.log" \
        | grep -E "^(cold|decode)" | sed "s/^/$variant PDL=$pdl /"
    done
  done
fi
if [[ $MODE == decode-splits ]]; then  # one GPU (~4 min): the decode attention's key splits, fewer programs an SM
  # (decode_attention.PROGRAMS_PER_SM 2 / 3 against the default 4): at batch 64 (4K) 3 leaves one split (512
  # programs, no merge kernel) where 4 makes two (1,024 programs and a merge); at batch 1 (32K) 50 splits for 64
  for p in 2 3 4; do
    timeout 200 python3 scripts/probes/with_constants.py longserve.kernels.decode_attention.PROGRAMS_PER_SM=$p -- \
      longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3 \
      --decode-batch-sizes 1@32768,16@8192,64@4096 --output-json "$OUT/latency_splits_$p.json" 2>&1 \
      | tee "$OUT/latency_splits_$p.log" | grep -E "^decode" | sed "s/^/PROGRAMS_PER_SM=$p /"
  done
fi
if [[ $MODE == fusions-a3b ]]; then  # one GPU: the Qwen3-30B-A3B shape's decode (q/k norm, launch-bound at
  # batch 1) with the q/k norms and the K/V store fused into the rotary kernel, each off against both on
  for c in longserve.models.rope.FUSE_QK_NORM=False longserve.models.rope.FUSE_KV_STORE=False \
           longserve.models.rope.FUSE_KV_STORE=True; do
    python3 scripts/probes/with_constants.py $c -- longserve.bench.latency --config qwen3-30b-a3b --load-format dummy \
      --dtype bfloat16 --warmup 1 --repeat 3 --decode-batch-sizes 1@4096,64@4096 \
      --output-json "$OUT/latency_a3b_${c##*.}.json" 2>&1 | tee "$OUT/latency_a3b_${c##*.}.log" | grep -E "^decode"
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
  fp8='{"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}}'
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

if [[ $MODE == piecewise ]]; then  # one GPU, ~6 min: piecewise CUDA graphs (off by default) against eager steps
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

if [[ $MODE == quant-decode ]]; then  # one GPU, ~8 min: the int4 and FP8 decode GEMVs against their GEMMs
  timeout 100 python3 scripts/gpu/bench_quant_kernels.py --tokens 1,2,4,8,16 \
    --output-json "$OUT/kernels_quant_decode.json" 2>&1 | tee "$OUT/kernels_quant_decode.log" | grep -E "crossover|beats"
  fp8='{"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}}'
  for limit in 0 16; do
    timeout 80 python3 scripts/probes/with_constants.py longserve.kernels.quant_gemm.WNA16_GEMV_MAX_TOKENS=$limit \
      -- longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --quantization gptq \
      --warmup 1 --repeat 3 --decode-batch-sizes 1@32768,64@4096 --output-json "$OUT/latency_int4_gemv$limit.json" \
      2>&1 | tee "$OUT/latency_int4_gemv$limit.log" | grep -E "^decode" || status=1
    timeout 80 python3 scripts/probes/with_constants.py longserve.kernels.quant_fp8.FP8_GEMV_MAX_TOKENS=$limit \
      -- longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --hf-overrides "$fp8" \
      --warmup 1 --repeat 3 --decode-batch-sizes 1@32768,64@4096 --output-json "$OUT/latency_fp8_gemv$limit.json" \
      2>&1 | tee "$OUT/latency_fp8_gemv$limit.log" | grep -E "^decode" || status=1
    # per-channel FP8 (--quantization fp8: the bf16 weights quantized at load, as vLLM does), batch 1
    timeout 70 python3 scripts/probes/with_constants.py longserve.kernels.quant_fp8.FP8_GEMV_MAX_TOKENS=$limit \
      -- longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --quantization fp8 \
      --warmup 1 --repeat 3 --decode-batch-sizes 1@32768 --output-json "$OUT/latency_fp8ch_gemv$limit.json" \
      2>&1 | tee "$OUT/latency_fp8ch_gemv$limit.log" | grep -E "^decode" || status=1
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
      timeout 120 python3 scripts/probes/with_constants.py longserve.kernels.int4_gemv.INT4_GEMV_RAW_HI=$raw -- \
        longserve.bench.latency --config $shape --load-format dummy --dtype bfloat16 --quantization gptq \
        --warmup 1 --repeat 3 --decode-batch-sizes $sizes --output-json "$OUT/latency_${shape}_int4_raw_hi$raw.json" \
        2>&1 | tee "$OUT/latency_${shape}_int4_raw_hi$raw.log" | grep -E "^decode" | sed "s/^/$shape raw_hi=$raw: /"
    done
  done
fi

if [[ $MODE == gemv-tune ]]; then  # one GPU, ~6 min: the decode GEMVs' tile tables (kernels/gemv_tables.py)
  # the 8B decode at batch 1 (32K) in FP8 blocks and GPTQ int4 with the default tiles, then tune_gemv writes
  # the tables into the package (tarred into $OUT: their names hold '=' and ','), then the same runs with them
  fp8='{"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}}'
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

if [[ $MODE == short-plans ]]; then  # one GPU, ~4 min: cuDNN plans for 1-4K new tokens over any prefix
  # (sdpa_shapes.SHORT_QUERY_ROWS, off): prefix hits with 64 / 1K / 2K / 4K new tokens and the start-up's plan
  # builds, without and with them (the 8B shape; hits over 32K and 64K)
  for rows in "()" "(1024, 2048, 4096)"; do
    tag=$([[ $rows == "()" ]] && echo off || echo on)
    timeout 240 python3 scripts/probes/with_constants.py "longserve.attention.sdpa_shapes.SHORT_QUERY_ROWS=$rows" -- \
      longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3 \
      --prompt-lens 32768 --prefix-hit 32768:64,32768:1024,32768:2048,32768:4096,65536:1024 \
      --output-json "$OUT/latency_8b_short_plans_$tag.json" 2>&1 | tee "$OUT/latency_8b_short_plans_$tag.log" \
      | grep -E "^(cold|prefix)|built [0-9]+ cuDNN" | sed "s/^/$tag: /"
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
    timeout 120 python3 scripts/probes/with_constants.py \
      longserve.kernels.moe_wna16.MOE_WNA16_GROUPED_MIN_TOKENS=$grouped -- longserve.bench.latency \
      --config qwen3-30b-a3b --load-format dummy --dtype bfloat16 --quantization gptq --warmup 1 --repeat 3 \
      --decode-batch-sizes 8@4096,64@4096 --output-json "$OUT/latency_a3b_int4_grouped$grouped.json" 2>&1 \
      | tee "$OUT/latency_a3b_int4_grouped$grouped.log" | grep -E "^decode" || status=1
  done
fi

if [[ $MODE == fp8-acc ]]; then  # one GPU, ~8 min: what full-fp32 accumulation costs the fp8 prefill
  # FP8_DOT_MAX_IMPRECISE_ACC 0 promotes the fp8 dots' partial sums after every wgmma (K = 32), which waits for
  # each; 64 every other; None (Triton's default, vLLM's Triton block-FP8 kernel's) never within a dot (one
  # BLOCK_K = 128 tile). Per value: the 8B and A3B FP8 cold TTFT (A3B 0.212 / 0.181 / 0.173 s at 8K, RESULTS.md
  # eighth session), the block GEMM against its fp32 reference at the 8B shapes (the error at a real K), and
  # the fp8 engine tests (their tiny models' blocks of 32-64 make 64 and None the same there)
  fp8='{"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}}'
  for acc in 0 64 None; do
    for shape in llama-3.1-8b qwen3-30b-a3b; do
      timeout 150 python3 scripts/probes/with_constants.py longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=$acc \
        -- longserve.bench.latency --config $shape --load-format dummy --dtype bfloat16 --hf-overrides "$fp8" \
        --warmup 1 --repeat 3 --prompt-lens 8192,32768 --output-json "$OUT/latency_${shape}_fp8_acc_$acc.json" 2>&1 \
        | tee "$OUT/latency_${shape}_fp8_acc_$acc.log" | grep -E "^cold"
    done
    [[ $acc == 0 ]] && continue
    timeout 150 python3 scripts/probes/with_constants.py longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=$acc \
      -- pytest -q -m gpu tests/gpu/test_quant_engine_gpu.py tests/gpu/test_quant_kernels_gpu.py \
      -k "(fp8 or ct-int8) and not gemv" -p no:cacheprovider --tb=short -rfE 2>&1 \
      | tee "$OUT/gpu_tests_fp8_acc_$acc.log" | grep -E "^(FAILED|E  )|passed|failed" | tail -24
  done
fi

if [[ $MODE == moe-gemv ]]; then  # one GPU, ~4 min: the small-batch MoE kernels and the k-sum kernel
  python3 -m pytest -q -m gpu tests/gpu/test_fused_moe_gpu.py -k "small_batch or sum_over_k" -s -p no:cacheprovider \
    --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "moe_gemv|sum over k|passed|failed" || status=1
  a3b=(--config qwen3-30b-a3b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3
       --decode-batch-sizes 1@32768,1@4096,8@4096)
  for switch in MOE_GEMV_MAX_TOKENS=0 MOE_SUM_TRITON_MAX_TOKENS=64; do
    timeout 150 python3 scripts/probes/with_constants.py longserve.kernels.fused_moe.$switch \
      -- longserve.bench.latency "${a3b[@]}" --output-json "$OUT/latency_a3b_${switch%%=*}.json" 2>&1 \
      | tee "$OUT/latency_a3b_${switch%%=*}.log" | grep -E "^decode"
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
    timeout 100 python3 scripts/probes/with_constants.py ${c[@]+"${c[@]}"} -- longserve.bench.latency \
      --config llama-3.1-8b --load-format dummy --dtype bfloat16 --quantization gptq --warmup 1 --repeat 3 \
      --decode-batch-sizes 1,64 --decode-context-len 4096 --output-json "$OUT/latency_int4_$path.json" 2>&1 \
      | tee "$OUT/latency_int4_$path.log" | grep -E "^decode" || status=1
  done
  # what fp32 accumulation (FP8_DOT_MAX_IMPRECISE_ACC=0, the default since 73be6a4: the engine tests fail with
  # Triton's own, None) costs the fp8 GEMMs and the 8B FP8 shape's prefill and decode
  fp8='{"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}}'
  for acc in 0 None; do
    timeout 120 python3 scripts/probes/with_constants.py longserve.kernels.quant_fp8.FP8_DOT_MAX_IMPRECISE_ACC=$acc \
      -- longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --hf-overrides "$fp8" \
      --warmup 1 --repeat 3 --prompt-lens 8192 --decode-batch-sizes 1@32768,64@4096 \
      --output-json "$OUT/latency_fp8_acc_$acc.json" 2>&1 | tee "$OUT/latency_fp8_acc_$acc.log" | grep -E "^(cold|decode)"
  done
fi

echo "=== summary ($MODE) ==="
grep -h "floor .* the floor" "$OUT"/latency_moe_*.log 2>/dev/null | sed 's/^\[bench latency [0-9:]*\] //'
grep -h "default .* best" "$OUT"/sweep_*.log 2>/dev/null
grep -h "wall .* ms, busy" "$OUT"/latency_*.log 2>/dev/null | sed 's/^\[bench latency [0-9:]*\] //'

grep -hE "passed|failed|error" "$OUT"/gpu_tests.log "$OUT"/e2e_cuda.log "$OUT"/gpu_tp_tests.log 2>/dev/null | tail -6
python3 - <<'PY'
import glob, json, os
for path in sorted(glob.glob(os.path.join(os.environ["OUT"], "latency_*.json"))):
    for r in json.load(open(path)):
        if r.get("skipped"):
            print(f"{r['name']:<28} skipped: {r['skipped']}"); continue
        if r["case"] == "decode":
            print(f"{r['name']:<28} itl {r['itl_ms_median']:.2f} ms")
        elif r["case"] == "prefix_hit":
            print(f"{r['name']:<28} ttft {r['ttft_s']:.4f} s  speedup vs cold {r['speedup']:.0f}x")
        else:
            hf = f"  hf {r['hf_wall_s']:.3f} s  ratio {r['hf_ratio']:.2f}" if r.get("hf_wall_s") else ""
            print(f"{r['name']:<28} ttft {r['ttft_s']:.3f} s  wall {r['wall_s']:.3f} s{hf}")
PY
exit $status
