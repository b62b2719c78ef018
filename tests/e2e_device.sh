#!/usr/bin/env bash
# End-to-end tests of a device against the CPU through the binary, on the fixtures: every
# method and kind of input merged on DEVICE gives the CPU's output (identical bits, or within
# ULPS units in the last place where the device's arithmetic may round differently, as cuBLAS
# may), with an ample budget and with a small one that makes units fall back to the CPU (each
# fallback announced). ctest runs it on the simulated device; scripts/gpu-check.sh on CUDA.
# The NaN and Inf counts of llmerge.json are the CPU's too (read with the jsonq built beside
# st_diff).
# E2E_DEVICE_SKIP names cases (the first argument of same_as_cpu) to leave out, each said on the
# output, for a device with a known defect that is being fixed.
# Usage: e2e_device.sh LLMERGE FIXTURES ST_DIFF ULPS DEVICE-ARGS -- SMALL-DEVICE-ARGS
#   e.g. e2e_device.sh build/llmerge build/fixtures build/st_diff 0 --device sim:1GiB -- --device sim:96KiB
set -u
llmerge=$1 fx=$2 st_diff=$3 ulps=$4
jsonq=$(dirname "$st_diff")/jsonq
shift 4
ample=() small=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do ample+=("$1"); shift; done
[ $# -gt 0 ] && shift
small=("$@")
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_device

B=$fx/base
# same_as_cpu NAME ARGS...: the merge on the CPU and with each set of device arguments agree.
same_as_cpu() {
  local name=$1
  shift
  case " ${E2E_DEVICE_SKIP:-} " in
  *" $name "*) echo "e2e_device: $name skipped (E2E_DEVICE_SKIP)"; return ;;
  esac
  # each run its own cache directory, so sparsegpt captures its Hessians on the device tested
  if ! XDG_CACHE_HOME=$work/cache-$name-cpu "$llmerge" "$@" -o "$work/$name-cpu" --device cpu -q >"$work/out" 2>&1; then
    bad "$name on cpu failed: $(head -c 400 "$work/out")"
    return
  fi
  local label args cache
  for label in ample small; do
    if [ $label = ample ]; then args=("${ample[@]}"); else args=("${small[@]}"); fi
    cache=$work/cache-$name-$label
    # On a device whose arithmetic rounds differently (ULPS > 0, CUDA), Hessians captured there
    # agree with the CPU's to float32 rounding only, and an entry at the top-k threshold could
    # flip: sparsegpt then merges with the CPU's Hessians (its cache), and gpu-check.sh compares
    # the captured Hessians themselves.
    [ "$ulps" != 0 ] && [ "$1" = sparsegpt ] && cache=$work/cache-$name-cpu
    if ! XDG_CACHE_HOME=$cache "$llmerge" "$@" -o "$work/$name-$label" "${args[@]}" >"$work/out" 2>&1; then
      bad "$name with ${args[*]} failed: $(head -c 600 "$work/out")"
      continue
    fi
    if [ $label = small ] && ! grep -q "fallback: " "$work/out"; then
      bad "$name with ${args[*]}: nothing fell back: $(head -c 400 "$work/out")"
    fi
    if "$st_diff" --ulps "$ulps" "$work/$name-cpu/model.safetensors" "$work/$name-$label/model.safetensors" \
      >"$work/diff" 2>&1; then
      ok
    else
      bad "$name with ${args[*]} differs from the cpu: $(tail -5 "$work/diff")"
    fi
    # the NaN and Inf counted in the inputs and the output: the same as on the cpu
    local want got
    want=$("$jsonq" "$work/$name-cpu/llmerge.json" nonfinite 2>&1) got=$("$jsonq" "$work/$name-$label/llmerge.json" nonfinite 2>&1)
    if [ "$want" = "$got" ]; then ok; else bad "$name with ${args[*]}: nonfinite $got, on the cpu $want"; fi
    rm -rf "$work/$name-$label"
  done
  rm -rf "$work/$name-cpu"
}

