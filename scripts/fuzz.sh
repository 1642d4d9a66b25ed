#!/usr/bin/env bash
# Builds the libFuzzer target over the C API (clang, ASan + UBSan, CUDA off) and runs it from
# the seed corpus in tests/fuzz/corpus. Any finding (crash, sanitizer report, canary overwrite,
# leak, timeout) fails the run and leaves the input in build-fuzz/findings/.
# Usage: scripts/fuzz.sh [runs]      (default 20000 executions, about 4 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20000}
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEBLAZE_ENABLE_CUDA=OFF \
  -DMOEBLAZE_SANITIZE=address,undefined -DMOEBLAZE_BUILD_FUZZ=ON -DMOEBLAZE_BUILD_TESTS=OFF \
  -DMOEBLAZE_BUILD_PERF=OFF -DMOEBLAZE_BUILD_DOCS=OFF -DMOEBLAZE_BUILD_RUST=OFF >/dev/null
cmake --build build-fuzz --parallel "$(nproc)"
work=build-fuzz/corpus
mkdir -p "$work" build-fuzz/findings
# The run's own corpus grows in build-fuzz/corpus; the tree's seeds are read, never written.
t0=$(date +%s)
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  build-fuzz/tests/fuzz/fuzz_api -runs="$runs" -seed=1 -max_len=512 -timeout=60 -rss_limit_mb=4096 \
  -artifact_prefix=build-fuzz/findings/ -print_final_stats=1 "$work" tests/fuzz/corpus 2>&1 | tail -25
echo "fuzz: $runs executions in $(( $(date +%s) - t0 )) s, no findings"
