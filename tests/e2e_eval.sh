#!/usr/bin/env bash
# End-to-end tests of `llmerge eval` through the binary, on the fixtures: the output line
# `perplexity P tokens N` with N counted here from the data file; .jsonl and .txt agree;
# --json carries the same numbers (perplexity = exp(nll_mean)); --samples and --seq-len change
# the count as they should; an adapter changes the perplexity, and the model merged from it
# (task-arithmetic, f32) evaluates to the same perplexity as the adapter applied at run time,
# also when its config leaves some of its modules out (a warning names their keys);
# on sim devices too small for the weights or for a batch the fallbacks are printed and the
# result is the CPU's; a device failure that is not out-of-memory is exit status 1 naming the
# batch, or the model, adapter and tensor while the weights are placed; bad usage and bad data
# are exit status 2 with a message naming the option, or the file and line; a --log-json that
# is or lies inside an input is refused (exit status 2) and the input kept.
# Usage: e2e_eval.sh LLMERGE FIXTURES JSONQ
set -u
llmerge=$1 fx=$2 jsonq=$3
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_eval

same() { if cmp -s "$work/$1.out" "$work/$2.out"; then ok; else bad "$1 and $2 differ: $(cat "$work/$1.out") / $(cat "$work/$2.out")"; fi; }
differ() { if ! cmp -s "$work/$1.out" "$work/$2.out"; then ok; else bad "$1 and $2 are the same: $(cat "$work/$1.out")"; fi; }
has() { if grep -qF -- "$2" "$work/$1"; then ok; else bad "$1 lacks '$2': $(head -c 600 "$work/$1")"; fi; }
lacks() { if ! grep -qF -- "$2" "$work/$1"; then ok; else bad "$1 has '$2'"; fi; }

# close A B REL: the numbers A and B agree to REL relative.
close() {
  if awk -v a="$1" -v b="$2" -v r="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= r * (b < 0 ? -b : b)) }'; then
    ok
  else
    bad "$1 and $2 differ by more than $3 (relative) ${4:-}"
  fi
}

# far A B REL: A and B differ by more than REL relative.
far() {
  if awk -v a="$1" -v b="$2" -v r="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d > r * (b < 0 ? -b : b)) }'; then
    ok
  else
    bad "$1 and $2 agree to $3 (relative) ${4:-}"
  fi
}

data=$fx/calib/calib.jsonl txt=$fx/calib/calib.txt
# predictions counted here: sum over sequences of (length - 1), with the options' cuts
preds() { awk -v n="${1:-0}" -v L="${2:-0}" 'n == 0 || NR <= n { l = NF; if (L > 0 && l > L) l = L; s += l - 1 } END { print s }' "$txt"; }
want_all=$(preds) want_3=$(preds 3) want_cut=$(preds 0 10)

# ---- the result -------------------------------------------------------------------------------
run base eval "$fx/base" --data "$data"
if grep -qE "^perplexity [0-9]+\.[0-9]{3} tokens $want_all\$" "$work/base.out" && [ "$(wc -l <"$work/base.out")" -eq 1 ]; then ok; else
  bad "base: stdout is '$(cat "$work/base.out")', wanted 'perplexity P tokens $want_all'"
fi
has base.err "llmerge eval: evaluating $fx/base on $data: 8 sequences"
lacks base.err fallback
run base_txt eval "$fx/base" --data "$txt" --threads 1
same base base_txt
run base_q eval "$fx/base" --data "$data" -q
same base base_q
if [ ! -s "$work/base_q.err" ]; then ok; else bad "-q still wrote to stderr: $(cat "$work/base_q.err")"; fi

