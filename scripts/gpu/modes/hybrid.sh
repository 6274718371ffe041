# Hybrid linear/full-attention models (Qwen3.5), one GPU:
# hybrid (~5 min, .whl/ carried for the tests): the Gated DeltaNet kernels' and the hybrid engines' GPU tests, each
# kernel's time at Qwen3.5's shape (scripts/probes/gdn_kernels.py, float32 and bf16 states), then the 35B-A3B
# shape with 20 of its 40 layers (35 GB of bf16 weights: an H100 holds them beside 256 state slots and as many
# checkpoints) cold 8K / 32K, a 32K prefix hit (from the state checkpoint its prefix left) and decode at batch 1 (32K)
# and 64 (4K), dummy weights; decode replays CUDA graphs, steps up to 4,096 tokens the piecewise graphs. Then the
# same cases on all 40 layers with GPTQ-int4 routed experts (the seed's model as released).
# shellcheck shell=bash

if [[ $MODE == hybrid ]]; then
  if [[ ${HYBRID_SKIP_TESTS:-0} == 1 ]]; then  # run by the tests mode already, in the same call
    echo "hybrid: GPU tests skipped (HYBRID_SKIP_TESTS=1)"
  elif python3 -c "import pytest" 2> /dev/null; then
    timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_gated_delta_gpu.py tests/gpu/test_hybrid_engine_gpu.py \
      -p no:cacheprovider --tb=short -rfE --durations=6 2>&1 | tee "$OUT/gpu_tests_hybrid.log" | tail -8 || status=1
  else
    echo "hybrid: no pytest (carry .whl/): the GPU tests skipped"
  fi
  for sd in float32 bfloat16; do
    timeout 120 python3 scripts/probes/gdn_kernels.py --state-dtype $sd 2>&1 | tee "$OUT/gdn_kernels_$sd.log"
  done
  LATENCY_TIMEOUT=240 latency_with a3b35_half "" -- --config qwen3.5-35b-a3b "${dummy[@]}" \
    --hf-overrides '{"num_hidden_layers": 20}' --prompt-lens 8192,32768 --prefix-hit 32768:64 \
    --decode-batch-sizes 1@32768,64@4096
  # the seed's own model as released (Qwen3.5-35B-A3B GPTQ-Int4): all 40 layers, the routed experts int4 (group
  # 128), attention, linear attention and shared experts bf16 (the official checkpoints' `dynamic` rules): 20.1 GiB
  # of weights by bench latency's plan (bench/weight_bytes.py)
  LATENCY_TIMEOUT=300 latency_with a3b35_gptq "int4" -- --config qwen3.5-35b-a3b "${dummy[@]}" \
    --hf-overrides "$seed_gptq" --prompt-lens 8192,32768 --prefix-hit 32768:64 --decode-batch-sizes 1@32768,64@4096
fi

# hybrid-int4-profile (~4 min): the seed's model as released (the GPTQ-int4 35B-A3B above), profiled: where cold 8K
# (3.4x its floor on an H100, forty-eighth session) and decode at batch 1 over 32K (4.1x) spend their time, and cold
# prompts without state marks (--mamba-cache-mode none)
if [[ $MODE == hybrid-int4-profile ]]; then
  LATENCY_TIMEOUT=200 latency_with a3b35_gptq_prof "int4" -- --config qwen3.5-35b-a3b "${dummy[@]}" \
    --hf-overrides "$seed_gptq" --prompt-lens 8192 --decode-batch-sizes 1@32768 --profile --host-profile
  grep -h "wall .* ms, busy" "$OUT/latency_a3b35_gptq_prof.log" | sed 's/^\[bench latency [0-9:]*\] //'
  top_ops "$OUT/latency_a3b35_gptq_prof.json" > "$OUT/top_ops_a3b35_gptq.txt"; head -70 "$OUT/top_ops_a3b35_gptq.txt"
  LATENCY_TIMEOUT=120 latency_with a3b35_gptq_nomarks "int4 no marks" -- --config qwen3.5-35b-a3b "${dummy[@]}" \
    --hf-overrides "$seed_gptq" --prompt-lens 8192,32768 --mamba-cache-mode none
fi

# hybrid-marks (~4 min): what a cold prompt's state checkpoint costs, the seed's model as released (GPTQ-int4
# 35B-A3B) and the 12-layer Qwen3-Next, one process each: saved inside the prompt's step (the default,
# cache/manager.py IN_STEP_SAVES), by a step of its own after a chunk cut at the mark (IN_STEP_SAVES=False: before the
# forty-eighth session), none kept (--mamba-cache-mode none); cold 8K / 32K and the 32K prefix hit
if [[ $MODE == hybrid-marks ]]; then
  python3 scripts/gpu/vllm_hybrid_cases.py --write-config /tmp/qwen3_next_12l
  for model in a3b35_gptq qnext12; do
    if [[ $model == a3b35_gptq ]]; then
      args=(--config qwen3.5-35b-a3b "${dummy[@]}" --hf-overrides "$seed_gptq")
    else
      args=(--config /tmp/qwen3_next_12l/config.json "${dummy[@]}")
    fi
    LATENCY_TIMEOUT=150 latency_with "${model}_in_step" "$model in step" -- "${args[@]}" --prompt-lens 8192,32768 \
      --prefix-hit 32768:64
    LATENCY_TIMEOUT=150 latency_with "${model}_cut" "$model cut" longserve.cache.manager.IN_STEP_SAVES=False -- \
      "${args[@]}" --prompt-lens 8192,32768 --prefix-hit 32768:64
    LATENCY_TIMEOUT=120 latency_with "${model}_none" "$model none" -- "${args[@]}" --prompt-lens 8192,32768 \
      --mamba-cache-mode none
  done
