#!/usr/bin/env bash
# Builds the documentation (docs/: the Markdown pages and the API reference
# generated from torch_sac's docstrings) into build/docs/, with every Sphinx
# warning an error.
#
#   bash scripts/build_docs.sh [SPHINX_ARGS...]     e.g. -E to rebuild everything
#
# Uses the current `python`. Installs requirements-docs.txt (pinned Sphinx
# and myst-parser) into it when the pinned versions are not there, with pip
# constrained to the installed torch so it is never replaced. autodoc
# imports torch_sac, so build it first in this Python (bash scripts/setup.sh,
# or pip install --no-build-isolation -e .).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"

if ! "$PY" - <<'PY'
import importlib.metadata as m, re, sys
pins = {}
for line in open("requirements-docs.txt"):
    line = line.split("#", 1)[0].strip()
    if line:
        name, version = re.split(r"==", line)
        pins[name.strip()] = version.strip()
for name, version in pins.items():
    try:
        if m.version(name) != version:
            sys.exit(1)
    except m.PackageNotFoundError:
        sys.exit(1)
PY
then
  constraint="$(mktemp)"
  trap 'rm -f "$constraint"' EXIT
  if "$PY" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" \
      > "$constraint" 2>/dev/null; then
    export PIP_CONSTRAINT="$constraint"
  fi
  "$PY" -m pip install -q -r requirements-docs.txt
fi

if ! "$PY" -c "import torch_sac" 2>/dev/null; then
  echo "build_docs.sh: 'import torch_sac' fails in $PY; build it first:" >&2
  echo "  bash scripts/setup.sh   (or: pip install --no-build-isolation -e .)" >&2
  "$PY" -c "import torch_sac" || true
  exit 1
fi

"$PY" -m sphinx -W --keep-going -b html "$@" docs build/docs
echo "build_docs.sh: ok, open build/docs/index.html"
