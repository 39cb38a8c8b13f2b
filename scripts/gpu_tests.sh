#!/usr/bin/env bash
# On the device machine: the GPU-marked kernel tests (with flash-linear-attention), then the model
# tests on CUDA in float32 (without it). Extra arguments go to the model-test pytest run.
#   bash scripts/gpu_tests.sh [pytest args for the model tests]
set -uo pipefail
source scripts/gpu_env.sh || exit 1
WITH_FLA=1 PYTHONPATH=/tmp/fla:$PYTHONPATH python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_kernel_*.py \
  tests/test_forward_gpu.py
kernels=$?
[ $# -gt 0 ] || set -- tests/test_parity.py tests/test_chunking_and_state.py
TIDAL_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -q "$@"
exit $(( kernels || $? ))
