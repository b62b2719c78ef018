#!/usr/bin/env bash
# End-to-end tests of merges written as LoRA adapters (--to-lora, llmerge extract) through the
# binary, on the fixtures: the round trip (the adapter merged back onto the base gives the merge
# it came from) where the merge's change has rank at most RANK (two adapters of rank 8 at rank 16;
# an adapter with bias deltas onto a base with biases), and where it does not (a full fine-tune at
# rank 8: BASE plus the factors' product, computed apart by st_lora), float32 factors against the
# merge to one unit in the last place or a millionth of the tensor's largest value (the change is
# the merge's float32 output less the base); norms that change written whole (modules_to_save) and
# merged back exactly; extract the same adapter as task-arithmetic --to-lora; llmerge.json's
# per-tensor ranks and errors; --to-lora exact (the inputs' factors concatenated) of task
# arithmetic and linear, and its refusals; the energy rule's ranks in rank_pattern; the same
# adapter on sim and cuda-emu with budgets under which factorisations fall back; llmerge run with
# --to-lora; every refusal exit status 2 before any work, nothing left behind. PEFT's rules on a
# Qwen2 full fine-tune: bias deltas beside an embedding (written whole), the tied embedding
# declared.
# Usage: e2e_lora.sh LLMERGE FIXTURES JSONQ ST_DIFF ST_LORA
set -u
llmerge=$1 fx=$2 jsonq=$3 st_diff=$4 st_lora=$5
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_lora

check() { if eval "$1"; then ok; else bad "$2"; fi; }
B=$fx/base F1=$fx/ft_full LP=$fx/lora_plain LN=$fx/lora_nested Q=$fx/qwen LB=$fx/lora_bias

# the change of two rank-8 adapters has rank 16 at most: at --to-lora 16 in float32 the adapter
# merged back is the merge, to float32 rounding of its values
run ad16 task-arithmetic "$B" "$LP" "$LN" -o "$work/ad16" --to-lora 16 --dtype f32
run ad16m task-arithmetic "$B" "$work/ad16" -o "$work/ad16m"
run ab task-arithmetic "$B" "$LP" "$LN" -o "$work/ab"
check '"$st_diff" --ulps 1 --rel 1e-6 "$work/ab/model.safetensors" "$work/ad16m/model.safetensors" >"$work/diff" 2>&1' \
  "the rank-16 adapter merged back is not the merge (see st_diff)"
json "$work/ad16/adapter_config.json" r 16
json "$work/ad16/adapter_config.json" lora_alpha 16
json "$work/ad16/adapter_config.json" peft_type LORA
json "$work/ad16/adapter_config.json" "target_modules" '["q_proj","v_proj"]'
json "$work/ad16/llmerge.json" outputs.adapter.factored 4
check 'awk "BEGIN { exit !($("$jsonq" "$work/ad16/llmerge.json" outputs.adapter.error_max) < 1e-6) }"' \
  "a rank-16 change at rank 16: error $("$jsonq" "$work/ad16/llmerge.json" outputs.adapter.error_max)"
# where the factorisation's time went (outputs.adapter.timings): Δ made, factored, and of that
# the host's work, the device's and the error's pass
tim() { "$jsonq" "$work/ad16/llmerge.json" outputs.adapter.timings.$1 2>&1; }
check 'awk -v d="$(tim delta_s)" -v f="$(tim factor_s)" -v h="$(tim host_s)" -v r="$(tim residual_s)" \
  -v v="$(tim device_s)" "BEGIN { exit !(d + 0 >= 0 && f + 0 > 0 && h + 0 > 0 && r + 0 > 0 && v + 0 > 0 &&
  h + r + v <= f) }"' \
  "timings: $("$jsonq" "$work/ad16/llmerge.json" outputs.adapter.timings 2>&1)"
# the same in BF16, the base's dtype (the default): the factors' rounding is the error
run ad16b task-arithmetic "$B" "$LP" "$LN" -o "$work/ad16b" --to-lora 16
json "$work/ad16b/llmerge.json" outputs.adapter.dtype BF16
check 'awk "BEGIN { e = $("$jsonq" "$work/ad16b/llmerge.json" outputs.adapter.error_max); exit !(e > 1e-4 && e < 2e-2) }"' \
  "BF16 factors: error $("$jsonq" "$work/ad16b/llmerge.json" outputs.adapter.error_max)"

