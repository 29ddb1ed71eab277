#!/usr/bin/env bash
# the skipkv+sfi run (no async scheduling), then the CUDA-only kernel/runtime tests
E=$(cd "$(dirname "$0")" && pwd)
POLICIES="skipkv+sfi" COT_ARGS="--no-async-scheduling" WORKLOADS="32000:256:0.5:16:16" GPU=0.9 \
  COTSERVE_VLLM_TELEMETRY=$OUT/skipkv-sfi-telemetry.jsonl timeout ${GBUDGET:-330} bash "$E/go.sh" cotserve evsfi
pkill -f "cotserve.cli|vllm.entrypoints" ; sleep 3; pkill -9 -f "cotserve.cli|vllm.entrypoints"
cp /tmp/cotserve-*.log "$OUT/" 2>/dev/null
export PYTHONPATH=/root/vsite:/root/xsite:$PWD
timeout ${TBUDGET:-150} python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_vllm_graph_sfi.py tests/test_sfi_paged_kernel.py \
  tests/test_sfi_select_kernel.py tests/test_h2o_paged_kernel.py 2>&1 | tail -30 | tee "$OUT/cuda-tests.txt"
