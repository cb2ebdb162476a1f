#!/usr/bin/env bash
# Installs the C++ API from the build tree to a scratch prefix, builds
# examples/cpp as a separate CMake project against that installed package
# (not the build tree) and runs it: it trains a small GPT with a region per
# block and exits non-zero if a gradient differs from training without
# checkpointing. Expects the build tree scripts/setup.sh made (build/cmake).
#
#   bash scripts/test_cpp_example.sh [cpu|cuda]
#
# The prefix and the example's build tree are fixed paths under build/,
# wiped on every run, so ccache recognises the example's compile.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=build/cmake
PREFIX="$PWD/build/cpp-install"
EXAMPLE_BUILD="$PWD/build/cpp-example"
TORCH_PREFIX="$("${PYTHON:-python}" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
LAUNCHER=()
if command -v ccache >/dev/null; then
  LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi

cmake --build "$BUILD_DIR" --target torch_sac -j2
rm -rf "$PREFIX" "$EXAMPLE_BUILD"
cmake --install "$BUILD_DIR" --prefix "$PREFIX" >/dev/null
cmake -S examples/cpp -B "$EXAMPLE_BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PREFIX;$TORCH_PREFIX" "${LAUNCHER[@]}" >/dev/null
cmake --build "$EXAMPLE_BUILD" -j2
"$EXAMPLE_BUILD/train_gpt" "$@"   # optional device: cpu (default) or cuda