# bias deltas (lora_bias) onto a base with biases: lora_B.bias, and the round trip
run adq task-arithmetic "$Q" "$LB" -o "$work/adq" --to-lora 8 --dtype f32
run adqm task-arithmetic "$Q" "$work/adq" -o "$work/adqm"
run qb task-arithmetic "$Q" "$LB" -o "$work/qb"
json "$work/adq/adapter_config.json" lora_bias true
check '"$st_diff" --ulps 1 --rel 1e-6 "$work/qb/model.safetensors" "$work/adqm/model.safetensors" >"$work/diff" 2>&1' \
  "the adapter with bias deltas merged back is not the merge (see st_diff)"

# a Qwen2 full fine-tune (its biases and tied embedding change too): the biases as lora_B.bias
# (lora_bias), so the embedding is written whole (PEFT takes no embedding LoRA beside lora_bias),
# the tie declared (ensure_weight_tying), both said; o_proj has no bias in BASE, which is said;
# llmerge reads it back
run qex extract "$Q" "$fx/qwen_ft" -o "$work/qex" --rank 8 --dtype f32
json "$work/qex/adapter_config.json" lora_bias true
json "$work/qex/adapter_config.json" ensure_weight_tying true
json "$work/qex/adapter_config.json" target_modules \
  '["down_proj","gate_proj","up_proj","k_proj","o_proj","q_proj","v_proj"]'
json "$work/qex/llmerge.json" outputs.adapter.tensors.0.name model.embed_tokens.weight
json "$work/qex/llmerge.json" outputs.adapter.tensors.0.as whole
check '"$jsonq" "$work/qex/llmerge.json" outputs.adapter.tensors | grep -q "k_proj.bias\",\"as\":\"bias\"" &&
  grep -q "; 6 bias changes as lora_B.bias; 5 tensors whole" "$work/qex.err"' \
  "the bias changes are not listed as lora_B.bias: $(grep "adapter:" "$work/qex.err" | head -1)"
check 'grep -q "model.embed_tokens.weight written whole (modules_to_save, BASE plus its factors. product)" \
  "$work/qex.err" && grep -q "has no bias in BASE: PEFT applies the adapter but its merge_and_unload refuses" \
  "$work/qex.err"' "the Qwen2 extraction's notes: $(tail -4 "$work/qex.err")"
check 'grep -q "\"embed_tokens\"" "$work/qex/adapter_config.json" &&
  ! grep -q lora_embedding "$work/qex/adapter_model.safetensors" &&
  grep -q "base_model.model.lm_head.weight" "$work/qex/adapter_model.safetensors"' \
  "the embedding is not in modules_to_save alone, with the tied lm_head's copy"
run qexm task-arithmetic "$Q" "$work/qex" -o "$work/qexm"
# (st_lora runs before check, so that the message shows what it printed)
"$st_lora" "$Q" "$work/qex" "$work/qexm" 1e-6 >"$work/stl" 2>&1
rc=$?
check '[ $rc -eq 0 ]' \
  "the Qwen2 adapter merged back is not BASE plus its change: $(cat "$work/stl")"

# a full fine-tune: its norms go whole into modules_to_save and come back exactly; its matrices
# as rank-8 factors, each with its error recorded; extract is task-arithmetic --to-lora
run ex extract "$B" "$F1" -o "$work/ex" --rank 8 --device cpu
run exta task-arithmetic "$B" "$F1" -o "$work/exta" --to-lora 8 --device cpu
check 'cmp -s "$work/ex/adapter_model.safetensors" "$work/exta/adapter_model.safetensors" &&
  cmp -s "$work/ex/adapter_config.json" "$work/exta/adapter_config.json"' "extract is not task-arithmetic --to-lora"
json "$work/ex/adapter_config.json" modules_to_save \
  '["model.layers.0.input_layernorm","model.layers.0.post_attention_layernorm","model.layers.1.input_layernorm","model.layers.1.post_attention_layernorm","model.norm"]'
