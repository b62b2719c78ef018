#!/usr/bin/env bash
# Runs every benchmark program built in BUILD (bench_*), then bench/bench_tokenize.sh, and prints
# their figures.
set -euo pipefail
build=${1:-build}
found=0
for b in "$build"/bench_*; do
  [ -x "$b" ] || continue
  found=1
  echo "== $(basename "$b") ($(nproc) cores)"
  "$b"
  echo
done
[ "$found" = 1 ] || { echo "bench.sh: no benchmark programs in $build" >&2; exit 1; }
echo "== bench_tokenize.sh"
bash "$(dirname "$0")/../bench/bench_tokenize.sh" "$build"
