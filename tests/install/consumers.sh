#!/usr/bin/env bash
# Installs the build into a scratch prefix, moves the prefix elsewhere (a relocated install),
# then builds and runs tests/install/consumer.c twice against it: through pkg-config and
# through find_package(MoEBlaze). Both must find the moved prefix, never the configured one.
# Also checks that the installed library names no CUDA library among its DT_NEEDED entries.
# Usage: consumers.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/staged" > "$work/install.log"
mv "$work/staged" "$work/moved"
prefix=$work/moved
pcdir=$(dirname "$(find "$prefix" -name moeblaze.pc | head -1)")
libdir=$(dirname "$(find "$prefix" -name 'libmoeblaze.so*' | head -1)")
export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

echo "== what the library needs from the loader"
lib=$(find "$prefix" -name 'libmoeblaze.so.*' -type f | head -1)
needed=$(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
echo "NEEDED: $needed"
case "$needed" in  # CUDA libraries are opened at first CUDA use, so the CPU engine loads anywhere
  *cublas*|*cudart*|*libcuda*|*nvidia*) echo "FAIL: libmoeblaze links a CUDA library"; exit 1 ;;
esac

echo "== pkg-config"
cflags=$(PKG_CONFIG_PATH=$pcdir pkg-config --cflags moeblaze)
libs=$(PKG_CONFIG_PATH=$pcdir pkg-config --libs moeblaze)
echo "cflags: $cflags"
echo "libs: $libs"
case "$cflags $libs" in
  *"$prefix"*) ;;
  *) echo "FAIL: pkg-config does not point into the relocated prefix $prefix"; exit 1 ;;
esac
# shellcheck disable=SC2086  # the flags are word lists
cc -std=c99 -Wall -Werror $cflags "$src/tests/install/consumer.c" $libs -o "$work/pc-consumer"
"$work/pc-consumer"

echo "== find_package(MoEBlaze)"
cmake -S "$src/tests/install/cmake_consumer" -B "$work/cm" -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_BUILD_TYPE=Release > "$work/cm.log" 2>&1 || { cat "$work/cm.log"; exit 1; }
grep -q "$prefix" "$work/cm/CMakeCache.txt" || { echo "FAIL: MoEBlaze_DIR is not in $prefix"; exit 1; }
cmake --build "$work/cm" > "$work/cm-build.log" 2>&1 || { cat "$work/cm-build.log"; exit 1; }
"$work/cm/consumer"
echo "consumers: 3 passed, 0 failed"
