#!/usr/bin/env bash
# On the device machine: install carried wheels, then time tiny and bench (random weights) on CUDA.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/tidal
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=
python3 -m tidal.cli checkpoint --preset tiny --out /tmp/tiny
python3 -m tidal.cli checkpoint --preset bench --out /tmp/bench --config-only
echo "== tiny, cuda, float32"; python3 scripts/gpu_smoke.py --model /tmp/tiny --dtype float32 --tokens 4000
echo "== bench (random weights), cuda, bfloat16"; python3 scripts/gpu_smoke.py --model /tmp/bench --load-format random --tokens "${BENCH_TOKENS:-4000}"
