#!/usr/bin/env bash
# Installs what building and testing MoEBlaze needs and is missing, from Debian's archive.
# Usage: scripts/install-deps.sh [bench|test]   (bench: the build tools only)
set -euo pipefail
what=${1:-test}

need=()
have() { command -v "$1" >/dev/null 2>&1; }
have cmake || need+=(cmake)
have ninja || need+=(ninja-build)
have g++ || need+=(g++)
have gcc || need+=(gcc)
have pkg-config || need+=(pkg-config)
have git || need+=(git)
if [ "$what" = test ]; then
  [ -f /usr/include/cmocka.h ] || need+=(libcmocka-dev)
  have abidiff || need+=(abigail-tools)
  have doxygen || need+=(doxygen)
  have python3 || need+=(python3)
  # `pip install .` into a virtual environment (configuration 5).
  python3 -c "import venv, ensurepip" >/dev/null 2>&1 || need+=(python3-venv python3-pip)
  # The fuzzer configuration: clang with libFuzzer and its sanitizer runtimes.
  have clang || need+=(clang)
  ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 || need+=(libclang-rt-dev)
  # Rust: Debian 12's cargo (1.63) is too old for the bindings (1.77); the Rust test runs where
  # a rustup toolchain is installed and is skipped, with a message, where none is.
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "install-deps: installing ${need[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# nvcc is optional: the CUDA part builds when the toolkit is found (default /usr/local/cuda).
if ! have nvcc && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "install-deps: using /usr/local/cuda/bin/nvcc"
fi
