#!/usr/bin/env bash
# A hash of the files a build reads (CMakeLists.txt, include/, src/, bindings/, perf/, tests/),
# by content: printed by gpu-check.sh on the GPU machine, where the copy's git history can lag
# its files, and comparable with the same command in a checkout.
cd "$(dirname "$0")/.."
find CMakeLists.txt include src bindings perf tests -type f \( -name '*.c' -o -name '*.cc' -o -name '*.cpp' \
  -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.hpp' -o -name '*.in' -o -name '*.py' \
  -o -name 'CMakeLists.txt' -o -name '*.cmake' \) -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z |
  xargs -0 sha256sum | sha256sum | cut -c1-16
