#!/usr/bin/env bash
# The demo `make demo` runs: llmerge on the bundled fixtures (generated into BUILD/fixtures by
# the build). Shows a sharded base model, a LoRA adapter checked against that base, a single
# safetensors file, and how a broken file is reported.
set -euo pipefail
build=${1:-build}
llmerge="$build/llmerge"
fx="$build/fixtures"
[ -x "$llmerge" ] && [ -d "$fx" ] || { echo "demo: build first (make)" >&2; exit 1; }

run() {
  echo
  echo "\$ llmerge $*"
  "$llmerge" "$@"
}

run --version
run inspect "$fx/base"
run inspect "$fx/lora_rslora" --base "$fx/base"
run inspect "$fx/qwen/model.safetensors"
echo
echo "\$ llmerge inspect $fx/broken/bad.safetensors   # a truncated file: exit status 2"
set +e
"$llmerge" inspect "$fx/broken/bad.safetensors"
echo "(exit status $?)"
set -e
echo
echo "demo: the fixtures are in $fx; llmerge is $llmerge"
