#!/usr/bin/env bash
# End-to-end tests of `llmerge run CONFIG.yml` (mergekit configuration files) through the binary,
# on the fixtures. Every method a configuration can name writes, byte for byte, the
# model.safetensors of the same merge on the command line, with mergekit's defaults written out
# there (density 1, normalize per method, rescale: true as --rescale l1, random_seed as --seed),
# per-tensor settings ({filter, value} lists, gradients over the layers) as the options' settings
# ('|' between the inputs' settings); and where a setting or a default is what makes the merge,
# the output differs from the merge without it, so that the comparisons can fail. Every key:
# dtype and out_dtype, random_seed, tokenizer_source (base; a model with the base's tokenizer,
# whose tokenizer files are copied; sources and models of other vocabularies, whose embedding
# rows are rebuilt to the output's ids, checked against rows moved by st_rows), chat_template (a
# Jinja string, auto, a name refused), a model given as BASE+LORA (the adapter), a model from a
# Hugging Face cache laid out here, mergekit_config.yml (the file, byte for byte) and the card.
# Every refusal is exit status 2 naming FILE:LINE (and the column where the reader has one) and
# leaves no output behind: the reader's (syntax, keys, types), a parameter the method does not
# take (globally, per model), a missing one, a value llmerge does not support, a count of
# models the method does not take, a density or gamma out of range anywhere in a setting, a
# merge option or a second operand on the command line; della's density ± epsilon outside (0,
# 1) in some tensor, which no one line holds, names the tensor instead. `llmerge plan CONFIG.yml` plans (the
# output's size in the configuration's dtype) and writes nothing. The simulated and the emulated
# CUDA device, with budgets that make units fall back, write the CPU's bytes.
# Usage: e2e_run.sh LLMERGE FIXTURES JSONQ ST_ROWS
set -u
llmerge=$1 fx=$2 jsonq=$3 st_rows=$4
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_run

# the Hugging Face cache is $work's only (a model below is taken from it)
hub=$work/hub
unset HUGGINGFACE_HUB_CACHE HF_HOME XDG_CACHE_HOME
export HF_HUB_CACHE=$hub HOME=$work/home

check() { if eval "$1"; then ok; else bad "$2"; fi; }
B=$fx/base F1=$fx/ft_full F2=$fx/ft_full2 LP=$fx/lora_plain LD=$fx/lora_dora

# cfg NAME: the configuration on stdin, as $work/NAME.yml.
cfg() { cat >"$work/$1.yml"; }

# runcfg NAME [OPTIONS...]: `llmerge run NAME.yml -o NAME.run` succeeds.
runcfg() {
  local n=$1
  shift
  run "$n" run "$work/$n.yml" -o "$work/$n.run" -q "$@"
}

# same WHAT A B: the model.safetensors of output directories A and B are the same bytes.
same() {
  if [ -s "$2/model.safetensors" ] && cmp -s "$2/model.safetensors" "$3/model.safetensors"; then ok; else
    bad "$1: ${2##*/}/model.safetensors and ${3##*/}/model.safetensors differ (or are missing)"
  fi
}

# differ WHAT A B: both were written and their model.safetensors differ.
differ() {
  if [ -s "$2/model.safetensors" ] && [ -s "$3/model.safetensors" ] &&
    ! cmp -s "$2/model.safetensors" "$3/model.safetensors"; then ok; else
    bad "$1: ${2##*/} and ${3##*/} are the same bytes (or one is missing)"
  fi
}

# vs NAME METHOD ARGS...: the configuration NAME.yml and `llmerge METHOD ARGS` (-o NAME.cli)
# write the same model.safetensors.
vs() {
  local n=$1
  shift
  runcfg "$n"
  run "$n.cli" "$@" -o "$work/$n.cli" -q
  same "$n: the configuration vs llmerge $*" "$work/$n.run" "$work/$n.cli"
}

# cli NAME METHOD ARGS...: `llmerge METHOD ARGS -o NAME` succeeds (a merge to compare with).
cli() {
  local n=$1
  shift
  run "$n" "$@" -o "$work/$n" -q
}

# ==== every method, as the command line makes it =================================================

# ties: a weight as {filter, value} conditions, a density gradient over the layers; normalize on
cfg ties <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters:
      weight:
        - filter: self_attn
          value: 0.7
        - value: 1.0
      density: [0.3, 0.8]
  - model: $LP
    parameters:
      weight: 0.5
      density: 0.6
EOF
vs ties ties "$B" "$F1" "$LP" --weights 'self_attn=0.7;1 | 0.5' --density '0.3,0.8 | 0.6' --normalize
# the filter and the gradient each make a difference
cli ties.nofilter ties "$B" "$F1" "$LP" --weights '1 | 0.5' --density '0.3,0.8 | 0.6'
cli ties.nograd ties "$B" "$F1" "$LP" --weights 'self_attn=0.7;1 | 0.5' --density '0.3 | 0.6'
differ "ties: the weight's filter" "$work/ties.run" "$work/ties.nofilter"
differ "ties: the density's gradient" "$work/ties.run" "$work/ties.nograd"

# ties without a density: mergekit's density 1, not the command line's 0.2
cfg ties_d1 <<EOF
merge_method: ties
base_model: $B
parameters:
  weight: 1
models:
  - model: $F1
  - model: $F2
    parameters:
      weight: 0.5
EOF
vs ties_d1 ties "$B" "$F1" "$F2" --weights 1,0.5 --density 1 --normalize
cli ties_d1.d02 ties "$B" "$F1" "$F2" --weights 1,0.5
differ "ties: density 1 by default" "$work/ties_d1.run" "$work/ties_d1.d02"

# dare_ties: random_seed, rescale: true by default (--rescale l1), normalize off
cfg dare_ties <<EOF
merge_method: dare_ties
base_model: $B
random_seed: 7
models:
  - model: $F1
    parameters:
      weight: 0.6
      density: 0.5
  - model: $LD
    parameters:
      weight: 0.4
      density: [0.4, 0.7]
EOF
vs dare_ties dare-ties "$B" "$F1" "$LD" --weights 0.6,0.4 --density '0.5 | 0.4,0.7' --seed 7 --rescale l1 \
  --no-normalize
cli dare_ties.inv dare-ties "$B" "$F1" "$LD" --weights 0.6,0.4 --density '0.5 | 0.4,0.7' --seed 7
differ "dare_ties: rescale l1 by default" "$work/dare_ties.run" "$work/dare_ties.inv"

# dare_linear is dare; rescale: false is --rescale none; two seeds give two merges
for seed in 1 2; do
  cfg dare_linear$seed <<EOF
merge_method: dare_linear
base_model: $B
random_seed: $seed
parameters:
  density: 0.5
models:
  - model: $F1
    parameters:
      weight: 0.5
  - model: $LP
    parameters:
      weight: 0.8
EOF
done
vs dare_linear1 dare "$B" "$F1" "$LP" --weights 0.5,0.8 --density 0.5 --seed 1 --rescale l1 --no-normalize
runcfg dare_linear2
differ "dare_linear: random_seed 1 and 2" "$work/dare_linear1.run" "$work/dare_linear2.run"
cfg dare_norescale <<EOF
merge_method: dare_linear
base_model: $B
random_seed: 1
parameters:
  density: 0.5
  rescale: false
models:
  - model: $F1
    parameters:
      weight: 0.5
  - model: $LP
    parameters:
      weight: 0.8
EOF
vs dare_norescale dare "$B" "$F1" "$LP" --weights 0.5,0.8 --density 0.5 --seed 1 --rescale none
differ "dare_linear: rescale: false" "$work/dare_norescale.run" "$work/dare_linear1.run"

# task_arithmetic: lambda as a gradient
cfg task_arithmetic <<EOF
merge_method: task_arithmetic
base_model: $B
parameters:
  lambda: [0.5, 1.5]
models:
  - model: $F1
    parameters:
      weight: 0.7
  - model: $LP
    parameters:
      weight: 0.3
EOF
vs task_arithmetic task-arithmetic "$B" "$F1" "$LP" --weights 0.7,0.3 --lambda 0.5,1.5 --no-normalize
cli task_arithmetic.l1 task-arithmetic "$B" "$F1" "$LP" --weights 0.7,0.3
differ "task_arithmetic: lambda" "$work/task_arithmetic.run" "$work/task_arithmetic.l1"

# breadcrumbs (gamma global) and breadcrumbs_ties (gamma per model, one a gradient)
cfg breadcrumbs <<EOF
merge_method: breadcrumbs
base_model: $B
parameters:
  density: 0.8
  gamma: 0.05
models:
  - model: $F1
    parameters:
      weight: 1
  - model: $F2
    parameters:
      weight: 0.5
