# gpu_check.sh's modes for the prefix hit (a short question over a long cached prefix) and the host's time
# (sourced by scripts/gpu/gpu_check.sh, which sets MODE, OUT and status): the 8B shape's hits, their attention
# (register caps, the packed, ragged and paged cuDNN calls), PDL in the hit, where the host's time goes, the launch
# cost, a conversation's next turn and the cuDNN plans for short queries. hit, hit-attention, hit-regs, hit-packed,
# hit-context, hit-ragged, paged-cudnn, hit-host, host, launch, turns: each described at its block.
# short-plans (one GPU, ~4 min): prefix hits of 64 / 1K / 2K / 4K new tokens over 32K (and 1K over 64K), and the
# start-up's cuDNN plan builds, without and with plans for 1-4K new tokens over any prefix (SHORT_QUERY_ROWS).
# hit-pdl (one GPU, ~4 min): issue 19's prefix hit (32K cached + 64 new; 90.5x the cold 32K at 0949067, 98.7x at
# e9be5b7) with PDL off and on (its 64-token graph's norms and rotary launch with it), 7 runs each, then
# scripts/probes/probe_hit.py (host segments and the forward's device time, PDL on).
# hit-fa3 (one GPU, ~2 min, .anchor/ carried): the hit's attention alone (64 new over 32K and beside it) in the
# Triton extend kernel, the Gluon one and vLLM's FlashAttention-3 over the same paged cache, as graph replays.
# hit-tiles (one GPU, ~5 min): the 8B prefix hit end to end with the wide short-chunk tile (256 rows on 16 warps,
# triton_backend.WIDE_SHORT_TILE) at 3 stages (the default) and 2, and switched off, twice each, alternating (hit-fa3
# times the tiles alone).
# hit-cudnn-graph (one GPU, ~4 min, .whl/ carried): scripts/probes/probe_packed_cudnn_graph.py (the packed cuDNN call as
# a capturable cudnn-frontend graph), the packed graph's GPU test, the 8B hit with attention/packed_graph.py off and on.
# hit-merge (one GPU, ~3 min, .whl/ carried): scripts/probes/probe_merge_packed.py (the packed path's merge at 16 and
# 8 splits), then the 8B hit with the packed graph at 16 and 8 splits (PACKED_GRAPH_SPLITS), twice each, alternating.
# hit-tail (one GPU, ~7 min, .whl/ carried): the packed path's causal part and merge in one kernel (on by default)
# (packed_graph.PACKED_TAIL_FUSED, kernels/packed_tail.py): its GPU tests, then the 8B hit off, on (32 and 16 rows a
# program; 4 prefix splits; q written into the packed rows by the rotary kernel), twice.
# hit-profile (one GPU, ~3 min): the prefix hit (32K cached + 64 new) under the profiler, by category and its top
# kernels, then scripts/probes/probe_hit.py: where the hit's device and host time go at the head.
# shellcheck shell=bash

if [[ $MODE == hit ]]; then  # one GPU: the prefix-hit cases alone (more runs), then cold 128K against HF
  base=(--config llama-3.1-8b --load-format dummy --dtype bfloat16)
  python3 -m longserve.bench.latency "${base[@]}" --warmup 1 --repeat 5 --prefix-hit 32768:64,32768:256 \
    --output-json "$OUT/latency_8b_hit.json" 2>&1 | tee "$OUT/latency_8b_hit.log" | tail -4
  python3 -m longserve.bench.latency "${base[@]}" --warmup 0 --repeat 1 --prompt-lens 131072 --compare-hf \
    --output-json "$OUT/latency_8b_128k.json" 2>&1 | tee "$OUT/latency_8b_128k.log" | tail -3
fi

if [[ $MODE == hit-attention ]]; then  # one GPU (~1 min): the prefix hit's attention: register caps, then cuDNN
  # the extend kernel at 2-4 programs an SM (register caps; sweep_short_extend.py's OCCUPANCY list), then cuDNN on
  # the GQA-packed rows with the keys split as a batch (probe_hit_cudnn.py)
  OCCUPANCY=1 timeout 200 python3 scripts/probes/sweep_short_extend.py 2>&1 | tee "$OUT/sweep_occupancy.log" \
    | grep -E "default|failed" | tail -6
  timeout 200 python3 scripts/probes/probe_hit_cudnn.py 2>&1 | tee "$OUT/probe_hit_cudnn.log" | tail -24
