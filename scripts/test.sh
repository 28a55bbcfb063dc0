#!/usr/bin/env bash
# Installs hybridrec with its test dependencies and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python -m pytest -q "$@"
