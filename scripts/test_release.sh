#!/usr/bin/env bash
# Builds torch_sac against one torch release and runs the Python suite there,
# as a new user on that release would: a fresh venv holding only PyPI's torch
# (a CUDA build; it runs on a CPU-only machine), then the README's setup
# command, then pytest.
#
#   bash scripts/test_release.sh RELEASE [ADAPTER...] [-- PYTEST_ARGS...]
#
#   RELEASE   a torch release, e.g. 2.11.0 or 2.15.0
#   ADAPTER   auto (default), key and/or python: one pytest run each
#
# Each release gets its own venv and its own copy of the source tree under
# build/releases/RELEASE (the extension module is built into the tree, so
# two releases cannot share one). Re-running reuses both: only what changed
# is copied and rebuilt. Writes build/releases/RELEASE/summary.txt, one line
# per adapter: "RELEASE ADAPTER <pytest's summary line>".
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

RELEASE="${1:?usage: test_release.sh RELEASE [ADAPTER...] [-- PYTEST_ARGS...]}"
shift
ADAPTERS=()
while (($#)) && [ "$1" != "--" ]; do ADAPTERS+=("$1"); shift; done
(($#)) && shift
PYTEST_ARGS=("$@")
((${#ADAPTERS[@]})) || ADAPTERS=(auto)

DIR="$ROOT/build/releases/$RELEASE"
VENV="$DIR/venv"
SRC="$DIR/src"
mkdir -p "$DIR"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$RELEASE'))" 2>/dev/null; then
  # PIP_CONSTRAINT=/dev/null lifts a machine-wide cap on torch's release.
  PIP_CONSTRAINT=/dev/null "$VENV/bin/python" -m pip install -q "torch==$RELEASE"
fi

# The tracked and not-ignored files of this checkout, as they are now.
mkdir -p "$SRC"
git ls-files -z --cached --others --exclude-standard |
  tar --null -T - -cf - | tar -xf - -C "$SRC"

export PATH="$VENV/bin:$PATH"
(cd "$SRC" && TORCH_SAC_BUILD_TESTS=OFF bash scripts/setup.sh)

: > "$DIR/summary.txt"
status=0
for adapter in "${ADAPTERS[@]}"; do
  log="$DIR/pytest-$adapter.log"
  set +e
  (cd "$SRC" && TORCH_SAC_ADAPTER="$adapter" python -m pytest tests/python -q -p no:cacheprovider \
     "${PYTEST_ARGS[@]}" 2>&1 | tee "$log" | tail -n 25)
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" -eq 0 ] || status=1
  line=$(grep -E "[0-9]+ (passed|failed)" "$log" | tail -1 | tr -d '=' | sed 's/^ *//')
  echo "$RELEASE $adapter ${line:-rc=$rc}" | tee -a "$DIR/summary.txt"
done
exit $status