fi

if [[ $MODE == hit-regs ]]; then  # one GPU (~4 min): a short chunk's stages and register cap, end to end
  # triton_backend.SHORT_CHUNK_STAGES / SHORT_CHUNK_MAXNREG (hit-attention's sweep: 2 stages at 168 registers
  # fastest alone), the prefix hits and cold 32K (the 100x's denominator) in one process each, twice, alternated;
  # the hits in the Triton kernel (the packed cuDNN call off)
  for round in 1 2; do
    for v in "3 None" "2 168"; do
      read -r st mr <<< "$v"
      LATENCY_TIMEOUT=170 latency_with hit_regs_s${st}_r${mr}_$round "stages $st maxnreg $mr:" \
        longserve.attention.sdpa_shapes.PACKED_PREFIX_CALLS=False \
        longserve.attention.triton_backend.SHORT_CHUNK_STAGES=$st \
        longserve.attention.triton_backend.SHORT_CHUNK_MAXNREG=$mr -- \
        --config llama-3.1-8b "${dummy[@]}" --repeat 5 --prompt-lens 32768 --prefix-hit 32768:64,32768:256
    done
  done
fi

if [[ $MODE == hit-packed ]]; then  # one GPU (~4 min): a prefix hit's question through the packed cuDNN call
  # its GPU test and the engine's (the lone chunk's graphs step aside for it), then the 8B hits with the packed
  # call on (the default) and off (the Triton kernel in the lone chunk's graph), cold 32K beside them
  timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_attention_gpu.py tests/gpu/test_engine_gpu.py \
    -p no:cacheprovider --tb=short -rfE -s -k "packed or library or unaligned or not attention" 2>&1 \
    | tee "$OUT/gpu_tests_packed.log" | grep -E "^(FAILED|ERROR|E  )|passed|failed|packed plans" | tail -20
  for on in True False; do
    LATENCY_TIMEOUT=170 latency_with hit_packed_$on "packed $on:" \
      longserve.attention.sdpa_shapes.PACKED_PREFIX_CALLS=$on -- --config llama-3.1-8b "${dummy[@]}" --repeat 5 \
      --prompt-lens 32768 --prefix-hit 32768:64,32768:256
  done
fi

if [[ $MODE == hit-context ]]; then  # one GPU (~5 min): the 32K + 64 hit outside hit-packed's small engine: packed
  # on / off after a cold 128K prompt (a 128K context), on in a fresh 128K context, then in a 32K context with a
  # 292,864-token pool (the vllm mode's), then packed on under cProfile (sixteenth session: the packed hit
  # scattered 11.9-22.1 ms, Triton 13.4-14.3)
  for on in True False; do
    LATENCY_TIMEOUT=150 latency_with hit_context_$on "packed $on, after 128K:" \
      longserve.attention.sdpa_shapes.PACKED_PREFIX_CALLS=$on -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
      --prompt-lens 131072 --prefix-hit 32768:64
  done
  LATENCY_TIMEOUT=100 latency_with hit_context_fresh "packed True, fresh 128K context:" \
    longserve.attention.sdpa_shapes.PACKED_PREFIX_CALLS=True -- --config llama-3.1-8b "${dummy[@]}" --repeat 5 \
    --context-length 131088 --prefix-hit 32768:64
  for on in True False; do
    LATENCY_TIMEOUT=80 latency_with hit_pool_$on "packed $on, big pool:" \
      longserve.attention.sdpa_shapes.PACKED_PREFIX_CALLS=$on -- --config llama-3.1-8b "${dummy[@]}" --repeat 5 \
      --max-total-tokens 292864 --prefix-hit 32768:64
  done
  LATENCY_TIMEOUT=80 LATENCY_LINES="^(prefix|.*host profile|  +[0-9])" latency_with hit_pool_host "packed True:" \
    longserve.attention.sdpa_shapes.PACKED_PREFIX_CALLS=True -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
    --max-total-tokens 292864 --prefix-hit 32768:64 --host-profile
fi

