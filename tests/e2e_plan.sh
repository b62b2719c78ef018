#!/usr/bin/env bash
# End-to-end tests of `llmerge plan` on the fixtures: on simulated devices the tensors plan says
# will not fit (and the adapters whose factors will not) are exactly those the real merge with
# the same arguments reports in its `fallback:` lines; the predicted output bytes and shard
# count equal the real output's (llmerge.json and the shard files' data bytes); --json parses;
# the text lines are there; bad arguments are exit status 2, as for the merge. For sparsegpt,
# the capture phase: the weights that will not fit, the batches halved and the sequences run on
# the CPU are exactly those the merge reports for each model, the activations' bytes are those
# its out-of-memory messages name, the sizes follow from the fixtures' shapes and calibration
# file, and what the cache holds after a merge spares the next plan's captures.
# Usage: e2e_plan.sh LLMERGE FIXTURES JSONQ
set -u
llmerge=$1 fx=$2 jsonq=$3
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_plan
export XDG_CACHE_HOME=$work/xdg  # sparsegpt's default cache: never the user's

# jq_list FILE PATH: the strings of the JSON array at PATH, one a line, sorted.
jq_list() {
  local n i
  n=$("$jsonq" "$1" "$2.#") || return 1
  for ((i = 0; i < n; i++)); do "$jsonq" "$1" "$2.$i"; done | sort
}

# data_bytes FILE: a safetensors file's data bytes (its size less the 8-byte length and header).
data_bytes() {
  local hlen size
  hlen=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
  size=$(stat -c %s "$1")
  echo $((size - 8 - hlen))
}

# capture_want PLAN_JSON: the capture fallbacks a plan predicts, one a line: "I weights",
# "I halved A-B T", "I cpu S T", "I sticky" (I: the capture, from 0; sequences from 1).
capture_want() {
  local n i k j kind
  n=$("$jsonq" "$1" capture.#) || return 0
  for ((i = 0; i < n; i++)); do
    [ "$("$jsonq" "$1" capture.$i.captured)" = true ] || continue
    [ "$("$jsonq" "$1" capture.$i.weights.fallback)" = true ] && echo "$i weights"
    k=$("$jsonq" "$1" capture.$i.fallbacks.#)
    for ((j = 0; j < k; j++)); do
      kind=$("$jsonq" "$1" capture.$i.fallbacks.$j.kind)
      if [ "$kind" = halved ]; then
        echo "$i halved $("$jsonq" "$1" capture.$i.fallbacks.$j.first)-$("$jsonq" "$1" capture.$i.fallbacks.$j.last)" \
          "$("$jsonq" "$1" capture.$i.fallbacks.$j.tokens)"
      else
        echo "$i cpu $("$jsonq" "$1" capture.$i.fallbacks.$j.first) $("$jsonq" "$1" capture.$i.fallbacks.$j.tokens)"
      fi
    done
    [ "$("$jsonq" "$1" capture.$i.sticky)" = true ] && echo "$i sticky"
    k=$("$jsonq" "$1" capture.$i.factor_fallbacks)
    [ "$k" -gt 0 ] && echo "$i factors $k"
  done
  return 0
}

# capture_got MERGE_OUTPUT: the same from what the merge said, each Hessian set's lines after its
# "Hessians of" line.
capture_got() {
  local i=-1 line re_h re_c factors=0
  re_h='fallback: hessian sequences ([0-9]+)-([0-9]+) \(([0-9]+) tokens\) halved'
  re_c='fallback: hessian sequence ([0-9]+) \(([0-9]+) tokens\) on cpu'
  while IFS= read -r line; do
    case $line in
      *": Hessians of "*)
        [ "$factors" -gt 0 ] && echo "$i factors $factors"
        i=$((i + 1)) factors=0 ;;
      *"fallback: hessian factor of "*) factors=$((factors + 1)) ;;
      *"fallback: hessian weights of "*) echo "$i weights" ;;
      *"--sticky-fallback"*) echo "$i sticky" ;;
      *)
        if [[ $line =~ $re_h ]]; then echo "$i halved ${BASH_REMATCH[1]}-${BASH_REMATCH[2]} ${BASH_REMATCH[3]}"
        elif [[ $line =~ $re_c ]]; then echo "$i cpu ${BASH_REMATCH[1]} ${BASH_REMATCH[2]}"; fi ;;
    esac
  done <"$1"
  [ "$factors" -gt 0 ] && echo "$i factors $factors"
  return 0
}