run base_json eval "$fx/base" --data "$data" --json --device cpu  # auto would take a GPU where there is one
json "$work/base_json.out" tokens "$want_all"
json "$work/base_json.out" sequences 8
json "$work/base_json.out" adapter null
json "$work/base_json.out" device cpu
json "$work/base_json.out" fallbacks.weights_on_cpu false
ppl=$("$jsonq" "$work/base_json.out" perplexity) nll=$("$jsonq" "$work/base_json.out" nll_mean)
close "$ppl" "$(awk -v x="$nll" 'BEGIN { printf "%.17g", exp(x) }')" 1e-12 "(perplexity vs exp(nll_mean))"
close "$ppl" "$(awk '{ print $2 }' "$work/base.out")" 2e-6 "(--json vs text)"

run samples eval "$fx/base" --data "$data" --samples 3
has samples.out "tokens $want_3"
run cut eval "$fx/base" --data "$data" --seq-len 10 --json
json "$work/cut.out" tokens "$want_cut"
json "$work/cut.out" seq_len 10
has cut.err "cut to 10 tokens (--seq-len)"

# the other fixtures and adapters
run qwen eval "$fx/qwen" --data "$data"
run qwen_bias eval "$fx/qwen" --adapter "$fx/lora_bias" --data "$data"
differ qwen qwen_bias
run llama3 eval "$fx/llama3" --data "$txt"
has llama3.out "tokens $want_all"
run plain eval "$fx/base" --adapter "$fx/lora_plain" --data "$data"
differ base plain
run nested eval "$fx/base" --adapter "$fx/lora_nested" --data "$data"
same plain nested
run mts eval "$fx/base" --adapter "$fx/lora_mts" --data "$data"
differ base mts

# ---- the merged model evaluates as the adapter applied at run time ----------------------------
if "$llmerge" task-arithmetic "$fx/base" "$fx/lora_plain" -o "$work/merged" --dtype f32 -q >"$work/merge.log" 2>&1; then
  ok
  run merged eval "$work/merged" --data "$data" --json
  run plain_json eval "$fx/base" --adapter "$fx/lora_plain" --data "$data" --json
  close "$("$jsonq" "$work/merged.out" perplexity)" "$("$jsonq" "$work/plain_json.out" perplexity)" 1e-5 \
    "(merged model vs adapter at run time)"
  far "$("$jsonq" "$work/merged.out" perplexity)" "$ppl" 1e-4 "(the merged model vs the base)"
else
  bad "task-arithmetic merge failed: $(head -c 600 "$work/merge.log")"
fi

# ---- an adapter's modules that PEFT would not load are not applied ---------------------------
# lora_plain's factors (q_proj and v_proj) under target_modules ["q_proj"]: the v_proj keys are
# named in a warning and left out, at run time as in the merged model.
mkdir -p "$work/sel_q" && cp "$fx/lora_plain/adapter_model.safetensors" "$work/sel_q/"
echo '{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}' >"$work/sel_q/adapter_config.json"
run sel_q eval "$fx/base" --adapter "$work/sel_q" --data "$data" --json
has sel_q.err "warning: --adapter $work/sel_q: keys 'base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight', "
has sel_q.err "are not applied, as PEFT would not load them: module model.layers.1.self_attn.v_proj: target_modules"
if "$llmerge" task-arithmetic "$fx/base" "$work/sel_q" -o "$work/merged_q" --dtype f32 -q >"$work/merge.log" 2>&1; then
  ok
  run merged_q eval "$work/merged_q" --data "$data" --json
  close "$("$jsonq" "$work/merged_q.out" perplexity)" "$("$jsonq" "$work/sel_q.out" perplexity)" 1e-5 \
    "(merged q_proj-only model vs the adapter at run time)"
  far "$("$jsonq" "$work/sel_q.out" perplexity)" "$("$jsonq" "$work/plain_json.out" perplexity)" 1e-6 \
    "(q_proj only vs q_proj and v_proj)"
else
  bad "task-arithmetic merge of sel_q failed: $(head -c 600 "$work/merge.log")"
fi