EOF
vs breadcrumbs breadcrumbs "$B" "$F1" "$F2" --weights 1,0.5 --density 0.8 --gamma 0.05 --no-normalize
cfg breadcrumbs_ties <<EOF
merge_method: breadcrumbs_ties
base_model: $B
parameters:
  density: 0.7
models:
  - model: $F1
    parameters:
      weight: 1
      gamma: [0.02, 0.1]
  - model: $LP
    parameters:
      weight: 0.5
      gamma: 0.05
EOF
vs breadcrumbs_ties breadcrumbs-ties "$B" "$F1" "$LP" --weights 1,0.5 --density 0.7 --gamma '0.02,0.1 | 0.05' \
  --no-normalize
cli breadcrumbs_ties.g breadcrumbs-ties "$B" "$F1" "$LP" --weights 1,0.5 --density 0.7 --gamma '0.02 | 0.05'
differ "breadcrumbs_ties: the gamma gradient" "$work/breadcrumbs_ties.run" "$work/breadcrumbs_ties.g"

# della (normalize on) and della_linear (off); epsilon; rescale: true is --rescale l1
cfg della <<EOF
merge_method: della
base_model: $B
random_seed: 3
parameters:
  density: 0.6
  epsilon: 0.1
models:
  - model: $F1
    parameters:
      weight: 1
  - model: $F2
    parameters:
      weight: 0.5
      epsilon: [0.05, 0.2]
EOF
vs della della "$B" "$F1" "$F2" --weights 1,0.5 --density 0.6 --epsilon '0.1 | 0.05,0.2' --seed 3 --rescale l1 \
  --normalize
cfg della_linear <<EOF
merge_method: della_linear
base_model: $B
random_seed: 3
parameters:
  weight: 0.5
  density: 0.6
  epsilon: 0.1
models:
  - model: $F1
  - model: $LD
EOF
vs della_linear della-linear "$B" "$F1" "$LD" --weights 0.5,0.5 --density 0.6 --epsilon 0.1 --seed 3 --rescale l1 \
  --no-normalize
cli della_linear.inv della-linear "$B" "$F1" "$LD" --weights 0.5,0.5 --density 0.6 --epsilon 0.1 --seed 3
differ "della_linear: rescale l1 by default" "$work/della_linear.run" "$work/della_linear.inv"

# ram: a global epsilon (mergekit's ram takes no weight, and no per-model parameter); its
# default is mergekit's 1e-5, and epsilon makes a difference
cfg ram <<EOF
merge_method: ram
base_model: $B
parameters:
  epsilon: 0.001
models:
  - model: $F1
  - model: $LP
EOF
vs ram ram "$B" "$F1" "$LP" --epsilon 0.001
cfg ram_default <<EOF
merge_method: ram
base_model: $B
models:
  - model: $F1
  - model: $LP
EOF
vs ram_default ram "$B" "$F1" "$LP" --epsilon 1e-5
differ "ram: epsilon" "$work/ram.run" "$work/ram_default.run"
cfg e_ram <<EOF
merge_method: ram
base_model: $B
models:
  - model: $F1
    parameters:
      weight: 0.5
EOF
expect 2 "$work/e_ram.yml:6" run "$work/e_ram.yml" -o "$work/e_ram.run"
check '[ ! -e "$work/e_ram.run" ]' "a refused ram configuration left $work/e_ram.run"
# ramplus_tl: r, alpha and epsilon, global; its defaults are mergekit's, and r makes a difference
cfg ramplus <<EOF
merge_method: ramplus_tl
base_model: $B
parameters:
  r: 0.5
  alpha: 2
  epsilon: 0.001
models:
  - model: $F1
  - model: $LP
EOF
vs ramplus ramplus-tl "$B" "$F1" "$LP" --r 0.5 --alpha 2 --epsilon 0.001
cfg ramplus_default <<EOF
merge_method: ramplus_tl
base_model: $B
models:
  - model: $F1
  - model: $LP
EOF
vs ramplus_default ramplus-tl "$B" "$F1" "$LP" --r 0.1 --alpha 0.2 --epsilon 1e-5
differ "ramplus_tl: r, alpha, epsilon" "$work/ramplus.run" "$work/ramplus_default.run"

# normalize: false is --no-normalize (ties' default is on)
sed 's/^base_model: .*/&\nparameters:\n  normalize: false/' "$work/ties.yml" >"$work/ties_nonorm.yml"
check 'grep -qx "  normalize: false" "$work/ties_nonorm.yml"' "ties_nonorm.yml: $(cat "$work/ties_nonorm.yml")"
vs ties_nonorm ties "$B" "$F1" "$LP" --weights 'self_attn=0.7;1 | 0.5' --density '0.3,0.8 | 0.6' --no-normalize
differ "ties: normalize: false" "$work/ties_nonorm.run" "$work/ties.run"

# linear: without base_model (the first model is the reference), and with it among the models
cfg linear <<EOF
merge_method: linear
models:
  - model: $F1
    parameters:
      weight: 0.3
  - model: $F2
    parameters:
      weight: 0.5
  - model: $B
    parameters:
      weight: 0.2
EOF
vs linear linear "$F1" "$F2" "$B" --weights 0.3,0.5,0.2 --normalize
# the first model's weight as a gradient: llmerge.json says so, not the default
cfg linear_grad <<EOF
merge_method: linear
models:
  - model: $F1
    parameters:
      weight: [0.3, 0.6]
  - model: $F2
    parameters:
      weight: 0.5
EOF
runcfg linear_grad
json "$work/linear_grad.run/llmerge.json" options.base_weight "per tensor: see the configuration"
cfg linear_base <<EOF
merge_method: linear
base_model: $B
models:
  - model: $F1
    parameters:
      weight: [0.2, 0.6]
  - model: $B
    parameters:
      weight: 0.7
EOF
vs linear_base linear "$B" "$F1" --weights '0.7 | 0.2,0.6' --normalize

# slerp: base_model among the models, t a gradient for mlp and a number elsewhere
cfg slerp <<EOF
merge_method: slerp
base_model: $B
models:
  - model: $B
  - model: $F1
parameters:
  t:
    - filter: mlp
      value: [0.3, 0.7]
    - value: 0.5
EOF
vs slerp slerp "$B" "$F1" --t 'mlp=0.3,0.7;0.5'
cli slerp.half slerp "$B" "$F1" --t 0.5
differ "slerp: t's filter and gradient" "$work/slerp.run" "$work/slerp.half"
# the same as mergekit's gradient-slerp example writes it: one slice of both models' every
# layer, which mergekit makes of models: itself; and ties with parameters per source; written
# into OUT as they are. llmerge plan plans it.
cfg slerp_slice <<EOF
slices:
  - sources:
      - model: $B
        layer_range: [0, 2]
      - model: $F1
        layer_range: [0, 2]
merge_method: slerp
base_model: $B
parameters:
  t:
    - filter: mlp
      value: [0.3, 0.7]
    - value: 0.5
EOF
runcfg slerp_slice
same "slerp in one slice is slerp of models:" "$work/slerp_slice.run" "$work/slerp.run"
check 'cmp -s "$work/slerp_slice.yml" "$work/slerp_slice.run/mergekit_config.yml"' "slerp_slice: mergekit_config.yml"
expect 0 "output: 213632 bytes in 1 shard" plan "$work/slerp_slice.yml" -o "$work/slerp_slice.plan"
cfg ties_slice <<EOF
merge_method: ties
base_model: $B
slices:
  - sources:
      - model: $B
        layer_range: [0, 2]
      - model: $F1
        layer_range: [0, 2]
        parameters:
          weight:
            - filter: self_attn
              value: 0.7
            - value: 1.0
          density: [0.3, 0.8]
      - model: $LP
        layer_range: [0, 2]
        parameters:
          weight: 0.5
          density: 0.6
EOF
runcfg ties_slice
same "ties in one slice is ties of models:" "$work/ties_slice.run" "$work/ties.run"
# a base_model that is not a source: mergekit's ties would stop, wanting its tensors
sed "\\|^ *- model: $B\$|,+1d" "$work/ties_slice.yml" >"$work/e_slice_base.yml"
expect 2 "$work/e_slice_base.yml:2:13: base_model '$B' is not among the slice's sources" \
  run "$work/e_slice_base.yml" -o "$work/e_slice_base.run"
check '[ ! -e "$work/e_slice_base.run" ]' "a refused slice left $work/e_slice_base.run"

# nuslerp: with base_model two fine-tunes' task vectors, without it two models
cfg nuslerp <<EOF
merge_method: nuslerp
base_model: $B
models:
  - model: $F1
    parameters:
      weight: 1
  - model: $F2
    parameters:
      weight: 2
