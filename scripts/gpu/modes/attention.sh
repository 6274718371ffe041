# gpu_check.sh's modes for the attention kernels: ours against vLLM's FlashAttention-3 and cuDNN, our Gluon Hopper
# kernels (sourced by scripts/gpu/gpu_check.sh, which sets MODE, OUT and status). fa3, gluon, gluon-ncu and
# fa3-engine unpack vLLM's build (unpack_vllm, in gpu_check.sh: .anchor/ carried); fa3, gluon, gluon-extend,
# gluon-ncu, fa3-engine: each described at its block.
# shellcheck shell=bash

if [[ $MODE == fa3 ]]; then  # one GPU (~2 min, .anchor/ carried): our attention against vLLM's FlashAttention-3, one
  # layer of the 8B (RESULTS.md twenty-first session): bursts of each shape, then each library's calls back to back
  # at the chip's power limit with its clock and power (FA3 in the engine took 7.8% off cold 128K where the bursts
  # found the prefix calls equal)
  unpack_vllm || status=1
  PYTHONPATH=$PWD:/tmp/site timeout 150 python3 scripts/probes/attention_vs_fa3.py 2>&1 \
    | tee "$OUT/attention_vs_fa3.log" | grep '^{' | cut -c1-200
  PROBE_SUSTAINED=5 PYTHONPATH=$PWD:/tmp/site timeout 150 python3 scripts/probes/attention_vs_fa3.py 2>&1 \
    | tee "$OUT/attention_vs_fa3_sustained.log" | grep '^{'
fi

# gluon_env SPLIT:PINGPONG:BLOCK_N:STAGES[:PAIRS[:PERSISTENT[:RUN]]]: the Gluon kernel's variables for one variant, as
# `env` arguments (gluon and gluon-ncu run their variants through it); RUN, the key blocks a body, overrides PAIRS
# (PAIRS=1: a run of 2)
gluon_env() {
  local split pp bn st pairs pers run
  IFS=: read -r split pp bn st pairs pers run <<< "$1"
  echo "GLUON_SPLIT=$split GLUON_PINGPONG=$pp GLUON_BLOCK_N=$bn GLUON_STAGES=$st GLUON_PAIRS=${pairs:-0}" \
    "GLUON_PERSISTENT=${pers:-0}${run:+ GLUON_RUN=$run}"
}

if [[ $MODE == gluon ]]; then  # one GPU (~2 min, .anchor/ carried for FA3's times): our own Hopper attention kernel
  # (Gluon; the engine's long prefix calls run it), each variant checked against fp32 and timed beside cuDNN and FA3.
  # GLUON_VARIANTS: SPLIT:PINGPONG:BLOCK_N:STAGES:PAIRS:PERSISTENT[:RUN] each (gluon_env). Twenty-second session: at
  # cuDNN's rate once K and V free their buffers apart; twenty-third: pairs + persistent 1.00-1.035x cuDNN on prefix
  # calls (the engine's default). Defaults now: the engine's, runs of 3 key blocks (_kv_run), persistent or not
  unpack_vllm || status=1
  for v in ${GLUON_VARIANTS:-1:0:128:2:1:1 1:0:128:2:1:1:3 1:0:128:2:1:0:3}; do
    # shellcheck disable=SC2046  # gluon_env's words are NAME=VALUE pairs
    env $(gluon_env "$v") PYTHONPATH=$PWD:/tmp/site timeout "${GLUON_TIMEOUT:-90}" python3 \
      scripts/probes/gluon_attention_check.py 2>&1 | tee "$OUT/gluon_attention_${v//:/}.log" \
      | grep -E '^\{|Error' | cut -c1-400
    [[ ${PIPESTATUS[0]} == 124 ]] && echo "gluon variant $v: timed out (a hang?)"
  done
fi

