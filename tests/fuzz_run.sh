#!/usr/bin/env bash
# Runs a fuzzer (fuzz_safetensors, fuzz_json, fuzz_yaml) for a bounded time: the seed corpus is what the
# module's test program writes with --write-corpus (afresh each run), new inputs go to a working
# corpus in the build tree; DICT, when given, is a libFuzzer dictionary of the format's tokens.
# Usage: fuzz_run.sh FUZZER TEST_PROGRAM WORKDIR SECONDS [DICT]
set -euo pipefail
fuzzer=$1 writer=$2 work=$3 secs=$4 dict=${5:-}
mkdir -p "$work/corpus" "$work/seeds"
"$writer" --write-corpus "$work/seeds" >/dev/null
cd "$work"
"$fuzzer" -max_total_time="$secs" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  ${dict:+-dict="$dict"} -print_final_stats=1 corpus seeds 2>fuzz.log || { tail -n 60 fuzz.log; exit 1; }
grep -E "^stat::number_of_executed_units|^Done" fuzz.log || true
echo "$(basename "$fuzzer"): $secs s without a crash"
