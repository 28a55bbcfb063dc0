#!/usr/bin/env bash
# Installs hybridrec and what it needs into the current Python environment.
# torch: a build already installed is kept (bring your own CUDA build); otherwise the CPU
# build 2.13.0 is installed, which on the project's machines comes from a local wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet -e ".${extras:+[$extras]}"
