#!/usr/bin/env bash
# H200 side, in the project root (the working tree that travelled), after stage.sh/setup.sh of ../README.md:
# end-to-end serving through HTTP, stock `vllm serve` against `cotserve serve --engine vllm`, both driven by
# vLLM's own load generator (`vllm bench serve`), the same random-weight Qwen3-4B-shaped model folder (built
# once per machine by mkmodel.py) and the same prompts (seed 0). One JSON per (server, policy, workload) in $OUT.
#   bash .vllm-dev/e2e/e2e.sh stock           stock vLLM, dense
#   bash .vllm-dev/e2e/e2e.sh cotserve        cotserve gateway + vLLM worker, each policy in $POLICIES
# Knobs (environment): WORKLOADS="IN:OUT:RANGE:PROMPTS:CONCURRENCY ..." (default below), POLICIES="dense sfi",
# GPU (gpu-memory-utilization, 0.85), SEQS (max-num-seqs, 64), MAXLEN (max-model-len, 36000),
# COT_ARGS (extra `cotserve serve` options), VLLM_ARGS (extra `vllm serve` options).
# A workload may end in :SEED (random prompts of that seed; default 0), so two workloads need not share prompts.
set -u
E=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=/root/vsite:/root/xsite VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=/root/m4b
WORKLOADS=${WORKLOADS:-"16000:1024:0.5:32:16 512:8192:0.5:48:32"}
GPU=${GPU:-0.85}; SEQS=${SEQS:-64}; MAXLEN=${MAXLEN:-36000}
if [ ! -f /root/xsite/.done ]; then
  python3 -m pip install -q --no-index --no-deps --target /root/xsite "$E"/whl/*.whl && touch /root/xsite/.done
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 1; }
python3 "$E/mkmodel.py" $M "$E/tok" || exit 1
tree() { local c; for c in $(ps -o pid= --ppid "$1"); do echo "$c"; tree "$c"; done; }
stop() { # the server and every process under it (vLLM's engine and workers can outlive their parent)
  local all; all="$1 $(tree "$1")"; kill $all 2>/dev/null; sleep 10; kill -9 $all 2>/dev/null; wait "$1" 2>/dev/null; }
wait_up() { for i in $(seq 1 400); do curl -sf "localhost:$1$2" >/dev/null 2>&1 && return 0; sleep 1; done; return 1; }
bench() { # name port in out range prompts conc seed [extra-body]
  local t0; t0=$(date +%s)
  timeout 900 python3 -m vllm.entrypoints.cli.main bench serve --backend openai-chat --base-url "http://127.0.0.1:$2" \
    --endpoint /v1/chat/completions --model m --tokenizer $M --dataset-name random --random-input-len "$3" \
    --random-output-len "$4" --random-range-ratio "{\"input\": 0.0, \"output\": $5}" --num-prompts "$6" \
    --max-concurrency "$7" --ignore-eos --temperature 1.0 --seed "$8" --num-warmups 2 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$OUT" \
    --result-filename "$1.json" --metadata "gpu_memory_utilization=$GPU" "max_num_seqs=$SEQS" "max_model_len=$MAXLEN" \
    "server=${1%%-*}" "server_args=${SERVER_ARGS:-}" ${9:+--extra-body "$9"} > "/tmp/$1.log" 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "Successful|Failed|Benchmark duration|Output token throughput|Median TTFT|Median TPOT|Median ITL" "/tmp/$1.log"
}
case ${1:-} in
  stock)
    SERVER_ARGS=${VLLM_ARGS:-}
    VLLM_PLUGINS=none python3 -m vllm.entrypoints.cli.main serve $M --served-model-name m --max-model-len $MAXLEN \
      --max-num-seqs $SEQS --gpu-memory-utilization $GPU --port 8100 ${VLLM_ARGS:-} > "$OUT/stock-server.log" 2>&1 & sp=$!
    wait_up 8100 /v1/models || { echo "stock vLLM did not start"; tail -30 "$OUT/stock-server.log"; stop $sp; exit 1; }
    for w in $WORKLOADS; do IFS=: read -r i o r n c s <<< "$w"; bench "stock-dense-$i-$o${s:+-s$s}" 8100 "$i" "$o" "$r" "$n" "$c" "${s:-0}"; done
    stop $sp ;;
  cotserve)
    SERVER_ARGS=${COT_ARGS:-}
    python3 -m cotserve.cli serve --engine vllm --model $M --served-model-name m --max-model-len $MAXLEN \
      --max-num-seqs $SEQS --gpu-memory-utilization $GPU --port 8200 ${COT_ARGS:-} > "$OUT/cotserve-server.log" 2>&1 & sp=$!
    wait_up 8200 /ready || { echo "cotserve did not become ready"; tail -40 "$OUT/cotserve-server.log"; stop $sp; exit 1; }
    for p in ${POLICIES:-dense sfi}; do
      for w in $WORKLOADS; do IFS=: read -r i o r n c s <<< "$w"
        bench "cotserve-$p-$i-$o${s:+-s$s}" 8200 "$i" "$o" "$r" "$n" "$c" "${s:-0}" "{\"cotserve\": {\"policy\": \"$p\"}}"; done
    done
    curl -s localhost:8200/metrics | grep -E '^cotserve_' | grep -vE '_created|_bucket' > "$OUT/cotserve-metrics.txt"
    stop $sp ;;
  *) echo "usage: e2e.sh stock|cotserve"; exit 2 ;;
esac
