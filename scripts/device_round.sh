#!/usr/bin/env bash
# One device call on nvidia-h200-x2: a short TP=2 smoke of the hc-shard bench on both GPUs, then in
# parallel the layer-major bench on GPU 0 and the kernel tests, numerics check and the TP=1
# off/control figure on GPU 1. Logs go to $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WITH_FLA=1 source scripts/gpu_env.sh > $OUT/env.log 2>&1 || { cat $OUT/env.log; exit 1; }
python3 -c 'import torch; print("gpus", torch.cuda.device_count())'
timeout 170 python3 scripts/bench_hc_shard.py --out $OUT/tp2_smoke --tp 2 --lengths 8192 --modes off,shard \
  --coalesce on --repeats 1 --decode-context 0 --decode-arms off > $OUT/tp2_smoke.log 2>&1
echo "tp2 smoke rc $?"; tail -5 $OUT/tp2_smoke.log
( export CUDA_VISIBLE_DEVICES=0
  timeout 330 python3 scripts/bench_layer_major.py --out $OUT/lm > $OUT/bench_layer_major.log 2>&1
  echo "layer-major rc $?" >> $OUT/bench_layer_major.log ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 160 python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_kernel_*.py tests/test_forward_gpu.py \
    > $OUT/gpu_tests.log 2>&1; echo "kernel tests rc $?" >> $OUT/gpu_tests.log
  timeout 80 python3 scripts/numerics_check.py --out $OUT/num > $OUT/numerics.log 2>&1
  echo "numerics rc $?" >> $OUT/numerics.log
  timeout 100 python3 scripts/bench_hc_shard.py --out $OUT/tp1 --tp 1 --lengths 8192 --modes off,control \
    --coalesce off --repeats 3 --decode-arms none > $OUT/tp1_control.log 2>&1
  echo "tp1 rc $?" >> $OUT/tp1_control.log ) &
wait
for f in gpu_tests numerics tp1_control bench_layer_major; do echo "== $f"; tail -12 $OUT/$f.log; done
