#!/usr/bin/env bash
# Sets up, then profiles training steps of a small GPT under several
# checkpointing policies and budgets (python -m torch_sac): the comparison
# table, the budget checks, and the memory-time trade-off plot.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m torch_sac "$@"