json "$work/ex/llmerge.json" outputs.adapter.factored 16
json "$work/ex/llmerge.json" outputs.adapter.rank 8
json "$work/ex/llmerge.json" outputs.adapter.tensors.0.name model.embed_tokens.weight
json "$work/ex/llmerge.json" outputs.adapter.tensors.0.as factors
json "$work/ex/llmerge.json" outputs.adapter.tensors.0.rank 8
run exm task-arithmetic "$B" "$work/ex" -o "$work/exm"
# merged back (in float32), the truncated change: BASE + B·A, computed apart (st_lora), where the
# rank-8 factors are far from the fine-tune's change
run exm32 task-arithmetic "$B" "$work/ex" -o "$work/exm32" --dtype f32
"$st_lora" "$B" "$work/ex" "$work/exm32" 1e-6 >"$work/stl" 2>&1
rc=$?
check '[ $rc -eq 0 ] && grep -q "^16 tensors with factors" "$work/stl"' \
  "the rank-8 adapter merged back is not BASE plus its factors' product: $(cat "$work/stl")"
run ftm32 task-arithmetic "$B" "$F1" -o "$work/ftm32" --dtype f32
check '"$st_lora" "$B" "$work/ex" "$work/ftm32" 1e-3 >/dev/null 2>&1; [ $? -eq 1 ]' \
  "the fine-tune itself is BASE plus its rank-8 factors' product: a check that cannot fail"
run ftm task-arithmetic "$B" "$F1" -o "$work/ftm"
n=$("$jsonq" "$work/exm/llmerge.json" outputs.tensors.#)
for i in $(seq 0 $((n - 1))); do
  name=$("$jsonq" "$work/exm/llmerge.json" outputs.tensors.$i.name)
  case $name in
  *norm.weight)
    check '[ "$("$jsonq" "$work/exm/llmerge.json" outputs.tensors.$i.xxh64)" = "$("$jsonq" "$work/ftm/llmerge.json" outputs.tensors.$i.xxh64)" ]' \
      "$name: merged back from the adapter, not the fine-tune's" ;;
  esac
done
check 'grep -q "^library_name: peft" "$work/ex/README.md" && grep -q "A LoRA adapter of rank 8 for" "$work/ex/README.md" &&
  grep -q -- "--to-lora 8" "$work/ex/README.md"' "the card of an adapter: $(head -12 "$work/ex/README.md")"
check 'grep -q "adapter: 16 matrices as factors of rank 8, relative error mean" "$work/ex.err"' \
  "no summary of the factors: $(tail -3 "$work/ex.err")"

# llmerge plan sizes the change held while it is factored, and the adapter
run plan plan task-arithmetic "$B" "$F1" -o "$work/planned" --to-lora 8 --device cpu
check 'grep -q "adapter: each matrix.s change is held in float32 while it is factored at rank 8: the largest, model.embed_tokens.weight, 64.00 KiB" "$work/plan.out"' \
  "plan --to-lora: $(cat "$work/plan.out")"
"$llmerge" plan task-arithmetic "$B" "$F1" -o "$work/planned" --to-lora 8 --device cpu --json >"$work/plan.json" \
  2>/dev/null
json "$work/plan.json" adapter.rank 8
json "$work/plan.json" adapter.delta_bytes 65536
json "$work/plan.json" adapter.delta_on host
# llmerge plan extract plans what extract runs: the task arithmetic of the one FT into an adapter
"$llmerge" plan extract "$B" "$F1" -o "$work/planned" --rank 8 --device cpu >"$work/plan_ex.out" 2>&1
# (the free disk space, which other processes move between the two, left out)
free_out() { sed 's/; [^;]* free at .*$/; FREE/' "$1"; }
check '[ "$(free_out "$work/plan.out")" = "$(free_out "$work/plan_ex.out")" ] &&
  grep -q "^adapter:" "$work/plan_ex.out"' \
  "plan extract: $(diff <(free_out "$work/plan.out") <(free_out "$work/plan_ex.out"))"
# on a device the changes are held there
"$llmerge" plan task-arithmetic "$B" "$F1" -o "$work/planned" --to-lora 8 --device sim:1GiB >"$work/plan_sim.out" \
  2>&1
check 'grep -q "held in float32 on sim:1GiB while it is factored at rank 8 (the largest, model.embed_tokens.weight" \
  "$work/plan_sim.out"' \
  "plan --to-lora on sim: $(cat "$work/plan_sim.out")"
"$llmerge" plan task-arithmetic "$B" "$F1" -o "$work/planned" --to-lora 8 --device sim:1GiB --json \
  >"$work/plan_sim.json" 2>/dev/null
json "$work/plan_sim.json" adapter.delta_on device
# where the largest change does not fit the device's budget, it is held on the host
"$llmerge" plan task-arithmetic "$B" "$F1" -o "$work/planned" --to-lora 8 --device sim:40KiB --json \
  >"$work/plan_small.json" 2>/dev/null
