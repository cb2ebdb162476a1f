#!/usr/bin/env bash
# Sets up, then trains a small model with torch_sac and prints what was saved,
# dropped and recomputed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m torch_sac.demo "$@"
