#!/usr/bin/env bash
# One device call for layer-major prefill with experts in host memory. Parts:
#   tests    the gpu-marked layer-major, PLE-table, GDN-graph and forward tests (those of the checkout)
#   numerics scripts/numerics_check.py (greedy ids cold, chunked and after a prefix hit; top-1 agreement)
#   prefill  scripts/bench_forward.py at 4K and 8K with GDN graphs on and off (where bench_forward has them)
#   profile  scripts/profile_layer_major.py: offline wall time against the PCIe floor, the copy gaps, host functions
#   text     scripts/bench_layer_major.py with the seed's text prompts (arms layer_major, chunked)
#   ids      the same with random token-id prompts
# TESTS overrides the test files; ARMS the bench's arms, in order (default layer_major,chunked). Limits: TEST_LIMIT, NUM_LIMIT, PREFILL_LIMIT, PROFILE_LIMIT, BENCH_LIMIT (seconds). Logs to $OUT.
#   bash scripts/device_issue8.sh [tests|numerics|prefill|profile|text|ids ...]   (default: tests profile text)
set -u
WITH_FLA=1 source scripts/gpu_env.sh > $OUT/env.log 2>&1 || { cat $OUT/env.log; exit 1; }
for part in ${*:-tests profile text}; do
  case $part in
    tests)
      timeout ${TEST_LIMIT:-150} python3 -m pytest -p no:cacheprovider -q -m gpu ${TESTS:-$(ls tests/test_layer_major.py \
        tests/test_ple_tables.py tests/test_gdn_graphs.py tests/test_forward_gpu.py 2>/dev/null)} \
        > $OUT/layer_major_gpu_tests.log 2>&1
      echo "tests rc $?" >> $OUT/layer_major_gpu_tests.log
      tail -4 $OUT/layer_major_gpu_tests.log ;;
    profile)
      timeout ${PROFILE_LIMIT:-150} python3 scripts/profile_layer_major.py --out $OUT --arms layer_major --host 30 \
        > $OUT/profile_layer_major.log 2>&1; echo "profile rc $?" >> $OUT/profile_layer_major.log
      grep -E "^(pinned|layer_major|chunked)|profiled|longest|rc " $OUT/profile_layer_major.log ;;
    numerics)
      timeout ${NUM_LIMIT:-150} python3 scripts/numerics_check.py --out $OUT/num > $OUT/numerics.log 2>&1
      echo "numerics rc $?" >> $OUT/numerics.log
      grep -E "^(greedy|PASS|FAIL)|rc " $OUT/numerics.log ;;
    prefill)
      arms=$(grep -q -- "--prefill-graphs" scripts/bench_forward.py && echo "--prefill-graphs on,off")
      timeout ${PREFILL_LIMIT:-150} python3 scripts/bench_forward.py --out $OUT --no-peer --no-kernels \
        --lengths 4096,8192 --decode-batches 1 --decode-graphs on $arms > $OUT/bench_forward.log 2>&1
      echo "prefill rc $?" >> $OUT/bench_forward.log
      grep -E "^(prefill|decode)|rc |peak" $OUT/bench_forward.log ;;
    text|ids)
      mkdir -p $OUT/$part
      timeout ${BENCH_LIMIT:-260} python3 scripts/bench_layer_major.py --out $OUT/$part --arms ${ARMS:-layer_major,chunked} \
        --prompts $part > $OUT/$part/bench_layer_major.log 2>&1; echo "bench rc $?" >> $OUT/$part/bench_layer_major.log
      tail -7 $OUT/$part/bench_layer_major.log ;;
  esac
done
