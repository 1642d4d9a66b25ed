#!/usr/bin/env bash
# Every function the header declares links against the library (oneDNN's test_c_symbols idea),
# and the header declares exactly the allowlisted symbols.
# Usage: check_symbols.sh <cc> <include dir> <libmoeblaze.so> <exported-symbols.txt>
set -euo pipefail
cc=$1 inc=$2 lib=$3 allow=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Declared functions: every "MOEBLAZE_API <type> moeblaze_name(" line of the header.
grep -o '^MOEBLAZE_API[^(]*(' "$inc/moeblaze/moeblaze.h" | grep -o 'moeblaze_[a-z0-9_]*($' | tr -d '(' |
  sort -u > "$work/declared.txt"
if ! diff -u "$allow" "$work/declared.txt"; then
  echo "check_symbols: the header's functions differ from $(basename "$allow")" >&2
  exit 1
fi
{
  echo '#include "moeblaze/moeblaze.h"'
  echo 'typedef void (*any_fn)(void);'
  echo 'int main(void) { any_fn fns[] = {'
  sed 's/.*/  (any_fn)\&&,/' "$work/declared.txt"
  echo '  }; return fns[0] == 0; }'
} > "$work/refs.c"
"$cc" -std=c99 -Wall -Werror -Wno-pedantic -I"$inc" "$work/refs.c" -o "$work/refs" "$lib" -Wl,-rpath,"$(dirname "$lib")"
"$work/refs"
echo "check_symbols: $(wc -l < "$work/declared.txt") declared functions, all linked"