# ---- fallbacks on the simulated device ------------------------------------------------------
run sim_big eval "$fx/base" --data "$data" --device sim:64MiB
same base sim_big
lacks sim_big.err fallback
# The weights go to a device as their stored bytes (BF16 here) and are converted there; a tensor
# whose stored bytes find no room beside its float32 weight is converted on the host instead
# (fallbacks.weights_converted_on_host counts them). The conversion is exact: every budget here
# that keeps the weights on the device (and runs the same batches, one sequence at a time) gives
# the same perplexity to the bit, whichever way its weights went, and the CPU's to float32
# rounding.
on_dev=0 on_host=0 stored=0 first=
for kb in 410 418 426 434 442 450 460; do
  run "sim_stored_$kb" eval "$fx/base" --data "$data" --device "sim:${kb}KiB" --json
  [ "$("$jsonq" "$work/sim_stored_$kb.out" fallbacks.weights_on_cpu)" = false ] || continue
  on_dev=$((on_dev + 1))
  if [ "$("$jsonq" "$work/sim_stored_$kb.out" fallbacks.weights_converted_on_host)" = 0 ]; then
    stored=$((stored + 1))
  else
    on_host=$((on_host + 1))
  fi
  p=$("$jsonq" "$work/sim_stored_$kb.out" perplexity)
  first=${first:-$p}
  if [ "$p" = "$first" ]; then ok; else bad "sim:${kb}KiB: perplexity $p, $first at the smallest budget that kept the weights there"; fi
  close "$p" "$ppl" 1e-6 "(sim:${kb}KiB vs cpu)"
done
if [ "$on_host" -ge 1 ] && [ "$stored" -ge 1 ]; then ok; else
  bad "of 7 budgets, $on_dev kept the weights on the device: $on_host with some converted on the host, $stored with none (wanted 1 or more of each)"
fi
json "$work/base_json.out" fallbacks.weights_converted_on_host 0
run sim_weights eval "$fx/base" --data "$data" --device sim:100KiB --log-json "$work/sim_weights.log"
same base sim_weights
has sim_weights.err "fallback: eval weights of $fx/base on cpu (sim:100KiB: out of memory"
has sim_weights.log '"event":"fallback",'
has sim_weights.log '"phase":"eval","unit":"weights of '"$fx/base"'","from":"sim:100KiB","to":"cpu","reason":"sim:100KiB: out of memory'
run gpu_mem eval "$fx/base" --data "$data" --device sim:1GiB --gpu-mem 100KiB --json
json "$work/gpu_mem.out" fallbacks.weights_on_cpu true
# 500 KiB holds the weights (about 420 KiB) and the activations of a few short sequences only
run sim_small eval "$fx/base" --data "$data" --device sim:500KiB --log-json "$work/sim_small.log"
same base sim_small
has sim_small.err "fallback: eval sequences 1-8 (155 tokens) halved on sim:500KiB (activations of a batch of 155 tokens"
has sim_small.err "on cpu (activations of a batch of"
has sim_small.log '"unit":"sequences 1-8 (155 tokens) halved","from":"sim:500KiB","to":"sim:500KiB"'
# one event per fallback line
n_lines=$(grep -c "fallback: " "$work/sim_small.err") n_events=$(grep -c '"event":"fallback"' "$work/sim_small.log")
if [ "$n_lines" -gt 1 ] && [ "$n_lines" = "$n_events" ]; then ok; else
  bad "sim_small: $n_lines fallback lines, $n_events fallback events in --log-json"
fi
run sim_small_json eval "$fx/base" --data "$data" --device sim:500KiB --json
close "$("$jsonq" "$work/sim_small_json.out" perplexity)" "$ppl" 1e-6 "(fallbacks vs cpu)"
# 450 KiB sends sequence 1 to the CPU; --sticky-fallback keeps every later one there instead of
# halving and retrying on the device: fewer fallback lines, the same result
run sim_retry eval "$fx/base" --data "$data" --device sim:450KiB
run sim_sticky eval "$fx/base" --data "$data" --device sim:450KiB --sticky-fallback
same sim_retry sim_sticky
same base sim_sticky
has sim_sticky.err "fallback: eval: every later sequence runs on cpu too (--sticky-fallback)"
lacks sim_retry.err "sticky"
n_retry=$(grep -c "fallback: eval sequence" "$work/sim_retry.err")
n_sticky=$(grep -c "fallback: eval sequence" "$work/sim_sticky.err")
if [ "$n_sticky" -lt "$n_retry" ] && [ "$n_sticky" -ge 1 ]; then ok; else
  bad "--sticky-fallback: $n_sticky fallback lines, without it $n_retry"
