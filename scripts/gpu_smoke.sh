#!/usr/bin/env bash
# On the device machine: install carried wheels, then time tiny and bench (random weights) on CUDA.
set -uo pipefail
WITH_FLA=1 source scripts/gpu_env.sh || exit 1
python3 -m tidal.cli checkpoint --preset tiny --out /tmp/tiny
python3 -m tidal.cli checkpoint --preset bench --out /tmp/bench --config-only
echo "== tiny, cuda, float32"; python3 scripts/gpu_smoke.py --model /tmp/tiny --dtype float32 --tokens 4000
echo "== bench (random weights), cuda, bfloat16"; python3 scripts/gpu_smoke.py --model /tmp/bench --load-format random --tokens "${BENCH_TOKENS:-4000}"
