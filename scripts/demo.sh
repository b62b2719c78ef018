#!/usr/bin/env bash
# The demo `make demo` runs: llmerge on the bundled fixtures (generated into BUILD/fixtures by
# the build). Shows a sharded base model, a LoRA adapter checked against that base, a single
# safetensors file, how a broken file is reported, and a TIES merge of the fixtures.
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

# A real merge: TIES of two LoRA adapters and a full fine-tune into the base, then a look at it.
# (--force: running the demo again replaces the previous result.)
out="$build/demo-merged"
run ties "$fx/base" "$fx/lora_plain" "$fx/lora_rslora" "$fx/ft_full" -o "$out" --dtype bf16 --force
echo
echo "\$ llmerge inspect $out   # without the tensor table"
"$llmerge" inspect "$out" | sed -n '/^tensors:/,$!p'
echo
echo "\$ ls $out"
ls "$out"
echo
echo "demo: the fixtures are in $fx; llmerge is $llmerge"
echo "demo: the merged model is in $out (llmerge.json says how it was made)"