fi
# a device failure that is not out of memory stops the run
LLMERGE_SIM_FAIL=launch:46 expect 1 "eval sequences 1-8 on sim:64MiB: layer 0: sim: injected failure of operation 46" eval "$fx/base" --data "$data" --device sim:64MiB
# one while the weights are placed: the phase, the model (and adapter) and the tensor are named
LLMERGE_SIM_FAIL=alloc:1 expect 1 "error: placing the weights of $fx/base on sim:64MiB: tensor 'model.embed_tokens.weight': sim: injected failure of allocation 1" \
  eval "$fx/base" --data "$data" --device sim:64MiB
LLMERGE_SIM_FAIL=launch:1 expect 1 "error: placing the weights of $fx/base on sim:64MiB: tensor 'model.embed_tokens.weight': sim: injected failure of operation 1, upload" \
  eval "$fx/base" --data "$data" --device sim:64MiB
LLMERGE_SIM_FAIL=alloc:5 expect 1 "error: placing the weights of $fx/base with adapter $fx/lora_plain on sim:64MiB: tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight': sim: injected failure of allocation 5" \
  eval "$fx/base" --adapter "$fx/lora_plain" --data "$data" --device sim:64MiB

# ---- usage and bad input: exit status 2 ------------------------------------------------------
expect 0 "--seq-len L" eval --help
for opt in --adapter --data --seq-len --samples --device --gpu-mem --threads --json --quiet --help; do
  has out " $opt "
done
expect 0 "eval" --help
expect 2 "no data: give --data FILE" eval "$fx/base"
expect 2 "needs MODEL" eval --data "$data"
expect 2 "did you mean '--samples'?" eval "$fx/base" --data "$data" --sample 3
expect 2 "--seq-len '1'" eval "$fx/base" --data "$data" --seq-len 1
expect 2 "--threads 'x'" eval "$fx/base" --data "$data" --threads x
expect 2 "--device tpu: unknown device" eval "$fx/base" --data "$data" --device tpu
expect 2 "--json takes no value" eval "$fx/base" --data "$data" --json=1
expect 2 "one MODEL only" eval "$fx/base" "$fx/qwen" --data "$data"
expect 2 "is an adapter directory: give its base model as MODEL" eval "$fx/lora_plain" --data "$data"
expect 2 "--adapter $fx/lora_bias does not fit MODEL $fx/base" eval "$fx/base" --adapter "$fx/lora_bias" --data "$data"
expect 0 "perplexity" eval "$fx/base" --adapter "$fx/lora_dora" --data "$data"
expect 2 "missing_shard" eval "$fx/broken/missing_shard" --data "$data"
expect 2 "$work/none.jsonl" eval "$fx/base" --data "$work/none.jsonl"

printf '{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 256]}\n' >"$work/vocab.jsonl"
expect 2 "$work/vocab.jsonl:2: input_ids[1]: token id 256 is outside the vocabulary (vocab_size 256)" \
  eval "$fx/base" --data "$work/vocab.jsonl"
