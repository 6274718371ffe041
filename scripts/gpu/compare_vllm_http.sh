#!/usr/bin/env bash
# Through HTTP, as users see it: `longserve serve` and vLLM 0.24's OpenAI server on one H200, the same model
# shape (Llama-3.1-8B, dummy weights, the word-level tokenizer ../shared/anchors/bench_vllm.py writes), the same
# flags where they overlap (--max-num-batched-tokens 8192, prefix caching on), text prompts over
# /v1/completions for both (both tokenize). Both servers stay up (vLLM with 45% of the GPU's memory, started
# first; longserve with its 40% and a KV pool of vLLM's size, --max-total-tokens, read from vLLM's log: the same
# cache on any card) and `longserve bench compare` drives one at a time with each workload of benchmarks/configs/
# vllm_http_*.yaml: RAG over 16K documents (Poisson), multi-turn conversations opening with 16K tokens, random
# 2K-in/128-out at a fixed rate, three long documents each of 8K/32K/64K. Before them, each server is warmed up
# once with a 20K-token shared document (chunked prefill, prefix hits, batched decode: Triton's JIT and the like
# happen there, not in the first measured requests). vLLM runs with VLLM_SERVER_DEV_MODE=1 (its POST
# /reset_prefix_cache, which `flush_cache: true` needs; a flush that fails makes `bench compare` exit 1 and is
# named in the report) and --enable-prompt-tokens-details (cached_tokens in its usage: the report's client-side
# cache hit column). longserve writes --step-log to $OUT/http/longserve_steps.jsonl, summed per workload at the
# end (scripts/probes/step_log_summary.py). Reports (report.md, results.json, PNGs) under $OUT/http/<workload>/,
# tarred into $OUT/http_reports.tgz. LONGSERVE_AB_ARGS="FLAGS" (AB_WORKLOADS="random ...") then serves longserve
# again with FLAGS, alone, for those workloads: an option's A/B through HTTP in the same call (below).
# Needs ../shared/anchors/* copied into .anchor/ (git-ignored; see that folder's README) and carried:
#   LONGSERVE_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu/compare_vllm_http.sh [rag,multiturn,random,longdoc]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/longserve-out}; mkdir -p "$OUT/http"
WORKLOADS=${1:-rag,multiturn,random,longdoc}
export PYTHONUNBUFFERED=1 LONGSERVE_COMMIT=${LONGSERVE_COMMIT:-unknown}
unset TRITON_INTERPRET
MODEL=/tmp/llama31_8b_dummy
source scripts/gpu/vllm_anchor.sh
unpack_vllm_anchor /tmp/site || exit 1  # cuDNN's frontend beside vLLM's packages: the server's PYTHONPATH below
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_CACHE_ROOT=/tmp/vllm_cache VLLM_SERVER_DEV_MODE=1
PYTHONPATH=/tmp/site python3 .anchor/bench_vllm.py --configs "" --model-dir $MODEL > "$OUT/http/model_dir.log" 2>&1 || exit 1
# the server packages (fastapi, uvicorn, pydantic) come from the same folder: it satisfies longserve's [server]
export PYTHONPATH=$PWD:/tmp/site

