#!/usr/bin/env bash
# Packs the pure-Python packages that the GPU machine's image lacks and the GPU checks use
# (torchtitan 0.3 and what it imports: tyro, docstring_parser, typeguard, spmd_types) into .pylib/,
# from a Python environment that has them; carry .pylib to the GPU machine with .deps, and
# scripts/gpu-check.sh puts it on PYTHONPATH after the image's own packages.
# Usage: bash scripts/pack-pylib.sh [python] (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
rm -rf .pylib
mkdir -p .pylib
for pkg in torchtitan tyro docstring_parser typeguard spmd_types; do
  dir=$("$py" -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('$pkg').origin))")
  cp -r "$dir" .pylib/
done
find .pylib -name __pycache__ -prune -exec rm -rf {} +
du -sh .pylib