printf '{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2}\n' >"$work/json.jsonl"
expect 2 "$work/json.jsonl:2: invalid JSON" eval "$fx/base" --data "$work/json.jsonl"
printf '1 2 3\n\n4 5\n' >"$work/blank.txt"
expect 2 "$work/blank.txt:2: empty line" eval "$fx/base" --data "$work/blank.txt"
printf '1 2 3\n4 five\n' >"$work/word.txt"
expect 2 "$work/word.txt:2: column 3: 'five' is not a token id" eval "$fx/base" --data "$work/word.txt"
printf '{"input_ids": []}\n' >"$work/empty.jsonl"
expect 2 "$work/empty.jsonl:1: empty sequence" eval "$fx/base" --data "$work/empty.jsonl"
printf '5\n7\n' >"$work/single.txt"
expect 2 "no next-token predictions" eval "$fx/base" --data "$work/single.txt"
printf '1 2\n' >"$work/data.csv"
expect 2 "unknown data format" eval "$fx/base" --data "$work/data.csv"
# a FIFO or a device as --data: refused without blocking on it (the bound turns a hang into
# a failure; a correct run ends at once)
timed() { timeout 60 "$real_llmerge" "$@"; }
real_llmerge=$llmerge llmerge=timed
mkfifo "$work/fifo.jsonl"
expect 2 "$work/fifo.jsonl is a FIFO, not a regular file" eval "$fx/base" --data "$work/fifo.jsonl"
ln -s /dev/null "$work/null.txt"
expect 2 "$work/null.txt is a character device, not a regular file" eval "$fx/base" --data "$work/null.txt"
llmerge=$real_llmerge
# a rope scaling the forward pass does not compute: refused before any work, naming the key
cp -r "$fx/base" "$work/yarn"
sed -i 's/"rope_scaling": null/"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}/' \
  "$work/yarn/config.json"
expect 2 "$work/yarn/config.json: key 'rope_scaling.rope_type': rope scaling type 'yarn' is not supported" \
  eval "$work/yarn" --data "$data"
lacks out "evaluating"
# a bad line after --samples is not read
printf '1 2 3\nnot ids\n' >"$work/late.txt"
run late eval "$fx/base" --data "$work/late.txt" --samples 1
has late.out "tokens 2"

# text lines: tokenized with MODEL's tokenizer.json. A byte-level tokenizer of the fixture's 256
# ids (each byte's GPT-2 character its byte's id, no merges) makes a text's ids its bytes, so
# {"text": "..."} must evaluate as {"input_ids": [its bytes]} does; without a tokenizer.json, a
# text line is refused naming the line. The characters are written as JSON's \u escapes, so the
# file is plain ASCII.
cp -r "$fx/base" "$work/tk_base"
rm "$work/tk_base/tokenizer_config.json"  # its add_bos_token names <s>, which the bytes' tokenizer lacks
{
  printf '{"model": {"type": "BPE", "vocab": {'
  n=0 sep=
  for ((b = 0; b < 256; b++)); do
    if ((b >= 33 && b <= 126 || b >= 0xa1 && b <= 0xac || b >= 0xae)); then c=$b; else c=$((256 + n)) n=$((n + 1)); fi
    printf '%s"\\u%04x": %d' "$sep" $c $b
    sep=', '
  done
  printf '}, "merges": []}, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}}'
} >"$work/tk_base/tokenizer.json"
printf '{"text": "Hi, tokens!"}\n{"text": "two"}\n' >"$work/text.jsonl"
printf '{"input_ids": [72, 105, 44, 32, 116, 111, 107, 101, 110, 115, 33]}\n{"input_ids": [116, 119, 111]}\n' \
  >"$work/text_ids.jsonl"
run text eval "$work/tk_base" --data "$work/text.jsonl" --device cpu
run text_ids eval "$work/tk_base" --data "$work/text_ids.jsonl" --device cpu
check_same() { if [ -s "$work/text.out" ] && cmp -s "$work/text.out" "$work/text_ids.out"; then ok; else
  bad "text and its bytes' ids differ: $(cat "$work/text.out") vs $(cat "$work/text_ids.out")"; fi; }
check_same
has text.out "tokens 12"
# the same for hessian (MODEL's tokenizer) and sparsegpt (BASE's): text gives its bytes' results
# (the calibration file's path is in the Hessians' metadata: the same path, the text then the ids)
mkdir -p "$work/h" && cp "$work/text.jsonl" "$work/h/calib.jsonl"
run h_text hessian "$work/tk_base" --calib "$work/h/calib.jsonl" -o "$work/h_text.safetensors" --device cpu
cp "$work/text_ids.jsonl" "$work/h/calib.jsonl"
run h_ids hessian "$work/tk_base" --calib "$work/h/calib.jsonl" -o "$work/h_ids.safetensors" --device cpu
if [ -s "$work/h_text.safetensors" ] && cmp -s "$work/h_text.safetensors" "$work/h_ids.safetensors"; then ok; else
  bad "hessian: text and its bytes' ids give other Hessians"; fi
