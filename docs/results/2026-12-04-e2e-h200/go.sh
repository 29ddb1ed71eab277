#!/usr/bin/env bash
# go.sh stock|cotserve TAG: e2e.sh with a poller of the server's vllm:* metrics every 2 s beside it.
E=$(cd "$(dirname "$0")" && pwd)
mode=$1; tag=$2; port=8100; [ "$mode" = cotserve ] && port=8200
( while true; do curl -s "localhost:$port/metrics" 2>/dev/null | grep -E '^vllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc|prefix_cache_(queries|hits)_total|prompt_tokens_total|generation_tokens_total|request_(prefill|decode|queue|inference)_time_seconds_(sum|count)|num_preemptions_total)' | sed "s/^/$(date +%s) /"; sleep 2; done ) > "$OUT/$tag-metrics-poll.txt" 2>/dev/null &
pp=$!
bash "$E/e2e.sh" "$mode"; rc=$?
kill $pp 2>/dev/null
for f in "$OUT"/*-server.log; do [ -f "$f" ] && { grep -E "Model loading took|KV cache|Maximum concurrency|reserv|async|max_num_batched|prefix|ERROR|Error|Traceback" "$f" | head -60 > "${f%.log}-$tag-startup.txt"; tail -80 "$f" > "${f%.log}-$tag-tail.txt"; gzip -f "$f"; mv "$f.gz" "$OUT/$tag-$(basename $f).gz"; }; done
exit $rc
