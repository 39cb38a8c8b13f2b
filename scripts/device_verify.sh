#!/usr/bin/env bash
# One device call: the forward-level hc-shard A/B with its profile on every GPU there is (TP = GPU
# count, when 2 or more), then on GPU 0 the GPU-marked kernel tests and the numerics check. Logs to $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WITH_FLA=1 source scripts/gpu_env.sh > $OUT/env.log 2>&1 || { cat $OUT/env.log; exit 1; }
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ]; then
  timeout ${HC_LIMIT:-150} python3 scripts/bench_hc_forward.py --out $OUT/hcf --tp $gpus --lengths 8192,65536,131072 \
    > $OUT/hc_forward.log 2>&1; echo "hc forward rc $?" >> $OUT/hc_forward.log
  grep -v USDT $OUT/hc_forward.log | head -12
fi
export CUDA_VISIBLE_DEVICES=0
timeout ${TEST_LIMIT:-240} python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_kernel_*.py tests/test_forward_gpu.py \
  > $OUT/gpu_tests.log 2>&1; echo "kernel tests rc $?" >> $OUT/gpu_tests.log
tail -5 $OUT/gpu_tests.log
timeout ${NUM_LIMIT:-120} python3 scripts/numerics_check.py --out $OUT/num > $OUT/numerics.log 2>&1
echo "numerics rc $?" >> $OUT/numerics.log
tail -8 $OUT/numerics.log
