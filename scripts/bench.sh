#!/usr/bin/env bash
# Quick start (a): install what is missing, build (Release), run perf/moeblaze-bench.
# - With a GPU: the paper's configs on the CUDA engine, next to a dense cuBLAS GEMM of the same
#   FLOPs (several minutes).
# - Without one: a short CPU correctness run (--quick: every paper config scaled down, error
#   against the fp64 reference with a pass/fail verdict, under a minute once built); the GPU numbers are in
#   perf/RESULTS.md.
# Extra arguments go to moeblaze-bench as they are (try --help; e.g. --configs modern, or
# --shape 32768,2048,768,128,8).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh bench
jobs=$(nproc)
cmake -S . -B build-bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_BUILD_TESTS=OFF \
      -DMOEBLAZE_BUILD_DOCS=OFF -DMOEBLAZE_BUILD_RUST=OFF >/dev/null
cmake --build build-bench --parallel "$jobs" --target moeblaze-bench
mkdir -p build-bench/results
if [ $# -eq 0 ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench.sh: no GPU on this machine: a short CPU correctness check (moeblaze-bench --quick)." >&2
  echo "bench.sh: the GPU numbers (H100) are in perf/RESULTS.md and summarised in the README." >&2
  exec build-bench/perf/moeblaze-bench --quick --json build-bench/results/bench.jsonl
fi
exec build-bench/perf/moeblaze-bench --json build-bench/results/bench.jsonl "$@"
