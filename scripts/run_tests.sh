#!/usr/bin/env bash
# Sets up, then runs every test: GoogleTest (C++), the C++ example against
# the installed package, and pytest under both interception adapters.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

ctest --test-dir build/cmake --output-on-failure -j2
# The C++ API as a user gets it: installed, then consumed by a separate project.
bash scripts/test_cpp_example.sh
TORCH_SAC_ADAPTER=key python -m pytest tests/python -q
TORCH_SAC_ADAPTER=python python -m pytest tests/python -q
