#!/usr/bin/env bash
# Server-level time to first token of conversation turns: `longserve serve` (dummy weights of a built-in shape,
# the embedded default model's tokenizer) under `longserve bench serve --dataset multi-turn` with text prompts
# over /v1/completions, first with the tokenizer prefix cache and short-first scheduling off, then with both
# on (the defaults). Both servers in turn, a short table last; JSON in $OUT.
#   GPU (needs the server packages; without a package index, see fetch_server_wheels.sh):
#     bash scripts/gpu/serve_turns.sh
#   CPU dry run:  SHAPE=tiny FIRST_LEN=2048 TURN_LEN=32 TURNS=3 CONVS=2 DTYPE=float32 bash scripts/gpu/serve_turns.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-llama-3.1-8b} DTYPE=${DTYPE:-bfloat16} PORT=${PORT:-30123}
CONVS=${CONVS:-4} TURNS=${TURNS:-6} FIRST_LEN=${FIRST_LEN:-32768} TURN_LEN=${TURN_LEN:-64} OUTPUT_LEN=${OUTPUT_LEN:-16}
OUT=${OUT:-/tmp/longserve-out}
mkdir -p "$OUT"
model=$(mktemp -d)
tokenizer=$(python3 -c "from longserve.assets import default_model_path; print(default_model_path())")
python3 - "$model" "$SHAPE" "$tokenizer" <<'PY'
import json, sys
from longserve.bench.configs import BUILTIN_CONFIGS
from longserve.tokenization.tokenizer import load_tokenizer
config = dict(BUILTIN_CONFIGS[sys.argv[2]])
config["vocab_size"] = max(config["vocab_size"], len(load_tokenizer(sys.argv[3])))  # dummy weights: any size
json.dump(config, open(f"{sys.argv[1]}/config.json", "w"))
PY
context=$((FIRST_LEN + TURNS * (TURN_LEN + OUTPUT_LEN) + 1024))
status=0
for variant in off on; do
  flags=()
  [[ $variant == off ]] && flags=(--tokenizer-prefix-cache-size 0 --schedule-policy fcfs)
  python3 -m longserve serve --model-path "$model" --tokenizer-path "$tokenizer" --load-format dummy \
    --dtype "$DTYPE" --port "$PORT" --context-length "$context" --log-stats-interval 0 ${flags[@]+"${flags[@]}"} \
    > "$OUT/serve_turns_server_$variant.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $server 2> /dev/null || break
    sleep 0.5
  done
  python3 -m longserve bench serve --base-url "http://127.0.0.1:$PORT" --backend vllm --dataset multi-turn \
    --multi-turn-conversations "$CONVS" --multi-turn-turns "$TURNS" --multi-turn-first-len "$FIRST_LEN" \
    --multi-turn-turn-len "$TURN_LEN" --output-len "$OUTPUT_LEN" --max-concurrency "$CONVS" --flush-cache \
    --warmup-requests 2 --disable-tqdm --output-json "$OUT/serve_turns_$variant.json" 2>&1 \
    | tee "$OUT/serve_turns_bench_$variant.log" | tail -4 || status=1
  kill $server; wait $server 2> /dev/null
done
rm -rf "$model"
python3 - "$OUT" "$TURNS" "$CONVS" <<'PY'
import json, statistics, sys
out, turns, convs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print("=== conversation turns: TTFT by turn, median over conversations (ms) ===")
print(f"{'variant':<8} " + " ".join(f"turn{t + 1:>3}" for t in range(turns)))
for variant in ("off", "on"):
    try:
        reqs = json.load(open(f"{out}/serve_turns_{variant}.json"))["requests"]
    except (OSError, KeyError, ValueError) as e:
        print(f"{variant:<8} no results: {e}")
        continue
    by_turn = [[r["ttft"] * 1e3 for r in reqs[t * convs : (t + 1) * convs] if r["success"]] for t in range(turns)]
    print(f"{variant:<8} " + " ".join(f"{statistics.median(x):7.1f}" if x else "      -" for x in by_turn))
PY
exit $status
