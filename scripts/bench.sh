#!/usr/bin/env bash
# Quick start (a): install what is missing, build (Release), run perf/moeblaze-bench on the
# paper's configs. Extra arguments go to moeblaze-bench (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh bench
jobs=$(nproc)
cmake -S . -B build-bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_BUILD_TESTS=OFF \
      -DMOEBLAZE_BUILD_DOCS=OFF -DMOEBLAZE_BUILD_RUST=OFF >/dev/null
cmake --build build-bench --parallel "$jobs" --target moeblaze-bench
mkdir -p build-bench/results
exec build-bench/perf/moeblaze-bench --json build-bench/results/bench.jsonl "$@"
