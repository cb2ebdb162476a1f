#!/usr/bin/env bash
# Installs everything torch_sac needs on a fresh Debian machine and builds it.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

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

python -m pip install -q -r requirements-dev.txt
# Without build isolation: the build must use the torch installed above.
python -m pip install -q --no-build-isolation -e .