EOF
vs nuslerp nuslerp "$B" "$F1" "$F2" --weights 1,2
# base_model listed with two others: the base, as mergekit drops it from the models it interpolates
cfg nuslerp_listed <<EOF
merge_method: nuslerp
base_model: $B
models:
  - model: $B
  - model: $F1
    parameters:
      weight: 1
  - model: $F2
    parameters:
      weight: 2
EOF
runcfg nuslerp_listed
same "nuslerp: base_model listed among three" "$work/nuslerp.run" "$work/nuslerp_listed.run"
cfg nuslerp_models <<EOF
merge_method: nuslerp
models:
  - model: $F1
    parameters:
      weight: 1
  - model: $F2
    parameters:
      weight: 3
EOF
vs nuslerp_models nuslerp --models-only "$F1" "$F2" --weights 1,3
differ "nuslerp: with and without base_model" "$work/nuslerp.run" "$work/nuslerp_models.run"

# multislerp, karcher, model_stock, nearswap
cfg multislerp <<EOF
merge_method: multislerp
base_model: $B
models:
  - model: $F1
    parameters:
      weight: 1
  - model: $F2
    parameters:
      weight: 2
  - model: $LP
    parameters:
      weight: 1
EOF
vs multislerp multislerp "$B" "$F1" "$F2" "$LP" --weights 1,2,1 --normalize
sed 's/^base_model: .*/&\nparameters:\n  normalize_weights: false/' "$work/multislerp.yml" >"$work/multislerp_raw.yml"
vs multislerp_raw multislerp "$B" "$F1" "$F2" "$LP" --weights 1,2,1 --no-normalize
differ "multislerp: normalize_weights: false" "$work/multislerp_raw.run" "$work/multislerp.run"
cfg karcher <<EOF
merge_method: karcher
parameters:
  max_iter: 3
  tol: 1e-9
models:
  - model: $B
  - model: $F1
  - model: $F2
EOF
vs karcher karcher "$B" "$F1" "$F2" --max-iter 3 --tol 1e-9
cli karcher.1 karcher "$B" "$F1" "$F2" --max-iter 1 --tol 1e-9
differ "karcher: max_iter" "$work/karcher.run" "$work/karcher.1"
# a base_model not among karcher's models is one more of them, the one the others are checked
# against, as mergekit adds it
cfg karcher_base <<EOF
merge_method: karcher
base_model: $B
parameters:
  max_iter: 3
  tol: 1e-9
models:
  - model: $F1
  - model: $F2
EOF
runcfg karcher_base
same "karcher: base_model outside models" "$work/karcher_base.run" "$work/karcher.run"
cfg model_stock <<EOF
merge_method: model_stock
base_model: $B
models:
  - model: $F1
  - model: $F2
EOF
vs model_stock model-stock "$B" "$F1" "$F2"
cfg nearswap <<EOF
merge_method: nearswap
base_model: $B
parameters:
  t: [0.001, 0.01]
models:
  - model: $B
  - model: $F1
EOF
vs nearswap nearswap "$B" "$F1" --t 0.001,0.01
cli nearswap.t nearswap "$B" "$F1" --t 0.001
differ "nearswap: t's gradient" "$work/nearswap.run" "$work/nearswap.t"

# ==== every key ===================================================================================

# what OUT holds besides the weights: the configuration as it was written, and the card
check 'cmp -s "$work/ties.yml" "$work/ties.run/mergekit_config.yml"' "mergekit_config.yml is not the configuration"
check 'cmp -s "$work/karcher.yml" "$work/karcher.run/mergekit_config.yml"' \
  "karcher: mergekit_config.yml is not the configuration"
check '[ -s "$work/ties.run/README.md" ] && grep -q "^# ties.run" "$work/ties.run/README.md"' \
  "the card: $(head -c 300 "$work/ties.run/README.md" 2>&1)"
json "$work/ties.run/llmerge.json" method ties
# the card and llmerge.json give the configuration's parameters, not the defaults the engine
# starts each tensor from: numbers as they are, settings that vary by tensor said to
per="per tensor: see the configuration"
check 'grep -qF "1. \`$F1\` (model): weight $per, density $per" "$work/ties.run/README.md" &&
  grep -qF "2. \`$LP\` (LoRA adapter): weight 0.5, density 0.6" "$work/ties.run/README.md"' \
  "the card's inputs: $(grep -A3 "^Fine-tunes" "$work/ties.run/README.md")"
json "$work/ties.run/llmerge.json" options.weights '["per tensor: see the configuration",0.5]'
json "$work/ties.run/llmerge.json" options.densities '["per tensor: see the configuration",0.6]'
check 'grep -qx -- "- lambda: per tensor: see the configuration" "$work/task_arithmetic.run/README.md" &&
  grep -qx -- "- lambda: per tensor: see --lambda" "$work/task_arithmetic.cli/README.md"' \
  "the card's lambda: $(grep -- "- lambda" "$work/task_arithmetic.run/README.md" "$work/task_arithmetic.cli/README.md")"
json "$work/task_arithmetic.run/llmerge.json" options.weights '[0.7,0.3]'
json "$work/task_arithmetic.run/llmerge.json" options.lambda "per tensor: see the configuration"
# t, gamma and epsilon likewise: the configuration's numbers, or "per tensor" where they vary
json "$work/slerp.run/llmerge.json" options.t "per tensor: see the configuration"
json "$work/slerp.cli/llmerge.json" options.t "per tensor: see --t"
json "$work/slerp.half/llmerge.json" options.t 0.5
json "$work/breadcrumbs.run/llmerge.json" options.gammas '[0.05,0.05]'
json "$work/breadcrumbs_ties.run/llmerge.json" options.gammas '["per tensor: see the configuration",0.05]'
json "$work/della.run/llmerge.json" options.epsilons '[0.1,"per tensor: see the configuration"]'
json "$work/della_linear.run/llmerge.json" options.epsilons '[0.1,0.1]'
cfg card <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters: {weight: 0.3, density: 0.5}
  - model: $F2
    parameters: {weight: 0.7, density: 0.2}
parameters: {lambda: 0.5}
EOF
runcfg card
check 'grep -qF "1. \`$F1\` (model): weight 0.3, density 0.5" "$work/card.run/README.md" &&
  grep -qF "2. \`$F2\` (model): weight 0.7, density 0.2" "$work/card.run/README.md" &&
  grep -qx -- "- lambda: 0.5" "$work/card.run/README.md"' \
  "the card: $(grep -A8 "^Fine-tunes" "$work/card.run/README.md")"
json "$work/card.run/llmerge.json" options.weights '[0.3,0.7]'
json "$work/card.run/llmerge.json" options.densities '[0.5,0.2]'
json "$work/card.run/llmerge.json" options.lambda 0.5
json "$work/dare_linear1.run/llmerge.json" method dare

# dtype alone sets the output dtype (mergekit's torch. prefix read too); out_dtype wins over it
cfg dtype <<EOF
merge_method: task_arithmetic
base_model: $B
dtype: torch.float16
models:
  - model: $F1
    parameters:
      weight: 0.5
EOF
vs dtype task-arithmetic "$B" "$F1" --weights 0.5 --dtype f16
json "$work/dtype.run/llmerge.json" options.dtype f16
json "$work/dtype.run/config.json" torch_dtype float16
cfg out_dtype <<EOF
merge_method: task_arithmetic
base_model: $B
dtype: bfloat16
out_dtype: float32
models:
  - model: $F1
    parameters:
      weight: 0.5
EOF
vs out_dtype task-arithmetic "$B" "$F1" --weights 0.5 --dtype f32
json "$work/out_dtype.run/llmerge.json" options.dtype f32
"$llmerge" inspect "$work/out_dtype.run" >"$work/inspect" 2>&1
check 'grep -qx "dtypes: F32 x21" "$work/inspect"' "out_dtype float32: $(grep dtypes "$work/inspect")"

# a model as BASE+LORA is the adapter merged onto the base
# plus_cfg NAME MODEL: task arithmetic of MODEL and ft_full2 onto the base.
plus_cfg() {
  cfg "$1" <<EOF
merge_method: task_arithmetic
base_model: $B
models:
  - model: $2
    parameters:
      weight: 0.8
  - model: $F2
    parameters:
      weight: 0.4
EOF
}
plus_cfg plus "$B+$LP"
plus_cfg plus_adapter "$LP"
runcfg plus
runcfg plus_adapter
same "BASE+LORA vs the adapter" "$work/plus.run" "$work/plus_adapter.run"
json "$work/plus.run/llmerge.json" inputs.0.kind adapter

# a model from a Hugging Face cache (laid out here as huggingface_hub lays one out)
commit=4444444444444444444444444444444444444444
entry=$hub/models--org--ft
mkdir -p "$entry/blobs" "$entry/snapshots/$commit" "$entry/refs"
for f in "$F1"/*; do
  blob=$(sha256sum "$f" | cut -d' ' -f1)
  cp "$f" "$entry/blobs/$blob" && ln -sf "../../blobs/$blob" "$entry/snapshots/$commit/${f##*/}"
