#!/usr/bin/env bash
# The local release matrix (long profile, not run by CI): the whole Python
# suite on every supported torch release under both adapters, each release
# in its own venv and source copy (scripts/test_release.sh), then a markdown
# table of the results (release x adapter x counts) with the date and commit,
# written to build/releases/matrix.md and printed. About 20 minutes per
# release on a 2-core machine with a cold compiler cache.
#
#   bash scripts/test_matrix.sh [RELEASE[@PYTHON]...]   (default: all supported,
#                                                in the python on PATH)
set -uo pipefail
cd "$(dirname "$0")/.."

RELEASES=("$@")
((${#RELEASES[@]})) || RELEASES=(2.11.0 2.12.1 2.13.0 2.14.1 2.15.0)
OUT=build/releases/matrix.md
mkdir -p build/releases

status=0
for release in "${RELEASES[@]}"; do
  bash scripts/test_release.sh "$release" key python || status=1
done

{
  echo "Release matrix: $(date -u +%Y-%m-%d), commit $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + local changes'), $(nproc) cores, $(python3 --version)"
  echo
  echo "| torch | adapter | result |"
  echo "|---|---|---|"
  for release in "${RELEASES[@]}"; do
    dir="build/releases/${release%@*}"
    [[ "$release" != *@* ]] || dir+="-py${release#*@}"
    summary="$dir/summary.txt"
    if [ -s "$summary" ]; then
      while read -r rel adapter rest; do echo "| $rel | $adapter | $rest |"; done < "$summary"
    else
      echo "| $release | - | did not build (see $dir) |"
    fi
  done
} > "$OUT"
cat "$OUT"
exit $status
