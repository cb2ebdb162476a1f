#!/usr/bin/env bash
# Installs everything torch_sac needs on a fresh Debian machine and builds it.
# Idempotent: a second run only rebuilds what changed.
#
# torch: the one already installed in this Python is used and never replaced
# (any release from 2.11 to 2.15, CPU or CUDA build). Only where none is
# installed does this install the primary release, torch 2.13.0 (the CPU
# build; see README "Supported torch releases").
set -euo pipefail
cd "$(dirname "$0")/.."

PRIMARY_TORCH=2.13.0

APT_PACKAGES=(cmake g++ make libgtest-dev ccache)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q "${missing[@]}"
fi

if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q "torch==$PRIMARY_TORCH"
fi
# Every later pip call is constrained to the installed torch, so nothing that
# the test tools pull in can replace it (this also stands in for the
# machine-wide pip constraint, which caps torch below the newest release).
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
# The installed distribution's version: a CUDA build's torch.__version__ has
# a local tag (2.15.0+cu130) that its package metadata (2.15.0) may lack.
python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > "$constraint"
export PIP_CONSTRAINT="$constraint"

# The build tools torch_sac declares ([build-system] requires): without build
# isolation pip does not install them itself.
python - <<'PY' | xargs python -m pip install -q
import re
text = open("pyproject.toml").read()
block = re.search(r"\[build-system\][^\[]*?requires\s*=\s*\[(.*?)\]", text, re.S).group(1)
print(" ".join(f"'{r}'" for r in re.findall(r'"([^"]+)"', block)))
PY
python -m pip install -q -r requirements-dev.txt
# Without build isolation: the build must use the torch installed above.
TORCH_SAC_BUILD_TESTS="${TORCH_SAC_BUILD_TESTS:-ON}" python -m pip install -q --no-build-isolation -e .
