#!/usr/bin/env bash
# Builds torch_sac against one torch release and runs the Python suite there,
# as a new user on that release would: a fresh venv holding only PyPI's torch
# (a CUDA build; it runs on a CPU-only machine), then the README's setup
# command, then pytest.
#
#   bash scripts/test_release.sh RELEASE[@PYTHON] [ADAPTER...] [-- PYTEST_ARGS...]
#
#   RELEASE   a torch release, e.g. 2.11.0 or 2.15.0
#   PYTHON    the venv's Python, e.g. 3.10 or 3.13 (default: the python on
#             PATH). Found as pythonX.Y on PATH or in pyenv's versions; it
#             must have a torch RELEASE wheel on PyPI.
#   ADAPTER   auto (default), key and/or python: one pytest run each
#
# Each release (and Python) gets its own venv and its own copy of the source
# tree under build/releases/RELEASE[-pyPYTHON] (the extension module is built
# into the tree, so two releases cannot share one). Re-running reuses both:
# only what changed is copied and rebuilt. Writes summary.txt there, one line
# per adapter: "RELEASE[@PYTHON] ADAPTER <pytest's summary line>".
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

SPEC="${1:?usage: test_release.sh RELEASE[@PYTHON] [ADAPTER...] [-- PYTEST_ARGS...]}"
shift
RELEASE="${SPEC%@*}"
PYTHON_VERSION=""
[ "$SPEC" = "$RELEASE" ] || PYTHON_VERSION="${SPEC#*@}"
ADAPTERS=()
while (($#)) && [ "$1" != "--" ]; do ADAPTERS+=("$1"); shift; done
(($#)) && shift
PYTEST_ARGS=("$@")
((${#ADAPTERS[@]})) || ADAPTERS=(auto)

# The interpreter the venv is made from: the first candidate that runs and
# is that version. A pyenv shim (pythonX.Y on PATH) exists for every
# installed version but fails unless that version is active, so each
# candidate is run, not just found.
find_python() {
  local version="$1" candidate pyenv_root
  pyenv_root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
  for candidate in "$(command -v "python$version" || true)" \
    "$pyenv_root"/versions/"$version".*/bin/python"$version"; do
    if [ -n "$candidate" ] && "$candidate" -c \
      "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$version')" \
      >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
  echo "test_release.sh: no working Python $version (neither python$version on PATH nor" \
    "in $pyenv_root/versions): install it, e.g. 'pyenv install $version'" >&2
  return 1
}
if [ -n "$PYTHON_VERSION" ]; then
  BASE_PYTHON="$(find_python "$PYTHON_VERSION")"
  DIR="$ROOT/build/releases/$RELEASE-py$PYTHON_VERSION"
else
  BASE_PYTHON="$(command -v python3)"
  DIR="$ROOT/build/releases/$RELEASE"
fi
VENV="$DIR/venv"
SRC="$DIR/src"
mkdir -p "$DIR"

# A venv that no longer runs (its base Python was removed) or was made from
# another Python is made again.
base_version="$("$BASE_PYTHON" -c 'import sys; print(sys.version_info[:2])')"
if ! venv_version="$("$VENV/bin/python" -c 'import sys; print(sys.version_info[:2])' 2>/dev/null)" ||
  [ "$venv_version" != "$base_version" ]; then
  "$BASE_PYTHON" -m venv --clear "$VENV"
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
  # No such line (a collection error, no test run) must not end the script
  # under pipefail: the summary then says rc=N, and the next adapter runs.
  line=$({ grep -E "[0-9]+ (passed|failed)" "$log" || true; } | tail -1 | tr -d '=' | sed 's/^ *//')
  echo "$SPEC $adapter ${line:-rc=$rc}" | tee -a "$DIR/summary.txt"
done
exit $status