fi

# seed-decode (~6 min): the seed's model as released (GPTQ-int4 35B-A3B, 40 layers) at decode b1@32K, b8@8K and
# b64@4K, one process each: the step before the forty-ninth session's changes (the linear-attention gating inside
# the delta rule's decode kernel, gated_delta_net.FUSED_DECODE_GATING; its two input GEMMs as one,
# STACKED_PROJECTIONS; the shared expert's gated add in one kernel, moe_block.FUSED_SHARED_GATE; the MoE block's
# three input GEMMs as one up to STACKED_INPUTS_MAX_TOKENS, 8) against the defaults, then the MoE inputs stacked at
# every batch size (256) beside the defaults (the attention output gate's kernel has no switch: in every run); the
# GDN and fused-op GPU tests first. (Its narrow run, every bf16 linear of at most 2,048 outputs in the Triton GEMM,
# lost: 4.11 ms at b1; dense.sh's dense-tables tunes that GEMM per shape instead.)
# At 475fa6f, before the stacked MoE inputs were on by default (RESULTS.md forty-ninth session): b1 4.53 -> 3.98 ms
# with the three fusions, 3.58 with the MoE inputs stacked; b64 15.99 -> 15.37, 15.48 stacked.
if [[ $MODE == seed-decode ]]; then
  if python3 -c "import pytest" 2> /dev/null; then
    timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_gated_delta_gpu.py tests/gpu/test_fused_ops_gpu.py \
      -k "gated_delta or decode or sigmoid" -p no:cacheprovider --tb=short -rfE 2>&1 \
      | tee "$OUT/gpu_tests_seed_decode.log" | tail -8 || status=1
  fi
  m=longserve.models
  off="$m.gated_delta_net.FUSED_DECODE_GATING=False $m.moe_block.FUSED_SHARED_GATE=False"
  off+=" $m.gated_delta_net.STACKED_PROJECTIONS=False $m.moe_block.STACKED_INPUTS_MAX_TOKENS=0"
  stacked=$m.moe_block.STACKED_INPUTS_MAX_TOKENS=256
  for run in "before $off" "defaults" "stacked256 $stacked"; do
    name=${run%% *}
    read -r -a consts <<< "${run#"$name"}"
    LATENCY_TIMEOUT=150 latency_with "a3b35_gptq_decode_$name" "int4 $name" ${consts[@]+"${consts[@]}"} -- \
      --config qwen3.5-35b-a3b "${dummy[@]}" --hf-overrides "$seed_gptq" \
      --decode-batch-sizes 1@32768,8@8192,64@4096 --repeat 2
  done
fi

# seed-grouped (~4 min): the seed's 4-bit experts at decode batches 16 and 32 with the grouped kernel from 16 tokens
# (moe_wna16.MOE_WNA16_GROUPED_MIN_TOKENS, the default), 32 and 64 (the routed GEMV below). The bound was measured on
# the 128-expert 30B-A3B (RESULTS.md eighth session: batch 16 10.32 -> 8.97 ms grouped), where 16 tokens route one
# pair an expert on average; the seed's 256 experts get half that, so its crossover may lie at 32 tokens (the
# fifty-third session set the rows path's bound in rows an expert for the same reason, from measurements).
if [[ $MODE == seed-grouped ]]; then
  for from in 16 32 64; do
    LATENCY_TIMEOUT=150 latency_with "a3b35_gptq_grouped$from" "int4 grouped from $from" \
      longserve.kernels.moe_wna16.MOE_WNA16_GROUPED_MIN_TOKENS=$from -- --config qwen3.5-35b-a3b "${dummy[@]}" \
      --hf-overrides "$seed_gptq" --decode-batch-sizes 16@8192,32@4096 --repeat 2
  done
fi