run sg_text sparsegpt "$work/tk_base" "$fx/ft_full" --calib "$work/text.jsonl" -o "$work/sg_text" --device cpu \
  --cache-dir "$work/sg_cache1" -q
run sg_ids sparsegpt "$work/tk_base" "$fx/ft_full" --calib "$work/text_ids.jsonl" -o "$work/sg_ids" --device cpu \
  --cache-dir "$work/sg_cache2" -q
if [ -s "$work/sg_text/model.safetensors" ] && cmp -s "$work/sg_text/model.safetensors" "$work/sg_ids/model.safetensors"
then ok; else bad "sparsegpt: text and its bytes' ids give other merges"; fi
# --data-format text: the file is one document, cut into windows of --seq-len tokens (stride =
# window, the last shorter): with the byte-level tokenizer, "abcdefghij" at --seq-len 4 is the
# three sequences of its bytes 97-100, 101-104, 105-106
printf 'abcdefghij' >"$work/doc.text"
printf '97 98 99 100\n101 102 103 104\n105 106\n' >"$work/doc_ids.txt"
run doc eval "$work/tk_base" --data "$work/doc.text" --data-format text --seq-len 4 --device cpu
run doc_ids eval "$work/tk_base" --data "$work/doc_ids.txt" --seq-len 4 --device cpu
if [ -s "$work/doc.out" ] && cmp -s "$work/doc.out" "$work/doc_ids.out"; then ok; else
  bad "a text document's windows: $(cat "$work/doc.out") vs its bytes' $(cat "$work/doc_ids.out")"; fi
has doc.out "tokens 7"
run sg_doc sparsegpt "$work/tk_base" "$fx/ft_full" --calib "$work/doc.text" --data-format text --seq-len 4 \
  -o "$work/sg_doc" --device cpu --cache-dir "$work/sg_cache5" -q
run sg_doc_ids sparsegpt "$work/tk_base" "$fx/ft_full" --calib "$work/doc_ids.txt" --seq-len 4 -o "$work/sg_doc_ids" \
  --device cpu --cache-dir "$work/sg_cache6" -q
if [ -s "$work/sg_doc/model.safetensors" ] && cmp -s "$work/sg_doc/model.safetensors" "$work/sg_doc_ids/model.safetensors"
then ok; else bad "sparsegpt --data-format text: not its bytes' merge"; fi
printf 'fine\nbad \xc3 byte\n' >"$work/bad.text"
expect 2 "$work/bad.text:2: not valid UTF-8" eval "$work/tk_base" --data "$work/bad.text" --data-format text
expect 2 "--data-format 'prose': ids" eval "$work/tk_base" --data "$work/doc.text" --data-format prose
expect 2 "text needs a tokenizer, and there is none here (MODEL $fx/base has no tokenizer.json" \
  eval "$fx/base" --data "$work/doc.text" --data-format text

# --tokenizer DIR: another directory's tokenizer.json, for a MODEL (or BASE) without one
mkdir -p "$work/tk_only" && cp "$work/tk_base/tokenizer.json" "$work/tk_only/"
run text_dir eval "$fx/base" --tokenizer "$work/tk_only" --data "$work/text.jsonl" --device cpu
if cmp -s "$work/text_dir.out" "$work/text_ids.out"; then ok; else bad "eval --tokenizer: $(cat "$work/text_dir.out")"; fi
run sg_dir sparsegpt "$fx/base" "$fx/ft_full" --calib "$work/text.jsonl" --tokenizer "$work/tk_only" \
  -o "$work/sg_dir" --device cpu --cache-dir "$work/sg_cache3" -q
