#!/usr/bin/env bash
# Runs the CPU-able model tests on the device machine's GPU (float32). Usage on the device:
#   bash scripts/gpu_tests.sh [pytest args]
# Expects wheels for missing packages in .whl/ (see NOTES-device.md).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/tidal
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
TIDAL_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -q -s "$@"
