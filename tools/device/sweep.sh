#!/usr/bin/env bash
# sweep.sh PHASE: e2e.sh's comparison on its four workloads split into phases that fit one 10-minute device
# call each, with the servers left running between calls (setsid; pid files under /root/run), so both servers
# run all four workloads in one lease with two server starts. Same load generator, model, prompts and flags
# as e2e.sh, but for the warm-ups (below).
#   stock1  the CUDA tests ($CUDA_TESTS=1), then start `vllm serve` (plugins off), dense on $W1
#   stock2  dense on $W2 on the same server, stop it, start `cotserve serve --engine vllm`
#   cot1    dense and sfi on $C1 on that server
#   cot2    dense and sfi on $C2, then stop it
#   profile with cotserve up, an SFI run whose engine steps are profiled for a while (`profiled`; auto runs it
#           after the measured runs, before cotserve stops, with PROFILE=1)
#   auto    all of it in order, as far as one call's time goes, and again in the next call until it prints
#           "all measured": setup, start stock, $ALL on stock, stop it, start cotserve, $ALL with dense and
#           sfi, stop it. A run whose JSON shows every request completed is not repeated; a server that
#           stopped answering is started again; a run that needs more than the call has left (a workload's
#           7th field, seconds) or a server start ($START_NEED) waits for the next call.
# Warm-ups: $WARM (1) warm-up requests before each server's and each policy's first run, none before its
# later runs on the same server (e2e.sh sends 2 before every run; a warm-up is a single request of up to
# 1,536 or 12,288 output tokens, tens of seconds each, and the servers are already warm then).
# After each phase on cotserve, one short request after a 3-s pause lets the runtime write the last
# request's telemetry line and the step clock's idle-gap line (cotserve/vllm/step_clock.py).
# The load generator runs in forks of bench_zygote.py, which imports vLLM's CLI once per machine (ZYGOTE=0: the
# CLI itself every run, ~29 s of import each on an H200), with vLLM's plugins off (a client: the cotserve
# plugin, installed by setup while the zygote imports, has nothing to do there).
# Everything a phase writes goes into $OUT/PHASE.tgz (one file: a call returns at most 8).
set -u
E=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=/root/vsite:/root/xsite VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=/root/m4b; R=/root/run; mkdir -p $R $R/prof
W1=${W1:-"16000:1024:0.5:32:16 32000:1024:0.5:32:16:1"}
W2=${W2:-"256:6144:0.75:48:32 512:8192:0.5:48:32"}
C1=${C1:-"$W1 256:6144:0.75:48:32"}; C2=${C2:-"512:8192:0.5:48:32"}
GPU=${GPU:-0.9}; SEQS=${SEQS:-64}; MAXLEN=${MAXLEN:-36000}
WARM=${WARM:-1}
POLICIES=${POLICIES:-"dense sfi"}  # cotserve's policies, in the order they run on each workload
SKIP_STOCK=${SKIP_STOCK:-0}  # 1: auto runs cotserve alone (SFI against cotserve dense only, when a lease is short)
# auto: all four workloads, each with the seconds its run needs at most (warm-up and load generator start-up
# included; an H100 takes longer than an H200: stock at 32,000 took 127 s in all on an H100, its load alone 75 s
# on an H200); a run that would not end before the call's limit waits for the next call
# (IN:OUT:RANGE:PROMPTS:CONCURRENCY:SEED:SECONDS; the 32,000-token prompts take seed 1, so that they do not begin
# with the 16,000-token ones, which a prefix cache would serve)
ALL=${ALL:-"32000:1024:0.5:32:16:1:145 16000:1024:0.5:32:16::90 256:6144:0.75:48:32::150 512:8192:0.5:48:32::200"}
START_NEED=${START_NEED:-230}
RESERVE=${RESERVE:-50}  # seconds kept at the end of a call for the flush, a server's stop and the archive
PHASE=${1:?phase}; T0=$(date +%s); LIMIT=${LIMIT:-560}
D=$R/$PHASE; mkdir -p $D
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
setup() {
  [ -f /root/xsite/.done ] || { python3 -m pip install -q --no-index --no-deps --target /root/xsite "$E"/whl/*.whl && touch /root/xsite/.done; }
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 1; }
  python3 "$E/mkmodel.py" $M "$E/tok" || exit 1
}
poll() { # port: vLLM's metrics every 2 s into $D/metrics-poll-PORT.txt
  ( while true; do curl -s "localhost:$1/metrics" 2>/dev/null | grep -E '^vllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc|prompt_tokens_total|generation_tokens_total|request_(prefill|decode|queue)_time_seconds_(sum|count)|num_preemptions_total)' | sed "s/^/$(date +%s) /"; sleep 2; done ) >> "$D/metrics-poll-$1.txt" 2>/dev/null &
  echo $! > $R/poll.pid; }
unpoll() { [ -f $R/poll.pid ] && kill "$(cat $R/poll.pid)" 2>/dev/null; rm -f $R/poll.pid; }
wait_up() { # port path [pid]: up, or give up when the server's process has ended or the call's time is spent
  for i in $(seq 1 300); do curl -sf "localhost:$1$2" >/dev/null 2>&1 && return 0
    [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null && return 1; [ "$(left)" -le "$RESERVE" ] && return 1; sleep 1; done; return 1; }
stop() { # NAME: the server's whole process group (vLLM's engine and workers included)
  local p; p=$(cat $R/$1.pid 2>/dev/null) || return 0
  kill -- -"$p" 2>/dev/null; sleep 8; kill -9 -- -"$p" 2>/dev/null; rm -f $R/$1.pid
  cp $R/$1-server.log $D/ 2>/dev/null; }
start() { # NAME PORT READY-PATH COMMAND...: in its own process group (setsid), so it outlives this call
  local n=$1 port=$2 path=$3; shift 3
  rm -f "$R"/warmed-"$n"*  # a new server: its first runs get their warm-ups again
  setsid "$@" > $R/$n-server.log 2>&1 < /dev/null & echo $! > $R/$n.pid
  wait_up "$port" "$path" "$(cat $R/$n.pid)" || { echo "$n did not start"; tail -40 $R/$n-server.log; stop "$n"; return 1; }
  echo "== $n up after $(( $(date +%s) - T0 )) s"; }
measured() { # NAME: a JSON of it, written in this or an earlier phase, with every request completed
  local f; for f in $R/*/"$1.json"; do [ -f "$f" ] && python3 -c "import json, sys; j = json.load(open(sys.argv[1]))
sys.exit(0 if j.get('failed') == 0 and j.get('completed') == j.get('num_prompts') else 1)" "$f" && return 0; done; return 1; }
alive() { [ -f $R/$1.pid ] && curl -sf -m 10 "localhost:$2$3" >/dev/null 2>&1; }  # NAME PORT PATH: its server answers
warmups() { # KEY: $WARM the first time a server or policy runs, 0 after
  if [ -f "$R/warmed-$1" ]; then echo 0; else touch "$R/warmed-$1"; echo "$WARM"; fi; }
# vLLM's CLI imported once per machine (bench_zygote.py beside this script or in tools/device/; kept between
# calls like the servers): a run starts in well under a second, not after the ~29 s of the CLI's import
Z=$E/bench_zygote.py; [ -f "$Z" ] || Z=$PWD/tools/device/bench_zygote.py
ZYGOTE=${ZYGOTE:-1}
zygote() { [ "$ZYGOTE" = 1 ] && [ -f "$Z" ] && [ -d /root/vsite ] || { ZYGOTE=0; return 0; }
  grep -qs bench_zygote "/proc/$(cat $R/zygote.sock.pid 2>/dev/null)/cmdline" && return 0
  VLLM_PLUGINS=none setsid python3 "$Z" serve $R/zygote.sock >> $R/zygote.log 2>&1 < /dev/null & }
vllm_cli() { # LIMIT OUTFILE ARGS...: `vllm ARGS...` in the zygote, or (none answers: 75) the CLI itself
  local lim=$1 out=$2 rc=75; shift 2
  [ "$ZYGOTE" = 1 ] && { python3 "$Z" run $R/zygote.sock "$out" "$lim" -- "$@"; rc=$?; }
  [ $rc -ne 75 ] && return $rc
  [ "$ZYGOTE" = 1 ] && { echo "== no zygote answers: vLLM's CLI itself from now on"; ZYGOTE=0; }
  lim=$(( $(left) - RESERVE )); [ "$lim" -ge 30 ] || return 1  # the wait for it counts against the call
  VLLM_PLUGINS=none timeout "$lim" python3 -m vllm.entrypoints.cli.main "$@" > "$out" 2>&1; }
bench() { # name port in out range prompts conc seed server_args [extra-body]  ($NW: warm-ups, $NEED: seconds it needs)
  # returns 0 when the run is measured (now or before), 1 when it is still to do
  local t0 lim; t0=$(date +%s); lim=$(( $(left) - RESERVE ))
  measured "$1" && { echo "== $1 already measured"; return 0; }
  [ "$lim" -lt "${NEED:-30}" ] && { echo "== $1 skipped: $lim s left, it needs ${NEED:-30}"; return 1; }
  local nw=${NW:-$WARM}; [ -n "${WKEY:-}" ] && nw=$(warmups "$WKEY")
  vllm_cli "$lim" "$D/$1.bench.txt" bench serve --backend openai-chat --base-url "http://127.0.0.1:$2" \
    --endpoint /v1/chat/completions --model m --tokenizer $M --dataset-name random --random-input-len "$3" \
    --random-output-len "$4" --random-range-ratio "{\"input\": 0.0, \"output\": $5}" --num-prompts "$6" \
    --max-concurrency "$7" --ignore-eos --temperature 1.0 --seed "$8" --num-warmups "$nw" \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$D" \
    --result-filename "$1.json" --metadata "gpu_memory_utilization=$GPU" "max_num_seqs=$SEQS" "max_model_len=$MAXLEN" \
    "server=${1%%-*}" "server_args=$9" ${10:+--extra-body "${10}"}
  echo "== $1 rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "Successful|Failed|Benchmark duration|Output token throughput|Median TTFT|Median TPOT|Median ITL" "$D/$1.bench.txt"
  measured "$1" && return 0
  [ -n "${WKEY:-}" ] && rm -f "$R/warmed-$WKEY"; return 1  # its retry gets the warm-ups again
}
cot() { # WORKLOADS POLICIES
  local p w i o r n c s need miss=0
  for w in $1; do IFS=: read -r i o r n c s need <<< "$w"
    for p in $2; do WKEY="cotserve-$p" NEED=${need:-30} bench "cotserve-$p-$i-$o${s:+-s$s}" 8200 "$i" "$o" "$r" "$n" "$c" "${s:-0}" "${COT_ARGS:-}" \
      "{\"cotserve\": {\"policy\": \"$p\"}}" || miss=1; done
  done; return $miss; }
flush() { # one short request after a pause: the runtime writes what waits for a next step
  sleep 3; curl -s -m 60 localhost:8200/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}' > /dev/null 2>&1; sleep 1; }
pack() { unpoll; curl -s localhost:8200/metrics 2>/dev/null | grep -E '^cotserve_' | grep -vE '_created|_bucket' > $D/cotserve-metrics.txt
  cp $R/*-server.log $D/ 2>/dev/null; for f in $D/*-server.log; do [ -f "$f" ] && grep -E "Model loading took|KV cache|Maximum concurrency|reserv|sfi: |async|max_num_batched|prefix|ERROR|Error|Traceback" "$f" | head -60 > "${f%.log}-startup.txt"; done
  cp /root/run/*.jsonl $R/zygote.log $D/ 2>/dev/null; tar -C $R -czf "$OUT/$PHASE.tgz" "$PHASE"; echo "== $PHASE done after $(( $(date +%s) - T0 )) s"; }
COT="python3 -m cotserve.cli serve --engine vllm --model $M --served-model-name m --max-model-len $MAXLEN --max-num-seqs $SEQS --gpu-memory-utilization $GPU --port 8200"
stock() { # WORKLOADS
  local w i o r n c s need miss=0
  for w in $1; do IFS=: read -r i o r n c s need <<< "$w"; WKEY=stock NEED=${need:-30} bench "stock-dense-$i-$o${s:+-s$s}" 8100 "$i" "$o" "$r" "$n" "$c" "${s:-0}" "" \
    || miss=1; done; return $miss; }
bytecode() { # once per machine: vLLM's bytecode written ahead (setup.sh unpacks sources only; the load generator's
  # import of vLLM took 29-33 s there), the time and PYTHONDONTWRITEBYTECODE logged
  [ -d /root/vsite ] && [ ! -f /root/vsite/.compiled ] || return 0
  local t=$(date +%s); python3 -m compileall -q -j 0 /root/vsite > $R/compileall.log 2>&1
  touch /root/vsite/.compiled
  echo "== bytecode compiled in $(( $(date +%s) - t )) s (PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset})"; }
profiled() { # an SFI run of $PW whose engine steps are profiled: $PSTEPS (300) steps from $PDELAY (8) s after it
  # starts (past its first prompts); cotserve/vllm/step_profile.py writes the trace and the table, copied into $D
  local i o r n c s need
  IFS=: read -r i o r n c s need <<< "${PW:-16000:1024:0.5:16:16::60}"
  ( sleep "${PDELAY:-8}"; echo "${PSTEPS:-300}" > $R/prof/trigger ) &
  NW=0 NEED=${need:-30} bench "profile-sfi-$i-$o" 8200 "$i" "$o" "$r" "$n" "$c" "${s:-0}" "" '{"cotserve": {"policy": "sfi"}}'
  for k in $(seq 1 60); do ls $R/prof/steps-*.txt >/dev/null 2>&1 && break; sleep 1; done
  cp $R/prof/steps-* $D/ 2>/dev/null; head -1 $D/steps-*.txt 2>/dev/null
  for f in $D/steps-*.json.gz; do [ -f "$f" ] && python3 "$PWD/tools/device/profile_summary.py" "$f" > "${f%.json.gz}-summary.json"; done
  cat $D/steps-*-summary.json 2>/dev/null | head -60; }
bytecode; zygote
case $PHASE in
  stock1) setup
    [ "${CUDA_TESTS:-1}" = 1 ] && PYTHONPATH=/root/vsite:/root/xsite:$PWD timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider \
      tests/test_vllm_graph_sfi.py tests/test_sfi_paged_kernel.py tests/test_sfi_select_kernel.py tests/test_h2o_paged_kernel.py \
      tests/test_step_clock.py \
      2>&1 | tail -30 | tee "$D/cuda-tests.txt"
    start stock 8100 /v1/models env VLLM_PLUGINS=none python3 -m vllm.entrypoints.cli.main serve $M --served-model-name m \
      --max-model-len $MAXLEN --max-num-seqs $SEQS --gpu-memory-utilization $GPU --port 8100 || { pack; exit 1; }
    poll 8100; stock "$W1"; pack ;;
  stock2) poll 8100; stock "$W2"; stop stock
    start cotserve 8200 /ready env COTSERVE_VLLM_TELEMETRY=$R/sfi-telemetry.jsonl COTSERVE_VLLM_PROFILE_DIR=$R/prof $COT || { pack; exit 1; }
    pack ;;
  cot1) poll 8200; cot "$C1" "$POLICIES"; flush; pack ;;
  cot2) poll 8200; cot "$C2" "$POLICIES"; flush; stop cotserve; pack ;;
  auto) # everything in order, as far as this call's time goes; call it again until it prints "all measured"
    [ -f $R/setup.done ] || { setup && touch $R/setup.done; } || exit 1
    if [ "$SKIP_STOCK" != 1 ] && [ ! -f $R/stock.finished ]; then
      alive stock 8100 /v1/models || { stop stock; [ "$(left)" -ge "$START_NEED" ] || { echo "== no time to start stock"; pack; exit 0; }
        start stock 8100 /v1/models env VLLM_PLUGINS=none python3 -m vllm.entrypoints.cli.main serve $M --served-model-name m \
          --max-model-len $MAXLEN --max-num-seqs $SEQS --gpu-memory-utilization $GPU --port 8100 || { pack; exit 1; }; }
      poll 8100; stock "$ALL" && touch $R/stock.finished; unpoll
      [ -f $R/stock.finished ] && stop stock
    fi
    if { [ "$SKIP_STOCK" = 1 ] || [ -f $R/stock.finished ]; } && [ ! -f $R/cot.finished ]; then
      alive cotserve 8200 /ready || { stop cotserve; [ "$(left)" -ge "$START_NEED" ] || { echo "== no time to start cotserve"; pack; exit 0; }
        start cotserve 8200 /ready env COTSERVE_VLLM_TELEMETRY=$R/sfi-telemetry.jsonl COTSERVE_VLLM_PROFILE_DIR=$R/prof $COT || { pack; exit 1; }; }
      poll 8200; cot "$ALL" "$POLICIES" && touch $R/cot.finished; flush
      [ -f $R/cot.finished ] && [ "${PROFILE:-0}" = 1 ] && profiled  # PROFILE=1: the profiled run before the stop
      [ -f $R/cot.finished ] && stop cotserve
    fi
    [ -f $R/cot.finished ] && { [ -f $R/stock.finished ] && echo "== all measured" || echo "== cotserve measured (stock skipped)"; }
    pack ;;
  profile) # cotserve up (started if not), then profiled() below
    alive cotserve 8200 /ready || { stop cotserve; start cotserve 8200 /ready env COTSERVE_VLLM_TELEMETRY=$R/sfi-telemetry.jsonl \
      COTSERVE_VLLM_PROFILE_DIR=$R/prof $COT || { pack; exit 1; }; }
    profiled; pack ;;
  *) echo "usage: sweep.sh stock1|stock2|cot1|cot2|auto|profile"; exit 2 ;;
esac