# compare NAME ARGS...: plan and merge with ARGS (the method first, then BASE FT... and options);
# the fallbacks and output sizes plan predicts must be what the merge reports.
compare() {
  local name=$1
  shift
  local out="$work/$name"
  if ! "$llmerge" plan "$@" -o "$out" --json >"$work/$name.plan.json" 2>"$work/$name.plan.err"; then
    bad "$name: plan $* failed: $(head -c 600 "$work/$name.plan.err")"
    return
  fi
  if ! "$jsonq" "$work/$name.plan.json" method >/dev/null; then
    bad "$name: plan --json is not JSON: $(head -c 300 "$work/$name.plan.json")"
    return
  fi
  ok
  if ! "$llmerge" "$@" -o "$out" --threads 2 --log-json "$work/$name.log" >"$work/$name.merge.out" 2>&1; then
    bad "$name: merge $* failed: $(head -c 600 "$work/$name.merge.out")"
    return
  fi
  # every fallback line is a --log-json event too (the sticky note is no unit's)
  local n_lines n_events
  n_lines=$(grep "fallback: " "$work/$name.merge.out" | grep -vc -- "--sticky-fallback")
  n_events=$(grep -c '"event":"fallback"' "$work/$name.log")
  if [ "$n_lines" = "$n_events" ]; then ok; else
    bad "$name: $n_lines fallback lines, $n_events fallback events in --log-json"
  fi
  # merge units
  jq_list "$work/$name.plan.json" merge.fallbacks >"$work/$name.want"
  sed -n 's/.*fallback: merge \([^ ]*\) on cpu.*/\1/p' "$work/$name.merge.out" | sort >"$work/$name.got"
  if cmp -s "$work/$name.want" "$work/$name.got"; then ok; else
    bad "$name: plan predicted merge fallbacks [$(tr '\n' ' ' <"$work/$name.want")], the merge had [$(tr '\n' ' ' <"$work/$name.got")]"
  fi
  # placement: FT paths compared by their last component (the merge names the resolved path)
  local n i
  n=$("$jsonq" "$work/$name.plan.json" place.#)
  for ((i = 0; i < n; i++)); do
    if [ "$("$jsonq" "$work/$name.plan.json" place.$i.fallback)" = true ]; then
      basename "$("$jsonq" "$work/$name.plan.json" place.$i.path)"
    fi
  done | sort >"$work/$name.pwant"
  sed -n 's/.*fallback: place \([^ ]*\) on cpu.*/\1/p' "$work/$name.merge.out" | xargs -r -n1 basename | sort \
    >"$work/$name.pgot"
  if cmp -s "$work/$name.pwant" "$work/$name.pgot"; then ok; else
    bad "$name: plan predicted place fallbacks [$(tr '\n' ' ' <"$work/$name.pwant")], the merge had [$(tr '\n' ' ' <"$work/$name.pgot")]"
  fi
  # the output: bytes and shards as llmerge.json records them and as the files hold them
  local want_bytes want_shards got_bytes got_shards files f sum=0
  want_bytes=$("$jsonq" "$work/$name.plan.json" output.bytes)
  want_shards=$("$jsonq" "$work/$name.plan.json" output.shards)
  got_bytes=$("$jsonq" "$out/llmerge.json" outputs.total_size)
  got_shards=$("$jsonq" "$out/llmerge.json" outputs.shards.#)
  files=$(ls "$out"/*.safetensors)
  for f in $files; do sum=$((sum + $(data_bytes "$f"))); done
  if [ "$want_bytes" = "$got_bytes" ] && [ "$want_bytes" = "$sum" ] && [ "$want_shards" = "$got_shards" ] &&
     [ "$want_shards" = "$(echo "$files" | wc -l)" ]; then ok; else
    bad "$name: plan predicted $want_bytes bytes in $want_shards shards; llmerge.json says $got_bytes in $got_shards, the files hold $sum in $(echo "$files" | wc -l)"
  fi
  # sparsegpt's capture: per Hessian set, the weights, halved batches and CPU sequences
  if "$jsonq" "$work/$name.plan.json" capture.# >/dev/null 2>&1; then
    capture_want "$work/$name.plan.json" >"$work/$name.cwant"
    capture_got "$work/$name.merge.out" >"$work/$name.cgot"
    if cmp -s "$work/$name.cwant" "$work/$name.cgot"; then ok; else
      bad "$name: plan predicted capture fallbacks [$(tr '\n' ',' <"$work/$name.cwant")], the merge had [$(tr '\n' ',' <"$work/$name.cgot")]"
    fi
    echo "$name: $(wc -l <"$work/$name.cgot") capture fallbacks, as planned"
  fi
  echo "$name: $(wc -l <"$work/$name.got") merge and $(wc -l <"$work/$name.pgot") place fallbacks, as planned"
}

# Fallbacks must happen for the comparisons above to mean anything: sim:64KiB makes some, and
# sim:1KiB leaves no room for any adapter's factors.
compare ties64 ties "$fx/base" "$fx/lora_plain" "$fx/ft_full" --device sim:64KiB
compare ties1 ties "$fx/base" "$fx/lora_plain" "$fx/lora_rslora" --device sim:1KiB
compare dare64 dare-ties "$fx/base" "$fx/ft_full" "$fx/lora_dora" "$fx/lora_mts" --device sim:64KiB --seed 7
compare ta96 task-arithmetic "$fx/base" "$fx/lora_rslora" "$fx/ft_full2" --device sim:96KiB --dtype f32
compare cap ties "$fx/base" "$fx/lora_plain" "$fx/lora_rslora" --device sim:1GiB --gpu-mem 40KiB --shard-size 60KB
compare global ties "$fx/base" "$fx/lora_plain" "$fx/ft_full" --device sim:64KiB --topk global
# --topk global's select units are sized as the merge units: the same tensors fall back there.
sed -n 's/.*fallback: select \([^ ]*\) on cpu.*/\1/p' "$work/global.merge.out" | sort -u >"$work/global.sgot"
if [ -s "$work/global.sgot" ] && cmp -s "$work/global.want" "$work/global.sgot"; then ok; else
  bad "global: select fallbacks [$(tr '\n' ' ' <"$work/global.sgot")], plan predicted [$(tr '\n' ' ' <"$work/global.want")]"
fi
for name in ties64 ties1; do
  if [ -s "$work/$name.got" ] || [ -s "$work/$name.pgot" ]; then ok; else bad "$name: the merge had no fallbacks to compare"; fi
done
if [ -s "$work/ties1.pgot" ]; then ok; else bad "ties1: no place fallback at sim:1KiB"; fi
if [ "$("$jsonq" "$work/cap.plan.json" output.shards)" -gt 1 ]; then ok; else bad "cap: --shard-size 60KB gave one shard"; fi

# ---- sparsegpt: the capture phase -------------------------------------------------------------
cj=$fx/calib/calib.jsonl ct=$fx/calib/calib.txt
# Each its own cache directory, so every Hessian set is captured. sim:300KiB leaves no room for
# either model's weights (431 and 417 KiB as float32); at 450KiB they fit but no batch does
# (halved down to sequences on the CPU); at 700KiB part of the accumulators fit and some batches;
# at 2MiB everything does.
sg() { local name=$1 size=$2; shift 2; compare "$name" sparsegpt "$fx/base" "$fx/lora_plain" "$fx/ft_full" \
  --calib "$cj" --density 0.3 --cache-dir "$work/cache-$name" --device "sim:$size" "$@"; }
sg sg300 300KiB
sg sg450 450KiB
sg sg700 700KiB
sg sg2m 2MiB
sg sgsticky 450KiB --sticky-fallback
sg sgbase 450KiB --hessian-from base
sg sgtwo 700KiB --calib "$ct" --seq-len 20 --calib-samples 6
sg sgcap 1GiB --gpu-mem 600KiB
# the merge's units with their importance buffers: at 150KiB the MLP tensors fit without them
# (112 KiB beside 14 KiB of factors) but not with them (145 KiB)
sg sg150 150KiB
sg sg48 48KiB
# the cases reach every kind of fallback, and one without any
for want in "sg300:weights" "sg450:halved" "sg450:cpu" "sgsticky:sticky" "sgbase:halved" "sg700:halved"; do
  if grep -q " ${want#*:}" "$work/${want%%:*}.cgot"; then ok; else bad "${want%%:*}: no ${want#*:} fallback to compare"; fi
done
if [ ! -s "$work/sg2m.cgot" ]; then ok; else bad "sg2m: capture fallbacks at 2MiB: $(cat "$work/sg2m.cgot")"; fi
if grep -q "mlp.down_proj" "$work/sg150.got" && [ -s "$work/sg48.got" ]; then ok; else
  bad "sg150/sg48: no merge fallbacks to compare: [$(tr '\n' ' ' <"$work/sg150.got")]"
fi
if [ "$("$jsonq" "$work/sgbase.plan.json" capture.#)" = 1 ] && [ "$("$jsonq" "$work/sgbase.plan.json" capture.0.ft)" = null ]
then ok; else bad "sgbase: not one capture of the base: $(head -c 400 "$work/sgbase.plan.json")"; fi

# The activations' bytes are those the merge's out-of-memory messages name ("allocating X").
fmt_bytes() { awk -v b="$1" 'BEGIN { split("B KiB MiB GiB TiB", u, " "); i = 1; v = b;
  while (v >= 1024 && i < 5) { v /= 1024; i++ } if (i == 1) printf "%d B\n", b; else printf "%.2f %s\n", v, u[i] }'; }
need=$("$jsonq" "$work/sg450.plan.json" capture.0.fallbacks.0.need_bytes)
tokens=$("$jsonq" "$work/sg450.plan.json" capture.0.fallbacks.0.tokens)
if grep -qF "activations of a batch of $tokens tokens: sim:450KiB: out of memory allocating $(fmt_bytes "$need") (" \
  "$work/sg450.merge.out"; then ok; else
  bad "sg450: the merge never asked for $(fmt_bytes "$need") for $tokens tokens: $(grep -m1 'halved' "$work/sg450.merge.out")"
fi
# ... and the device bytes in use beside them are the planned weights and accumulators there
inuse=$(( $("$jsonq" "$work/sg450.plan.json" capture.0.weights.bytes) + $("$jsonq" "$work/sg450.plan.json" capture.0.hessians.device_bytes) ))
if grep -qF "($(fmt_bytes "$inuse") of 450.00 KiB in use)" "$work/sg450.merge.out"; then ok; else
  bad "sg450: planned $(fmt_bytes "$inuse") in use: $(grep -m1 'halved' "$work/sg450.merge.out")"
fi

# Sizes from the fixtures' shapes (config.json) and the calibration file.
cfg=$fx/base/config.json
h=$("$jsonq" "$cfg" hidden_size) i=$("$jsonq" "$cfg" intermediate_size) L=$("$jsonq" "$cfg" num_hidden_layers)
q=$(( $("$jsonq" "$cfg" num_attention_heads) * $("$jsonq" "$cfg" head_dim) ))
kv=$(( $("$jsonq" "$cfg" num_key_value_heads) * $("$jsonq" "$cfg" head_dim) ))
V=$("$jsonq" "$cfg" vocab_size)
heads=2; [ "$("$jsonq" "$cfg" tie_word_embeddings)" = true ] && heads=1
params=$(( heads * V * h + L * (h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h) + h ))
weights=$(( 4 * params + 4 * $("$jsonq" "$cfg" head_dim) / 2 ))  # BF16: all converted, and the rope table
hess=$(( 4 * L * (h * h + q * q + h * h + i * i) ))
seqs=$(wc -l <"$ct") tokens=$(awk '{ n += NF } END { print n }' "$ct") longest=$(awk '{ if (NF > m) m = NF } END { print m }' "$ct")
if "$llmerge" plan sparsegpt "$fx/base" "$fx/ft_full" "$fx/lora_plain" -o "$work/sz" --calib "$ct" --device cpu \
     --cache-dir "$work/cache-sz" --json >"$work/sz.json" 2>&1; then
  got="$("$jsonq" "$work/sz.json" capture.0.weights.bytes) $("$jsonq" "$work/sz.json" capture.0.hessians.bytes)"
  got="$got $("$jsonq" "$work/sz.json" capture.0.sequences) $("$jsonq" "$work/sz.json" capture.0.tokens)"
  got="$got $("$jsonq" "$work/sz.json" capture.0.longest) $("$jsonq" "$work/sz.json" capture.0.largest_batch)"
  got="$got $("$jsonq" "$work/sz.json" capture.0.batches) $("$jsonq" "$work/sz.json" capture.0.weights.on)"
  got="$got $("$jsonq" "$work/sz.json" capture.0.activations.fit_tokens) $("$jsonq" "$work/sz.json" capture.1.weights.bytes)"
  want="$weights $hess $seqs $tokens $longest $tokens 1 cpu null $weights"  # lora_plain's F32 factors are used in place
  if [ "$got" = "$want" ]; then ok; else bad "plan sizes on the cpu: got [$got], want [$want]"; fi
  # the merge's U_cc² sets (a double per input of every layer, one set per FT) and the peak
  sets=$(( 2 * 8 * L * (h + q + h + i) ))
  peak=$("$jsonq" "$work/sz.json" cpu.peak_bytes) cap0=$("$jsonq" "$work/sz.json" capture.0.cpu.peak_bytes)
  mpeak=$("$jsonq" "$work/sz.json" cpu.merge_peak_bytes)
  if [ "$("$jsonq" "$work/sz.json" cpu.hessian_sets)" = "$sets" ] && [ "$peak" -ge "$cap0" ] && [ "$peak" -ge "$mpeak" ] &&
     [ "$("$jsonq" "$work/sz.json" capture.0.cpu.accumulators)" = "$hess" ]; then ok; else
    bad "plan's cpu figures: sets $("$jsonq" "$work/sz.json" cpu.hessian_sets) (want $sets), peak $peak, capture $cap0, merge $mpeak"
  fi
else
  bad "plan sparsegpt on the cpu failed: $(head -c 600 "$work/sz.json")"
fi

# What the cache holds after a merge spares the captures: the masks of every FT (the same
# options: no Hessians needed), U_cc² (another density: masks differ), the Hessians alone.
cache=$work/cache-sg450
plan_cached() { "$llmerge" plan sparsegpt "$fx/base" "$fx/lora_plain" "$fx/ft_full" -o "$work/pc" --calib "$cj" \
  --cache-dir "$cache" --device sim:450KiB --json "$@" >"$work/pc.json" 2>"$work/pc.err" &&
  echo "$("$jsonq" "$work/pc.json" capture.0.cached) $("$jsonq" "$work/pc.json" capture.1.cached) $("$jsonq" "$work/pc.json" cache.looked_up)"; }
got=$(plan_cached --density 0.3)
if [ "$got" = "masks masks true" ]; then ok; else bad "after the merge, same options: $got $(head -c 300 "$work/pc.err")"; fi
got=$(plan_cached --density 0.5)
if [ "$got" = "ucc2 ucc2 true" ]; then ok; else bad "after the merge, another density: $got $(head -c 300 "$work/pc.err")"; fi
rm -f "$cache"/ucc2-* "$cache"/mask-*
got=$(plan_cached --density 0.3)
if [ "$got" = "hessians hessians true" ]; then ok; else bad "the Hessians alone in the cache: $got $(head -c 300 "$work/pc.err")"; fi
if [ "$("$jsonq" "$work/pc.json" capture.0.cpu.peak_bytes)" -lt "$("$jsonq" "$work/sg450.plan.json" capture.0.cpu.peak_bytes)" ]
then ok; else bad "Hessians from the cache planned no smaller than a capture"; fi
# a plan writes nothing: the cache holds what it held
ls "$cache" >"$work/cache.before"
plan_cached --density 0.3 >/dev/null
ls "$cache" >"$work/cache.after"
if cmp -s "$work/cache.before" "$work/cache.after" && [ ! -e "$work/pc" ]; then ok; else bad "plan changed the cache or wrote OUT"; fi
# an empty cache directory is not hashed for
if "$llmerge" plan sparsegpt "$fx/base" "$fx/lora_plain" -o "$work/pe" --calib "$cj" --cache-dir "$work/empty" --json \
     >"$work/pe.json" && [ "$("$jsonq" "$work/pe.json" cache.looked_up)" = false ] &&
   [ "$("$jsonq" "$work/pe.json" capture.0.cached)" = none ]; then ok; else bad "plan with an empty cache: $(head -c 300 "$work/pe.json")"; fi

# The text names the capture's steps.
if "$llmerge" plan sparsegpt "$fx/base" "$fx/lora_plain" "$fx/ft_full" -o "$work/t" --calib "$cj" --device sim:450KiB \
     --cache-dir "$work/cache-text" >"$work/stext" 2>&1 &&
   grep -q "^capture: FT 1 (.*lora_plain) on .*calib.jsonl: 8 sequences, [0-9]* tokens (the longest [0-9]*); 1 batch of at most 4096 tokens" "$work/stext" &&
   grep -q "^capture: FT 1 (.*lora_plain) weights: .* of float32 on sim:450KiB" "$work/stext" &&
   grep -q "^capture: FT 2 (.*ft_full) Hessians: 8 accumulators, 224.00 KiB" "$work/stext" &&
   grep -q "^capture: FT 1 (.*lora_plain) activations: .* the largest batch that fits is [0-9]* tokens" "$work/stext" &&
   grep -q "^capture: FT 1 (.*lora_plain) fallback: sequence 1 ([0-9]* tokens) on cpu" "$work/stext" &&
   grep -q "^capture: FT 2 (.*ft_full) cpu: peak about " "$work/stext" &&
   grep -q "^merge: importance (sparsegpt): 14 tensors" "$work/stext" &&
   grep -q "^cpu: peak about .*, in the " "$work/stext" &&
   grep -q "^cache: the merge writes about " "$work/stext"; then ok; else
  bad "plan sparsegpt's text: $(cat "$work/stext")"
fi
expect2_sg() { "$llmerge" plan sparsegpt "$fx/base" "$fx/lora_plain" -o "$work/x" "$@" >"$work/bad" 2>&1; }
expect2_sg; if [ $? -eq 2 ] && grep -q "needs calibration data" "$work/bad"; then ok; else bad "plan sparsegpt without --calib: $(cat "$work/bad")"; fi

# The text form names each phase.
if "$llmerge" plan ties "$fx/base" "$fx/lora_plain" "$fx/ft_full" -o "$work/t" --device sim:1KiB >"$work/text" 2>&1 &&
   grep -q "^place: FT 1 (.*lora_plain) .* of LoRA factors: stays on cpu (does not fit)$" "$work/text" &&
   grep -q "^merge: largest tensor .* needs .* on sim:1KiB; [0-9]* of [0-9]* tensors do not fit" "$work/text" &&
   grep -q "^cpu: peak about " "$work/text" &&
   grep -q "^output: [0-9]* bytes in 1 shard; .* free at $work (fits)$" "$work/text"; then ok; else
  bad "plan's text: $(cat "$work/text")"
fi
# On the CPU nothing is placed and nothing falls back; plan writes nothing.
if "$llmerge" plan ties "$fx/base" "$fx/lora_plain" -o "$work/c" --device cpu --json >"$work/cpu.json" &&
   [ "$("$jsonq" "$work/cpu.json" merge.fallbacks.#)" = 0 ] && [ "$("$jsonq" "$work/cpu.json" place.0.on)" = cpu ] &&
   [ "$("$jsonq" "$work/cpu.json" cpu.peak_bytes)" -gt 0 ] && [ ! -e "$work/c" ]; then ok; else
  bad "plan on the cpu: $(head -c 600 "$work/cpu.json")"
fi

# Bad arguments: exit status 2 with a message, as the merge commands.
expect2() {
  local needle=$1
  shift
  "$llmerge" plan "$@" >"$work/bad" 2>&1
  local rc=$?
  if [ $rc -eq 2 ] && grep -qF -- "$needle" "$work/bad"; then ok; else
    bad "plan $* exited $rc, wanted 2 and '$needle': $(head -c 300 "$work/bad")"
  fi
}
expect2 "Usage"
expect2 "not a merge method" tie "$fx/base" "$fx/lora_plain" -o "$work/x"
expect2 "no output directory" ties "$fx/base" "$fx/lora_plain"
expect2 "did you mean" ties "$fx/base" "$fx/lora_plain" -o "$work/x" --densty 0.5
expect2 "--weights" ties "$fx/base" "$fx/lora_plain" -o "$work/x" --weights 1,2
expect2 "sim:" ties "$fx/base" "$fx/lora_plain" -o "$work/x" --device sim:banana
expect2 "FT 1" ties "$fx/base" "$fx/llama3" -o "$work/x"
mkdir -p "$work/exists"
expect2 "already exists" ties "$fx/base" "$fx/lora_plain" -o "$work/exists"

e2e_end