if [[ $MODE == hit-ragged ]]; then  # one GPU (~2 min): can the packed prefix call live in a CUDA graph? cuDNN's ragged
  # form over the whole cache (scripts/probes/probe_ragged_cudnn.py: right, captured and replayed, its time)
  timeout 150 python3 scripts/probes/probe_ragged_cudnn.py 2>&1 | tee "$OUT/probe_ragged_cudnn.log" | tail -30
fi

if [[ $MODE == paged-cudnn ]]; then  # one GPU (~4 min; the test wheels carried: cuDNN's frontend): one paged cuDNN call
  # for the prefix hit and for chunks over long prefixes, against the engine's paths, and the hit in a CUDA graph
  # (scripts/probes/probe_paged_cudnn.py), with the engine's pages of 16 tokens and with pages of 64
  for page in 16 64; do
    PROBE_PAGE=$page timeout 120 python3 scripts/probes/probe_paged_cudnn.py 2>&1 \
      | tee "$OUT/probe_paged_cudnn_page$page.log" | tail -25
  done
fi

if [[ $MODE == hit-cudnn-graph ]]; then  # one GPU (~4 min; the test wheels carried: cuDNN's frontend): the hit's
  # packed cuDNN call built as a cudnn-frontend graph with device inputs (paged, ragged), right, captured, timed; the
  # engine's packed graph (attention/packed_graph.py) against the Triton kernel; the 8B hit with it off and on
  timeout 150 python3 scripts/probes/probe_packed_cudnn_graph.py 2>&1 | tee "$OUT/probe_packed_cudnn_graph.log" | tail -40
  timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_packed_graph_gpu.py -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_packed_graph.log" | tail -4 || status=1
  for on in False True; do
    LATENCY_TIMEOUT=150 latency_with hit_packed_graph_$on "PACKED_GRAPHS=$on" \
      longserve.attention.packed_graph.PACKED_GRAPHS=$on -- --config llama-3.1-8b "${dummy[@]}" --repeat 7 \
      --prefix-hit 32768:64
  done
fi

if [[ $MODE == hit-merge ]]; then  # one GPU (~3 min; .whl/ carried): the packed path's merge, alone then end to end
  timeout 100 python3 scripts/probes/probe_merge_packed.py 2>&1 | tee "$OUT/probe_merge_packed.log" | tail -4
  for run in 1 2; do
    for splits in 16 8; do
      LATENCY_TIMEOUT=100 latency_with hit_merge_s${splits}_$run "splits $splits" \
        longserve.attention.packed_graph.PACKED_GRAPH_SPLITS=$splits -- --config llama-3.1-8b "${dummy[@]}" \
        --repeat 7 --prefix-hit 32768:64
    done
  done
fi

if [[ $MODE == hit-tail ]]; then  # one GPU (~7 min; .whl/ carried): the fused causal part + merge, tests then A/B
  timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_packed_graph_gpu.py -p no:cacheprovider --tb=short -rfE 2>&1 \
    | tee "$OUT/gpu_tests_packed_graph.log" | tail -3 || status=1
  # on: the defaults, 32 rows a program (8 tokens of the 8B's 4-head groups, 64 programs) and q written into the
  # packed rows by the rotary kernel (PACKED_Q_BY_ROPE); rows16: 16 rows, 128 programs (64 rows were 3% slower than
  # 32 in the 2026-12-06 H100 calls, 16 tied on 2026-12-07); copyq: q copied by a kernel of its own a layer, as
  # before (2026-12-07: 0.2 ms slower in both rounds). 4 cuDNN splits instead of 8 lost 2.3 ms (2026-12-07): gone.
  for run in off1 on1 rows16_1 copyq_1 off2 on2 rows16_2 copyq_2; do
    c=(longserve.attention.packed_graph.PACKED_TAIL_FUSED=False)
    [[ $run == off* ]] || c=(longserve.attention.packed_graph.PACKED_TAIL_FUSED=True)
    [[ $run == rows16* ]] && c+=(longserve.kernels.packed_tail.ROWS=16)
    [[ $run == copyq* ]] && c+=(longserve.attention.packed_graph.PACKED_Q_BY_ROPE=False)
    LATENCY_TIMEOUT=100 latency_with hit_tail_$run "tail $run" "${c[@]}" -- --config llama-3.1-8b "${dummy[@]}" \
      --repeat 7 --prefix-hit 32768:64
  done
