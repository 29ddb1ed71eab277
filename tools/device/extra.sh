#!/usr/bin/env bash
# extra.sh PHASE [FILES...]: GPU runs in the project root after staging vLLM (../shared/tools/device-vllm)
# and its e2e folder (to /root/stage/e2e; see README.md here).
#   setup           cotserve and its wheels installed, /root/m4b (random-weight Qwen3-4B-shaped folder with the
#                   bundled model's tokenizer, e2e's mkmodel.py), then the CUDA-only tests
#   part FILES...   keep the carried parts of the bundled model (tools/stage_model.py pack or pack-gguf) in
#                   /root/mparts
#   fidelity-native the bundled model unpacked (a pack-gguf bundle is converted there), then the native engine's
#                   CUDA fidelity of five policies against dense: needs no vLLM, only the model and the data folder
#   replay-stock    stock vLLM (no plugin), dense, 32,768 x 16 and 131,072 x 4, 512 new tokens
#   replay-sfi      the plugin's SFI rows, same shapes, tokens replayed from MATH solutions
#   fidelity        the bundled model's real weights, unpacked: CUDA fidelity of five policies against dense
#   parts WHEELS    on a bare machine (no vLLM staged): cotserve's pydantic/dill wheels from the carried folder
#                   WHEELS, then the CUDA tests of SFI's kernels and runtime and the no-vLLM timings (vllm_parts:
#                   launch costs, refreshes' GPU against host time, each launch of a refresh alone, the fast step;
#                   vllm_plan; a refresh's profile); TUNE=1: then the fast-step launch table (tune_sfi_fast)
# Outputs go to $OUT.
set -u
export PYTHONPATH=/root/vsite:/root/xsite:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
DATA=/root/stage/data; E=/root/stage/e2e
long_model() { # /root/m4l: /root/m4b's weights, positions up to 140,000 (random weights: no trained limit)
  [ -d /root/m4l ] && return 0; mkdir -p /root/m4l; ln -s /root/m4b/* /root/m4l/; rm /root/m4l/config.json
  python3 -c "import json; c=json.load(open('/root/m4b/config.json')); c['max_position_embeddings']=140000; json.dump(c, open('/root/m4l/config.json','w'))"; }
SHAPES="--context 32768,131072 --batch 16,4 --new-tokens 512 --gpu-memory-utilization 0.8"
case ${1:?phase} in
  setup) [ -f /root/xsite/.done ] || { python3 -m pip install -q --no-index --no-deps --target /root/xsite $E/whl/*.whl \
      && touch /root/xsite/.done; }
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 1; }
    python3 $E/mkmodel.py /root/m4b $E/tok || exit 1
    timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_vllm_graph_sfi.py tests/test_sfi_paged_kernel.py \
      tests/test_sfi_select_kernel.py tests/test_h2o_paged_kernel.py tests/test_step_clock.py 2>&1 | tail -15 | tee $OUT/cuda-tests.txt ;;
  part) shift; mkdir -p /root/mparts; cp "$@" /root/mparts/; ls /root/mparts ;;
  replay-stock) long_model; python3 -m cotserve.bench.vllm_decode --no-plugin --policy dense $SHAPES --model /root/m4l \
      --json $OUT/replay-stock.json 2>&1 | grep -vE "it/s|Loading" | tail -25 ;;
  replay-sfi) long_model; COTSERVE_VLLM_TELEMETRY=$OUT/replay-sfi-telemetry.jsonl python3 -m cotserve.bench.vllm_decode \
      --policy sfi $SHAPES --model /root/m4l --replay $DATA/math_train.jsonl --json $OUT/replay-sfi.json 2>&1 \
      | grep -vE "it/s|Loading" | tail -25 ;;
  fidelity-native) [ -d /root/model/model ] || python3 tools/stage_model.py unpack /root/mparts /root/model || exit 1
    PYTHONPATH=$PWD:$(ls $DATA/redis-*.whl 2>/dev/null | head -1) python3 -m cotserve.cli bench fidelity \
      --model /root/model/model --policy sfi,skipkv,rkv,h2o,skipkv+sfi --context 4096 --steps 128 --batch 2 \
      --data-dir $DATA --json $OUT/fidelity-cuda-native.json 2>&1 | grep -vE "it/s|Loading" | tail -12 ;;
  fidelity) [ -d /root/model/model ] || python3 tools/stage_model.py unpack /root/mparts /root/model || exit 1
    python3 -m cotserve.cli bench fidelity --engine vllm --model /root/model/model --policy sfi,skipkv,rkv,h2o,skipkv+sfi \
      --context 4096 --steps 128 --batch 2 --data-dir $DATA --gpu-memory-utilization 0.5 --json $OUT/fidelity-cuda.json 2>&1 \
      | grep -vE "it/s|Loading" | tail -25 ;;
  parts) python3 -m pip install -q --no-index --no-deps --target /tmp/site "${2:?wheels folder}"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
    timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_vllm_graph_sfi.py tests/test_sfi_paged_kernel.py \
      tests/test_sfi_select_kernel.py 2>&1 | tail -15 | tee $OUT/cuda-tests.txt
    { python3 -m cotserve.bench.vllm_parts --launches; python3 -m cotserve.bench.vllm_parts --refresh 1 16384 1 32768 4 16384
      python3 -m cotserve.bench.vllm_parts --refresh-parts 1 16384; python3 -m cotserve.bench.vllm_parts --refresh-parts 1 32768
      python3 -m cotserve.bench.vllm_parts; python3 -m cotserve.bench.vllm_plan; } 2>&1 | grep '^{' | tee $OUT/parts.jsonl
    python3 -m cotserve.bench.vllm_parts --profile 1 16384 > $OUT/refresh-profile.txt 2>&1; tail -30 $OUT/refresh-profile.txt
    [ "${TUNE:-0}" = 1 ] && timeout 150 python3 -m cotserve.bench.tune_sfi_fast --out $OUT/sfi-fast-launch-table.json 2>&1 | tail -5 ;;
  *) echo "usage: extra.sh setup|part|replay-stock|replay-sfi|fidelity-native|fidelity|parts"; exit 2 ;;
esac