done
printf %s $commit >"$entry/refs/main"
sed "s|$F1|org/ft|" "$work/ties.yml" >"$work/hub.yml"
check 'grep -q "model: org/ft$" "$work/hub.yml"' "hub.yml: $(cat "$work/hub.yml")"
runcfg hub
same "a model from the Hugging Face cache" "$work/hub.run" "$work/ties.run"
json "$work/hub.run/llmerge.json" inputs.0.path "$(cd "$entry/snapshots/$commit" && pwd -P)"

# tokenizer_source and chat_template, on copies of the fixtures with tokenizers of their own.
# vocab SWAP ADDED NORMALIZER: a tokenizer.json of the fixtures' 256 ids (t0 ... t255), with
# t7 and t9 swapped where SWAP is 1, an added token "<new>" at id ADDED (none where -), and
# NORMALIZER as its normalizer (files of the same vocabulary need not be the same bytes).
vocab() {
  local v="" i
  for i in $(seq 0 255); do
    t=t$i
    [ "$1" = 1 ] && [ $i = 7 ] && t=t9
    [ "$1" = 1 ] && [ $i = 9 ] && t=t7
    v="$v${v:+, }\"$t\": $i"
  done
  printf '{"version": "1.0", "added_tokens": [%s], "normalizer": %s, "model": {"type": "BPE", "vocab": {%s}, "merges": []}}\n' \
    "$([ "$2" = - ] || printf '{"id": %s, "content": "<new>", "special": true}' "$2")" "$3" "$v"
}
# tok DIR FROM VOCAB-ARGS TEMPLATE [MAX]: FROM's files and these tokenizer files in DIR.
tok() {
  mkdir -p "$1" && cp "$2"/*.json "$2"/*.safetensors "$1"/ && vocab $3 >"$1/tokenizer.json" &&
    printf '{"bos_token": "<s>", "model_max_length": %s, "chat_template": "%s"}\n' "${5:-256}" "$4" \
      >"$1/tokenizer_config.json"
}
# tk_base, tk_same (other bytes: its normalizer), tk_third and tk_pad (an added token beyond the
# embeddings' 256 rows, which mergekit strips) share a vocabulary; tk_other swaps two tokens and
# tk_more adds one beyond the rows.
tok "$work/tk_base" "$B" "0 - null" "{{ 'base' }}"
tok "$work/tk_same" "$F1" "0 - {\"type\":\"NFC\"}" "{{ 'same' }}" 512
tok "$work/tk_other" "$F2" "1 - null" "{{ 'other' }}"
tok "$work/tk_third" "$F2" "0 - null" "{{ 'other' }}" 1024
tok "$work/tk_pad" "$F2" "0 256 null" "{{ 'other' }}"
tok "$work/tk_more" "$F2" "0 256 null" "{{ 'other' }}"
# tk_cfg NAME LINE [FT2]: a configuration merging three fine-tunes onto tk_base (the second
# tk_other unless FT2 names another), LINE its third.
tk_cfg() {
  cfg "$1" <<EOF
merge_method: task_arithmetic
base_model: $work/tk_base
$2
models:
  - model: $work/tk_same
    parameters:
      weight: 0.5
  - model: $work/${3:-tk_other}
    parameters:
      weight: 0.5
  - model: $work/tk_third
    parameters:
      weight: 0.5
EOF
}
tk_cfg tk_base "tokenizer_source: base" tk_pad
runcfg tk_base
check 'cmp -s "$work/tk_base.run/tokenizer_config.json" "$work/tk_base/tokenizer_config.json" &&
  cmp -s "$work/tk_base.run/tokenizer.json" "$work/tk_base/tokenizer.json"' \
  "tokenizer_source: base: not the base's tokenizer"
# a model's tokenizer of the base's vocabulary, in other bytes: its files go into OUT
tk_cfg tk_same "tokenizer_source: $work/tk_same" tk_pad
runcfg tk_same
check 'cmp -s "$work/tk_same.run/tokenizer_config.json" "$work/tk_same/tokenizer_config.json" &&
  cmp -s "$work/tk_same.run/tokenizer.json" "$work/tk_same/tokenizer.json"' \
  "tokenizer_source tk_same: OUT's tokenizer_config.json is $(cat "$work/tk_same.run/tokenizer_config.json")"
same "tokenizer_source leaves the weights alone" "$work/tk_same.run" "$work/tk_base.run"
# another vocabulary: each model's embedding rows are rebuilt to the output's ids, as mergekit
# rebuilds them. tk_other (t7 and t9 at each other's ids) merges as tk_fixed, its rows 7 and 9
# swapped by st_rows (apart from llmerge) under the base's tokenizer.
tk_cfg tk_model "tokenizer_source: base"
run tk_model run "$work/tk_model.yml" -o "$work/tk_model.run"
check 'grep -qF "vocabulary: model '"'$work/tk_other'"' has 256 of the 256 tokens (2 at other ids)" "$work/tk_model.err"' \
  "tk_model: no note of the rows moved: $(head -c 600 "$work/tk_model.err")"
# mergekit's tokenizer block with a source is tokenizer_source
tk_cfg tk_block "tokenizer:
  source: base"
run tk_block run "$work/tk_block.yml" -o "$work/tk_block.run"
same "tokenizer: {source: base} is tokenizer_source: base" "$work/tk_block.run" "$work/tk_model.run"
# rows OP DIR ARGS...: $F2's files in DIR, `st_rows OP` ARGS applied to each of its shards.
rows() {
  local op=$1 dir=$2 f
  shift 2
  mkdir -p "$dir" && cp "$F2"/*.json "$dir/" &&
    for f in "$F2"/*.safetensors; do "$st_rows" "$op" "$f" "$dir/${f##*/}" "$@" || return 1; done
}
rows swap "$work/tk_fixed" 256 7 9 && vocab 0 - null >"$work/tk_fixed/tokenizer.json"
tk_cfg tk_fixed "tokenizer_source: base" tk_fixed
runcfg tk_fixed
same "a model of another vocabulary merges with its rows moved" "$work/tk_model.run" "$work/tk_fixed.run"
differ "the rows of a model of another vocabulary are moved" "$work/tk_model.run" "$work/tk_base.run"
json "$work/tk_model.run/config.json" vocab_size 256
# the source's vocabulary (t9 at id 7): the same merge with rows 7 and 9 of every matrix swapped,
# and the source's tokenizer in OUT
tk_cfg tk_other "tokenizer_source: $work/tk_other"
runcfg tk_other
"$st_rows" swap "$work/tk_model.run/model.safetensors" "$work/tk_swapped.safetensors" 256 7 9
check 'cmp -s "$work/tk_swapped.safetensors" "$work/tk_other.run/model.safetensors"' \
  "tokenizer_source tk_other: not the merge with rows 7 and 9 swapped"
check 'cmp -s "$work/tk_other.run/tokenizer.json" "$work/tk_other/tokenizer.json"' "tk_other: not its tokenizer.json"
# a source with a token past the base's rows (<new> at 256, which no model has): a zero row 256,
# vocab_size 257, the other rows the merge's
tk_cfg tk_more "tokenizer_source: $work/tk_more" tk_pad
run tk_more run "$work/tk_more.yml" -o "$work/tk_more.run"
json "$work/tk_more.run/config.json" vocab_size 257
for t in model.embed_tokens.weight lm_head.weight; do
  check '[ "$("$st_rows" hash "$work/tk_more.run/model.safetensors" $t 0 256)" = \
    "$("$st_rows" hash "$work/tk_base.run/model.safetensors" $t 0 256)" ]' "tk_more: $t rows 0-255 differ"
  check '"$st_rows" zero "$work/tk_more.run/model.safetensors" $t 256 257' "tk_more: $t row 256 is not zeros"
done
check 'grep -q "1 in no model (zeros)" "$work/tk_more.err"' "tk_more: $(head -c 600 "$work/tk_more.err")"
# a model with a row more (tk_big: <new> at 256, its row a copy of its row 3): under the base's
# vocabulary that row goes and the merge is tk_base's; under its own, every model takes it
# shard_of DIR TENSOR: the shard of DIR that holds TENSOR
shard_of() { sed -n "s/.*\"$2\": \"\([^\"]*\)\".*/\1/p" "$work/$1/model.safetensors.index.json"; }
rows append "$work/tk_big" 256 3 &&
  sed -i 's/"vocab_size": 256/"vocab_size": 257/' "$work/tk_big/config.json" &&
  vocab 0 256 null >"$work/tk_big/tokenizer.json"