wait_up() {  # url pid name: poll /health until 200, or give up when the process died or after 300 s
  for _ in $(seq 300); do
    curl -sf "$1/health" > /dev/null && { echo "[compare] $3 up"; return 0; }
    kill -0 "$2" 2>/dev/null || { echo "[compare] $3 died: see its log"; return 1; }
    sleep 1
  done
  echo "[compare] $3 not up after 300 s"; return 1
}
start_longserve() {  # port, step log, extra flags...: `longserve serve` in the background, its pid in LS
  python3 -m longserve serve --model $MODEL --load-format dummy --dtype bfloat16 --max-num-batched-tokens 8192 \
    --mem-fraction-static "$LS_FRACTION" --host 127.0.0.1 --port "$1" --step-log "$2" "${@:3}" \
    > "${2%_steps.jsonl}_server.log" 2>&1 &
  LS=$!
  wait_up "http://127.0.0.1:$1" $LS longserve || { tail -20 "${2%_steps.jsonl}_server.log"; kill $LS; return 1; }
}
warm_up() {  # port name: not measured; the compare runs flush the cache it leaves
  python3 -m longserve bench serve --base-url "http://127.0.0.1:$1" --backend vllm --dataset shared-prefix \
    --shared-prefix-docs 1 --shared-prefix-doc-len 20000 --shared-prefix-questions 8 --output-len 32 \
    --max-concurrency 4 --warmup-requests 0 --seed 99 --tokenizer $MODEL --disable-tqdm > "$OUT/http/warmup_$2.log" 2>&1 \
    || { echo "[compare] warm-up of $2 failed:"; tail -5 "$OUT/http/warmup_$2.log"; }
}
status=0
KV_ARGS=()  # longserve's KV pool: vLLM's size once its server is up (below)
LS_FRACTION=0.40
if [[ $WORKLOADS != none ]]; then  # none: the A/B below only (vLLM's figures from an earlier call)
  python3 -m vllm.entrypoints.openai.api_server --model $MODEL --load-format dummy --dtype bfloat16 \
    --max-model-len 131072 --enable-prefix-caching --max-num-batched-tokens 8192 --gpu-memory-utilization 0.45 \
    --enable-prompt-tokens-details --host 127.0.0.1 --port 8000 > "$OUT/http/vllm_server.log" 2>&1 &
  VL=$!
  wait_up http://127.0.0.1:8000 $VL vllm || { tail -20 "$OUT/http/vllm_server.log"; kill $VL; exit 1; }
  # the same KV cache for both: vLLM's, as it logs it (an H200 gave it 381,536 tokens and us 330,592 from the
  # fractions, both past every workload's working set; on an 80 GB card the fractions would leave each ~120-150K,
  # under the multi-turn workload's ~150K, and the smaller cache would evict the more)
  kv_tokens=$(grep -oE 'GPU KV cache size: [0-9,]+ tokens' "$OUT/http/vllm_server.log" | head -1 | grep -oE '[0-9,]+' \
    | tr -d ,)
  # without it, the fraction: ours bounds all the memory in use on the card (model_runner._num_pages), vLLM's 45% too
  if [[ -n $kv_tokens ]]; then KV_ARGS=(--max-total-tokens "$kv_tokens"); else LS_FRACTION=0.85; fi
  echo "[compare] vLLM's KV cache: ${kv_tokens:-not found in its log} tokens; longserve's pool: ${kv_tokens:-by its fraction}"
  # LONGSERVE_EXTRA_ARGS: more `longserve serve` flags (an A/B of an option, e.g. --piecewise-cuda-graph-max-tokens 0)
  # shellcheck disable=SC2086
  start_longserve 30000 "$OUT/http/longserve_steps.jsonl" "${KV_ARGS[@]}" ${LONGSERVE_EXTRA_ARGS:-} \
    || { kill $VL; exit 1; }
  echo "[compare] both up after ${SECONDS}s"
  warm_up 30000 longserve
  warm_up 8000 vllm

  for w in ${WORKLOADS//,/ }; do
    echo "[compare] $w at ${SECONDS}s"
    echo "$w $(date +%s.%N)" >> "$OUT/http/workload_marks.txt"  # the step log's parts (step_log_summary.py)
    python3 -m longserve bench compare --config benchmarks/configs/vllm_http_$w.yaml --output-dir "$OUT/http/$w" \
      --disable-tqdm > "$OUT/http/$w.log" 2>&1 || { status=1; tail -5 "$OUT/http/$w.log"; }
    [[ -f "$OUT/http/$w/report.md" ]] && sed -n '1,40p' "$OUT/http/$w/report.md"
  done
  kill -TERM $LS $VL 2>/dev/null; wait $LS $VL 2>/dev/null  # the A/B's server plans its memory as the first did
  LS_FRACTION=0.40  # vLLM gone: 0.40 alone leaves the pool 0.85 left beside vLLM's 0.45 (the fallback above)
fi
# LONGSERVE_AB_ARGS: then longserve again with these flags, alone, for the workloads in AB_WORKLOADS (default
# random), vLLM's figures being those above: an option's A/B through HTTP in the same call. Reports under
# $OUT/http/<workload>_ab/, its step log in longserve_ab_steps.jsonl.
if [[ -n ${LONGSERVE_AB_ARGS:-} ]]; then
  # shellcheck disable=SC2086
  if start_longserve 30001 "$OUT/http/longserve_ab_steps.jsonl" "${KV_ARGS[@]}" $LONGSERVE_AB_ARGS; then
    warm_up 30001 longserve_ab
    for w in ${AB_WORKLOADS:-random}; do
      echo "[compare] $w with $LONGSERVE_AB_ARGS at ${SECONDS}s"
      echo "$w $(date +%s.%N)" >> "$OUT/http/workload_marks_ab.txt"
      python3 - "$w" "$OUT/http/vllm_http_${w}_ab.yaml" <<'PY'
import sys, yaml
w, dst = sys.argv[1:]
with open(f"benchmarks/configs/vllm_http_{w}.yaml") as f:
    config = yaml.safe_load(f)
config["endpoints"] = [{"name": "longserve-ab", "base_url": "http://127.0.0.1:30001", "backend": "vllm",
                        "endpoint": "completions"}]
with open(dst, "w") as f:
    yaml.safe_dump(config, f)
PY
      python3 -m longserve bench compare --config "$OUT/http/vllm_http_${w}_ab.yaml" --output-dir "$OUT/http/${w}_ab" \
        --disable-tqdm > "$OUT/http/${w}_ab.log" 2>&1 || { status=1; tail -5 "$OUT/http/${w}_ab.log"; }
      [[ -f "$OUT/http/${w}_ab/report.md" ]] && sed -n '1,30p' "$OUT/http/${w}_ab/report.md"
    done
    kill -TERM $LS 2>/dev/null; wait $LS 2>/dev/null
    python3 scripts/probes/step_log_summary.py "$OUT/http/longserve_ab_steps.jsonl" "$OUT/http/workload_marks_ab.txt" \
      | tee "$OUT/http/longserve_ab_steps_summary.txt"
  else
    status=1
  fi
fi
echo "[compare] done at ${SECONDS}s"
[[ -f $OUT/http/longserve_steps.jsonl ]] && python3 scripts/probes/step_log_summary.py "$OUT/http/longserve_steps.jsonl" \
  "$OUT/http/workload_marks.txt" | tee "$OUT/http/longserve_steps_summary.txt"
# issue 19's verdict last: TTFT P50 / P95 against vLLM's a workload, the random workload's throughput, ITL stalls
[[ $WORKLOADS != none ]] && python3 scripts/dev/http_table.py "$OUT/http" | tee "$OUT/http/http_table.md"
tar czf "$OUT/http_reports.tgz" -C "$OUT" http
exit $status