lp=$fx/lora_plain lr=$fx/lora_rslora ld=$fx/lora_dora lm=$fx/lora_mts ln=$fx/lora_nested
ff=$fx/ft_full ff2=$fx/ft_full2
same_as_cpu ties ties "$B" "$lp" "$lr" "$ff"
same_as_cpu ties-count ties "$B" "$ld" "$ff2" --sign count --lambda 0.8 --densities 0.3,0.6
same_as_cpu ties-global ties "$B" "$lp" "$lm" "$ff" --topk global --dtype f32
same_as_cpu dare dare "$B" "$lp" "$ff" "$ln" --seed 5
same_as_cpu dare-l1 dare "$B" "$ld" "$ff2" --rescale l1 --dtype f16
same_as_cpu dare-ties dare-ties "$B" "$lr" "$ff" --weights 0.6,1.2 --seed 3
same_as_cpu task-arithmetic task-arithmetic "$B" "$lp" "$ld" "$ff" --lambda 0.5
same_as_cpu task-arithmetic-norm task-arithmetic "$B" "$lm" "$ff2" --normalize
same_as_cpu lora-bias ties "$fx/qwen" "$fx/lora_bias"
# full models only: on the cpu these tensors take the fused dense operations, on an
# accelerator the separate ones
same_as_cpu ties-full ties "$B" "$ff" "$ff2" --densities 0.3,0.5
same_as_cpu dare-ties-full dare-ties "$B" "$ff" "$ff2" --seed 9 --dtype f32
same_as_cpu task-arithmetic-full task-arithmetic "$B" "$ff" "$ff2" --weights 0.7,0.4
same_as_cpu sparsegpt sparsegpt "$B" "$lp" "$lr" "$ff" --calib "$fx/calib/calib.jsonl" --density 0.3
# the mergekit methods: the Gram pass (on the cpu fused for full models), the coefficients'
# linear pass, nearswap's step, breadcrumbs' two thresholds (fused on the cpu; with a DoRA
# adapter, its pieces over τ in buffers), della's ranks, sce's variances, ram's mean of the
# entries above epsilon and ramplus-tl's counting pass
same_as_cpu linear linear "$ff" "$lp" "$ff2"
same_as_cpu slerp slerp "$B" "$ff" --t 0.3
same_as_cpu nuslerp nuslerp "$B" "$ff" "$ld" --weights 0.3,0.7
same_as_cpu multislerp multislerp "$B" "$ff" "$ff2" "$lp"
same_as_cpu karcher karcher "$ff" "$ff2" "$B"
same_as_cpu model-stock model-stock "$B" "$ff" "$ff2" "$lr"
same_as_cpu nearswap nearswap "$B" "$ff" --t 0.001
same_as_cpu breadcrumbs breadcrumbs "$B" "$ff" "$ff2" "$lp" --density 0.4 --gamma 0.05
same_as_cpu breadcrumbs-dora breadcrumbs-ties "$B" "$lp" "$ld" "$ff" --densities 0.3,0.5,0.4 --gamma 0.05
same_as_cpu della della "$B" "$ff" "$ff2" "$lp" --density 0.5 --seed 2
same_as_cpu sce sce "$B" "$ff" "$ff2" "$lp"
same_as_cpu ram ram "$B" "$ff" "$ff2" "$lp" --epsilon 0.001
same_as_cpu ramplus-tl ramplus-tl "$B" "$ff" "$ff2" "$lp" --epsilon 0.001 --r 0.5 --alpha 2
# breadcrumbs' second selection counts τ where its first left it (a tensor in one slab), rather
# than copying the inputs to the device again: as much copied to the device as ties copies
for m in ties breadcrumbs; do
  "$llmerge" $m "$B" "$ff" "$ff2" "$lp" --density 0.4 -o "$work/copies-$m" "${ample[@]}" -q >"$work/out" 2>&1 ||
    bad "$m with ${ample[*]} failed: $(head -c 400 "$work/out")"
done
to_t=$("$jsonq" "$work/copies-ties/llmerge.json" transfers.bytes_to_device 2>&1)
to_b=$("$jsonq" "$work/copies-breadcrumbs/llmerge.json" transfers.bytes_to_device 2>&1)
if [ "$to_t" -gt 0 ] 2>/dev/null && [ "$to_b" = "$to_t" ]; then ok; else
  bad "with ${ample[*]}: breadcrumbs copied $to_b bytes to the device, ties $to_t"; fi
rm -rf "$work/copies-ties" "$work/copies-breadcrumbs"

# LLMERGE_PROFILE: the device's operations counted and timed, printed at exit; the merge is the
# same bits
env -u LLMERGE_PROFILE "$llmerge" ties "$B" "$lp" "$ff" -o "$work/prof" "${ample[@]}" -q >"$work/out" 2>&1 &&
  LLMERGE_PROFILE=1 "$llmerge" ties "$B" "$lp" "$ff" -o "$work/prof-on" "${ample[@]}" -q >"$work/prof.err" 2>&1 ||
  bad "ties with ${ample[*]} and LLMERGE_PROFILE failed: $(head -c 400 "$work/out" "$work/prof.err")"
if cmp -s "$work/prof/model.safetensors" "$work/prof-on/model.safetensors"; then ok; else
  bad "ties with ${ample[*]}: LLMERGE_PROFILE changed the merge"; fi
# a row per operation: device, name, calls and seconds; the selection's histograms and the
# merge's combine on the device among them (its name begins with what --device gives: cuda is
# cuda:0). Every tensor is one slab on the device, so each selection takes the two full
# histogram passes there, not a window guessed from a sample (see lm_eng_select_tensor).
dev=${ample[*]}
dev=${dev#--device }
dev=${dev%% *}
if grep -q "^llmerge: profile (LLMERGE_PROFILE): .* s since the first device operation" "$work/prof.err" &&
  awk -v dev="$dev" 'index($1, dev) == 1 && $2 == "hist_abs" && $3 >= 2 { h = 1 }
    index($1, dev) == 1 && $2 == "combine" && $3 >= 1 { c = 1 } $2 == "hist_window" { w = 1 }
    END { exit !(h && c && !w) }' "$work/prof.err"; then ok; else
  bad "LLMERGE_PROFILE's table with ${ample[*]}: $(head -c 800 "$work/prof.err")"; fi
if [ ! -s "$work/out" ]; then ok; else bad "without LLMERGE_PROFILE, a -q run printed: $(head -c 400 "$work/out")"; fi
rm -rf "$work/prof" "$work/prof-on"

# NaN and Inf in the base, a full FT and a LoRA factor
od=$fx/odd
same_as_cpu nonfinite-ties ties "$od/base_inf" "$od/ft_nonfinite" "$od/lora_nan" "$lr" --densities 0.3,0.5,0.4
same_as_cpu nonfinite-dare dare "$od/base_inf" "$od/lora_nan" "$ld" "$od/ft_nonfinite" --seed 4 --rescale l1 --dtype f16
same_as_cpu nonfinite-ta task-arithmetic "$B" "$od/ft_nonfinite" "$od/lora_nan" "$lm"

e2e_end