fi

if [[ $MODE == hit-host ]]; then  # one GPU (~2 min): where the host's time goes in a prefix hit, packed call on, off
  # (on: the layers' attention eager between the piecewise graphs; off: the lone chunk's graph), cProfile's top
  for on in True False; do
    LATENCY_TIMEOUT=170 LATENCY_LINES="^(prefix|.*host profile|  +[0-9])" latency_with hit_host_$on "packed $on:" \
      longserve.attention.sdpa_shapes.PACKED_PREFIX_CALLS=$on -- --config llama-3.1-8b "${dummy[@]}" --repeat 3 \
      --prefix-hit 32768:64 --host-profile
  done
fi

if [[ $MODE == hit-pdl ]]; then  # one GPU (~4 min): the prefix hit with PDL off and on, then where its time goes
  for pdl in False True; do
    LATENCY_TIMEOUT=200 latency_with hit_pdl_$pdl "PDL=$pdl" longserve.kernels.launch.PDL=$pdl -- --config \
      llama-3.1-8b "${dummy[@]}" --repeat 7 --prefix-hit 32768:64
  done
  timeout 200 python3 scripts/probes/probe_hit.py 2>&1 | grep -vE "^\[bench|INFO|WARNING" | tee "$OUT/probe_hit.log" | tail -16
fi

if [[ $MODE == hit-fa3 ]]; then  # one GPU (~2 min, .anchor/): what a kernel reaches at the hit's attention shapes
  unpack_vllm || status=1
  PYTHONPATH=$PWD:/tmp/site timeout 200 python3 scripts/probes/hit_attention_fa3.py 2>&1 \
    | tee "$OUT/hit_attention_fa3.log" | grep '^{' | cut -c1-1500
fi

if [[ $MODE == hit-tiles ]]; then  # one GPU (~5 min): the hit end to end, the wide tile at 3 stages (the default), 2
  # stages (no stack), and off, twice each, alternating
  tile=longserve.attention.triton_backend.WIDE_SHORT_TILE
  for run in 1 2; do
    for variant in stages3 stages2 off; do
      case $variant in
        stages3) consts=() ;;
        stages2) consts=("$tile={\"BLOCK_M\":256,\"BLOCK_N\":64,\"num_warps\":16,\"num_stages\":2}") ;;
        off) consts=(longserve.attention.triton_backend.WIDE_SHORT_CHUNKS=False) ;;
      esac
      LATENCY_TIMEOUT=100 latency_with hit_wide_${variant}_$run "wide $variant" ${consts[@]+"${consts[@]}"} -- \
        --config llama-3.1-8b "${dummy[@]}" --repeat 7 --prefix-hit 32768:64
    done
  done
fi

if [[ $MODE == hit-profile ]]; then  # one GPU (~3 min): the prefix hit's kernels, then its host segments
  LATENCY_TIMEOUT=150 LATENCY_LINES="prefix-" latency_with hit_profile "" -- --config llama-3.1-8b \
    "${dummy[@]}" --repeat 5 --prefix-hit 32768:64 --profile
  top_ops "$OUT/latency_hit_profile.json"
  timeout 200 python3 scripts/probes/probe_hit.py 2>&1 | grep -vE "^\[bench|INFO|WARNING" | tee "$OUT/probe_hit.log" | tail -16
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

if [[ $MODE == short-plans ]]; then  # one GPU, ~4 min: cuDNN plans for 1-4K new tokens over any prefix
  # (sdpa_shapes.SHORT_QUERY_ROWS, off): prefix hits with 64 / 1K / 2K / 4K new tokens and the start-up's plan
  # builds, without and with them (the 8B shape; hits over 32K and 64K)
  for rows in "()" "(1024, 2048, 4096)"; do
    tag=$([[ $rows == "()" ]] && echo off || echo on)
    LATENCY_LINES="^(cold|prefix)|built [0-9]+ cuDNN" latency_with 8b_short_plans_$tag "$tag:" \
      "longserve.attention.sdpa_shapes.SHORT_QUERY_ROWS=$rows" -- \
      --config llama-3.1-8b "${dummy[@]}" --repeat 3 --prompt-lens 32768 --prefix-hit \
      32768:64,32768:1024,32768:2048,32768:4096,65536:1024
  done
fi
