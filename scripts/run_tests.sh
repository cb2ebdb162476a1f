#!/usr/bin/env bash
# Sets up, then runs the checks (formatting, docs, import cycles) and every
# test: GoogleTest (C++), the C++ example against
# the installed package, and pytest under both interception adapters on the
# primary torch (the one setup.sh keeps or installs), in the active Python;
# then the whole Python suite at the two ends of the supported range, each
# from PyPI in its own venv, built with the README's command
# (scripts/test_release.sh), under the adapter that release picks by
# default: the oldest torch on the oldest Python (2.11.0 on 3.10) and the
# newest on the newest (2.15.0 on 3.13).
#
# TORCH_SAC_CI_RELEASES overrides that list, items RELEASE[@PYTHON] ("" skips
# it: the quick local loop). scripts/test_matrix.sh is the long profile:
# every supported release under both adapters.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

# Checks that need no test run: C++ formatting, the docs (Sphinx, warnings
# as errors), the package's import layering and its private names.
bash scripts/check_format.sh
bash scripts/build_docs.sh
python scripts/check_import_cycles.py
python scripts/check_private_names.py

ctest --test-dir build/cmake --output-on-failure -j2
# The C++ API as a user gets it: installed, then consumed by a separate project.
bash scripts/test_cpp_example.sh
# Everything under the key adapter; under the Python one only the tests that
# run ops through an adapter (pyproject.toml's marker adapter_independent:
# the rest would run the same code twice).
TORCH_SAC_ADAPTER=key python -m pytest tests/python -q
TORCH_SAC_ADAPTER=python python -m pytest tests/python -q -m "not adapter_independent"

for release in ${TORCH_SAC_CI_RELEASES-2.11.0@3.10 2.15.0@3.13}; do
  bash scripts/test_release.sh "$release" auto
done
