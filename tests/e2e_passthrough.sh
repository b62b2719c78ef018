#!/usr/bin/env bash
# End-to-end tests of `llmerge passthrough` (layer stacking) on the fixtures: a stack of two
# models loads (`llmerge inspect`: check ok, 4 layers), its config.json says 4 layers and keeps
# the rest of the first model's, each output tensor holds the bytes of the tensor it comes from
# (st_hash: layers 0-1 the base's, layers 2-3 ft_full's layers 0-1, the embeddings the base's,
# the final norm and lm_head ft_full's) and llmerge.json's hashes are its data's; the base
# restacked from two slices of itself is the base, byte for byte, and evaluates to the same
# perplexity, and `llmerge eval` runs on a 4-layer stack; a scale changes exactly the slice's
# tensors; --dtype, --shard-size, the side files from the first slice's model, the card, the
# log; every bad input is exit status 2 naming it and leaves nothing; a run stopped by SIGINT or
# failing while it reads (an input truncated under it: SIGBUS) leaves nothing.
# Usage: e2e_passthrough.sh LLMERGE FIXTURES JSONQ ST_HASH
set -u
llmerge=$1 fx=$2 jsonq=$3 st_hash=$4
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_passthrough

check() { if eval "$1"; then ok; else bad "$2"; fi; }
B=$fx/base F=$fx/ft_full data=$fx/calib/heldout.jsonl

# no_output DIR: neither DIR nor a temporary directory or lock beside it is left.
no_output() {
  local left
  left=$(find "$(dirname "$1")" -maxdepth 1 -name "$(basename "$1")*" | head -3)
  if [ -z "$left" ]; then ok; else bad "left behind: $left"; fi
}

