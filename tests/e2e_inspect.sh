#!/usr/bin/env bash
# End-to-end tests of `llmerge inspect` through the binary: the facts it reports about each
# fixture (text and --json), the exit status 2 and a message naming the defect for every
# broken input (the fixtures' broken directories and the reader's whole broken-file table),
# and usage errors.
# Usage: e2e_inspect.sh LLMERGE FIXTURES TEST_SAFETENSORS JSONQ
set -u
llmerge=$1 fx=$2 st_test=$3 jsonq=$4
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_inspect

# json PATH WANT: the value at PATH of the last --json output.
json() {
  local got
  got=$("$jsonq" "$work/json" "$1" 2>&1)
  if [ "$got" = "$2" ]; then ok; else bad "json $1 = '$got', wanted '$2'"; fi
}

inspect_json() {
  if "$llmerge" inspect --json "$@" >"$work/json" 2>"$work/err"; then ok; else bad "inspect --json $* failed: $(cat "$work/err")"; fi
}

# ---- models ----------------------------------------------------------------------------------
expect 0 "LlamaForCausalLM" inspect "$fx/base"
expect 0 "parameters: 106816" inspect "$fx/base"
expect 0 "shards: 2" inspect "$fx/base"
expect 0 "check: ok" inspect "$fx/base"
inspect_json "$fx/base"
json kind model
json config.hidden_size 64
json config.num_key_value_heads 2
json config.head_dim 16
json n_params 106816
json n_tensors 21
json shards.# 2
json dtypes.BF16 21
json check.status ok
# The shard byte counts add up to the tensor bytes, which add up to the parameter count × 2.
s0=$("$jsonq" "$work/json" shards.0.bytes) s1=$("$jsonq" "$work/json" shards.1.bytes)
[ $((s0 + s1)) -eq $((106816 * 2)) ] && ok || bad "shard bytes $s0 + $s1 != 2 x 106816"

inspect_json "$fx/qwen"
json config.architecture Qwen2ForCausalLM
json config.tie_word_embeddings true
json config.biases.q_proj true
json config.biases.o_proj false
json check.status ok
expect 0 "tied embeddings: yes" inspect "$fx/qwen"

# A full fine-tuned model compared with its base.
expect 0 "LlamaForCausalLM" inspect "$fx/ft_full" --base "$fx/base"

# ---- a single file ---------------------------------------------------------------------------
inspect_json "$fx/qwen/model.safetensors"
json kind safetensors
json metadata.format pt
json n_tensors 26
expect 0 "model.layers.0.self_attn.q_proj.bias" inspect "$fx/qwen/model.safetensors"

# ---- adapters --------------------------------------------------------------------------------
inspect_json "$fx/lora_plain" --base "$fx/base"
json kind adapter
json config.r 8
json modules.# 4
json modules.0.scale 2
expect 0 "every module fits" inspect "$fx/lora_plain" --base "$fx/base"

# rslora with patterns: scale alpha/sqrt(r); layer 1's v_proj has r 4 (rank_pattern) and every
# v_proj alpha 32 (alpha_pattern), so its scale is 32/sqrt(4) = 16.
inspect_json "$fx/lora_rslora" --base "$fx/base"
json config.use_rslora true
json modules.# 14
n=$("$jsonq" "$work/json" modules.#)
found=0
for ((i = 0; i < n; i++)); do
  m=$("$jsonq" "$work/json" modules.$i.module)
  if [ "$m" = model.layers.1.self_attn.v_proj ]; then
    found=1
    json modules.$i.r 4
    json modules.$i.alpha 32
    json modules.$i.scale 16
  elif [ "$m" = model.layers.0.self_attn.q_proj ]; then
    # 8 / sqrt(8), as Python computes it
    json modules.$i.scale 2.8284271247461898
  fi
done
[ $found = 1 ] && ok || bad "lora_rslora: no module model.layers.1.self_attn.v_proj"

expect 0 "magnitude" inspect "$fx/lora_dora" --base "$fx/base"
inspect_json "$fx/lora_mts" --base "$fx/base"
json config.modules_to_save.0 lm_head
json modules.0.kind embedding
expect 0 "lm_head.weight" inspect "$fx/lora_mts" --base "$fx/base"
expect 0 "every module fits" inspect "$fx/lora_bias" --base "$fx/qwen"
# The nested layout: a directory holding one adapter directory.
expect 0 "checkpoint-100" inspect "$fx/lora_nested" --base "$fx/base"

# ---- broken inputs: exit 2 and a message naming the problem -----------------------------------
expect 2 "MetadataIncompleteBuffer" inspect "$fx/broken/bad.safetensors"
expect 2 "adapter_model.bin" inspect "$fx/broken/adapter_bin"
expect 2 "IA3" inspect "$fx/broken/peft_ia3"
expect 2 "model-00002-of-00002.safetensors" inspect "$fx/broken/missing_shard"
expect 2 "[8, 48]" inspect "$fx/broken/lora_bad_shape" --base "$fx/base"
expect 2 "k_proj.bias" inspect "$fx/lora_bias" --base "$fx/base"
expect 2 "no such file or directory" inspect "$work/no-such-dir"
expect 2 "is not a model" inspect "$fx/lora_plain" --base "$fx/lora_dora"

# Every file of the reader's broken-file table, as a file on disk: exit 2 naming the defect.
"$st_test" --write-corpus "$work/corpus" >/dev/null || bad "test_safetensors --write-corpus failed"
for f in "$work"/corpus/*; do
  name=$(basename "$f")
  [ "$name" = seed_valid ] && continue
  cp "$f" "$work/$name.safetensors"
  "$llmerge" inspect "$work/$name.safetensors" >"$work/out" 2>&1
  rc=$?
  if [ $rc -eq 2 ] && grep -q "$name.safetensors: [A-Za-z0-9]*: " "$work/out"; then ok; else
    bad "broken file $name: exit $rc, $(head -c 300 "$work/out")"
  fi
done
cp "$work/corpus/seed_valid" "$work/seed.safetensors"
expect 0 "tensors: 2" inspect "$work/seed.safetensors"

# ---- usage -----------------------------------------------------------------------------------
expect 2 "Usage" inspect
expect 2 "--frobnicate" inspect --frobnicate "$fx/base"
expect 0 "--base DIR" inspect --help
expect 2 "did you mean 'inspect'" inspcet "$fx/base"
expect 0 "inspect" --help
expect 2 "Usage" 
expect 0 "llmerge 0" --version

e2e_end
