#!/usr/bin/env bash
# Several gpu_check.sh modes in one device call, in order, within one time budget: each mode runs only if the
# minutes it needs (its estimate below, or NAME=MINUTES on the command line) are left, into $OUT/MODE/ with its
# log, and is packed into $OUT/MODE.tgz at once (a call returns few files, and none whose name holds '=' or ',';
# a call cut short keeps the modes already packed). The wheels of scripts/gpu/fetch_test_wheels.sh, if carried
# in .whl/, are installed first (the tests, quant and structured modes need them).
#   LONGSERVE_COMMIT=abc1234 QUEUE_SECONDS=570 bash scripts/gpu/queue.sh tests gemv-tune short-plans=5
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/longserve-out}
budget=${QUEUE_SECONDS:-570}
declare -A MINUTES=([tests]=7 [gemv-tune]=6 [short-plans]=4 [piecewise]=6 [fp8-acc]=8
                    [moe-grouped]=5 [vllm]=9 [quant-bench]=8 [tune-int-moe]=6 [tune-moe-tables]=8 [raw-hi]=4 [pdl]=5 [decode-splits]=3 [decode-tile]=5 [silu-quant]=3
                    [serial-reduce]=3 [pdl-moe]=6 [hit-pdl]=4 [dense-gemm]=4 [decode-merge]=3 [fp8-moe-gemv]=2
                    [hit-attention]=1 [hit-regs]=4 [hit-packed]=4 [hit-host]=2 [hit-profile]=3 [hit-fa3]=3 [hit-tiles]=5 [hit-cudnn-graph]=4 [hit-merge]=3 [gemm-tunable]=1 [hit-context]=6 [hit-ragged]=2 [chunks]=6 [paged-cudnn]=4 [chunk-decodes]=4 [prompt-step]=4 [fa3]=2 [gluon]=4 [gluon-ncu]=3 [fa3-engine]=6 [gluon-extend]=3 [int4-mma]=5 [int4-mma-decode]=6 [int4-mma-moe]=7 [fp8-wgmma]=8 [fp8-wgmma-moe]=5 [kvfp8-f16]=7 [int4-reps2]=4 [int4-profile]=3 [fp8-block-decode]=5 [gemv-prefetch]=5 [int4-wave]=5 [fp8-profile]=2 [int4-dequant]=7 [int4-fused-prefill]=6 [lone-chunks]=7 [lone-long]=5 [swiglu-gemm]=3 [swiglu-engine]=5 [dense-gated]=5 [dense-lone]=3 [int4-mid-steps]=6 [int4-dense-rows]=7 [a3b-fp8-prefill]=7 [fp8-gated]=8 [tune-fp8-moe-acc32]=7 [fp8-acc-quality]=4 [int4-tma]=7 [int4-ncu]=2 [tma-stream]=1 [int4-slots]=5 [int4-gated]=6 [int4-ahead]=8 [fp8-ahead]=5 [ahead-decodes]=5 [early-loads]=5 [b1-stack]=3 [norm-epilogue]=6 [norm-profile]=4 [hit-tail]=7 [granule]=3 [hybrid]=7 [hybrid-int4-profile]=4 [hybrid-marks]=5 [hybrid-vllm]=9 [tune-moe-hybrid]=8 [moe-inputs]=5 [int4-rows-a3b35]=3 [dense-tables]=8 [dense-tables-8b]=5 [seed-decode]=6 [seed-grouped]=4 [decode-wide]=7)  # measured or estimated per mode, on an H200
# (2026-12-03: pdl 294 s, decode-splits 127 s, vllm 367 s, quant-bench 431 s, silu-quant 129 s, dense-gemm 143 s,
# serial-reduce 104 s; fourteenth session: tests 543 s with the piecewise graphs on, before the PDL tests ran
# apart, decode-merge 148 s, fp8-moe-gemv 110 s, vllm 374 s; fifteenth: hit-attention 42 s, hit-regs 219 s, hit-packed
# 154-206 s, hit-host 96 s; sixteenth: tests 330 s, vllm 448 s; seventeenth: hit-ragged 21 s, chunks 262 s, fp8-acc
# 376 s, quant-bench 415 s; thirty-second, an H100, with bench latency's graphs planned for its cases: gluon-extend
# 159 s, b1-stack 162 s, tests 324 s, vllm 351 s; forty-third, an H100: lone-long 271 s, dense-lone 129 s, hit-tail
# 230-259 s, granule 203 s, vllm 374 s; forty-fourth, an H100: tests 294 s, b1-stack 208 s, hit-tail 419 s (ten runs))
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# a carry cut to fit the 64 MiB cap may leave out a wheel the GPU tests need: say so before they fail for it
# (fifty-third session: xgrammar without apache-tvm-ffi failed the three structured-output tests)
for module in xgrammar compressed_tensors; do
  why=$(python3 -c "import $module" 2>&1 | tail -1)
  [[ -n $why ]] && echo "== warning: $module does not import ($why): the GPU tests that use it will fail"
done
start=$(date +%s)
for item in "$@"; do
  mode=${item%%=*}
  need=$(( 60 * ${MINUTES[$mode]:-5} ))
  [[ $item == *=* ]] && need=$(( 60 * ${item#*=} ))
  left=$(( budget - ($(date +%s) - start) ))
  if (( left < need )); then
    echo "== $mode: skipped ($left s left, needs ~$need s)"
    continue
  fi
  mkdir -p "$OUT/$mode"
  t0=$(date +%s)
  OUT=$OUT/$mode timeout "$left" bash scripts/gpu/gpu_check.sh "$mode" > "$OUT/$mode/$mode.log" 2>&1
  echo "== $mode: rc $?, $(( $(date +%s) - t0 )) s"
  grep -vE "^\[bench|INFO|WARNING" "$OUT/$mode/$mode.log" | tail -30
  (cd "$OUT" && tar czf "$mode.tgz" "$mode")
done