# decode-wide (~7 min): the decode attention's tile at head_dim > 128 (decode_attention.WIDE_HEAD_CONFIG, never
# swept: the seed's attention layers, 16 query heads on 2 KV heads of 256, took 43 us a layer at b1@32K on an H100
# where their K/V take ~24 us): its GPU tests at the sweep's candidates, the sweep at the seed's shape
# (sweep_decode.py --shape qwen3.5), then the seed's decode b1@32K, b8@8K, b64@4K with the default tile, the sweep's
# fastest at 1 x 32K (at the engine's split count), that with twice the splits, and the default again.
if [[ $MODE == decode-wide ]]; then
  if python3 -c "import pytest" 2> /dev/null; then
    timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_attention_gpu.py -k decode_wide_heads -p no:cacheprovider \
      --tb=short -rfE 2>&1 | tee "$OUT/gpu_tests_decode_wide.log" | tail -3 || status=1
  fi
  OUT=$OUT timeout 200 python3 scripts/probes/sweep_decode.py --shape qwen3.5 2>&1 | tee "$OUT/sweep_decode_wide.log" \
    | grep -v failed || status=1
  best=$(python3 - "$OUT/sweep_decode_qwen3.5.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r["case"] == "decode_1x32k" and r.get("stage") == "tile"]
print(json.dumps(min(rows, key=lambda r: r["ms"])["cfg"], separators=(",", ":")) if rows else "")
PY
  )
  echo "the sweep's fastest tile at 1 x 32K: ${best:-none}"
  if [[ -n $best ]]; then
    d=longserve.kernels.decode_attention
    for run in default best splits default2; do
      consts=(); [[ $run != default* ]] && consts=("$d.WIDE_HEAD_CONFIG=$best")
      # twice the splits: 128 a KV head at 32K, 256 programs at b1 where the default's 128 leave SMs idle
      [[ $run == splits ]] && consts+=("$d.MAX_SPLITS=128" "$d.MIN_KEYS_PER_SPLIT=256")
      LATENCY_TIMEOUT=150 latency_with "a3b35_gptq_decode_wide_$run" "wide tile $run" ${consts[@]+"${consts[@]}"} -- \
        --config qwen3.5-35b-a3b "${dummy[@]}" --hf-overrides "$seed_gptq" \
        --decode-batch-sizes 1@32768,8@8192,64@4096 --repeat 2
    done
  fi
fi

# hybrid-vllm (~9 min, .anchor/ carried, records moved aside): longserve against vLLM 0.24 on a hybrid shape both
# serve as a text model (scripts/gpu/vllm_hybrid_cases.py: Qwen3-Next's decoder). vLLM's MoE cannot run from the slim
# anchor (no `_moe_C` ops: forty-seventh session), so the pair runs the 48-layer decoder with dense MLPs (its GDN
# and attention layers as the MoE model's): cold 8K / 32K, a 32K prefix + 64, decode at batch 1 over 32K. Before it,
# longserve alone on the 12-layer MoE shape, profiled (the hit's host time), and cold prompts without state marks
# (--mamba-cache-mode none: what the extra step at a cold prompt's last full page costs).
# HYBRID_VLLM_PAIR_ONLY=1 runs the pair alone.
if [[ $MODE == hybrid-vllm && ${HYBRID_VLLM_PAIR_ONLY:-0} != 1 ]]; then
  python3 scripts/gpu/vllm_hybrid_cases.py --write-config /tmp/qwen3_next_12l
  LATENCY_TIMEOUT=200 latency_with qnext12 "" -- --config /tmp/qwen3_next_12l/config.json "${dummy[@]}" \
    --prompt-lens 8192,32768 --prefix-hit 32768:64 --decode-batch-sizes 1@32768 --profile --host-profile
  grep -h "wall .* ms, busy" "$OUT/latency_qnext12.log" | sed 's/^\[bench latency [0-9:]*\] //'
  top_ops "$OUT/latency_qnext12.json" > "$OUT/top_ops_qnext12.txt"; head -60 "$OUT/top_ops_qnext12.txt"
  grep -A16 "prefix-32768:64: host profile" "$OUT/latency_qnext12.log" | head -20
  LATENCY_TIMEOUT=150 latency_with qnext12_nomarks "no marks" -- --config /tmp/qwen3_next_12l/config.json \
    "${dummy[@]}" --prompt-lens 8192,32768 --mamba-cache-mode none
fi
if [[ $MODE == hybrid-vllm ]]; then
  python3 scripts/gpu/vllm_hybrid_cases.py --write-config /tmp/qwen3_next_dense --dense
  LATENCY_TIMEOUT=200 latency_with qnext_dense "longserve" -- --config /tmp/qwen3_next_dense/config.json \
    "${dummy[@]}" --prompt-lens 8192,32768 --prefix-hit 32768:64 --decode-batch-sizes 1@32768
  if unpack_vllm; then
    # vLLM's Qwen3-Next imports compressed-tensors (its GDN layer's quantization configs; the Llama of the other
    # vLLM modes does not): its wheel and loguru's, which fetch_test_wheels.sh copies into .anchor/
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .anchor/compressed_tensors-*.whl \
      .anchor/loguru-*.whl || status=1
    PYTHONPATH=/tmp/site:$PYTHONPATH timeout 330 python3 scripts/gpu/vllm_hybrid_cases.py /tmp/qwen3_next_dense \
      > "$OUT/vllm_hybrid.log" 2>&1 || status=1
    grep '^{"engine"' "$OUT/vllm_hybrid.log" || tail -30 "$OUT/vllm_hybrid.log"
  else
    status=1
  fi
fi