json "$work/plan_small.json" adapter.delta_on host
check '[ ! -e "$work/planned" ]' "plan wrote $work/planned"

# the energy rule: per matrix the fewest values keeping the fraction, in rank_pattern
run en task-arithmetic "$B" "$LP" -o "$work/en" --to-lora 16 --to-lora-energy 0.9
json "$work/en/adapter_config.json" r 16
check '[ "$("$jsonq" "$work/en/adapter_config.json" rank_pattern.#)" = 4 ]' \
  "energy 0.9: rank_pattern $("$jsonq" "$work/en/adapter_config.json" rank_pattern)"
for i in 0 1 2 3; do
  check '[ "$("$jsonq" "$work/en/llmerge.json" outputs.adapter.tensors.$i.rank)" -lt 8 ]' \
    "energy 0.9 kept rank $("$jsonq" "$work/en/llmerge.json" outputs.adapter.tensors.$i.rank) of a rank-8 change"
done

# the same adapter on the simulated and the emulated CUDA device, with room and with budgets under
# which units fall back. With room every matrix's change is made and factored on the device (the
# merge's values go there as they come). The budgets, each exercising one way back to the CPU:
# at cuda-emu:400KiB the changes are made on the device but no factorisation fits (each change
# comes home for the CPU's); at sim:100KiB some changes find no room for the base's chunks (the
# merged values come home, the change is made there); at cuda-emu:300KiB the embedding's change
# does not fit beside the merge (the merged values go to the host); sim:40KiB mixes them all.
# Every matrix is counted on one side, and each fallback note in llmerge.json.
budgets="cuda-emu:400KiB sim:100KiB cuda-emu:300KiB sim:40KiB"
for d in sim:1GiB cuda-emu:1GiB $budgets; do
  run "dev_$d" extract "$B" "$F1" -o "$work/dev_$d" --rank 8 --device "$d"
  check 'cmp -s "$work/dev_$d/adapter_model.safetensors" "$work/ex/adapter_model.safetensors"' \
    "--device $d: another adapter than the cpu's"
done
adq() { "$jsonq" "$work/dev_$1/llmerge.json" "outputs.adapter.$2" 2>&1; }
where() { echo "$(adq "$1" deltas_on_device) $(adq "$1" deltas_on_host)"; }
# the notes: the change did not fit beside the merge, no room for the base's chunks, the factors
notes() { echo "$(grep -c "fallback: --to-lora: the change of .* did not fit" "$work/dev_$1.err")" \
  "$(grep -c "fallback: --to-lora: the change of .*: no room on" "$work/dev_$1.err")" \
  "$(grep -c "fallback: --to-lora: the factors of" "$work/dev_$1.err")"; }
factored=$("$jsonq" "$work/ex/llmerge.json" outputs.adapter.factored)
ex_where="$("$jsonq" "$work/ex/llmerge.json" outputs.adapter.deltas_on_device 2>&1) $("$jsonq" \
  "$work/ex/llmerge.json" outputs.adapter.deltas_on_host 2>&1)"
check '[ "$ex_where" = "0 $factored" ]' "the cpu: changes on a device and the host $ex_where (of $factored)"
for d in sim:1GiB cuda-emu:1GiB; do
  check '[ "$(where $d)" = "$factored 0" ] && [ "$(notes $d)" = "0 0 0" ] && [ "$(adq $d fallbacks)" = 0 ]' \
    "--device $d: changes on the device and the host $(where $d) (of $factored), notes $(notes $d)"
done
for d in $budgets; do
  read -r on_dev on_host < <(where $d)
  read -r n_change n_room n_factors < <(notes $d)
  check '[ $((on_dev + on_host)) = "$factored" ] && [ "$(adq $d fallbacks)" = $((n_change + n_room + n_factors)) ] &&
    [ "$on_host" = $((n_change + n_room)) ]' \
    "$d: changes on the device and the host $(where $d) (of $factored), notes $(notes $d), $(adq $d fallbacks) counted"
done
check '[ "$(notes cuda-emu:400KiB)" = "0 0 $factored" ] && [ "$(where cuda-emu:400KiB)" = "$factored 0" ]' \
  "cuda-emu:400KiB: notes $(notes cuda-emu:400KiB), changes on the device and the host $(where cuda-emu:400KiB)"
