#!/usr/bin/env bash
# Sets up, then profiles training steps of a small GPT under several
# checkpointing policies and budgets (python -m torch_sac): the comparison
# table, the budget checks, and the memory-time trade-off plot; then the
# trade-off curve of plans over the model's blocks against the hand-written
# recipes (python -m torch_sac frontier, sac_frontier.png).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m torch_sac "$@"
echo
python -m torch_sac frontier --plot sac_frontier.png