# hashes DIR: "NAME HASH" of every tensor of the model directory DIR, sorted.
hashes() { "$st_hash" "$1"/*.safetensors | sort; }

# hash_of FILE NAME: NAME's hash in the "NAME HASH" list FILE.
hash_of() { awk -v n="$2" '$1 == n { print $2 }' "$1"; }

# wait_for COND: true once COND holds, false after about 10 s.
wait_for() {
  local i
  for ((i = 0; i < 200; i++)); do
    eval "$1" && return 0
    sleep 0.05
  done
  return 1
}

# ---- a stack of two models ----------------------------------------------------------------------
x=$work/stack
run stack passthrough -o "$x" --slice "$B:0:2" --slice "$F:0:2"
check '"$llmerge" inspect "$x" >"$work/inspect" 2>&1 && grep -q "^check: ok" "$work/inspect" && grep -q "layers 4," "$work/inspect"' \
  "inspect $x: $(head -c 800 "$work/inspect")"
json "$x/config.json" num_hidden_layers 4
json "$x/config.json" hidden_size 64
json "$x/config.json" torch_dtype bfloat16
# config.json is the base's but for num_hidden_layers
diff <(grep -v num_hidden_layers "$B/config.json") <(grep -v num_hidden_layers "$x/config.json") >"$work/cfgdiff" &&
  ok || bad "config.json differs from the base's beyond num_hidden_layers: $(cat "$work/cfgdiff")"
hashes "$B" >"$work/base.h"
hashes "$F" >"$work/ft.h"
hashes "$x" >"$work/stack.h"
check '[ "$(wc -l <"$work/stack.h")" -eq $((2 + 4 * 9 + 1)) ]' "the stack holds $(wc -l <"$work/stack.h") tensors, not 39"
mism=0
for k in input_layernorm.weight post_attention_layernorm.weight self_attn.q_proj.weight self_attn.k_proj.weight \
  self_attn.v_proj.weight self_attn.o_proj.weight mlp.gate_proj.weight mlp.up_proj.weight mlp.down_proj.weight; do
  for l in 0 1; do
    [ "$(hash_of "$work/stack.h" "model.layers.$l.$k")" = "$(hash_of "$work/base.h" "model.layers.$l.$k")" ] ||
      { mism=$((mism + 1)); echo "  layer $l $k is not the base's layer $l" >&2; }
    [ "$(hash_of "$work/stack.h" "model.layers.$((l + 2)).$k")" = "$(hash_of "$work/ft.h" "model.layers.$l.$k")" ] ||
      { mism=$((mism + 1)); echo "  layer $((l + 2)) $k is not ft_full's layer $l" >&2; }
  done
done
check '[ $mism -eq 0 ]' "$mism layer tensors do not come from where they should"
check '[ -n "$(hash_of "$work/base.h" model.embed_tokens.weight)" ] &&
       [ "$(hash_of "$work/stack.h" model.embed_tokens.weight)" = "$(hash_of "$work/base.h" model.embed_tokens.weight)" ]' \
  "the embeddings are not the first slice's model's"
for t in model.norm.weight lm_head.weight; do
  check '[ "$(hash_of "$work/stack.h" $t)" = "$(hash_of "$work/ft.h" $t)" ] &&
         [ "$(hash_of "$work/stack.h" $t)" != "$(hash_of "$work/base.h" $t)" ]' "$t is not the last slice's model's"
done
# llmerge.json: its hash of each tensor is the data's, the slices, the inputs
n=$("$jsonq" "$x/llmerge.json" outputs.tensors.#)
mism=0
for ((i = 0; i < n; i++)); do
  name=$("$jsonq" "$x/llmerge.json" outputs.tensors.$i.name)
  [ "$("$jsonq" "$x/llmerge.json" outputs.tensors.$i.xxh64)" = "$(hash_of "$work/stack.h" "$name")" ] || mism=$((mism + 1))
done
check '[ "$n" -eq 39 ] && [ $mism -eq 0 ]' "llmerge.json lists $n tensors, $mism with a hash that is not their data's"
json "$x/llmerge.json" method passthrough
json "$x/llmerge.json" options.slices.1.layer_range '[0,2]'
json "$x/llmerge.json" options.slices.1.output_layers '[2,4]'
json "$x/llmerge.json" options.slices.1.scale null
json "$x/llmerge.json" options.num_hidden_layers 4
json "$x/llmerge.json" base.path "$(cd "$B" && pwd -P)"
json "$x/llmerge.json" inputs.0.path "$(cd "$F" && pwd -P)"
json "$x/llmerge.json" stats.tensors_copied 39
check '[ -f "$x/tokenizer_config.json" ] && [ -f "$x/generation_config.json" ]' "the base's side files were not copied"
check 'grep -qF -- "--slice $B:0:2 --slice $F:0:2 --dtype bf16" "$x/README.md" && grep -q "^2\. layers 0 to 1 of .* as layers 2 to 3$" "$x/README.md"' \
  "the card does not list the slices and the command: $(cat "$x/README.md")"
# the stack runs
if "$llmerge" eval "$x" --data "$data" -q >"$work/eval.out" 2>&1 && grep -qE '^perplexity [0-9.]+ tokens [0-9]+$' "$work/eval.out"; then
  ok
else
  bad "eval on the stack: $(head -c 600 "$work/eval.out")"
fi

# ---- the base restacked is the base -------------------------------------------------------------
y=$work/same
run same passthrough -o "$y" --slice "$B:0:1" --slice "$B:1:2" -q
hashes "$y" >"$work/same.h"
check 'cmp -s "$work/same.h" "$work/base.h"' "two slices of the base are not the base: $(diff "$work/base.h" "$work/same.h" | head -5)"
json "$y/llmerge.json" inputs '[]'
"$llmerge" eval "$B" --data "$data" -q >"$work/eval.base" 2>&1
"$llmerge" eval "$y" --data "$data" -q >"$work/eval.same" 2>&1
check 'grep -q "^perplexity" "$work/eval.base" && cmp -s "$work/eval.base" "$work/eval.same"' \
  "the restacked base evaluates otherwise: $(cat "$work/eval.base" "$work/eval.same")"

# ---- scale, dtype, shards, the first slice's side files -------------------------------------------
z=$work/scaled
run scaled passthrough -o "$z" --slice "$B:0:2" --slice "$F:1:2:0.5" -q
hashes "$z" >"$work/scaled.h"
check '[ "$(hash_of "$work/scaled.h" model.layers.1.mlp.up_proj.weight)" = "$(hash_of "$work/base.h" model.layers.1.mlp.up_proj.weight)" ] &&
       [ "$(hash_of "$work/scaled.h" model.embed_tokens.weight)" = "$(hash_of "$work/base.h" model.embed_tokens.weight)" ]' \
  "the unscaled slice changed"
check '[ -n "$(hash_of "$work/scaled.h" model.layers.2.mlp.up_proj.weight)" ] &&
       [ "$(hash_of "$work/scaled.h" model.layers.2.mlp.up_proj.weight)" != "$(hash_of "$work/ft.h" model.layers.1.mlp.up_proj.weight)" ] &&
       [ "$(hash_of "$work/scaled.h" lm_head.weight)" != "$(hash_of "$work/ft.h" lm_head.weight)" ]' \
  "the scaled slice (its layer, lm_head) is unchanged"
json "$z/llmerge.json" options.slices.1.scale 0.5
json "$z/llmerge.json" stats.tensors_merged $((9 + 2))
json "$z/config.json" num_hidden_layers 3
w=$work/f32
run f32 passthrough -o "$w" --slice "$fx/ft_full2:0:2" --slice "$B:0:1" --dtype f32 --shard-size 110KB -q
json "$w/config.json" torch_dtype float32
check '[ -f "$w/model.safetensors.index.json" ] && [ "$(ls "$w"/model-*.safetensors | wc -l)" -gt 1 ]' "--shard-size 110KB wrote one shard"
check '"$llmerge" inspect "$w" 2>&1 | grep -q "^check: ok"' "the f32 stack does not load"
# ft_full2 has no tokenizer files: none are copied from the later slice's base
check '[ ! -e "$w/tokenizer_config.json" ]' "side files came from another slice's model than the first"
# a MODEL whose path ends in ':' and a number, with SCALE written out
ln -s "$B" "$work/b:3"
run colon passthrough -o "$work/colon" --slice "$work/b:3:0:2:1" -q
json "$work/colon/llmerge.json" options.slices.0.layer_range '[0,2]'
# without SCALE the number is read as FROM: the model is $work/b
expect 2 "slice 1: $work/b: no such file or directory" passthrough -o "$work/colon2" --slice "$work/b:3:0:2"
# the log
run log passthrough -o "$work/log" --slice "$B:0:1" -q --log-json "$work/log.jsonl"
check 'grep -q "\"event\":\"start\"" "$work/log.jsonl" && grep -q "\"event\":\"end\"" "$work/log.jsonl" &&
       [ "$(grep -c "\"event\":\"tensor\"" "$work/log.jsonl")" -eq $((2 + 9 + 1)) ]' "the log: $(head -c 600 "$work/log.jsonl")"
# --force replaces; without it OUT is refused
expect 2 "already exists (use --force to replace it)" passthrough -o "$work/log" --slice "$B:0:2"
run force passthrough -o "$work/log" --slice "$B:0:2" --force -q
json "$work/log/config.json" num_hidden_layers 2

# ---- bad inputs: exit status 2, nothing written ---------------------------------------------------
x=$work/bad
expect 2 "slice 1: layer range [0, 3) of $B: is outside the model's layers (the model has layers 0 to 1" \
  passthrough -o "$x" --slice "$B:0:3"
expect 2 "slice 2: layer range [1, 1) of $F: holds no layer" passthrough -o "$x" --slice "$B:0:2" --slice "$F:1:1"
expect 2 "--slice '$B:a:2': use MODEL:FROM:TO or MODEL:FROM:TO:SCALE" passthrough -o "$x" --slice "$B:a:2"
expect 2 "--slice '$B:0:2:x': use MODEL:FROM:TO" passthrough -o "$x" --slice "$B:0:2:x"
expect 2 "--slice '$B': use MODEL:FROM:TO" passthrough -o "$x" --slice "$B"
expect 2 "slice 2: " passthrough -o "$x" --slice "$B:0:2" --slice "$work/nothing:0:1"
expect 2 "slice 1: $fx/lora_plain is not a model directory (it is an adapter" passthrough -o "$x" --slice "$fx/lora_plain:0:1"
expect 2 "slice 2: $fx/qwen is not of the first slice's architecture: its config.json has architectures[0] Qwen2ForCausalLM" \
  passthrough -o "$x" --slice "$B:0:2" --slice "$fx/qwen:0:1"
expect 2 "slice 2: $fx/llama3: tensor 'model.layers.0." passthrough -o "$x" --slice "$B:0:2" --slice "$fx/llama3:0:1"
check 'grep -qE "is \[[0-9, ]+\], but .model\.layers\.0\..* of $B is \[[0-9, ]+\]" "$work/out"' "the shape error names no shapes: $(cat "$work/out")"
expect 2 "no slices: give --slice MODEL:FROM:TO" passthrough -o "$x"
expect 2 "no output directory: give -o OUT" passthrough --slice "$B:0:1"
expect 2 "passthrough takes its models in --slice MODEL:FROM:TO options, not as operands" passthrough "$B" -o "$x"
expect 2 "refusing to write there" passthrough -o "$B/sub" --slice "$B:0:1"
expect 2 "--dtype 'f8': not an output dtype" passthrough -o "$x" --slice "$B:0:1" --dtype f8
no_output "$x"
check '[ ! -e "$B/sub" ]' "an output was written inside an input"
expect 0 "Usage: llmerge passthrough -o OUT --slice MODEL:FROM:TO[:SCALE]" passthrough --help
expect 0 "passthrough" --help

# ---- a run that stops or fails leaves nothing -------------------------------------------------------
# (a background job of a script starts with SIGINT ignored, and a process keeps an ignored SIGINT
# ignored: job control gives the job its own process group and SIGINT back)
set -m
x=$work/int/out
mkdir "$work/int"
LLMERGE_TEST_DELAY_MS=150 "$llmerge" passthrough -o "$x" --slice "$B:0:2" --slice "$F:0:2" --log-json "$work/int.jsonl" \
  >"$work/out" 2>&1 &
pid=$!
wait_for 'grep -q "\"event\":\"tensor\"" "$work/int.jsonl" 2>/dev/null' || bad "the stack never started: $(head -c 600 "$work/out")"
kill -INT "$pid"
wait "$pid"
rc=$?
check '[ $rc -eq 130 ] && grep -qF "error: interrupted by SIGINT: removed the partial output $x.tmp-" "$work/out"' \
  "SIGINT: exit $rc: $(head -c 600 "$work/out")"
no_output "$x"
set +m
# ft_full's only shard, mapped, cut down to its header under the run: exit status 1, nothing left
x=$work/bus/out ft=$work/ft-copy
mkdir "$work/bus"
cp -r "$F" "$ft"
LLMERGE_TEST_DELAY_MS=150 "$llmerge" passthrough -o "$x" --slice "$B:0:2" --slice "$ft:0:2" --log-json "$work/bus.jsonl" \
  >"$work/out" 2>&1 &
pid=$!
wait_for 'grep -q "\"event\":\"tensor\"" "$work/bus.jsonl" 2>/dev/null' || bad "the stack never started: $(head -c 600 "$work/out")"
truncate -s $(($(od -An -tu8 -N8 "$ft/model.safetensors" | tr -d ' ') + 8)) "$ft/model.safetensors"
wait "$pid"
rc=$?
check '[ $rc -eq 1 ] && grep -qF "error: $ft/model.safetensors changed while llmerge was reading it" "$work/out"' \
  "SIGBUS: exit $rc (want 1, naming the shard): $(head -c 600 "$work/out")"
no_output "$x"

e2e_end