check '[ "$(notes sim:100KiB | cut -d" " -f1)" = 0 ] && [ "$(notes sim:100KiB | cut -d" " -f2)" -gt 0 ]' \
  "sim:100KiB: notes $(notes sim:100KiB)"
check 'grep -q "the change of model.embed_tokens.weight did not fit on cuda-emu:300KiB beside the merge" \
  "$work/dev_cuda-emu:300KiB.err"' "cuda-emu:300KiB: notes $(notes cuda-emu:300KiB)"

# llmerge run takes --to-lora from the command line
cat >"$work/cfg.yml" <<EOF
merge_method: task_arithmetic
base_model: $B
models:
  - model: $LP
    parameters:
      weight: 1.0
  - model: $LN
    parameters:
      weight: 1.0
EOF
run cfg run "$work/cfg.yml" -o "$work/cfg" --to-lora 16
check 'cmp -s "$work/cfg/adapter_model.safetensors" "$work/ad16b/adapter_model.safetensors" &&
  [ -s "$work/cfg/mergekit_config.yml" ]' "llmerge run --to-lora: not the command line's adapter ($(ls "$work/cfg"))"
check 'grep -q "llmerge run mergekit_config.yml -o .* --to-lora 16" "$work/cfg/README.md"' \
  "the card of run --to-lora: $(grep -A2 sh "$work/cfg/README.md")"

# --to-lora exact: the inputs' factors concatenated (weights folded into B), rank the sum of
# theirs, a saved tensor merged whole; merged back, the merge itself; no SVD, so no error
LM=$fx/lora_mts
run ex1 task-arithmetic "$B" "$LP" "$LM" --weights '0.5|0.7' -o "$work/ex1" --to-lora exact --dtype f32
run ex1m task-arithmetic "$B" "$work/ex1" -o "$work/ex1m"
run ex1r task-arithmetic "$B" "$LP" "$LM" --weights '0.5|0.7' -o "$work/ex1r"
check '"$st_diff" --ulps 1 --rel 1e-6 "$work/ex1r/model.safetensors" "$work/ex1m/model.safetensors" >"$work/diff" 2>&1' \
  "the exact adapter merged back is not the merge (see st_diff)"
json "$work/ex1/adapter_config.json" r 12
json "$work/ex1/adapter_config.json" rank_pattern \
  '{"model.embed_tokens":4,"model.layers.0.self_attn.v_proj":8,"model.layers.1.self_attn.v_proj":8}'
json "$work/ex1/adapter_config.json" modules_to_save '["lm_head"]'
json "$work/ex1/llmerge.json" outputs.adapter.exact true
json "$work/ex1/llmerge.json" outputs.adapter.error_max null
check 'grep -q "5 matrices as the inputs. factors concatenated (rank 4 to 12, exact); 1 tensor whole" "$work/ex1.err"' \
  "exact: $(tail -2 "$work/ex1.err")"
# linear (normalized: the base's coefficient is 1) of two adapters, in float32 by default (the
# base's dtype is bf16); with --dtype bf16 the factors are rounded, which the run says
run ex2 linear "$B" "$LP" "$LN" --weights '1|2|1' -o "$work/ex2" --to-lora exact
json "$work/ex2/llmerge.json" outputs.adapter.dtype F32
run ex2h linear "$B" "$LP" "$LN" --weights '1|2|1' -o "$work/ex2h" --to-lora exact --dtype bf16
json "$work/ex2h/llmerge.json" outputs.adapter.dtype BF16
check 'grep -q "(rank 16, exact, then rounded to bf16)" "$work/ex2h.err"' \
  "exact in bf16: $(grep adapter: "$work/ex2h.err")"
run ex2m task-arithmetic "$B" "$work/ex2" -o "$work/ex2m"
run ex2r linear "$B" "$LP" "$LN" --weights '1|2|1' -o "$work/ex2r"
check '"$st_diff" --ulps 1 --rel 1e-6 "$work/ex2r/model.safetensors" "$work/ex2m/model.safetensors" >"$work/diff" 2>&1' \
  "the exact adapter of linear merged back is not the merge (see st_diff)"
expect 2 "--to-lora exact concatenates the inputs' factors: FT 2 $F1 is a full model" \
  task-arithmetic "$B" "$LP" "$F1" -o "$work/bad" --to-lora exact
expect 2 "only task-arithmetic and linear merges of LoRA adapters allow, not ties" \
  ties "$B" "$LP" "$LN" -o "$work/bad" --to-lora exact