tk_cfg tk_bigbase "tokenizer_source: base" tk_big
runcfg tk_bigbase
same "a model's token the output's vocabulary lacks is dropped" "$work/tk_bigbase.run" "$work/tk_base.run"
tk_cfg tk_bigsrc "tokenizer_source: $work/tk_big" tk_big
run tk_bigsrc run "$work/tk_bigsrc.yml" -o "$work/tk_bigsrc.run"
json "$work/tk_bigsrc.run/config.json" vocab_size 257
for t in model.embed_tokens.weight lm_head.weight; do
  check '[ "$("$st_rows" hash "$work/tk_bigsrc.run/model.safetensors" $t 0 256)" = \
    "$("$st_rows" hash "$work/tk_base.run/model.safetensors" $t 0 256)" ] &&
    [ "$("$st_rows" hash "$work/tk_bigsrc.run/model.safetensors" $t 256 257)" = \
    "$("$st_rows" hash "$work/tk_big/$(shard_of tk_big $t)" $t 256 257)" ]' "tk_bigsrc: $t is not the merge plus tk_big's row 256"
done
check 'grep -q "1 from the only model that has them" "$work/tk_bigsrc.err"' "tk_bigsrc: $(head -c 600 "$work/tk_bigsrc.err")"
# llmerge plan counts the rebuilt rows' files; nothing is left beside OUT by either
run tk_plan plan "$work/tk_bigsrc.yml" -o "$work/tk_plan.run"
check 'grep -q "vocabulary: the embeddings are rebuilt to the output.s vocabulary in" "$work/tk_plan.out"' \
  "plan: $(head -c 600 "$work/tk_plan.out")"
check '[ -z "$(ls -A "$work" | grep -e vocab -e "\.tmp-")" ]' "left beside OUT: $(ls -A "$work" | grep -e vocab -e '\.tmp-')"
# nor can a merge of moved rows be an adapter of the base
expect 2 "--to-lora: the merge moves the embeddings' rows to another vocabulary (tokenizer_source: $work/tk_other)" \
  run "$work/tk_other.yml" -o "$work/tk_lora.run" --to-lora 4
check '[ ! -e "$work/tk_lora.run" ]' "a refused --to-lora left $work/tk_lora.run"
# an adapter that changes a rebuilt matrix cannot have its rows moved
sed "s|$work/tk_third|$fx/lora_mts|" "$work/tk_other.yml" >"$work/tk_mts.yml"
expect 2 "$work/tk_mts.yml:11:12: model '$fx/lora_mts': $fx/lora_mts: its LoRA module 'model.embed_tokens' changes model.embed_tokens.weight, whose rows are rebuilt" \
  run "$work/tk_mts.yml" -o "$work/tk_mts.run"
check '[ ! -e "$work/tk_mts.run" ]' "a refused rebuild left $work/tk_mts.run"
printf '{"model": {"vocab": {"a": -1}}}' >"$work/tk_pad/tokenizer.json"
tk_cfg tk_bad "tokenizer_source: $work/tk_pad"
expect 2 "$work/tk_pad/tokenizer.json: model.vocab: token 'a' has id -1, not a token id" \
  run "$work/tk_bad.yml" -o "$work/tk_bad.run"
printf '{"model": {"vocab": {}}}' >"$work/tk_pad/tokenizer.json"
expect 2 "$work/tk_bad.yml:3: tokenizer_source '$work/tk_pad': its vocabulary has no tokens" \
  run "$work/tk_bad.yml" -o "$work/tk_bad.run"
check '[ ! -e "$work/tk_bad.run" ]' "a refused tokenizer_source left $work/tk_bad.run"
vocab 0 256 null >"$work/tk_pad/tokenizer.json"
# without tokenizer.json anywhere (the fixtures): the base's own directory is its vocabulary;
# another model is compared by tokenizer.model, and the message says which side lacks it
cfg tk_basedir <<EOF
merge_method: task_arithmetic
base_model: $B
tokenizer_source: $B
parameters:
  weight: 1
models:
  - model: $F1
