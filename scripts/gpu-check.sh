#!/usr/bin/env bash
# One call on the GPU machine: build (CMocka carried in .deps/), run the GPU tests, the
# compute-sanitizer passes, the GPU soak and the benchmarks; logs under $OUT, a summary last.
# Usage (device tool, carry .deps):
#   bash scripts/gpu-check.sh [tests|gemm|sanitize|sanitize-full|soak|fuzz|fsdp|ep|eptorch|epbench|epexchange|epprofile|routing|plan|torch|pytorch|example|policies|maxtokens|bench|engines|sidebyside|profile|ncu|all]...
# routing: the routing options on both CUDA engines against the CPU engine
# (tests/gpu/test_gpu_routing_options.c; ROUTING_SANITIZE="memcheck racecheck" runs its quick
# subset under those tools too), then what each option costs (perf/routing_options_cost.py, ROUTING_COST_ARGS;
# "skip" runs none); not part of "all" (the tests mode runs the test through ctest).
# shared: where a shared expert runs best (perf/shared_expert_overlap.py, SHARED_ARGS): after the
# routed experts, beside them on a second stream, or as more groups of their grouped GEMM; on a
# machine of several GPUs, in line or beside on the expert-parallel layer; not part of "all".
# ep: the expert-parallel layer on every GPU of the machine (at least 2; test_ep_gpu also on 2 of
# more) against the single-GPU layer (tests/ep/test_ep_gpu.cpp, tests/ep/test_ep_processes.cpp);
# EP_SANITIZE="memcheck racecheck"
# runs the one-process-per-rank test on two GPUs under those tools too;
# not part of "all" (the tests mode runs it through ctest).
# eptorch: MoELayer(ep_group=...) on every GPU (tests/gpu/ep_torch_check.py) and
# examples/moe_lm_ep.py on 2 GPUs against one GPU's loss curve.
# epbench: perf/ep-bench, the EP layer's weak scaling over the machine's GPUs (EP_BENCH_ARGS;
# EP_BENCH_HOST=1 adds the HOST transport), then perf/ep_torch_baselines.py (all_to_all_single +
# MoEBlaze, torchtitan-style) on 2, 4, ... GPUs.
# epexchange: perf/ep_exchange_bw.py, the exchanges' GB/s per GPU inside a step against the SMs
# they take, on every GPU of the machine (EP_EXCHANGE_ARGS); not part of "all".
# epprofile: perf/ep_step_profile.py, one EP fwd+bwd step's kernels in start order on rank 0,
# with the rows beside the local GEMMs and before them (EP_PROFILE_ARGS, EP_PROFILE_GPUS: the
# ranks, default every GPU); not part of "all".
# sidebyside: perf/side_by_side.py on SonicMoE's configs (SIDE_CONFIGS), with SonicMoE run first
# through .peers/run_sonic.sh when its bundle is carried in .peers/sonic/site (not part of "all").
# profile: the CUDA kernels of one MoEBlaze fwd+bwd through moeblaze.torch (PROFILE_CONFIG).
# kernels: perf/step_kernels.py, a step's kernels grouped by what they do, MoEBlaze beside SonicMoE
# in one process when its bundle is carried in .peers/ (KERNELS_CONFIGS; not part of "all").
# torch: perf/torch_baselines.py (TORCH_ARGS, e.g. "--configs modern --skip-naive").
# engines: both CUDA engines (fused, cuBLASLt) on the paper's configs (SiLU, SwiGLU) and the modern
# ones (SwiGLU), one table per engine and config file (not part of "all": about 6 minutes;
# ENGINES_ONLY=name,... limits it to those configs).
# pytorch: the Python binding's tests with torch on the GPU (CUDA autograd, MoELayer on the fused
# engine under torch.compile and CUDA graphs; the converters against transformers, and against
# torchtitan when .pylib is carried: scripts/pack-pylib.sh).
# example: examples/moe_lm.py in bf16, on the engine AUTO picks and on the fused engine under
# torch.compile(reduce-overhead); matplotlib from wheels carried in .whl/ when the image has none.
# gemm: the sm_90a grouped GEMMs alone: their kernel tests (the stage pipeline, the tile
# scheduler, varlen M, weight gradients, the activation-backward epilogue), a
# SASS check (HGMMA, no local memory) and perf/grouped-gemm-bench (GEMM_BENCH_ARGS, e.g.
# "--bn 256"; "skip" runs no bench); GEMM_SANITIZE="memcheck racecheck synccheck" runs the
# kernel tests under those tools.
# fuzz: the differential fuzzer of the CUDA engines (tests/gpu/fuzz_gpu.c) for FUZZ_SECONDS
# (default 240), then under compute-sanitizer memcheck for FUZZ_MEMCHECK_SECONDS (default 60;
# 0 skips it); FUZZ_SEED replays a run, FUZZ_CASE one case of it (the seed a finding prints; tests/gpu/fuzz_gpu.c).
# plan: perf/plan-bench (the routing plan against a CUB sort) and perf/router-bench (the router's
# kernels alone against their HBM floor).
# fsdp: a small model of MoELayer blocks under FSDP2 (fully_shard) on every GPU of the machine
# (at least 2) against the same model on one GPU (tests/gpu/fsdp2_train.py); not part of "all".
# sanitize: memcheck, racecheck, initcheck and synccheck on the quick subset of the GPU tests,
# on test_gpu_hardening and on test_plan_cuda (SANITIZE_TOOLS="racecheck ..." runs only those); sanitize-full: racecheck and initcheck on the full GPU test set
# (not part of "all": about 10 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moeblaze-out}
mkdir -p "$OUT"
what=("$@")
[ ${#what[@]} -gt 0 ] || what=(all)
want() {
  for w in "${what[@]}"; do
    [ "$w" = "$1" ] && return 0
    [ "$w" = all ] && [ "$1" != sanitize-full ] && [ "$1" != engines ] && [ "$1" != fsdp ] && [ "$1" != sidebyside ] \
      && [ "$1" != profile ] && [ "$1" != ncu ] && [ "$1" != ep ] && [ "$1" != routing ] && [ "$1" != shared ] && [ "$1" != epbench ] && [ "$1" != eptorch ] \
      && [ "$1" != epexchange ] && [ "$1" != epprofile ] && [ "$1" != kernels ] && return 0
  done
  return 1
}
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

# Pure-Python packages the image lacks (scripts/pack-pylib.sh: torchtitan and its imports), after
# the image's own site-packages.
pylib=""
[ -d .pylib ] && pylib=:$(python3 -c "import site; print(':'.join(site.getsitepackages()))"):$PWD/.pylib

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# What ran, by content: the copy's git history can lag its files. scripts/tree-hash.sh computes
# the same hash in a checkout.
echo "tree: $(bash scripts/tree-hash.sh)" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
# Expert parallelism is built against the NCCL that PyTorch loads (its nvidia-nccl wheel), so that
# the torch runs and the C tests (linked to the same library) use one NCCL version.
nccl_dir=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null)
nccl_args=()
[ -n "$nccl_dir" ] && [ -f "$nccl_dir/include/nccl_device.h" ] && nccl_args=(-DMOEBLAZE_NCCL_INCLUDE_DIR="$nccl_dir/include" -DMOEBLAZE_NCCL_LIBRARY="$nccl_dir/lib/libnccl.so.2")
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_ENABLE_CUDA=ON -DMOEBLAZE_BUILD_DOCS=OFF \
      -DMOEBLAZE_BUILD_RUST=OFF "${nccl_args[@]}" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "NCCL: $(grep -E 'MOEBLAZE_NCCL_(INCLUDE_DIR|LIBRARY):' build-gpu/CMakeCache.txt | tr '\n' ' ')"
if ! cmake --build build-gpu --parallel "$(nproc)" >> "$OUT/build.log" 2>&1; then
  grep -E 'error|FAILED' "$OUT/build.log" | head -30; exit 1
fi
summary+=("build: ok in $(( $(date +%s) - t0 )) s; fatbin: $(cuobjdump --list-elf build-gpu/src/libmoeblaze.so.0 2>/dev/null | grep -o 'sm_[0-9a]*' | sort | uniq -c | tr -s ' ' | tr '\n' ';') PTX: $(cuobjdump --list-ptx build-gpu/src/libmoeblaze.so.0 2>/dev/null | grep -o 'sm_[0-9a]*' | sort | uniq -c | tr -s ' ' | tr '\n' ';')")

if want gemm; then
  # the generated per-variant objects (src/gemm/sm90/kernels.cmake)
  for obj in $(find build-gpu/src -path '*sm90_kernels*' -name '*.cu.o' | sort); do
    cuobjdump -sass "$obj" > "$OUT/$(basename "$obj" .cu.o).sass" 2>&1
    summary+=("$(basename "$obj" .cu.o) SASS: HGMMA $(grep -c HGMMA "$OUT/$(basename "$obj" .cu.o).sass"), local-memory LDL/STL $(grep -cE 'LDL|STL' "$OUT/$(basename "$obj" .cu.o).sass")")
  done
  for t in test_sm90_pipeline test_sm90_tile_scheduler test_sm90_grouped_gemm test_sm90_weight_grad test_sm90_act_backward; do
    timeout 300 build-gpu/tests/kernels/$t > "$OUT/$t.log" 2>&1
    rc=$?
    grep -vE '^\[ *(RUN|  OK) *\]' "$OUT/$t.log" | tail -20
    summary+=("$t: rc=$rc; $(grep -E 'PASSED|FAILED' "$OUT/$t.log" | tr '\n' ' ')")
    for tool in ${GEMM_SANITIZE:-}; do  # e.g. "memcheck racecheck synccheck"
      quick=(); [ $t = test_sm90_pipeline ] || [ $t = test_sm90_act_backward ] && quick=(quick)  # a subset under the tools
      timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
        build-gpu/tests/kernels/$t "${quick[@]}" > "$OUT/$t-$tool.log" 2>&1
      summary+=("$t under $tool: rc=$?; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$t-$tool.log" | tail -1)")
    done
  done
  # contiguous A also through the gathered path's cp.async loads (TMA by default)
  MOEBLAZE_SM90_A_LOAD=cp.async timeout 300 build-gpu/tests/kernels/test_sm90_grouped_gemm > "$OUT/test_sm90_grouped_gemm-cpasync.log" 2>&1
  summary+=("test_sm90_grouped_gemm, A by cp.async: rc=$?; $(grep -E 'PASSED|FAILED' "$OUT/test_sm90_grouped_gemm-cpasync.log" | tr '\n' ' ')")
  if [ "${GEMM_BENCH_ARGS:-}" != skip ]; then
    timeout 400 build-gpu/perf/grouped-gemm-bench ${GEMM_BENCH_ARGS:-} > "$OUT/gemm-bench.txt" 2> "$OUT/gemm-bench.err"
    summary+=("gemm bench: rc=$? (table below)")
  fi
fi
if want ep; then
  # the expert-parallel layer on every GPU of the machine (skipped with one) against one GPU
  timeout ${EP_TIMEOUT:-300} build-gpu/tests/ep/test_ep_gpu > "$OUT/test_ep_gpu.log" 2>&1
  rc=$?
  grep -vE '^  ok ' "$OUT/test_ep_gpu.log" | tail -30
  summary+=("test_ep_gpu: rc=$rc; $(grep -c '^  ok ' "$OUT/test_ep_gpu.log") checks ok, $(grep -c FAILED "$OUT/test_ep_gpu.log") FAILED; $(tail -1 "$OUT/test_ep_gpu.log")")
  # the test layers send their rows beside the local GEMMs (the rule in heuristics.hpp): once
  # more with the rows sent before them
  MOEBLAZE_EP_OVERLAP=0 timeout ${EP_TIMEOUT:-300} build-gpu/tests/ep/test_ep_gpu > "$OUT/test_ep_gpu-rows-before.log" 2>&1
  rc=$?
  grep -E 'FAILED|rror' "$OUT/test_ep_gpu-rows-before.log" | tail -10
  summary+=("test_ep_gpu, rows before the GEMMs: rc=$rc; $(grep -c '^  ok ' "$OUT/test_ep_gpu-rows-before.log") checks ok, $(grep -c FAILED "$OUT/test_ep_gpu-rows-before.log") FAILED")
  # and with the returning rows moved by the return exchange (the local combine stores them into
  # the peers by default)
  MOEBLAZE_EP_RETURN=kernel timeout ${EP_TIMEOUT:-300} build-gpu/tests/ep/test_ep_gpu > "$OUT/test_ep_gpu-return-kernel.log" 2>&1
  rc=$?
  grep -E 'FAILED|rror' "$OUT/test_ep_gpu-return-kernel.log" | tail -10
  summary+=("test_ep_gpu, returns by the return exchange: rc=$rc; $(grep -c '^  ok ' "$OUT/test_ep_gpu-return-kernel.log") checks ok, $(grep -c FAILED "$OUT/test_ep_gpu-return-kernel.log") FAILED")
  # one process per rank (layers made from an ncclUniqueId) and the soak (EP_SOAK_STEPS, 1000)
  timeout ${EP_TIMEOUT:-300} build-gpu/tests/ep/test_ep_processes > "$OUT/test_ep_processes.log" 2>&1
  rc=$?
  grep -vE '^  ok ' "$OUT/test_ep_processes.log" | tail -20
  grep -E 'soak' "$OUT/test_ep_processes.log" | head -12
  summary+=("test_ep_processes: rc=$rc; $(grep -c '^  ok ' "$OUT/test_ep_processes.log") checks ok, $(grep -c FAILED "$OUT/test_ep_processes.log") FAILED; $(tail -1 "$OUT/test_ep_processes.log")")
  # compute-sanitizer follows every rank's process: two ranks, a short soak
  if [ -n "${EP_SANITIZE:-}" ]; then
    for tool in $EP_SANITIZE; do
      EP_PROCS=2 EP_SOAK_STEPS=${EP_SANITIZE_STEPS:-4} timeout ${EP_SANITIZE_TIMEOUT:-400} \
        compute-sanitizer --tool "$tool" --target-processes all --report-api-errors no --error-exitcode 9 --print-limit 20 \
        build-gpu/tests/ep/test_ep_processes > "$OUT/test_ep_processes-$tool.log" 2>&1
      summary+=("test_ep_processes (2 ranks) under $tool: rc=$?; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/test_ep_processes-$tool.log" | tr '\n' ' '); $(tail -1 "$OUT/test_ep_processes-$tool.log")")
    done
  fi
fi
if want eptorch; then
  # MoELayer(ep_group=...) on every GPU against one GPU (eager, state_dict, torch.compile, CUDA
  # graphs, FSDP2), then examples/moe_lm_ep.py on 2 GPUs against one GPU's loss curve
  gpus=$(nvidia-smi -L | wc -l)
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONPATH=$PWD/bindings/python PYTHONUNBUFFERED=1 \
    timeout ${EP_TIMEOUT:-300} torchrun --standalone --nproc_per_node="$gpus" tests/gpu/ep_torch_check.py \
    > "$OUT/ep-torch-check.log" 2>&1
  rc=$?
  grep -E '^  |PASS|FAIL|Error|error' "$OUT/ep-torch-check.log" | tail -30
  summary+=("ep_torch_check on $gpus GPUs: rc=$rc; $(grep -E '^(PASS|FAIL)' "$OUT/ep-torch-check.log" | tail -1)")
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONPATH=$PWD/bindings/python PYTHONUNBUFFERED=1 \
    timeout ${EP_TIMEOUT:-300} torchrun --standalone --nproc_per_node=2 examples/moe_lm_ep.py ${EP_EXAMPLE_ARGS:-} \
    > "$OUT/moe-lm-ep.log" 2>&1
  rc=$?
  # the loss table and the comparison, not the launcher's traceback of a failed rank
  grep -E '^(model|ep |single|step|largest|PASS|FAIL)|^ *[0-9]+  ' "$OUT/moe-lm-ep.log" | tail -40
  grep -E 'Error|error' "$OUT/moe-lm-ep.log" | grep -v ChildFailedError | tail -5
  summary+=("examples/moe_lm_ep.py on 2 GPUs: rc=$rc; $(grep -E '^(PASS|FAIL)' "$OUT/moe-lm-ep.log" | tail -1)")
fi
if want epexchange; then
  gpus=$(nvidia-smi -L | wc -l)
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONPATH=$PWD/bindings/python PYTHONUNBUFFERED=1 \
    timeout ${EP_TIMEOUT:-300} torchrun --standalone --nproc_per_node="$gpus" perf/ep_exchange_bw.py ${EP_EXCHANGE_ARGS:-} \
    > "$OUT/ep-exchange.md" 2> "$OUT/ep-exchange.err"
  rc=$?
  cat "$OUT/ep-exchange.md"; grep -E 'Error|error' "$OUT/ep-exchange.err" | tail -3
  summary+=("ep exchange bandwidth: rc=$rc (table above)")
fi
if want epprofile; then
  gpus=${EP_PROFILE_GPUS:-$(nvidia-smi -L | wc -l)}
  for overlap in 1 0; do
    MOEBLAZE_EP_OVERLAP=$overlap MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONPATH=$PWD/bindings/python \
      PYTHONUNBUFFERED=1 timeout ${EP_TIMEOUT:-300} torchrun --standalone --nproc_per_node="$gpus" \
      perf/ep_step_profile.py ${EP_PROFILE_ARGS:-} > "$OUT/ep-profile-overlap$overlap.md" 2> "$OUT/ep-profile-overlap$overlap.err"
    rc=$?
    head -3 "$OUT/ep-profile-overlap$overlap.md"; grep -E 'Error|error' "$OUT/ep-profile-overlap$overlap.err" | tail -3
    summary+=("ep step profile, MOEBLAZE_EP_OVERLAP=$overlap, $gpus ranks: rc=$rc; $(grep '^step ms' "$OUT/ep-profile-overlap$overlap.md")")
  done
fi
if want epbench; then
  # the EP layer's weak scaling over the machine's GPUs (EP_BENCH_ARGS: tokens per rank,
  # iterations, shape names)
  timeout ${EP_TIMEOUT:-300} build-gpu/perf/ep-bench ${EP_BENCH_ARGS:-} > "$OUT/ep-bench.md" 2> "$OUT/ep-bench.err"
  rc=$?
  cat "$OUT/ep-bench.md"; tail -5 "$OUT/ep-bench.err"
  summary+=("ep-bench: rc=$rc (table above)")
  # the torch.distributed baselines beside it, on 2, 4, ... of the same GPUs (EP_TORCH_ARGS;
  # EP_TORCH=0 skips them)
  gpus=$(nvidia-smi -L | wc -l)
  [ "${EP_TORCH:-1}" = 0 ] && gpus=0
  for p in 2 4 8; do
    [ "$p" -le "$gpus" ] || break
    MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONPATH=$PWD/bindings/python PYTHONUNBUFFERED=1 \
      timeout ${EP_TIMEOUT:-300} torchrun --standalone --nproc_per_node=$p perf/ep_torch_baselines.py ${EP_TORCH_ARGS:-} \
      > "$OUT/ep-torch-$p.md" 2> "$OUT/ep-torch-$p.err"
    rc=$?
    cat "$OUT/ep-torch-$p.md"; grep -E 'Error|error' "$OUT/ep-torch-$p.err" | tail -3
    summary+=("ep torch baselines, $p ranks: rc=$rc (table above)")
  done
fi
if want routing; then
  timeout 600 build-gpu/tests/gpu/test_gpu_routing_options > "$OUT/routing-options.log" 2>&1
  rc=$?
  grep -E '^\[ *(PASSED|FAILED|  OK|RUN) *\]|aux|Error|error|relative' "$OUT/routing-options.log" | tail -30
  summary+=("test_gpu_routing_options: rc=$rc; $(grep -E '^\[ *(PASSED|FAILED) *\]' "$OUT/routing-options.log" | tr '\n' ' ')")
  for tool in ${ROUTING_SANITIZE:-}; do
    ROUTING_TEST_QUICK=1 timeout 400 compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
      build-gpu/tests/gpu/test_gpu_routing_options > "$OUT/routing-options-$tool.log" 2>&1
    summary+=("test_gpu_routing_options under $tool: rc=$?; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/routing-options-$tool.log" | tail -1)")
  done
  if [ "${ROUTING_COST_ARGS:-}" != skip ]; then
    MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONPATH=$PWD/bindings/python PYTHONUNBUFFERED=1 \
      timeout 400 python3 perf/routing_options_cost.py ${ROUTING_COST_ARGS:-} > "$OUT/routing-cost.md" 2> "$OUT/routing-cost.err"
    rc=$?
    cat "$OUT/routing-cost.md"; tail -5 "$OUT/routing-cost.err"
    summary+=("routing options cost: rc=$rc (table above)")
  fi
fi
if want shared; then
  gpus=$(nvidia-smi -L | wc -l)
  launch=(python3)  # several GPUs: the expert-parallel layer, one process per GPU
  [ "$gpus" -gt 1 ] && launch=(torchrun --standalone --nproc_per_node="$gpus")
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONPATH=$PWD/bindings/python PYTHONUNBUFFERED=1 \
    timeout 500 "${launch[@]}" perf/shared_expert_overlap.py ${SHARED_ARGS:-} > "$OUT/shared-expert.md" 2> "$OUT/shared-expert.err"
  rc=$?
  cat "$OUT/shared-expert.md"; tail -5 "$OUT/shared-expert.err"
  summary+=("shared expert placement: rc=$rc (table above)")
fi
if want tests; then
  ctest --test-dir build-gpu -L gpu -V --timeout 900 > "$OUT/tests.log" 2>&1
  rc=$?
  grep -E '^\[ *(PASSED|FAILED|  OK|RUN) *\]|ok  |rel err|differs|failed|Error' "$OUT/tests.log" | tail -40
  summary+=("gpu tests: rc=$rc; $(grep -E 'tests passed|tests failed' "$OUT/tests.log" | tail -1)")
  ctest --test-dir build-gpu -L host --timeout 900 > /tmp/host-tests.log 2>&1
  rc=$?
  cat /tmp/host-tests.log >> "$OUT/tests.log"
  summary+=("host tests on the GPU machine: rc=$rc; $(grep -E 'tests passed|tests failed' /tmp/host-tests.log | tail -1)")
fi
# compute-sanitizer <tool> on one test binary; the ERROR SUMMARY (or RACECHECK SUMMARY) line
# goes into the summary. initcheck runs with MOEBLAZE_SANITIZER_INIT_GEMM_OUTPUTS=1: cuBLASLt's
# TMA stores are invisible to it (the probe below shows this on cuBLASLt alone).
sanitize() {  # sanitize <tool> <label> <binary> [env...]
  local tool=$1 label=$2 bin=$3; shift 3
  env "$@" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 "$bin" > /tmp/san.log 2>&1
  local rc=$?
  { echo "==== $tool $label"; cat /tmp/san.log; } >> "$OUT/sanitizers.log"
  summary+=("compute-sanitizer $tool ($label): rc=$rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/san.log | tail -1)")
}
if want sanitize; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
    extra=(); label="quick subset"
    [ $tool = initcheck ] && extra=(MOEBLAZE_SANITIZER_INIT_GEMM_OUTPUTS=1)
    # racecheck on all three engine runs outlasted a 10-minute device call; it checks shared
    # memory, so the fused engine (our kernels; the windowed run uses the same ones) is its target.
    [ $tool = racecheck ] && extra=(MOEBLAZE_TEST_ENGINE=fused) && label="quick subset, fused engine"
    sanitize $tool "$label" build-gpu/tests/gpu/test_gpu_vs_cpu MOEBLAZE_GPU_TEST_QUICK=1 "${extra[@]}"
    sanitize $tool "hardening" build-gpu/tests/gpu/test_gpu_hardening "${extra[@]}"
    sanitize $tool "routing plan" build-gpu/tests/plan/test_plan_cuda
  done
  for dt in 0 1; do
    compute-sanitizer --tool initcheck build-gpu/tests/gpu/initcheck-tma-probe $dt > /tmp/probe.log 2>&1
    summary+=("initcheck probe, cuBLASLt alone ($([ $dt = 0 ] && echo bf16 || echo f32) output): $(grep -m1 -E 'ERROR SUMMARY' /tmp/probe.log)")
  done
fi
if want sanitize-full; then  # the two slow tools side by side, each on the full GPU test set
  MOEBLAZE_SANITIZER_INIT_GEMM_OUTPUTS=1 compute-sanitizer --tool initcheck --error-exitcode 9 --print-limit 20 \
    build-gpu/tests/gpu/test_gpu_vs_cpu > /tmp/init-full.log 2>&1 &
  init_pid=$!
  compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 20 build-gpu/tests/gpu/test_gpu_vs_cpu \
    > /tmp/race-full.log 2>&1
  race_rc=$?
  wait $init_pid; init_rc=$?
  cat /tmp/race-full.log /tmp/init-full.log >> "$OUT/sanitizers.log"
  summary+=("compute-sanitizer racecheck (full GPU test set): rc=$race_rc; $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' /tmp/race-full.log | tail -1); $(grep -cE '^\[ +OK' /tmp/race-full.log) tests OK")
  summary+=("compute-sanitizer initcheck (full GPU test set): rc=$init_rc; $(grep -E 'ERROR SUMMARY' /tmp/init-full.log | tail -1); $(grep -cE '^\[ +OK' /tmp/init-full.log) tests OK")
fi
if want soak; then
  build-gpu/tests/soak/soak --device cuda --steps 10000 > /tmp/soak.log 2>&1
  summary+=("soak: rc=$?; $(tail -1 /tmp/soak.log)")
fi
if want fuzz; then
  seed=${FUZZ_SEED:-$(date +%s%N)}
  build-gpu/tests/gpu/fuzz_gpu "${FUZZ_SECONDS:-240}" "$seed" > "$OUT/fuzz.log" 2>&1
  rc=$?
  grep -A1 FINDING "$OUT/fuzz.log" | head -20
  summary+=("gpu fuzz: rc=$rc; $(tail -1 "$OUT/fuzz.log")")
  if [ "${FUZZ_MEMCHECK_SECONDS:-60}" != 0 ]; then
    compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 build-gpu/tests/gpu/fuzz_gpu \
      "${FUZZ_MEMCHECK_SECONDS:-60}" "$((seed + 1))" > "$OUT/fuzz-memcheck.log" 2>&1
    rc=$?
    summary+=("gpu fuzz under memcheck: rc=$rc; $(grep -E '^fuzz_gpu' "$OUT/fuzz-memcheck.log" | tail -1); $(grep -E 'ERROR SUMMARY' "$OUT/fuzz-memcheck.log" | tail -1)")
  fi
fi
if want fsdp; then
  gpus=$(nvidia-smi -L | wc -l)
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONPATH=$PWD/bindings/python PYTHONUNBUFFERED=1 \
    timeout 600 torchrun --standalone --nproc_per_node="$gpus" tests/gpu/fsdp2_train.py > "$OUT/fsdp.log" 2>&1
  rc=$?
  grep -E '^step|PASS|FAIL|Error' "$OUT/fsdp.log" | tail -34
  summary+=("fsdp2 on $gpus GPUs: rc=$rc; $(grep -E '^(PASS|FAIL)' "$OUT/fsdp.log" | tail -1)")
fi
if want plan; then
  build-gpu/perf/plan-bench > "$OUT/plan-bench.md" 2>&1
  summary+=("plan-bench: rc=$?")
  cat "$OUT/plan-bench.md"
  build-gpu/perf/router-bench > "$OUT/router-bench.md" 2>&1
  summary+=("router-bench: rc=$?; pair = split fp32 on $(grep -c '| yes |$' "$OUT/router-bench.md") cases, NO on $(grep -c '| NO |$' "$OUT/router-bench.md")")
  cat "$OUT/router-bench.md"
fi
if want torch; then
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONUNBUFFERED=1 \
    python3 perf/torch_baselines.py ${TORCH_ARGS:-} --json "$OUT/torch.json" > "$OUT/torch.md" 2>&1
  summary+=("torch baselines: rc=$?")
  tail -45 "$OUT/torch.md"
fi
if want pytorch; then  # the Python tests with torch on the GPU (CUDA autograd, fused engine + CUDA graphs)
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONPATH=$PWD/bindings/python$pylib PYTHONUNBUFFERED=1 \
    timeout 600 python3 -m unittest discover -s bindings/python/tests -v > "$OUT/pytorch-tests.log" 2>&1
  summary+=("python tests with torch: rc=$?; $(tail -1 "$OUT/pytorch-tests.log"); $(grep -cE 'skipped' "$OUT/pytorch-tests.log") skipped")
  grep -E 'Cuda|cuda|FAIL|ERROR' "$OUT/pytorch-tests.log" | head -20
fi
if want example; then  # the MoE language model, MoELayer vs pure PyTorch (loss curves, tokens/s, memory)
  pyextra=""
  if ! python3 -c "import matplotlib" 2>/dev/null && ls .whl/*.whl > /dev/null 2>&1; then
    for w in .whl/*.whl; do  # wheels are zip files: unpacked, they import (numpy only if missing)
      case "$w" in *numpy-*) python3 -c "import numpy" 2>/dev/null && continue ;; esac
      python3 -m zipfile -e "$w" /tmp/mpl-site
    done
    pyextra=/tmp/mpl-site
  fi
  for variant in "auto" "fused --compile"; do
    tag=$(echo "$variant" | tr -d ' -')
    MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONPATH=$PWD/bindings/python${pyextra:+:$pyextra} \
      PYTHONUNBUFFERED=1 timeout 400 python3 examples/moe_lm.py --engine $variant --png "$OUT/moe_lm_$tag.png" \
      > "$OUT/moe_lm_$tag.txt" 2>&1
    summary+=("example ($variant): rc=$?; $(grep -E 'largest|^tolerance' "$OUT/moe_lm_$tag.txt" | tr '\n' ' ')")
    grep -vE 'Warning|warn\(' "$OUT/moe_lm_$tag.txt" | tail -30
  done
fi
if want policies; then  # the save policies' memory/speed trade-off on two configs
  for pol in recompute all; do
    build-gpu/perf/moeblaze-bench --only conf3,conf4 --policy $pol --no-check > /tmp/pol-$pol.md 2>&1
    summary+=("bench --policy $pol: rc=$?")
    cat /tmp/pol-$pol.md >> "$OUT/policies.md"
  done
  cat "$OUT/policies.md"
fi
if want maxtokens; then  # the largest training step that fits, vs a plain torch._grouped_mm MoE
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONUNBUFFERED=1 \
    timeout ${MAXTOKENS_TIMEOUT:-420} python3 perf/max_tokens.py --json "$OUT/max-tokens.json" ${MAXTOKENS_ARGS:-} \
    > "$OUT/max-tokens.md" 2>&1
  summary+=("max tokens: rc=$?")
  cat "$OUT/max-tokens.md"
fi
if want engines; then
  for eng in fused cublaslt; do
    for cf in paper modern; do
      acts=swiglu; [ $cf = paper ] && acts=silu,swiglu
      timeout 400 build-gpu/perf/moeblaze-bench --configs $cf --activations $acts --engine $eng --no-check \
        ${ENGINES_ONLY:+--only $ENGINES_ONLY} \
        > "$OUT/engines-$cf-$eng.md" 2>&1
      summary+=("moeblaze-bench --configs $cf --engine $eng: rc=$?")
    done
  done
  for cf in paper modern; do  # fwd+bwd ms side by side, and the full table (perf/RESULTS.md's form)
    paste -d'|' <(grep -E '^\| (conf|sonic|qwen|olmoe|deepseek|mixtral)' "$OUT/engines-$cf-fused.md" | cut -d'|' -f2,3,11) \
      <(grep -E '^\| (conf|sonic|qwen|olmoe|deepseek|mixtral)' "$OUT/engines-$cf-cublaslt.md" | cut -d'|' -f11) |
      sed 's/^/fused | cublaslt fwd+bwd ms: /'
    sonic=""; [ $cf = modern ] && sonic="--configs perf/configs/modern-configs.json"
    python3 perf/engines_table.py "$OUT/engines-$cf-fused.md" "$OUT/engines-$cf-cublaslt.md" $sonic > "$OUT/engines-$cf-table.md" 2>&1
  done
fi
if want sidebyside; then  # perf/side_by_side.py; SonicMoE first when its bundle is carried in .peers/
  sonic_arg=()
  if [ -f .peers/run_sonic.sh ] && [ -d .peers/sonic/site ]; then
    SONIC_BUNDLE=$PWD/.peers/sonic/site OUT=$OUT TOTAL_S=${SONIC_TOTAL_S:-570} bash .peers/run_sonic.sh ${SIDE_CONFIGS:-} \
      > "$OUT/sonic.txt" 2>&1
    summary+=("sonic: rc=$?; $(grep -c '^sonic [0-9]' "$OUT/sonic.txt") lines, $(grep -c ' NA NA NA' "$OUT/sonic.txt") NA")
    grep -E '^sonic' "$OUT/sonic.txt"
    sonic_arg=(--sonic "$OUT/sonic.txt")
  fi
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONUNBUFFERED=1 timeout ${SIDE_TIMEOUT:-500} \
    python3 perf/side_by_side.py ${SIDE_CONFIGS:+--configs $SIDE_CONFIGS} "${sonic_arg[@]}" ${SIDE_ARGS:-} \
    --json "$OUT/side_by_side.json" > "$OUT/side_by_side.md" 2>&1
  summary+=("side by side: rc=$?")
  cat "$OUT/side_by_side.md"
fi
if want profile; then  # the kernels of one MoEBlaze fwd+bwd through moeblaze.torch
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONUNBUFFERED=1 timeout 300 \
    python3 perf/side_by_side.py --profile ${PROFILE_CONFIG:-40960,768,256,128,8} > "$OUT/profile.md" 2>&1
  summary+=("profile: rc=$?")
  head -40 "$OUT/profile.md"
fi
if want kernels; then  # perf/step_kernels.py; SonicMoE beside MoEBlaze when its bundle is carried in .peers/
  sk_env=() sk_arg=()
  if [ -f .peers/run_sonic.sh ] && [ -d .peers/sonic/site ]; then
    sw=/tmp/sonic-site  # unpacked and import-checked by run_sonic.sh's dry run
    SONIC_BUNDLE=$PWD/.peers/sonic/site SONIC_WORK=$sw SONIC_DRYRUN=1 OUT=$OUT bash .peers/run_sonic.sh 1,1,1,1,1 \
      > "$OUT/sonic-unpack.txt" 2>&1
    sk_env=(PYTHONPATH="$sw:$sw/nvidia_cutlass_dsl/python_packages" USE_QUACK_GEMM=0 TORCH_CUDA_ARCH_LIST=9.0)
    sk_arg=(--sonic)
  fi
  env "${sk_env[@]}" MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 PYTHONUNBUFFERED=1 timeout ${KERNELS_TIMEOUT:-500} \
    python3 perf/step_kernels.py "${sk_arg[@]}" ${KERNELS_CONFIGS:-32768,2048,768,128,8} > "$OUT/step_kernels.md" 2>&1
  summary+=("step kernels: rc=$?")
  grep -E '^###' "$OUT/step_kernels.md"
  sed -n '/^## Side by side/,$p' "$OUT/step_kernels.md"
fi
if want ncu; then  # Nsight Compute on the named kernels of one fwd+bwd through moeblaze.torch
  MOEBLAZE_LIBRARY=$PWD/build-gpu/src/libmoeblaze.so.0 timeout 400 ncu --kernel-name "regex:${NCU_KERNELS:-route_tokens|router_backward|loss_partials}" \
    --launch-count ${NCU_COUNT:-3} --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 perf/side_by_side.py --profile ${PROFILE_CONFIG:-40960,768,256,128,8} > "$OUT/ncu.txt" 2>&1
  summary+=("ncu: rc=$?")
  grep -E '^  [a-z_].*\(|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Memory Throughput|Compute \(SM\) Throughput|Warp Cycles Per Issued|Stall|One or More|Executed Ipc A' "$OUT/ncu.txt" | head -80
fi
if want bench; then
  build-gpu/perf/moeblaze-bench --json "$OUT/bench.jsonl" > "$OUT/bench.md" 2>&1
  summary+=("bench: rc=$?")
  cat "$OUT/bench.md"
fi
[ -f "$OUT/gemm-bench.txt" ] && cat "$OUT/gemm-bench.txt"
echo "==== summary"
printf '%s\n' "${summary[@]}"