expect 2 "is DoRA (module 'model.layers.0.self_attn.q_proj')" task-arithmetic "$B" "$fx/lora_dora" -o "$work/bad" \
  --to-lora exact
expect 2 "scales the base's" linear "$B" "$LP" --weights '1|1' --no-normalize -o "$work/bad" --to-lora exact
expect 2 "--to-lora-energy needs --to-lora RANK (the most any tensor keeps), not exact" \
  task-arithmetic "$B" "$LP" -o "$work/bad" --to-lora exact --to-lora-energy 0.9
expect 2 "--rank 'exact': the adapter's rank, a whole number from 1 to 65536, is needed" \
  extract "$B" "$F1" -o "$work/bad" --rank exact

# refusals: exit 2 before any work, nothing written
cat >"$work/pt.yml" <<EOF
merge_method: passthrough
slices:
  - sources:
      - model: $B
        layer_range: [0, 2]
EOF
expect 2 "--to-lora: a passthrough stacks layers into a new model" run "$work/pt.yml" -o "$work/bad" --to-lora 4
expect 2 "--to-lora: a passthrough stacks layers into a new model" passthrough --slice "$B:0:2" -o "$work/bad" \
  --to-lora 4
# a LoRA of another model (PATH+LORA) is merged onto it in the cache: not before --to-lora's checks
cat >"$work/pl.yml" <<EOF
merge_method: task_arithmetic
base_model: $B
models:
  - model: $F1+$LP
    parameters: {weight: 1.0}
EOF
expect 2 "--to-lora 40: tensor 'model.layers.0.self_attn.k_proj.weight' is [32, 64]" \
  run "$work/pl.yml" -o "$work/bad" --to-lora 40 --cache-dir "$work/plcache"
expect 2 "pl.yml:4:12: model '$F1+$LP': --to-lora exact concatenates the inputs' factors: this is a LoRA of another model than the base" \
  run "$work/pl.yml" -o "$work/bad" --to-lora exact --cache-dir "$work/plcache"
check '[ ! -e "$work/plcache" ]' \
  "a refused --to-lora made PATH+LORA's model first: $(ls -R "$work/plcache" 2>/dev/null | head -5)"
expect 2 "--to-lora '0': the adapter's rank" task-arithmetic "$B" "$LP" -o "$work/bad" --to-lora 0
expect 2 "--to-lora 40: tensor 'model.layers.0.self_attn.k_proj.weight' is [32, 64], whose rank is at most 32" \
  task-arithmetic "$B" "$LP" -o "$work/bad" --to-lora 40
expect 2 "--to-lora-energy needs --to-lora RANK" task-arithmetic "$B" "$LP" -o "$work/bad" --to-lora-energy 0.9
expect 2 "--to-lora-energy '1.5': a fraction of the energy in (0, 1]" task-arithmetic "$B" "$LP" -o "$work/bad" \
  --to-lora 8 --to-lora-energy 1.5
expect 2 "--rank is llmerge extract's option" ties "$B" "$LP" -o "$work/bad" --rank 8
expect 2 "--rank R is needed" extract "$B" "$F1" -o "$work/bad"
expect 2 "llmerge extract takes BASE and one FT" extract "$B" "$F1" "$LP" -o "$work/bad" --rank 4
expect 2 "needs BASE and FT (usage: llmerge extract BASE FT -o ADAPTER --rank R)" extract "$B" -o "$work/bad" --rank 4
expect 2 "llmerge plan: error: --rank R is needed: the adapter's rank (see llmerge extract --help)" \
  plan extract "$B" "$F1" -o "$work/bad"
expect 0 "Usage: llmerge extract BASE FT -o ADAPTER --rank R" plan extract "$B" "$F1" -o "$work/bad" --rank 4 --help
expect 2 "--density is not an option of llmerge extract" extract "$B" "$F1" -o "$work/bad" --rank 4 --density 0.5
expect 2 "--rank 33: tensor 'model.layers.0.self_attn.k_proj.weight'" extract "$B" "$F1" -o "$work/bad" --rank 33
# a merge that changes nothing has no adapter
expect 1 "no tensor changes" task-arithmetic "$B" "$B" -o "$work/bad" --to-lora 4
check '[ ! -e "$work/bad" ] && [ -z "$(ls -A "$work" | grep -e "^bad")" ]' "a refused adapter left $(ls -A "$work" | grep bad)"

e2e_end
