#!/usr/bin/env bash
# Checks that every C++ source and header is formatted by .clang-format and
# that the Python sources pass ruff (lint and format, configured in
# pyproject.toml); exits non-zero, listing the differences, when one does not.
#
#   scripts/check_format.sh          check (CI)
#   scripts/check_format.sh --fix    format the files in place
#
# clang-format's output changes between releases, so only the version pinned
# in requirements-dev.txt is used. It is taken from, in order: $CLANG_FORMAT;
# the environment of $PYTHON (default: python3), where
# `pip install -r requirements-dev.txt` puts it; clang-format on PATH. When
# none of them is the pinned version, the script installs it from PyPI into
# build/clang-format-venv (nothing else is installed there; torch is never
# touched) and uses that.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

FIX=0
case "${1:-}" in
  --fix) FIX=1 ;;
  "") ;;
  *) echo "usage: $0 [--fix]" >&2; exit 2 ;;
esac

PIN="$(sed -n 's/^clang-format==\([0-9.]*\).*/\1/p' requirements-dev.txt)"
if [[ -z "$PIN" ]]; then
  echo "check_format: no clang-format==X.Y.Z pin in requirements-dev.txt" >&2
  exit 2
fi

version_of() { "$1" --version 2>/dev/null | sed -n 's/.*clang-format version \([0-9.]*\).*/\1/p'; }

PYTHON="${PYTHON:-python3}"
candidates=()
[[ -n "${CLANG_FORMAT:-}" ]] && candidates+=("$CLANG_FORMAT")
if command -v "$PYTHON" >/dev/null 2>&1; then
  scripts_dir="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)"
  [[ -n "$scripts_dir" ]] && candidates+=("$scripts_dir/clang-format")
fi
command -v clang-format >/dev/null 2>&1 && candidates+=("$(command -v clang-format)")
LOCAL_VENV="$ROOT/build/clang-format-venv"
candidates+=("$LOCAL_VENV/bin/clang-format")

CF=""
for c in "${candidates[@]}"; do
  if [[ -x "$c" && "$(version_of "$c")" == "$PIN" ]]; then
    CF="$c"
    break
  fi
done
if [[ -z "$CF" ]]; then
  echo "check_format: clang-format $PIN not found; installing it into $LOCAL_VENV" >&2
  "$PYTHON" -m venv "$LOCAL_VENV"
  "$LOCAL_VENV/bin/pip" install --quiet "clang-format==$PIN"
  CF="$LOCAL_VENV/bin/clang-format"
fi

# Every C++ file of the project, tracked or new (not ignored).
DIRS=(csrc policies include tests/cpp examples/cpp)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t FILES < <(git ls-files --cached --others --exclude-standard -- "${DIRS[@]}" \
    | grep -E '\.(h|hpp|cpp|cc|cu|cuh)$' | sort -u | while read -r f; do [[ -f "$f" ]] && echo "$f"; done)
else
  mapfile -t FILES < <(find "${DIRS[@]}" -type f \
    \( -name '*.h' -o -name '*.hpp' -o -name '*.cpp' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) | sort)
fi
if [[ ${#FILES[@]} -eq 0 ]]; then
  echo "check_format: no C++ files found" >&2
  exit 2
fi

# ruff, pinned the same way; found in $PYTHON's environment or installed
# into the same local venv.
RUFF_PIN="$(sed -n 's/^ruff==\([0-9.]*\).*/\1/p' requirements-dev.txt)"
RUFF="${scripts_dir:-}/ruff"
ruff_version() { "$1" --version 2>/dev/null | sed -n 's/^ruff \([0-9.]*\).*/\1/p'; }
if [[ ! -x "$RUFF" || "$(ruff_version "$RUFF")" != "$RUFF_PIN" ]]; then
  RUFF="$LOCAL_VENV/bin/ruff"
  if [[ ! -x "$RUFF" || "$(ruff_version "$RUFF")" != "$RUFF_PIN" ]]; then
    [[ -x "$LOCAL_VENV/bin/pip" ]] || "$PYTHON" -m venv "$LOCAL_VENV"
    "$LOCAL_VENV/bin/pip" install --quiet "ruff==$RUFF_PIN"
  fi
fi
PY_DIRS=(torch_sac tests bench scripts examples setup.py)

if [[ $FIX -eq 1 ]]; then
  "$CF" -i --style=file "${FILES[@]}"
  "$RUFF" check --fix "${PY_DIRS[@]}"
  "$RUFF" format "${PY_DIRS[@]}"
  echo "check_format: formatted ${#FILES[@]} C++ files (clang-format $PIN) and the Python sources (ruff $RUFF_PIN)"
  exit 0
fi

if "$CF" --dry-run --Werror --style=file "${FILES[@]}"; then
  echo "check_format: ${#FILES[@]} files formatted (clang-format $PIN)"
else
  echo "check_format: files above are not formatted; run scripts/check_format.sh --fix" >&2
  exit 1
fi
if "$RUFF" check "${PY_DIRS[@]}" && "$RUFF" format --check "${PY_DIRS[@]}"; then
  echo "check_format: Python sources pass ruff $RUFF_PIN (lint and format)"
else
  echo "check_format: ruff found the problems above; run scripts/check_format.sh --fix" >&2
  exit 1
fi