if [[ $MODE == gluon-extend ]]; then  # one GPU (~3 min, .whl/ carried for the tests): the Gluon extend kernel (kernels/
  # gluon_extend.py: a short chunk over a long paged prefix, the prefix hit's attention) against fp32 and timed beside
  # the Triton extend kernel, at 1, 2 and 4 waves of programs (GLUON_EXTEND_WAVES: its split count) and at Triton's
  # split count, then the prefix hit end to end with the engine's extend calls on Triton and on it. First its GPU tests, then the engines' GPU tests (greedy tokens against the torch reference: prefix hits,
  # chunked prefill, GQA) with the engine's extend calls on it (gluon_calls.GLUON_EXTEND_CALLS)
  if python3 -c "import pytest" 2> /dev/null; then
    timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_gluon_attention_gpu.py -k "extend or non_finite" -p no:cacheprovider \
      --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_gluon_extend.log" | tail -4 || status=1
    timeout 200 python3 scripts/probes/with_constants.py longserve.attention.gluon_calls.GLUON_EXTEND_CALLS=True -- \
      pytest -q -m gpu tests/gpu/test_engine_gpu.py -p no:cacheprovider --tb=short -rfE 2>&1 \
      | tee "$OUT/gpu_tests_engine_gluon_extend.log" | tail -4 || status=1
  else
    echo "gluon-extend: no pytest (carry .whl/): the GPU tests skipped"
  fi
  for waves in ${GLUON_EXTEND_WAVES_LIST:-2 1 4}; do
    GLUON_EXTEND_WAVES=$waves OUT=$OUT PYTHONPATH=$PWD:/tmp/site timeout "${GLUON_TIMEOUT:-120}" python3 \
      scripts/probes/gluon_extend_check.py 2>&1 | tee "$OUT/gluon_extend_waves$waves.log" | grep -E '^\{|Error' | cut -c1-400
    [[ ${PIPESTATUS[0]} == 124 ]] && echo "gluon-extend at $waves waves: timed out (a hang?)"
    [[ -f $OUT/gluon_extend.json ]] && mv "$OUT/gluon_extend.json" "$OUT/gluon_extend_waves$waves.json"
  done
  # end to end: the prefix hit with the engine's extend calls on Triton (as it is) and on the Gluon kernel
  # (gluon_calls.GLUON_EXTEND_CALLS), one process each
  hit=(longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 5
       --prompt-lens 32768 --prefix-hit 32768:64,32768:1024)
  for impl in triton gluon; do
    if [[ $impl == triton ]]; then run=(python3 -m "${hit[@]}"); else
      run=(python3 scripts/probes/with_constants.py longserve.attention.gluon_calls.GLUON_EXTEND_CALLS=True -- "${hit[@]}"); fi
    PYTHONPATH=$PWD:/tmp/site timeout 200 "${run[@]}" --output-json "$OUT/hit_extend_$impl.json" 2>&1 \
      | tee "$OUT/hit_extend_$impl.log" | grep -E "^cold|^prefix|with_constants|Error" | sed "s/^/$impl /"
  done
fi

if [[ $MODE == gluon-ncu ]]; then  # one GPU (~3 min, .anchor/ carried for FA3): Nsight Compute (which reads the
  # counters on this machine's runtime) on one call each of the Gluon draft, cuDNN and FA3, a chunk's prefix call and
  # a causal 8K (scripts/probes/gluon_ncu.py): where the draft's 10-16% to FA3 goes. GLUON_NCU_VARIANTS as gluon's
  unpack_vllm || status=1
  ncu_bin=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2> /dev/null | head -1)}
  for v in ${GLUON_NCU_VARIANTS:-1:0:128:2:0 1:0:128:2:1}; do
    name=gluon_ncu_${v//:/}
    # shellcheck disable=SC2046  # gluon_env's words are NAME=VALUE pairs
    env $(gluon_env "$v") PYTHONPATH=$PWD:/tmp/site timeout 240 "$ncu_bin" --clock-control none --profile-from-start off --csv \
      --page details --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
      python3 scripts/probes/gluon_ncu.py > "$OUT/$name.csv" 2> "$OUT/$name.log" || status=1
    echo "== $v"
    python3 scripts/probes/gluon_ncu.py --summary "$OUT/$name.csv" | tee "$OUT/${name}_summary.txt"
  done
fi

if [[ $MODE == fa3-engine ]]; then  # one GPU (~6 min, .anchor/ carried): the engine's cold prompts with its library
  # attention calls all cuDNN's (the engine before the Gluon kernel took its prefix calls), as it is (the long prefix
  # calls on the Gluon kernel's default variant, gluon_calls.GLUON_PREFIX_CALLS) and all FA3's, one process each
  unpack_vllm || status=1
  lat=(longserve.bench.latency --config llama-3.1-8b --load-format dummy --dtype bfloat16 --warmup 1 --repeat 2
       --prompt-lens 8192,32768,131072)
  for impl in cudnn engine fa3; do
    case $impl in
      cudnn) run=(python3 scripts/probes/with_constants.py longserve.attention.gluon_calls.GLUON_PREFIX_CALLS=False -- "${lat[@]}") ;;
      engine) run=(python3 -m "${lat[@]}") ;;
      fa3) run=(python3 scripts/probes/with_fa3.py --impl fa3 -- "${lat[@]}") ;;
    esac
    PYTHONPATH=$PWD:/tmp/site timeout 200 "${run[@]}" --output-json "$OUT/latency_attention_$impl.json" 2>&1 \
      | tee "$OUT/latency_attention_$impl.log" | grep -E "^cold|with_fa3|Error" | sed "s/^/$impl /"
  done
fi
