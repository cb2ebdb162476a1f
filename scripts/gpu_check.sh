#!/usr/bin/env bash
# The one-command GPU check: on a machine with a CUDA GPU and torch (2.11+)
# already installed, and no network, it
#   1. builds torch_sac with the README's command (all cores, no GoogleTest),
#   2. runs the release checks that need this machine's Python and torch,
#   3. runs the CUDA tests (pytest -m cuda) under both interception adapters,
#   4. builds the C++ API's example and trains it on the GPU,
#   5. runs the GPU benchmark (bench/bench_gpu.py),
# and writes logs plus a short results table (results.md) to OUT_DIR,
# printing the table last. Each stage has a time limit, so the whole check
# ends in about 8 minutes on 16 cores even when a stage hangs.
#
# On a machine without a CUDA device it builds, runs nothing CUDA, says so
# and exits 0.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        (default: gpu_check_out/)
#
# Stage limits (seconds) can be lowered for a short rerun:
#   GPU_CHECK_TEST_LIMIT (default 120 per adapter), GPU_CHECK_BENCH_LIMIT
#   (default 210); GPU_CHECK_BENCH_ARGS passes options to bench_gpu.py;
#   GPU_CHECK_SKIP_BENCH=1 skips the benchmark; GPU_CHECK_TESTS selects tests
#   (a pytest -k expression).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${1:-gpu_check_out}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PY="${PYTHON:-python3}"
export PYTHON="$PY"  # scripts/test_cpp_example.sh finds torch through it
TEST_LIMIT="${GPU_CHECK_TEST_LIMIT:-120}"
BENCH_LIMIT="${GPU_CHECK_BENCH_LIMIT:-210}"
RESULTS="$OUT_DIR/results.md"
START=$(date +%s)
export PYTHONUNBUFFERED=1

elapsed() { echo $(( $(date +%s) - START )); }
row() { echo "| $1 | $2 | $3 |" >> "$RESULTS"; }

# pytest_stage NAME LOG LIMIT ARGS...: pytest with a time limit; its summary
# line (or the time-out) becomes a table row, its failures go to failures.txt.
pytest_stage() {
  local name="$1" log="$2" limit="$3" t0 rc summary
  shift 3
  t0=$(date +%s)
  timeout -k 10 "$limit" "$PY" -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1
  rc=$?
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error)|no tests ran" "$log" | tail -1 | tr -d '=')
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    summary="TIMED OUT after ${limit}s; $summary"
  fi
  [ $rc -eq 0 ] || status=1
  row "$name" "${summary:-rc=$rc}" $(( $(date +%s) - t0 ))
  grep -E "^(FAILED|ERROR)" "$log" | head -20 | sed 's/^/    /' >> "$OUT_DIR/failures.txt"
}

{
  echo "# torch_sac GPU check"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  "$PY" - <<'EOF'
import platform, torch
print(f"- python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"- card: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
else:
    print("- card: none (no CUDA device)")
EOF
  echo "- cores: $(nproc)"
  echo
  echo "| stage | result | seconds |"
  echo "|---|---|---|"
} > "$RESULTS"

# 1. Build: the README's command, the installed torch, no network.
t0=$(date +%s)
if TORCH_SAC_BUILD_TESTS=OFF "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . \
    > "$OUT_DIR/build.log" 2>&1; then
  row build ok $(( $(date +%s) - t0 ))
elif TORCH_SAC_BUILD_TESTS=OFF "$PY" setup.py build_ext --inplace >> "$OUT_DIR/build.log" 2>&1; then
  # pip's editable install needs setuptools >= 64 and wheel in this
  # environment; without them the same CMake build runs in place.
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  row build "ok (in place: pip's editable install failed, see build.log)" $(( $(date +%s) - t0 ))
else
  row build "FAILED (build.log)" $(( $(date +%s) - t0 ))
  tail -40 "$OUT_DIR/build.log"
  cat "$RESULTS"
  exit 1
fi
if ! "$PY" -c "import torch_sac; print('adapter', torch_sac.adapter(), '-', torch_sac.adapter_reason())" \
    > "$OUT_DIR/import.log" 2>&1; then
  row import "FAILED (import.log)" 0
  cat "$OUT_DIR/import.log"
  cat "$RESULTS"
  exit 1
fi
row import "$(head -1 "$OUT_DIR/import.log")" 0

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: built and imported torch_sac; nothing CUDA was run" | tee -a "$RESULTS"
  cat "$RESULTS"
  exit 0
fi

status=0
# 2. Release checks that need no GPU but this machine's Python and torch:
# the version checks and the cleanup after a forward that raises.
pytest_stage "release checks (CPU)" "$OUT_DIR/release_tests.log" 120 \
  tests/python/test_releases.py tests/python/test_error_cleanup.py

# 3. CUDA tests, once per adapter. pytest's summary line goes in the table.
for adapter in python key; do
  args=(tests/python/test_cuda.py -m cuda -rs --junitxml "$OUT_DIR/cuda_tests_$adapter.xml")
  if [ -n "${GPU_CHECK_TESTS:-}" ]; then args+=(-k "$GPU_CHECK_TESTS"); fi
  TORCH_SAC_ADAPTER=$adapter pytest_stage "cuda tests ($adapter adapter)" \
    "$OUT_DIR/cuda_tests_$adapter.log" "$TEST_LIMIT" "${args[@]}"
done

# 4. The C++ API's example (examples/cpp) built against the installed
# package and trained on the GPU: gradients bitwise equal to no checkpointing.
t0=$(date +%s)
timeout -k 10 240 bash scripts/test_cpp_example.sh cuda > "$OUT_DIR/cpp_example.log" 2>&1
rc=$?
if [ $rc -eq 0 ]; then
  row "C++ example on cuda" "$(tail -1 "$OUT_DIR/cpp_example.log")" $(( $(date +%s) - t0 ))
else
  status=1
  row "C++ example on cuda" "rc=$rc (cpp_example.log)" $(( $(date +%s) - t0 ))
fi

# 5. GPU benchmark.
if [ -z "${GPU_CHECK_SKIP_BENCH:-}" ]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 10 "$BENCH_LIMIT" "$PY" bench/bench_gpu.py --out "$OUT_DIR/bench_gpu.md" \
    ${GPU_CHECK_BENCH_ARGS:-} > "$OUT_DIR/bench_gpu.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    row "bench_gpu.py" "ok (bench_gpu.md)" $(( $(date +%s) - t0 ))
  else
    status=1
    row "bench_gpu.py" "rc=$rc (bench_gpu.log)" $(( $(date +%s) - t0 ))
  fi
fi

row total "" "$(elapsed)"
if [ -s "$OUT_DIR/failures.txt" ]; then
  { echo; echo "Failures:"; cat "$OUT_DIR/failures.txt"; } >> "$RESULTS"
fi
if [ -s "$OUT_DIR/bench_gpu.md" ]; then
  { echo; cat "$OUT_DIR/bench_gpu.md"; } >> "$RESULTS"
fi
cat "$RESULTS"
exit $status
