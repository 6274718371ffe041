#!/usr/bin/env bash
# On a GPU machine, one command per MODE: GPU tests, the CPU e2e suite on CUDA, kernel microbenchmarks, the
# probes and the latency benchmark of the Llama-3.1-8B shape against HF transformers. Logs and JSON go to
# $OUT; a short table last. LONGSERVE_COMMIT is the commit the JSON metadata names: compute it where the tree
# is a git checkout (a copied tree's .git may be stale) and pass it as a literal, e.g.
#   LONGSERVE_COMMIT=abc1234 bash scripts/gpu/gpu_check.sh latency
# The modes live in scripts/gpu/modes/, all of its *.sh sourced in name order: dense.sh (tests, the dense shapes,
# vLLM, tensor parallelism), prefix_hit.sh (the prefix hit, the host's time), attention.sh (FA3, the Gluon
# attention kernels), moe.sh, quant.sh (quantized weights, the fp8 KV cache), int4_gemv.sh and fp8_gemv.sh (the
# decode GEMVs on the tensor cores), hybrid.sh (Qwen3.5's Gated DeltaNet models), each mode described there; MODES below lists them all. A mode's blocks all
# lie in one file, so the order of the files changes no mode (tests/unit/test_gpu_scripts.py checks that).
# (tests, quant, kvfp8, structured, pdl, pdl-moe, serial-reduce, dense-gemm: carry the wheels of
# scripts/gpu/fetch_test_wheels.sh and install them first; scripts/gpu/queue.sh does.)
set -uo pipefail
cd "$(dirname "$0")/../.."
MODES=" all quick tests bench long tp tp2 tp32 profile latency hit host launch turns structured vllm chunks fusions
pdl decode-splits decode-tile piecewise short-plans moe moe-tests moe-bench moe-long moe-tp fusions-a3b moe-gemv tune-int-moe tune-moe-tables
moe-grouped quant quant-tests quant-bench kvfp8 switches quant-decode raw-hi gemv-tune fp8-acc silu-quant
serial-reduce pdl-moe hit-pdl dense-gemm decode-merge fp8-moe-gemv hit-attention hit-regs hit-packed hit-host hit-profile hit-fa3 hit-tiles hit-cudnn-graph hit-merge gemm-tunable hit-context hit-ragged paged-cudnn chunk-decodes prompt-step fa3 gluon gluon-ncu fa3-engine gluon-extend int4-mma int4-mma-decode int4-mma-moe fp8-wgmma fp8-wgmma-moe kvfp8-f16 int4-reps2 int4-profile fp8-block-decode gemv-prefetch int4-wave fp8-profile int4-dequant int4-fused-prefill lone-chunks lone-long swiglu-gemm swiglu-engine dense-gated dense-lone int4-mid-steps int4-dense-rows a3b-fp8-prefill fp8-gated tune-fp8-moe-acc32 fp8-acc-quality int4-tma int4-ncu tma-stream int4-slots int4-gated int4-ahead fp8-ahead ahead-decodes early-loads b1-stack norm-epilogue norm-profile hit-tail granule hybrid hybrid-int4-profile hybrid-marks hybrid-vllm tune-moe-hybrid moe-inputs int4-rows-a3b35 dense-tables dense-tables-8b seed-decode seed-grouped decode-wide "
MODE=${1:-all}
if [[ " ${MODES//$'\n'/ } " != *" $MODE "* ]]; then
  echo "usage: LONGSERVE_COMMIT=\$(git rev-parse --short HEAD) bash scripts/gpu/gpu_check.sh MODE, one of:$MODES" >&2
  exit 2
fi
OUT=${OUT:-/tmp/longserve-out}
mkdir -p "$OUT"; export OUT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} LONGSERVE_COMMIT=${LONGSERVE_COMMIT:-unknown}
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# the chip's clock and power every 200 ms through the mode (it runs prefill at its 700 W limit, the SM clock
# ~1,500 of 1,980 MHz, and one short run in five to nine came out 7-11% slow: RESULTS.md twentieth session)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 200 \
  > "$OUT/clocks.csv" 2>&1 &
clocks_pid=$!
trap 'kill $clocks_pid 2> /dev/null' EXIT
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
# the official FP8 checkpoints' quantization_config (128x128 blocks, dynamic activations) on dummy weights, as the
# modes pass it: --hf-overrides "$fp8"
fp8='{"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}}'

# top_ops FILE: each profiled case's kernels in a `bench latency --profile` JSON record, device ms (spans, and the
# time past the kernels before them: programmatic dependent launch overlaps the spans) and calls
top_ops() {
  python3 - "$1" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if r.get("profile", {}).get("top_ops"):
        print(r["name"])
    for op in r.get("profile", {}).get("top_ops", []):
        own = f" ({op['exclusive_ms']:.2f} past waits)" if "exclusive_ms" in op else ""
        print(f"  {op['ms']:8.2f} ms{own} {op['calls']:6d}x {op['name'][:90]}")
PY
}

# latency_with NAME LABEL [module.CONSTANT=VALUE ...] -- ARGS...: `longserve.bench.latency ARGS` in its own process
# with those module constants set (scripts/probes/with_constants.py), within $LATENCY_TIMEOUT s (240), its JSON and
# log kept as $OUT/latency_NAME.{json,log}; the log's lines matching $LATENCY_LINES (the cases' result lines)
# printed behind LABEL. The modes' A/B measurements of a switch are loops over it.
latency_with() {
  local name=$1 label=$2 consts=()
  shift 2
  while (( $# )) && [[ $1 != -- ]]; do consts+=("$1"); shift; done
  shift
  timeout "${LATENCY_TIMEOUT:-240}" python3 scripts/probes/with_constants.py ${consts[@]+"${consts[@]}"} -- \
    longserve.bench.latency "$@" --output-json "$OUT/latency_$name.json" 2>&1 | tee "$OUT/latency_$name.log" \
    | grep -E "${LATENCY_LINES:-^(cold|prefix|decode)}" | sed "s/^/${label:+$label }/"
}
# the dummy-weight bf16 runs every A/B measures
dummy=(--load-format dummy --dtype bfloat16 --warmup 1)
# the seed's model as released (Qwen3.5-35B-A3B GPTQ-Int4): with --config qwen3.5-35b-a3b, --hf-overrides "$seed_gptq"
# quantizes the routed experts int4 (group 128) and keeps attention, linear attention and shared experts bf16 (the
# official checkpoints' `dynamic` rules)
seed_gptq='{"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false,
  "sym": true, "dynamic": {"-:.*attn.*": {}, "-:.*shared_expert.*": {}}}}'
# vLLM 0.24's slim build into /tmp/site and cuDNN's frontend into a folder of its own (scripts/gpu/vllm_anchor.sh),
# and vLLM's environment (../shared/anchors/README.md): the modes that run vLLM need .anchor/ carried
source scripts/gpu/vllm_anchor.sh
unpack_vllm() {
  unpack_vllm_anchor /tmp/cudnn-site || return 1
  export PYTHONPATH=$PYTHONPATH:/tmp/cudnn-site
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_CACHE_ROOT=/tmp/vllm_cache VLLM_ENABLE_V1_MULTIPROCESSING=0
}

for part in scripts/gpu/modes/*.sh; do
  # shellcheck source=/dev/null
  source "$part"  # each runs the blocks of MODE it holds, setting status=1 on a failure
done

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
