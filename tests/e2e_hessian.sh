#!/usr/bin/env bash
# End-to-end tests of `llmerge hessian` through the binary, on the fixtures: the output loads with
# `llmerge inspect`, holds one F32 [in, in] tensor per distinct linear input named after its first
# consumer, and n_tokens (counted here from the calibration file) in __metadata__; .jsonl and .txt
# give the same file; an adapter changes the Hessians; the sim device, also too small for the
# weights, gives the CPU's values, and accumulators that do not fit are said as a fallback; --log-json records the run; a failed run
# (a device failure that is not out-of-memory) is exit status 1 and leaves nothing at the output
# path, and one while the weights are placed names the model, the adapter and the tensor; bad
# usage, a bad calibration file (naming file and line), an existing output without --force and
# an output or log inside an input (even with --force) are exit status 2 before any work.
# Usage: e2e_hessian.sh LLMERGE FIXTURES JSONQ
set -u
llmerge=$1 fx=$2 jsonq=$3
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_hessian

# tensors FILE: the tensor data of a safetensors file, past its header (for comparing values).
tensors() { local n; n=$(od -An -tu8 -N8 "$1" | tr -d ' '); tail -c +$((n + 9)) "$1"; }

data=$fx/calib/calib.jsonl txt=$fx/calib/calib.txt
ntok=$(grep -o '[0-9][0-9]*' "$txt" | wc -l | tr -d ' ')

# ---- the output ------------------------------------------------------------------------------
run base hessian "$fx/base" --calib "$data" -o "$work/h.safetensors" --device cpu
if "$llmerge" inspect "$work/h.safetensors" --json >"$work/h.json" 2>"$work/h.err"; then ok; else
  bad "inspect of the output failed: $(cat "$work/h.err")"
fi
json "$work/h.json" metadata.n_tokens "$ntok"
json "$work/h.json" metadata.n_sequences 8
json "$work/h.json" n_tensors 8
json "$work/h.json" dtypes.F32 8
# tensors sorted by name: per layer down_proj, gate_proj, o_proj, q_proj
i=0
for l in 0 1; do
  for t in "mlp.down_proj 128" "mlp.gate_proj 64" "self_attn.o_proj 64" "self_attn.q_proj 64"; do
    set -- $t
    json "$work/h.json" "tensors.$i.name" "model.layers.$l.$1"
    json "$work/h.json" "tensors.$i.shape" "[$2,$2]"
    i=$((i + 1))
  done
done
"$jsonq" "$work/h.json" metadata.adapter >/dev/null 2>&1 && bad "metadata has an adapter without --adapter" || ok
ls "$work" | grep -q 'tmp' && bad "a temporary file was left: $(ls "$work")" || ok

# .txt gives the same file, but for the calibration path in the metadata
run txt hessian "$fx/base" --calib "$txt" -o "$work/t.safetensors" --device cpu -q
if [ ! -s "$work/txt.err" ]; then ok; else bad "-q still wrote to stderr: $(cat "$work/txt.err")"; fi
if cmp -s <(tensors "$work/h.safetensors") <(tensors "$work/t.safetensors"); then ok; else bad ".jsonl and .txt differ"; fi

# --calib-samples and --seq-len change n_tokens as they should
run cap hessian "$fx/base" --calib "$data" -o "$work/c.safetensors" --device cpu --calib-samples 2 --seq-len 5
"$llmerge" inspect "$work/c.safetensors" --json >"$work/c.json"
json "$work/c.json" metadata.n_tokens 10
json "$work/c.json" metadata.seq_len 5

# an adapter changes the Hessians, and is named in the metadata
run ad hessian "$fx/base" --adapter "$fx/lora_plain" --calib "$data" -o "$work/a.safetensors" --device cpu
"$llmerge" inspect "$work/a.safetensors" --json >"$work/a.json"
json "$work/a.json" metadata.adapter "$fx/lora_plain"
if ! cmp -s <(tensors "$work/h.safetensors") <(tensors "$work/a.safetensors"); then ok; else bad "the adapter changes nothing"; fi

# Qwen2
run qwen hessian "$fx/qwen" --calib "$data" -o "$work/q.safetensors" --device cpu
"$llmerge" inspect "$work/q.safetensors" --json >"$work/q.json"
json "$work/q.json" n_tensors 8

# ---- devices and fallbacks: the CPU's values (the sim device runs the CPU's operations) ------
for dev in sim:1GiB sim:540KiB sim:64KiB; do
  run "sim" hessian "$fx/base" --calib "$data" -o "$work/s.safetensors" --device "$dev" --force \
    --log-json "$work/s.log"
  # with room, or with the weights on the CPU, the sums run in the CPU's order: the same bits
  # (halved batches sum in another order: test_hessian compares those to float32 rounding)
  if [ "$dev" != sim:540KiB ]; then
    if cmp -s <(tensors "$work/h.safetensors") <(tensors "$work/s.safetensors"); then ok; else
      bad "--device $dev differs from the cpu"
    fi
  fi
  if [ "$dev" = sim:64KiB ]; then
    grep -qF "fallback: hessian weights of $fx/base on cpu" "$work/sim.err" && ok || bad "$dev: no weights fallback: $(cat "$work/sim.err")"
  fi
  if [ "$dev" = sim:540KiB ]; then
    grep -qF "fallback: hessian accumulators of layers" "$work/sim.err" && ok || bad "$dev: no accumulator fallback: $(cat "$work/sim.err")"
    grep -qF '"fallback"' "$work/s.log" && ok || bad "$dev: no fallback event in --log-json: $(head -c 400 "$work/s.log")"
  fi
