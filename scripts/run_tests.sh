#!/usr/bin/env bash
# Sets up, then runs every test: GoogleTest (C++) and pytest under both
# interception adapters.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

ctest --test-dir build/cmake --output-on-failure
TORCH_SAC_ADAPTER=key python -m pytest tests/python -q
TORCH_SAC_ADAPTER=python python -m pytest tests/python -q
