#!/usr/bin/env bash
# moeblaze-bench's command line (CTest): malformed options exit 2 with the usage, --shape and
# both config schemas run, and every line of --json output is valid JSON (null, never nan).
# Usage: check_bench_cli.sh <moeblaze-bench>
set -uo pipefail
bench=$1
fail=0
expect_exit() {  # expect_exit <code> <args...>
  local want=$1; shift
  "$bench" "$@" >/tmp/bench-cli.out 2>&1
  local got=$?
  if [ $got != "$want" ]; then echo "FAIL: moeblaze-bench $* exited $got, want $want"; cat /tmp/bench-cli.out; fail=1; fi
  if [ "$want" = 2 ] && ! grep -q "usage:" /tmp/bench-cli.out; then echo "FAIL: moeblaze-bench $*: no usage"; fail=1; fi
}
expect_exit 2 --dtype fp32
expect_exit 2 --policy everything
expect_exit 2 --device tpu
expect_exit 2 --reps 3x
expect_exit 2 --reps 0
expect_exit 2 --tokens -5
expect_exit 2 --window -1
expect_exit 2 --cpu-gflop nan
expect_exit 2 --shape 1,2,3
expect_exit 2 --shape 64,32,48,4,8
expect_exit 2 --activations silu,tanh
expect_exit 2 --frobnicate 1
expect_exit 2 --quick --device cuda
expect_exit 2 stray
expect_exit 2 --json
expect_exit 0 --help
json=/tmp/bench-cli.jsonl
expect_exit 0 --device cpu --shape 48,32,40,6,2 --shape 40,24,16,4,4 --activations swiglu,gelu --reps 1 --warmup 0 --json "$json"
python3 - "$json" <<'PY' || fail=1
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert len(rows) == 4, rows
for r in rows:
    assert r["ceiling_ms"] is None, r          # no dense ceiling on the CPU: null, not nan
    assert r["check"] is True and r["max_rel_err"] < 2e-2, r
assert {(r["d"], r["n"], r["experts"], r["k"]) for r in rows} == {(32, 40, 6, 2), (24, 16, 4, 4)}, rows
print("bench CLI: %d JSON rows valid" % len(rows))
PY
expect_exit 0 --quick --configs modern --only qwen3_30b_a3b,mixtral --json "$json"
python3 -c "import json,sys; rows=[json.loads(l) for l in open('$json')]; assert len(rows)==4 and all(r['check'] for r in rows), rows" || fail=1
[ $fail = 0 ] && echo "bench CLI: OK"
exit $fail