done

# a device failure that is not out of memory: exit 1, nothing left at the output path
LLMERGE_SIM_FAIL=launch:40 expect 1 "injected failure" hessian "$fx/base" --calib "$data" -o "$work/f.safetensors" --device sim:1GiB
if [ ! -e "$work/f.safetensors" ] && ! ls "$work" | grep -q 'f.safetensors.tmp'; then ok; else bad "a failed run left output: $(ls "$work")"; fi
# one while the weights are placed names the phase, the model and adapter, and the tensor
LLMERGE_SIM_FAIL=alloc:1 expect 1 "error: placing the weights of $fx/base with adapter $fx/lora_plain on sim:1GiB: tensor 'model.embed_tokens.weight': sim: injected failure of allocation 1" \
  hessian "$fx/base" --adapter "$fx/lora_plain" --calib "$data" -o "$work/f.safetensors" --device sim:1GiB
if [ ! -e "$work/f.safetensors" ] && ! ls "$work" | grep -q 'f.safetensors.tmp'; then ok; else bad "a failed run left output: $(ls "$work")"; fi

# ---- usage and bad input: exit status 2, before any work ------------------------------------
expect 0 "--calib-samples N" hessian --help
expect 2 "exists (give --force" hessian "$fx/base" --calib "$data" -o "$work/h.safetensors"
printf '1 2 3\n4 x 5\n' >"$work/bad.txt"
expect 2 "$work/bad.txt:2" hessian "$fx/base" --calib "$work/bad.txt" -o "$work/b.safetensors"
printf '{"input_ids": [1, 2]}\n{"input_ids": [1, 999]}\n' >"$work/oov.jsonl"
expect 2 "$work/oov.jsonl:2" hessian "$fx/base" --calib "$work/oov.jsonl" -o "$work/b.safetensors"
if [ ! -e "$work/b.safetensors" ]; then ok; else bad "bad input left an output"; fi
expect 2 "no calibration data" hessian "$fx/base" -o "$work/b.safetensors"
expect 2 "no output" hessian "$fx/base" --calib "$data"
expect 2 "is a directory" hessian "$fx/base" --calib "$data" -o "$work"
expect 2 "its directory does not exist" hessian "$fx/base" --calib "$data" -o "$work/no/h.safetensors"
expect 2 "did you mean '--calib-samples'" hessian "$fx/base" --calib "$data" -o "$work/b.safetensors" --calib-sample 3
expect 2 "is an adapter directory" hessian "$fx/lora_plain" --calib "$data" -o "$work/b.safetensors"
expect 2 "--seq-len" hessian "$fx/base" --calib "$data" -o "$work/b.safetensors" --seq-len 0
# a FIFO as --calib: refused without blocking on it (the bound turns a hang into a failure)
timed() { timeout 60 "$real_llmerge" "$@"; }
real_llmerge=$llmerge llmerge=timed
mkfifo "$work/fifo.txt"
expect 2 "$work/fifo.txt is a FIFO, not a regular file" hessian "$fx/base" --calib "$work/fifo.txt" -o "$work/b.safetensors"
llmerge=$real_llmerge
# a rope scaling the forward pass does not compute: refused before any work, naming the key
cp -r "$fx/base" "$work/yarn"
sed -i 's/"rope_scaling": null/"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}/' \
  "$work/yarn/config.json"
expect 2 "$work/yarn/config.json: key 'rope_scaling.rope_type': rope scaling type 'yarn' is not supported" \
  hessian "$work/yarn" --calib "$data" -o "$work/b.safetensors"
if ! grep -q "capturing" "$work/out"; then ok; else bad "hessian: the yarn config was refused after the work started"; fi
if [ ! -e "$work/b.safetensors" ]; then ok; else bad "bad input left an output"; fi

# ---- no output or log inside an input, even with --force: exit 2, the inputs as they were ----
gb=$work/g-base gc=$work/g-calib.jsonl gl=$work/g-lora
cp -r "$fx/base" "$gb" && cp "$data" "$gc" && cp -r "$fx/lora_plain" "$gl"
g_before=$(cat "$gb"/* "$gc" | md5sum)
expect 2 "-o $gb/model-00001-of-00002.safetensors is inside MODEL $gb" \
  hessian "$gb" --calib "$gc" -o "$gb/model-00001-of-00002.safetensors" --force
expect 2 "-o $gc is --calib $gc" hessian "$gb" --calib "$gc" -o "$gc" --force
expect 2 "-o $gl/h.safetensors is inside --adapter $gl" hessian "$gb" --adapter "$gl" --calib "$gc" -o "$gl/h.safetensors"
expect 2 "--log-json $gb/config.json is inside MODEL $gb" \
  hessian "$gb" --calib "$gc" -o "$work/g.safetensors" --log-json "$gb/config.json"
expect 2 "--log-json $gc is --calib $gc" hessian "$gb" --calib "$gc" -o "$work/g.safetensors" --log-json "$gc"
if [ "$(cat "$gb"/* "$gc" | md5sum)" = "$g_before" ] && [ ! -e "$work/g.safetensors" ] && [ ! -e "$gl/h.safetensors" ]; then
  ok
else
  bad "an output inside an input changed it: $(ls -l "$gb" "$gc")"
fi

e2e_end
