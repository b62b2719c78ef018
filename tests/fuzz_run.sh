#!/usr/bin/env bash
# Runs the safetensors fuzzer for a bounded time: the seed corpus is the broken-file table of
# test_safetensors (written afresh), new inputs go to a working corpus in the build tree.
# Usage: fuzz_run.sh FUZZER TEST_SAFETENSORS WORKDIR SECONDS
set -euo pipefail
fuzzer=$1 writer=$2 work=$3 secs=$4
mkdir -p "$work/corpus" "$work/seeds"
"$writer" --write-corpus "$work/seeds" >/dev/null
cd "$work"
"$fuzzer" -max_total_time="$secs" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 corpus seeds 2>fuzz.log || { tail -n 60 fuzz.log; exit 1; }
grep -E "^stat::number_of_executed_units|^Done" fuzz.log || true
echo "fuzz_safetensors: $secs s without a crash"
