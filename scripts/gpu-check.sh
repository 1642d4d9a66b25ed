#!/usr/bin/env bash
# One call on the GPU machine: build (CMocka carried in .deps/), run the GPU tests, a
# compute-sanitizer memcheck pass, and the benchmark; logs under $OUT, a short summary last.
# Usage (device tool, carry .deps): bash scripts/gpu-check.sh [tests|sanitize|bench|all]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moeblaze-out}
mkdir -p "$OUT"
what=("$@")
[ ${#what[@]} -gt 0 ] || what=(all)
want() { for w in "${what[@]}"; do [ "$w" = all ] || [ "$w" = "$1" ] && return 0; done; return 1; }
summary=()

# CMocka from the carried Debian packages (the GPU image has none).
if [ -d .deps ]; then
  mkdir -p /tmp/cmocka
  for f in .deps/*.deb; do dpkg -x "$f" /tmp/cmocka; done
  cm=/tmp/cmocka/usr
  libdir=$(dirname "$(find $cm -name 'libcmocka.so*' | head -1)")
  export PKG_CONFIG_PATH=$(dirname "$(find $cm -name cmocka.pc | head -1)")
  sed -i "s#/usr/#$cm/#g" "$PKG_CONFIG_PATH/cmocka.pc"
  export LD_LIBRARY_PATH=$libdir:${LD_LIBRARY_PATH:-}
  export LIBRARY_PATH=$libdir:${LIBRARY_PATH:-}
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_ENABLE_CUDA=ON -DMOEBLAZE_BUILD_DOCS=OFF \
      -DMOEBLAZE_BUILD_RUST=OFF > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
if ! cmake --build build-gpu --parallel 16 > "$OUT/build.log" 2>&1; then
  grep -E 'error|FAILED' "$OUT/build.log" | head -30; exit 1
fi
summary+=("build: ok in $(( $(date +%s) - t0 )) s")

if want tests; then
  ctest --test-dir build-gpu -L gpu -V --timeout 900 > "$OUT/gpu-tests.log" 2>&1
  rc=$?
  grep -E '^\[ *(PASSED|FAILED|  OK|RUN) *\]|ok  |rel err|differs|failed|Error' "$OUT/gpu-tests.log" | tail -40
  summary+=("gpu tests: rc=$rc; $(grep -E 'tests passed|tests failed' "$OUT/gpu-tests.log" | tail -1)")
  ctest --test-dir build-gpu -L host --timeout 900 > "$OUT/host-tests.log" 2>&1
  summary+=("host tests on the GPU machine: rc=$?; $(grep -E 'tests passed|tests failed' "$OUT/host-tests.log" | tail -1)")
fi
if want sanitize; then
  MOEBLAZE_GPU_TEST_QUICK=1 compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/tests/gpu/test_gpu_vs_cpu \
    > "$OUT/memcheck.log" 2>&1
  summary+=("compute-sanitizer memcheck: rc=$?; $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)")
fi
if want bench; then
  build-gpu/perf/moeblaze-bench --json "$OUT/bench.jsonl" > "$OUT/bench.md" 2>&1
  summary+=("bench: rc=$?")
  cat "$OUT/bench.md"
fi
echo "==== summary"
printf '%s\n' "${summary[@]}"