EOF
runcfg tk_basedir
cli tk_basedir.cli task-arithmetic "$B" "$F1"
same "tokenizer_source: the base's directory" "$work/tk_basedir.run" "$work/tk_basedir.cli"
sed "s|^tokenizer_source: .*|tokenizer_source: $F2|" "$work/tk_basedir.yml" >"$work/tk_nospm.yml"
expect 2 "$work/tk_nospm.yml:3: tokenizer_source '$F2': neither it nor the base has a tokenizer.json, and neither \
has a tokenizer.model" run "$work/tk_nospm.yml" -o "$work/tk_nospm.run"
# chat_template: a Jinja string into OUT's tokenizer_config.json (the rest of it kept); auto,
# the template most of the models have (tk_other's and tk_third's, neither the base's nor the
# first fine-tune's); a name of mergekit's gives llmerge's template of that format; another
# short word is refused with its line
tk_cfg tk_jinja "chat_template: \"{% for m in messages %}{{ m['content'] }}{% endfor %}\""
runcfg tk_jinja
json "$work/tk_jinja.run/tokenizer_config.json" chat_template "{% for m in messages %}{{ m['content'] }}{% endfor %}"
json "$work/tk_jinja.run/tokenizer_config.json" model_max_length 256
tk_cfg tk_auto "chat_template: auto"
runcfg tk_auto
json "$work/tk_auto.run/tokenizer_config.json" chat_template "{{ 'other' }}"
json "$work/tk_base.run/tokenizer_config.json" chat_template "{{ 'base' }}"
# auto reads each template as transformers loads it for mergekit: chat_template.jinja over
# tokenizer_config.json's string, a list's "default" entry, whitespace around it stripped; so
# the three fine-tunes agree on one template, and the base's loses
mkdir -p "$work/ct_jinja" "$work/ct_space" "$work/ct_list"
for d in ct_jinja ct_space ct_list; do cp "$F1"/*.json "$F1"/*.safetensors "$work/$d/"; done
printf "{{ 'chat' }}\n" >"$work/ct_jinja/chat_template.jinja"
printf '{"chat_template": "{{ 1 }}"}' >"$work/ct_jinja/tokenizer_config.json"
printf '{"chat_template": "  {{ '"'chat'"' }}\\n"}' >"$work/ct_space/tokenizer_config.json"
printf '{"chat_template": [{"name": "tool_use", "template": "{{ 2 }}"}, %s]}' \
  '{"name": "default", "template": "{{ '"'chat'"' }}"}' >"$work/ct_list/tokenizer_config.json"
cfg ct_auto <<EOF
merge_method: task_arithmetic
base_model: $work/tk_base
chat_template: auto
models:
  - model: $work/ct_jinja
    parameters: {weight: 0.3}
  - model: $work/ct_space
    parameters: {weight: 0.3}
  - model: $work/ct_list
    parameters: {weight: 0.3}
EOF
runcfg ct_auto
json "$work/ct_auto.run/tokenizer_config.json" chat_template "{{ 'chat' }}"
tk_cfg tk_chatml "chat_template: chatml"
runcfg tk_chatml
json "$work/tk_chatml.run/tokenizer_config.json" chat_template \
  "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
for name in llama3 alpaca exaone mistral; do
  tk_cfg "tk_$name" "chat_template: $name"
  runcfg "tk_$name"
done
check 'grep -q "<|start_header_id|>" "$work/tk_llama3.run/tokenizer_config.json" &&
  grep -q "### Instruction:" "$work/tk_alpaca.run/tokenizer_config.json" &&
  grep -q "\[|endofturn|\]" "$work/tk_exaone.run/tokenizer_config.json" &&
  grep -q " \[INST\] " "$work/tk_mistral.run/tokenizer_config.json"' "a named chat_template not written"
tk_cfg tk_vicuna "chat_template: vicuna"
expect 2 "$work/tk_vicuna.yml:3: chat_template 'vicuna'" run "$work/tk_vicuna.yml" -o "$work/tk_vicuna.run"
check '[ ! -e "$work/tk_vicuna.run" ]' "a refused chat_template left $work/tk_vicuna.run"

# ==== every refusal: exit status 2, FILE:LINE[:COLUMN], nothing left ==============================

# no_output DIR: neither DIR nor a temporary directory or lock beside it is left.
no_output() {
  local left
  left=$(find "$(dirname "$1")" -maxdepth 1 -name "$(basename "$1")*" | head -3)
  if [ -z "$left" ]; then ok; else bad "left behind: $left"; fi
}

# refused NAME WHERE NEEDLE: `llmerge run NAME.yml` exits with status 2, its message holds
# "NAME.yml:WHERE: " and NEEDLE, and no output is left.
refused() {
  local needle=$3
  expect 2 "$work/$1.yml:$2: " run "$work/$1.yml" -o "$work/$1.run"
  check 'grep -qF -- "$needle" "$work/out"' "$1: the message lacks '$needle': $(head -c 600 "$work/out")"
  no_output "$work/$1.run"
}

cfg e_syntax <<EOF
merge_method: ties
base_model: $B
models: [ {model: $F1
EOF
refused e_syntax 4:1 "not valid YAML"
cfg e_key <<EOF
merge_method: ties
base_modle: $B
models:
  - model: $F1
EOF
refused e_key 2:1 "unknown key 'base_modle'; did you mean 'base_model'?"
cfg e_param <<EOF
merge_method: ties
base_model: $B
parameters:
  weight: 1
  gamma: 0.1
models:
  - model: $F1
EOF
refused e_param 5:3 "'gamma' is not a parameter of ties"
cfg e_param_model <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters:
      weight: 1
      epsilon: 0.1
EOF
refused e_param_model 7:7 "models[0].parameters: 'epsilon' is not a per-model parameter of ties"
cfg e_t_model <<EOF
merge_method: slerp
base_model: $B
parameters:
  t: 0.5
models:
  - model: $B
  - model: $F1
    parameters:
      t: 0.3
EOF
refused e_t_model 9:7 "models[1].parameters: 't' is not a per-model parameter of slerp"
cfg e_type <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters:
      weight: heavy
EOF
refused e_type 6:15 "weight must be a number"
cfg e_no_weight <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters:
      weight: 1
  - model: $F2
    parameters:
      density: 0.5
EOF
refused e_no_weight 7:12 "model '$F2' has no weight"
cfg e_no_t <<EOF
merge_method: slerp
base_model: $B
models:
  - model: $B
  - model: $F1
EOF
refused e_no_t 1:15 "slerp needs parameters: t"
# t given only for some tensors: the others have none (mergekit stops there too), for slerp and
# nearswap; the weight the same, for a model's tensors
cfg e_t_part <<EOF
merge_method: slerp
base_model: $B
models:
  - model: $B
  - model: $F1
parameters:
  t:
    - filter: self_attn
      value: 0.2
EOF
refused e_t_part 7:3 "t: no condition matches tensor 'model.embed_tokens.weight', and the method needs a t for"
cfg e_t_part_ns <<EOF
merge_method: nearswap
base_model: $B
models:
  - model: $F1
parameters:
  t: [{filter: mlp, value: 0.001}]
EOF
refused e_t_part_ns 6:3 "t: no condition matches tensor"
cfg e_w_part <<EOF
merge_method: task_arithmetic
base_model: $B
models:
  - model: $F1
    parameters:
      weight: [{filter: mlp, value: 0.5}]
EOF
expect 2 "model.embed_tokens.weight" run "$work/e_w_part.yml" -o "$work/e_w_part.run"
no_output "$work/e_w_part.run"
cfg e_no_base <<EOF
merge_method: ties
models:
  - model: $F1
    parameters:
      weight: 1
EOF
refused e_no_base 1:15 "ties needs base_model"
# the per-row and per-column forms: nuslerp_flatten: false (with nuslerp_row_wise: true),
# model_stock's filter_wise: true
cfg rows_nuslerp <<EOF
merge_method: nuslerp
base_model: $B
parameters:
  weight: 1
  nuslerp_flatten: false
models:
  - model: $F1
  - model: $F2
EOF
vs rows_nuslerp nuslerp "$B" "$F1" "$F2" --weights 1,1 --per-row
cli rows_whole nuslerp "$B" "$F1" "$F2" --weights 1,1
differ "nuslerp_flatten: false" "$work/rows_nuslerp.run" "$work/rows_whole"
cfg cols_nuslerp <<EOF
merge_method: nuslerp
base_model: $B
parameters:
  weight: 1
  nuslerp_flatten: false
  nuslerp_row_wise: true
models:
  - model: $F1
  - model: $F2
EOF
vs cols_nuslerp nuslerp "$B" "$F1" "$F2" --weights 1,1 --per-column
differ "nuslerp_row_wise: true" "$work/cols_nuslerp.run" "$work/rows_nuslerp.run"
cfg rows_stock <<EOF
merge_method: model_stock
base_model: $B
parameters:
  filter_wise: true
models:
  - model: $F1
  - model: $F2
EOF
vs rows_stock model-stock "$B" "$F1" "$F2" --per-row
cfg e_union <<EOF
merge_method: ties
base_model: $B
tokenizer_source: union
models:
  - model: $F1
    parameters: {weight: 1}
EOF
refused e_union 3:19 "tokenizer_source: 'union'"
# slices with a method: one slice whose sources each give every layer runs as models: (below);
# several slices, a part of the stack, or a stack not the base's are refused, naming it
cfg e_slices <<EOF
merge_method: linear
slices:
  - sources:
      - model: $B
        layer_range: [0, 1]
  - sources:
      - model: $B
        layer_range: [1, 2]
EOF
refused e_slices 6:5 "2 slices: with merge_method linear llmerge merges one slice"
cfg e_slice_from <<EOF
merge_method: linear
slices:
  - sources:
      - model: $B
        layer_range: [0, 2]
      - model: $F1
        layer_range: [1, 3]
EOF
refused e_slice_from 6:16 "model '$F1': layer_range [1, 3]: with merge_method linear a slice's sources each give every layer"
cfg e_slice_part <<EOF
merge_method: linear
slices:
  - sources:
      - model: $B
        layer_range: [0, 1]
      - model: $F1
        layer_range: [0, 1]
parameters:
  weight: 1
EOF
refused e_slice_part 3:5 "slices[0]: its sources' layer_range is [0, 1], and the base $B has 2 layers"
expect 2 "$work/e_slice_part.yml:3:5: slices[0]: its sources' layer_range is [0, 1]" \
  plan "$work/e_slice_part.yml" -o "$work/e_slice_part.run"
cfg e_passthrough <<EOF
merge_method: passthrough
models:
  - model: $B
EOF
refused e_passthrough 1:15 "passthrough takes slices"
# passthrough with slices: llmerge passthrough's stack, the configuration in OUT
cfg stack <<EOF
merge_method: passthrough
slices:
  - sources:
      - model: $B
        layer_range: [0, 2]
  - sources:
      - model: $F1
        layer_range: [1, 2]
        parameters:
          scale: 0.5
dtype: float32
EOF
runcfg stack
run stack.cli passthrough -o "$work/stack.cli" --slice "$B:0:2" --slice "$F1:1:2:0.5" --dtype f32 -q
same "passthrough's slices vs llmerge passthrough" "$work/stack.run" "$work/stack.cli"
check 'cmp -s "$work/stack.yml" "$work/stack.run/mergekit_config.yml"' "passthrough: OUT lacks the configuration"
# the run options a stack has no use for (where it runs, the cache, -v, --strict) are taken, as
# for any configuration, and their values still checked
run stack.opts run "$work/stack.yml" -o "$work/stack.opts" --device cpu --threads 2 --gpu-mem 1GiB \
  --cache-dir "$work/stack.cache" -v --strict -q
same "passthrough with the run options" "$work/stack.run" "$work/stack.opts"
expect 2 "--threads 'x': a whole number of threads" run "$work/stack.yml" -o "$work/stack.bad" --threads x
run stack.flags run "$work/stack.yml" -o "$work/stack.flags" -qqqqqqqq -vvvvvvvv
same "passthrough with bundled flags" "$work/stack.run" "$work/stack.flags"
no_output "$work/stack.bad"
# base_model gives mergekit's passthrough its config.json and tokenizer: the first slice's model
# is llmerge's, so that base_model is the same stack, and another is refused
sed "1a base_model: $B" "$work/stack.yml" >"$work/stack_base.yml"
runcfg stack_base
same "passthrough with base_model the first slice's model" "$work/stack.run" "$work/stack_base.run"
cfg e_stack_base <<EOF
merge_method: passthrough
base_model: $F2
slices:
  - sources:
      - model: $B
        layer_range: [0, 2]
EOF
refused e_stack_base 2:13 \
  "base_model '$F2': mergekit's passthrough takes the output's config.json and tokenizer files from base_model"
# chat_template with passthrough: set on the first slice's tokenizer, as mergekit sets it on the
# copied one; auto over base_model and the slices' models (ct_jinja and ct_space agree on one)
sed '$a chat_template: chatml' "$work/stack.yml" >"$work/stack_chatml.yml"
runcfg stack_chatml
same "passthrough: chat_template leaves the weights alone" "$work/stack.run" "$work/stack_chatml.run"
json "$work/stack_chatml.run/tokenizer_config.json" chat_template \
  "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
cfg stack_auto <<EOF
merge_method: passthrough
chat_template: auto
slices:
  - sources: [{model: $B, layer_range: [0, 2]}]
  - sources: [{model: $work/ct_jinja, layer_range: [1, 2]}]
  - sources: [{model: $work/ct_space, layer_range: [0, 1]}]
EOF
runcfg stack_auto
json "$work/stack_auto.run/tokenizer_config.json" chat_template "{{ 'chat' }}"
# tokenizer_source with passthrough: the first slice's model's tokenizer (base, where base_model
# is that model, or by its name) is the stack as it is; another model's is refused
sed "1a tokenizer_source: base" "$work/stack_base.yml" >"$work/stack_tkbase.yml"
runcfg stack_tkbase
same "passthrough: tokenizer_source: base" "$work/stack.run" "$work/stack_tkbase.run"
sed "1a tokenizer_source: $B" "$work/stack.yml" >"$work/stack_tkfirst.yml"
runcfg stack_tkfirst
same "passthrough: tokenizer_source the first slice's model" "$work/stack.run" "$work/stack_tkfirst.run"
sed "1a tokenizer_source: base" "$work/stack.yml" >"$work/e_stack_tknobase.yml"
refused e_stack_tknobase 2 "tokenizer_source: base needs base_model"
sed "1a tokenizer_source: $F2" "$work/stack.yml" >"$work/e_stack_tkother.yml"
refused e_stack_tkother 2 "tokenizer_source '$F2': with passthrough, the tokenizer is the first slice's model's"
# ... and the last slice's model gives lm_head: its tokens must be at the same ids (tk_same's
# are, in other bytes; tk_other has two swapped)
cfg stack_tksame <<EOF
merge_method: passthrough
base_model: $work/tk_base
tokenizer_source: base
slices:
  - sources: [{model: $work/tk_base, layer_range: [0, 2]}]
  - sources: [{model: $work/tk_same, layer_range: [1, 2]}]
EOF
runcfg stack_tksame
sed "s|$work/tk_same|$work/tk_other|" "$work/stack_tksame.yml" >"$work/e_stack_tkswap.yml"
refused e_stack_tkswap 6:23 "model '$work/tk_other': the last slice's model gives the output layer (lm_head), and its \
tokens are not at the ids of the first slice's model's tokenizer"
# a merge whose output vocabulary has no tokenizer.json cannot place a model's that has one
cfg e_tk_unmatched <<EOF
merge_method: task_arithmetic
base_model: $B
tokenizer_source: base
parameters:
  weight: 0.5
models:
  - model: $work/tk_other
EOF
refused e_tk_unmatched 7 "model '$work/tk_other' has a tokenizer.json, and the output's vocabulary (tokenizer_source: \
base) has none"
# (messages name the key as the file gives it)
sed "s|^tokenizer_source: base|tokenizer: {source: base}|" "$work/e_tk_unmatched.yml" >"$work/e_tk_unmatched2.yml"
refused e_tk_unmatched2 7 "the output's vocabulary (tokenizer.source: base) has none"
cfg e_sparsegpt <<EOF
merge_method: sparsegpt
base_model: $B
models:
  - model: $F1
    parameters: {weight: 1}
EOF
refused e_sparsegpt 1:15 "'sparsegpt' is not a method llmerge runs from a configuration"
cfg e_method <<EOF
merge_method: ties_plus
base_model: $B
models:
  - model: $F1
EOF
refused e_method 1:15 "'ties_plus' is not a method"
check 'grep -qF "(ties, dare, " "$work/out" && grep -qF ", passthrough; sparsegpt needs" "$work/out" &&
  ! grep -qF ", sparsegpt," "$work/out"' "the methods a configuration runs: $(cat "$work/out")"
cfg e_fusion <<EOF
merge_method: arcee_fusion
base_model: $B
models:
  - model: $F1
EOF
refused e_fusion 1:15 "merge_method: arcee_fusion is mergekit's and not in llmerge"
# a model that cannot be opened is named where it was written
cfg e_nomodel <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters: {weight: 1}
  - model: $work/no-such-model
    parameters: {weight: 1}
EOF
refused e_nomodel 6:12 "model '$work/no-such-model': $work/no-such-model: no such file or directory"
cfg e_linear_lora <<EOF
merge_method: linear
models:
  - model: $LP
    parameters: {weight: 1}
  - model: $B
    parameters: {weight: 1}
EOF
refused e_linear_lora 3:12 "model '$LP': BASE $LP is not a model directory (it is an adapter directory)"
# PATH+LORA on a model other than the base: the adapter merged into PATH once, in the cache
cfg pluslora <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1+$LP
    parameters: {weight: 1}
EOF
runcfg pluslora --cache-dir "$work/loras"
check 'ls -d "$work"/loras/lora-* >/dev/null 2>&1' "PATH+LORA: nothing made in the cache"
cli pluslora_composite task-arithmetic "$F1" "$LP"
cli pluslora_cli ties "$B" "$work/pluslora_composite" --density 1
same "PATH+LORA vs the adapter merged into PATH first" "$work/pluslora.run" "$work/pluslora_cli"
expect 0 "from the cache" run "$work/pluslora.yml" -o "$work/pluslora.again" --cache-dir "$work/loras"
# llmerge plan writes nothing, not even such a model in the cache: it plans PATH in its place
expect 0 "output: " plan "$work/pluslora.yml" -o "$work/pluslora.plan" --cache-dir "$work/loras.plan"
check '[ ! -e "$work/loras.plan" ] && [ ! -e "$work/pluslora.plan" ]' \
  "llmerge plan made PATH+LORA's model: $(ls -R "$work/loras.plan" 2>/dev/null | head -3)"
same "PATH+LORA from the cache" "$work/pluslora.run" "$work/pluslora.again"
cfg e_plus_base <<EOF
merge_method: ties
base_model: $B+$LP
models:
  - model: $F1
    parameters: {weight: 1}
EOF
refused e_plus_base 2:13 "a LoRA on the base is not supported"
cfg e_linear_base <<EOF
merge_method: linear
base_model: $B
models:
  - model: $F1
    parameters: {weight: 1}
  - model: $F2
    parameters: {weight: 1}
EOF
refused e_linear_base 2:13 "base_model '$B' is not among them"
cfg e_nuslerp_base <<EOF
merge_method: nuslerp
base_model: $B
models:
  - model: $F1
    parameters: {weight: 1}
  - model: $B
    parameters: {weight: 1}
EOF
refused e_nuslerp_base 6:12 "base_model is one of only two models listed"
# a model listed twice: mergekit merges it once with the first entry's parameters; the same
# directory spelled otherwise is another reference to mergekit, merged twice by both
cfg e_twice <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters: {weight: 1}
  - model: $F2
    parameters: {weight: 1}
  - model: $F1
    parameters: {weight: 0.5}
EOF
refused e_twice 8:12 "model '$F1' is listed twice in models (lines 4 and 8): mergekit would merge it once, \
with the first entry's parameters; list it once"
cfg twice_spelled <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters: {weight: 1}
  - model: $F2
    parameters: {weight: 1}
  - model: $F1/.
    parameters: {weight: 0.5}
EOF
vs twice_spelled ties "$B" "$F1" "$F2" "$F1/." --weights 1,1,0.5 --density 1
# as many models as the method takes
cfg e_slerp_models <<EOF
merge_method: slerp
base_model: $B
parameters:
  t: 0.5
models:
  - model: $F1
  - model: $F2
EOF
refused e_slerp_models 1:15 "slerp takes 1 model besides base_model, not 2"
cfg e_karcher_models <<EOF
merge_method: karcher
models:
  - model: $F1
EOF
refused e_karcher_models 1:15 "karcher takes at least 2 models, not 1"
# a density or gamma out of range anywhere in a setting, before any work
cfg e_density <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters:
      weight: 1
      density:
        - filter: mlp
          value: [0.5, 1.5]
        - value: 0.5
EOF
refused e_density 9:24 "models[0].parameters: density 1.5 is not in (0, 1]"
# a gradient's bad number is named where it stands, on a line of its own
cfg e_density_line <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters:
      weight: 1
      density: [0.5,
        1.5]
EOF
refused e_density_line 8:9 "models[0].parameters: density 1.5 is not in (0, 1]"
# one {filter, value} on its own, not in a list, fails in mergekit for every tensor
cfg e_cond_map <<EOF
merge_method: ties
base_model: $B
models:
  - model: $F1
    parameters:
      weight: {filter: mlp, value: 0.5}
EOF
refused e_cond_map 6:15 "write it as a list of conditions"
cfg e_gamma <<EOF
merge_method: breadcrumbs
base_model: $B
parameters:
  gamma: -0.1
models:
  - model: $F1
    parameters: {weight: 1}
EOF
refused e_gamma 4:10 "parameters: gamma -0.1 is not in [0, 1]"
# dtype is checked where out_dtype wins over it too (mergekit computes in it)
cfg e_dtype <<EOF
merge_method: task_arithmetic
base_model: $B
dtype: float8
out_dtype: float32
models:
  - model: $F1
    parameters: {weight: 1}
EOF
refused e_dtype 3 "dtype: 'float8' is not a dtype llmerge writes"
# a gradient only where llmerge's position of a tensor is mergekit's: a base without
# num_hidden_layers (an architecture llmerge does not check, named as GPT-2 is) is refused naming
# the gradient, the tensor and why, in a configuration and on the command line; a number there is
# fine
mkdir -p "$work/gr_nolayers" "$work/gr_ft" "$work/gr_short"
cp "$B"/*.json "$B"/*.safetensors "$work/gr_nolayers/"
cp "$F1"/*.json "$F1"/*.safetensors "$work/gr_ft/"
cp "$B"/*.json "$B"/*.safetensors "$work/gr_short/"
for d in gr_nolayers gr_ft; do
  sed -i -e '/"num_hidden_layers"/d' -e 's/"LlamaForCausalLM"/"GPT2LMHeadModel"/' \
    -e 's/"model_type": "llama"/"model_type": "gpt2"/' "$work/$d/config.json"
done
sed -i 's/"num_hidden_layers": 2/"num_hidden_layers": 1/' "$work/gr_short/config.json"
cfg e_grad_nolayers <<EOF
merge_method: ties
base_model: $work/gr_nolayers
models:
  - model: $work/gr_ft
    parameters:
      weight: 1
      density: [0.5, 1]
EOF
refused e_grad_nolayers 7:16 "parameter 'density' is a gradient over the layers, and tensor \
'model.embed_tokens.weight' has no known position among them: the base's config.json has no num_hidden_layers (at \
its top level or in text_config)"
expect 2 "parameter 'density' is a gradient over the layers, and tensor 'model.embed_tokens.weight'" \
  ties "$work/gr_nolayers" "$work/gr_ft" -o "$work/e_grad.cli" --densities '*=0.5,1'
no_output "$work/e_grad.cli"
expect 2 "parameter 't' is a gradient over the layers" \
  slerp "$work/gr_nolayers" "$work/gr_ft" -o "$work/e_grad.cli" --t 'self_attn=0,0.5,1;0.5'
no_output "$work/e_grad.cli"
cli grad_number ties "$work/gr_nolayers" "$work/gr_ft" --densities 0.5
# layers past num_hidden_layers in its stack (a multi-token-prediction layer after the counted
# ones): the last position, t = 1 (with one layer counted, layer 0 is at 1 too), so the gradient
# is 1 on every MLP tensor; a gradient of one value anywhere is fine
cfg grad_long <<EOF
merge_method: slerp
base_model: $work/gr_short
parameters:
  t:
    - filter: mlp
      value: [0, 1]
    - value: 0.5
models:
  - model: $work/gr_short
  - model: $F1
EOF
runcfg grad_long
sed -e 's/value: \[0, 1\]/value: 1/' "$work/grad_long.yml" >"$work/grad_long1.yml"
runcfg grad_long1
same "layers past num_hidden_layers at t = 1" "$work/grad_long.run" "$work/grad_long1.run"
cli grad_const ties "$work/gr_nolayers" "$work/gr_ft" --densities '*=0.5,0.5'
cli grad_const1 ties "$work/gr_nolayers" "$work/gr_ft" --densities 0.5
same "a gradient of one value where positions are unknown" "$work/grad_const" "$work/grad_const1"
# a multimodal model's count, under text_config, places the layers as a top-level one does
mkdir -p "$work/gr_text" "$work/gr_top"
cp "$B"/*.json "$B"/*.safetensors "$work/gr_text/"
cp "$B"/*.json "$B"/*.safetensors "$work/gr_top/"
sed -e 's/"num_hidden_layers": 2,/"text_config": {"num_hidden_layers": 2},/' -e 's/"LlamaForCausalLM"/"GPT2LMHeadModel"/' \
  -e 's/"model_type": "llama"/"model_type": "gpt2"/' "$B/config.json" >"$work/gr_text/config.json"
sed -e 's/"LlamaForCausalLM"/"GPT2LMHeadModel"/' -e 's/"model_type": "llama"/"model_type": "gpt2"/' \
  "$B/config.json" >"$work/gr_top/config.json"
check 'grep -q "\"text_config\": {\"num_hidden_layers\": 2}" "$work/gr_text/config.json"' "no text_config made"
cli grad_text ties "$work/gr_text" "$work/gr_ft" --densities '*=0.5,1'
cli grad_top ties "$work/gr_top" "$work/gr_ft" --densities '*=0.5,1'
same "layers counted under text_config" "$work/grad_text" "$work/grad_top"
# a stack of another length than the count is another module's (a vision tower's), placed by
# its own length as mergekit places each module's layers: here the 2 layers under a count of 3
# are where a count of 2 puts them
sed -e 's/"num_hidden_layers": 2/"num_hidden_layers": 3/' "$work/gr_top/config.json" >"$work/gr_top3.json"
cp "$work/gr_top3.json" "$work/gr_top/config.json"
cli grad_other ties "$work/gr_top" "$work/gr_ft" --densities '*=0.5,1'
same "a stack placed by its own length" "$work/grad_other" "$work/grad_top"
# della's density ± epsilon must lie in (0, 1) in every tensor: two settings that are each in
# range but not together in the MLP's tensors are refused naming the first such tensor, before
# any work, in a configuration and on the command line
cfg e_della <<EOF
merge_method: della
base_model: $B
parameters:
  density: 0.5
  epsilon:
    - filter: mlp
      value: 0.6
    - value: 0.1
models:
  - model: $F1
    parameters: {weight: 1}
EOF
expect 2 "epsilon of model '$F1' is 0.6 in tensor 'model.layers.0.mlp.down_proj.weight' with density 0.5" \
  run "$work/e_della.yml" -o "$work/e_della.run"
no_output "$work/e_della.run"
expect 2 "epsilon of FT 1 is 0.6 in tensor 'model.layers.0.mlp.down_proj.weight' with density 0.5" \
  della "$B" "$F1" -o "$work/e_della.cli" --density 0.5 --epsilon 'mlp=0.6;0.1'
no_output "$work/e_della.cli"
expect 2 "epsilon of model '$F1' is 0.6 in tensor" plan "$work/e_della.yml" -o "$work/e_della.run"
# the command line: a merge option, two operands
expect 2 "--density shapes the merge: llmerge run takes it from CONFIG" run "$work/ties.yml" -o "$work/e_cli.run" \
  --density 0.5
no_output "$work/e_cli.run"
expect 2 "llmerge run takes one configuration file, not 2" run "$work/ties.yml" "$work/karcher.yml" -o "$work/e_cli.run"
no_output "$work/e_cli.run"

# ==== llmerge plan CONFIG.yml: a plan, nothing written ============================================

# the output's size follows the configuration's dtype: 106,816 parameters in bf16, then in f32
expect 0 "output: 213632 bytes in 1 shard" plan "$work/ties.yml" -o "$work/plan.run"
check 'grep -qF "place: model '"'$LP'"' ($LP) " "$work/out" && grep -q "^place: .* of LoRA factors" "$work/out" && grep -q "^merge: " "$work/out"' \
  "llmerge plan printed: $(head -c 600 "$work/out")"
no_output "$work/plan.run"
expect 0 "output: 427264 bytes in 1 shard" plan "$work/out_dtype.yml" -o "$work/plan.run"
no_output "$work/plan.run"
expect 2 "$work/e_param.yml:5:3: " plan "$work/e_param.yml" -o "$work/plan.run"
no_output "$work/plan.run"

# ==== the devices: the CPU's bytes, units falling back ============================================

# devices NAME DEV...: the configuration NAME.yml on each device DEV writes NAME.run's bytes,
# and at least one unit falls back to the CPU
devices() {
  local n=$1 d
  shift
  for d in "$@"; do
    rm -rf "$work/$n.dev"
    if "$llmerge" run "$work/$n.yml" -o "$work/$n.dev" --device "$d" >"$work/dev.out" 2>&1; then ok; else
      bad "run $n.yml --device $d: $(head -c 600 "$work/dev.out")"
    fi
    same "$n on $d" "$work/$n.run" "$work/$n.dev"
    check 'grep -q "fallback: " "$work/dev.out"' "$n on $d: no unit fell back: $(grep "devices:" "$work/dev.out")"
  done
}
# per-tensor weights, densities from a gradient, a random drop, an adapter
devices dare_ties sim:96KiB cuda-emu:1100KiB cuda-emu:64KiB
devices ties sim:96KiB cuda-emu:64KiB
# slerp's whole-tensor norms and dot products, t from a filter and a gradient
devices slerp sim:96KiB cuda-emu:64KiB

e2e_end
