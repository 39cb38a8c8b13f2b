#!/usr/bin/env bash
# Issue 14 on nvidia-h200-x2: the hc-shard protocol in interleaved pairs of arms (both servers up at
# once, samples in turn), TP = 2, bench preset, random weights. Stage a: off vs shard+coalesce with
# decode and agreement; stage b: shard vs off+coalesce (decode in the other order); stage c: control vs control+coalesce.
#   bash scripts/device_issue14.sh a|b|c [seconds]
set -u
stage=$1; limit=${2:-500}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WITH_FLA=1 source scripts/gpu_env.sh > $OUT/env_$stage.log 2>&1 || { cat $OUT/env_$stage.log; exit 1; }
case $stage in
  a) args="--arms off,shard+coalesce --decode-arms off,shard+coalesce --agreement" ;;
  b) args="--arms shard,off+coalesce --decode-arms shard,off+coalesce" ;;
  c) args="--arms control,control+coalesce --decode-arms none" ;;
esac
timeout $limit python3 scripts/bench_hc_shard.py --out $OUT/tp2_$stage --tp 2 --lengths 8192,65536,131072 \
  --repeats 2 --interleave $args > $OUT/tp2_$stage.log 2>&1
echo "stage $stage rc $?" | tee -a $OUT/tp2_$stage.log
tail -25 $OUT/tp2_$stage.log
