#!/usr/bin/env bash
# One device call for layer-major prefill with experts in host memory. Parts:
#   tests    the gpu-marked layer-major and PLE-table tests (tests/test_layer_major.py, tests/test_ple_tables.py)
#   profile  scripts/profile_layer_major.py: offline wall time against the PCIe floor, the copy gaps, host functions
#   text     scripts/bench_layer_major.py with the seed's text prompts (arms layer_major, chunked)
#   ids      the same with random token-id prompts
# Limits: TEST_LIMIT, PROFILE_LIMIT, BENCH_LIMIT (seconds). Logs to $OUT.
#   bash scripts/device_issue8.sh [tests|profile|text|ids ...]   (default: tests profile text)
set -u
WITH_FLA=1 source scripts/gpu_env.sh > $OUT/env.log 2>&1 || { cat $OUT/env.log; exit 1; }
for part in ${*:-tests profile text}; do
  case $part in
    tests)
      timeout ${TEST_LIMIT:-150} python3 -m pytest -p no:cacheprovider -q -m gpu tests/test_layer_major.py \
        tests/test_ple_tables.py > $OUT/layer_major_gpu_tests.log 2>&1
      echo "tests rc $?" >> $OUT/layer_major_gpu_tests.log
      tail -4 $OUT/layer_major_gpu_tests.log ;;
    profile)
      timeout ${PROFILE_LIMIT:-150} python3 scripts/profile_layer_major.py --out $OUT --arms layer_major --host 30 \
        > $OUT/profile_layer_major.log 2>&1; echo "profile rc $?" >> $OUT/profile_layer_major.log
      grep -E "^(pinned|layer_major|chunked)|profiled|longest|rc " $OUT/profile_layer_major.log ;;
    text|ids)
      mkdir -p $OUT/$part
      timeout ${BENCH_LIMIT:-260} python3 scripts/bench_layer_major.py --out $OUT/$part --arms layer_major,chunked \
        --prompts $part > $OUT/$part/bench_layer_major.log 2>&1; echo "bench rc $?" >> $OUT/$part/bench_layer_major.log
      tail -7 $OUT/$part/bench_layer_major.log ;;
  esac
done
