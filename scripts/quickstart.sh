#!/usr/bin/env bash
# Installs hybridrec and trains DeepFM on generated Criteo-like data with the embedded store;
# prints the final test AUC next to the planted model's best achievable AUC.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
hybridrec train configs/quickstart.yaml --overwrite "$@"
