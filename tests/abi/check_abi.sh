#!/usr/bin/env bash
# The ABI guard (docs/abi-policy.md): exported symbols == allowlist, all versioned
# @@MOEBLAZE_0, SONAME libmoeblaze.so.0, only allowed NEEDED entries (the C/C++ runtime: cudart is static and cuBLASLt is opened
# at first use), and
# abidiff against the committed baseline (tests/abi/baseline/libmoeblaze.so.0.abi).
# Usage: check_abi.sh <libmoeblaze.so.0> <source dir>
set -uo pipefail
lib=$1 src=$2
here=$src/tests/abi
fail=0
err() { echo "check_abi: $*" >&2; fail=1; }

nm -D --defined-only "$lib" | awk '$2 == "T" {print $3}' | sed 's/@.*//' | sort > /tmp/moeblaze-exported.$$
if ! diff -u "$here/exported-symbols.txt" /tmp/moeblaze-exported.$$; then err "exported functions differ from exported-symbols.txt"; fi
rm -f /tmp/moeblaze-exported.$$
other=$(nm -D --defined-only "$lib" | awk '$2 != "T" && $2 != "A" {print $3}')
[ -z "$other" ] || err "unexpected exported non-function symbols: $other"
unversioned=$(readelf --dyn-syms -W "$lib" | awk '$7 != "UND" && $8 ~ /^moeblaze_/ && $8 !~ /@@MOEBLAZE_0$/ {print $8}')
[ -z "$unversioned" ] || err "symbols without the MOEBLAZE_0 version: $unversioned"
readelf -d "$lib" | grep -q 'SONAME.*\[libmoeblaze\.so\.0\]' || err "SONAME is not libmoeblaze.so.0"
allowed='^(libstdc\+\+\.so\.6|libm\.so\.6|libgcc_s\.so\.1|libc\.so\.6|ld-linux-x86-64\.so\.2|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1)$'
for n in $(readelf -d "$lib" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p'); do
  [[ $n =~ $allowed ]] || err "unexpected NEEDED entry $n (cudart is static, cuBLASLt opened at first use: no CUDA library may be linked)"
done

if command -v abidiff >/dev/null 2>&1; then
  abidiff --headers-dir2 "$src/include/moeblaze" --suppressions "$here/suppressions.ini" \
    "$here/baseline/libmoeblaze.so.0.abi" "$lib" > /tmp/moeblaze-abidiff.$$ 2>&1
  rc=$?
  if (( rc & 1 || rc & 2 )); then cat /tmp/moeblaze-abidiff.$$; err "abidiff failed to run (rc $rc)"; fi
  if (( rc & 8 )); then cat /tmp/moeblaze-abidiff.$$; err "abidiff: INCOMPATIBLE ABI change against the baseline"; fi
  if (( rc & 4 )) && ! (( rc & 8 )); then
    cat /tmp/moeblaze-abidiff.$$
    # Functions added since the baseline release are compatible when docs/symbols-in-versions
    # names the release that introduced them; any other change is not.
    summary=$(grep -E '^(Functions|Variables) changes summary' /tmp/moeblaze-abidiff.$$)
    other_change=$(echo "$summary" | grep -vE ': 0 Removed, 0 Changed( \([0-9]+ filtered out\))?, [0-9]+ Added')
    if [ "${MOEBLAZE_ABI_ALLOW_ADDITIONS:-0}" = 1 ]; then echo "check_abi: compatible additions allowed by MOEBLAZE_ABI_ALLOW_ADDITIONS=1"
    elif [ -n "$other_change" ]; then err "abidiff: changes other than added functions: $other_change"
    else
      for f in $(sed -n "s/.*{\(moeblaze_[a-z0-9_]*\)@@MOEBLAZE_0}.*/\1/p" /tmp/moeblaze-abidiff.$$); do
        since=$(awk -v f="$f" '$1 == f {print $2}' "$src/docs/symbols-in-versions")
        if [ -z "$since" ] || [ "$since" = "0.1.0" ]; then
          err "abidiff: $f was added since the baseline but docs/symbols-in-versions gives no later release for it"
        else echo "check_abi: $f added in $since"; fi
      done
    fi
  fi
  rm -f /tmp/moeblaze-abidiff.$$
  echo "check_abi: abidiff against the baseline: rc $rc"
else
  err "abidiff not found (apt-get install abigail-tools)"
fi
[ $fail = 0 ] && echo "check_abi: OK ($(wc -l < "$here/exported-symbols.txt") symbols @@MOEBLAZE_0, SONAME libmoeblaze.so.0)"
exit $fail
