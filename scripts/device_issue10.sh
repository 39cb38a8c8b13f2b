#!/usr/bin/env bash
# One device call for decode: the GPU-marked forward tests (CUDA graph replays against eager steps),
# then decode under the profiler with graphs on and off, then decode against the HBM floor; server:
# decode through tidal serve (graphs and overlap on and off); kernels: the decode kernels' tests (all of
# them, compiled) and scripts/bench_decode_kernels.py (KBENCH_ARGS: its arguments); numerics: scripts/numerics_check.py (NUM_BISECT: its
# --bisect list); qsa: the attention kernels' launch-config sweep (scripts/tune_attention.py); moe: the grouped
# path's gate_up launch-config sweep (scripts/tune_moe.py); conv: the conv1d prefill sweep (scripts/tune_conv.py);
# prefill: the
# closing notes' bench_forward.py run (prefill 4K/8K/32K, decode at batch 1/8/32 with graphs) and a 32K
# profile_forward.py (kernel table, GPU busy and idle time). Logs to $OUT.
#   bash scripts/device_issue10.sh [tests|kernels|prefill|profile|floor|server|numerics|qsa|moe|conv ...]   (default: tests profile floor)
set -u
WITH_FLA=1 source scripts/gpu_env.sh > $OUT/env.log 2>&1 || { cat $OUT/env.log; exit 1; }
# The device checkout's .git does not follow the working tree it carries: name the tree in the command
# (TREE=<commit> bash scripts/device_issue10.sh ...), since git log there reads an older commit.
echo "working tree: ${TREE:-not named}" >> $OUT/env.log
parts=${*:-tests profile floor}
for part in $parts; do
  case $part in
    tests)
      timeout ${TEST_LIMIT:-200} python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_forward_gpu.py \
        > $OUT/forward_gpu.log 2>&1; echo "forward tests rc $?" >> $OUT/forward_gpu.log
      tail -4 $OUT/forward_gpu.log ;;
    kernels)
      timeout ${KTEST_LIMIT:-200} python3 -m pytest -p no:cacheprovider -q ${KTESTS:-tests/test_kernel_moe_decode.py \
        tests/test_kernel_qsa_select.py tests/test_kernel_moe.py tests/test_kernel_moe_triton.py \
        tests/test_kernel_ngram_qsa.py tests/test_kernel_ngram_triton.py tests/test_kernel_hc_norm.py tests/test_kernel_conv_gdn.py \
        tests/test_kernel_attention.py \
        tests/test_kernel_gdn_prefill.py} > $OUT/kernel_tests.log 2>&1; echo "kernel tests rc $?" >> $OUT/kernel_tests.log
      tail -4 $OUT/kernel_tests.log
      timeout ${KBENCH_LIMIT:-200} python3 scripts/bench_decode_kernels.py --out $OUT ${KBENCH_ARGS:-} > $OUT/bench_decode_kernels.log 2>&1
      echo "kernel bench rc $?" >> $OUT/bench_decode_kernels.log
      cat $OUT/bench_decode_kernels.log ;;
    profile)
      timeout ${TABLE_LIMIT:-90} python3 scripts/profile_decode.py --out $OUT/table --batches 1 --contexts 8192 \
        --steps 24 --graphs on --kernel-table 45 > $OUT/profile_kernels.log 2>&1; echo "table rc $?" >> $OUT/profile_kernels.log
      timeout ${PROFILE_LIMIT:-240} python3 scripts/profile_decode.py --out $OUT --batches 1,8,32 \
        --contexts 16,8192 --steps 24 --graphs on,off > $OUT/profile_decode.log 2>&1
      echo "profile rc $?" >> $OUT/profile_decode.log
      grep -E "^graphs|rc " $OUT/profile_decode.log ;;
    prefill)
      timeout ${PREFILL_LIMIT:-200} python3 scripts/bench_forward.py --out $OUT --no-peer --no-kernels \
        --lengths 4096,8192,32768 --decode-batches 1,8,32 --decode-context 512 --decode-graphs on \
        > $OUT/bench_forward.log 2>&1; echo "prefill rc $?" >> $OUT/bench_forward.log
      grep -E "^(prefill|decode)|rc |peak" $OUT/bench_forward.log
      timeout ${PROFILE_LIMIT:-150} python3 scripts/profile_forward.py --out $OUT --tokens 32768 --decode-batch 1 \
        --rows 60 > $OUT/profile_forward.log 2>&1; echo "profile rc $?" >> $OUT/profile_forward.log
      grep -E "^(prefill|decode|GPU)|rc " $OUT/profile_forward.log ;;
    floor)
      timeout ${FLOOR_LIMIT:-150} python3 scripts/bench_forward.py --out $OUT --no-peer --no-kernels --lengths 4096 \
        --decode-batches 1,8,32 --decode-context 512 --decode-graphs on,off > $OUT/bench_decode.log 2>&1
      echo "floor rc $?" >> $OUT/bench_decode.log
      grep -E "^decode|rc |peak" $OUT/bench_decode.log ;;
    server)
      timeout ${SERVER_LIMIT:-300} python3 scripts/bench_decode_server.py --out $OUT/server --concurrency 1,8,32 \
        --contexts 16,8192 --tokens 128 --arms graphs,graphs-no-overlap,eager > $OUT/bench_decode_server.log 2>&1
      echo "server rc $?" >> $OUT/bench_decode_server.log
      grep -E "context|rc |stopped" $OUT/bench_decode_server.log ;;
    qsa)
      timeout ${QSA_LIMIT:-120} python3 scripts/tune_attention.py \
        > $OUT/tune_attention.log 2>&1; echo "tune rc $?" >> $OUT/tune_attention.log
      cat $OUT/tune_attention.log ;;
    moe)
      timeout ${MOE_LIMIT:-240} python3 scripts/tune_moe.py > $OUT/tune_moe.log 2>&1; echo "tune rc $?" >> $OUT/tune_moe.log
      cat $OUT/tune_moe.log ;;
    conv)
      timeout ${CONV_LIMIT:-120} python3 scripts/tune_conv.py > $OUT/tune_conv.log 2>&1; echo "tune rc $?" >> $OUT/tune_conv.log
      cat $OUT/tune_conv.log ;;
    numerics)
      timeout ${NUM_LIMIT:-150} python3 scripts/numerics_check.py --out $OUT/num ${NUM_BISECT:+--bisect "$NUM_BISECT"} > $OUT/numerics.log 2>&1
      echo "numerics rc $?" >> $OUT/numerics.log
      grep -E "^(greedy|bisect|PASS|FAIL)|rc " $OUT/numerics.log ;;
  esac
done