run sg_dir_ids sparsegpt "$fx/base" "$fx/ft_full" --calib "$work/text_ids.jsonl" -o "$work/sg_dir_ids" --device cpu \
  --cache-dir "$work/sg_cache4" -q
if [ -s "$work/sg_dir/model.safetensors" ] && cmp -s "$work/sg_dir/model.safetensors" "$work/sg_dir_ids/model.safetensors"
then ok; else bad "sparsegpt --tokenizer: text and its bytes' ids give other merges"; fi
expect 2 "--tokenizer $fx/base has no tokenizer.json" eval "$work/tk_base" --tokenizer "$fx/base" --data "$work/text.jsonl"
expect 2 "$work/text.jsonl:1: \"text\" needs a tokenizer, and there is none here (MODEL $fx/base has no tokenizer.json" \
  eval "$fx/base" --data "$work/text.jsonl"
# chat data is refused with its line
printf '{"messages": [{"role": "user", "content": "hi"}]}\n' >"$work/chat.jsonl"
expect 2 "$work/chat.jsonl:1: chat data (\"messages\") is not read" eval "$work/tk_base" --data "$work/chat.jsonl"
# a tokenizer whose vocabulary goes past the model's (256 ids) is refused before any work; an
# added token past it only where a text holds it
mkdir -p "$work/tk_big" "$work/tk_added"
sed 's/"vocab": *{/"vocab": {"zz": 300, /' "$work/tk_base/tokenizer.json" >"$work/tk_big/tokenizer.json"
expect 2 "token 'zz' has id 300, past the model's vocab_size 256: the tokenizer does not fit the model" \
  eval "$fx/base" --tokenizer "$work/tk_big" --data "$work/text.jsonl"
sed 's/^{/{"added_tokens": [{"id": 300, "content": "<big>"}], /' "$work/tk_base/tokenizer.json" \
  >"$work/tk_added/tokenizer.json"
run added_ok eval "$fx/base" --tokenizer "$work/tk_added" --data "$work/text.jsonl"
printf '{"text": "fine"}\n{"text": "a <big> token"}\n' >"$work/big.jsonl"
expect 2 "$work/big.jsonl:2: token 3 of the text: token id 300 is outside the vocabulary (vocab_size 256)" \
  eval "$fx/base" --tokenizer "$work/tk_added" --data "$work/big.jsonl"
# so is a tokenizer_config.json whose add_bos_token names a token the tokenizer lacks
cp "$work/tk_base/tokenizer.json" "$fx/base/tokenizer_config.json" "$work/tk_big/"
expect 2 "tk_big/tokenizer_config.json: add_bos_token is true but bos_token is no token of" \
  eval "$fx/base" --tokenizer "$work/tk_big" --data "$work/text.jsonl"

# --log-json never over an input: the data file, a file of MODEL or of the adapter
cp "$data" "$work/g-data.jsonl" && cp -r "$fx/base" "$work/g-base" && cp -r "$fx/lora_plain" "$work/g-lora"
g_before=$(cat "$work/g-data.jsonl" "$work/g-base"/* "$work/g-lora"/* | md5sum)
expect 2 "--log-json $work/g-data.jsonl is --data $work/g-data.jsonl" \
  eval "$work/g-base" --data "$work/g-data.jsonl" --log-json "$work/g-data.jsonl"
expect 2 "--log-json $work/g-base/config.json is inside MODEL $work/g-base" \
  eval "$work/g-base" --data "$work/g-data.jsonl" --log-json "$work/g-base/config.json"
expect 2 "--log-json $work/g-lora/adapter_config.json is inside --adapter $work/g-lora" eval "$work/g-base" \
  --adapter "$work/g-lora" --data "$work/g-data.jsonl" --log-json "$work/g-lora/adapter_config.json"
if [ "$(cat "$work/g-data.jsonl" "$work/g-base"/* "$work/g-lora"/* | md5sum)" = "$g_before" ]; then ok; else bad "eval's --log-json changed an input"; fi

e2e_end
