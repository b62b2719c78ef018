#!/usr/bin/env bash
# End-to-end tests of `llmerge plan` on the fixtures: on simulated devices the tensors plan says
# will not fit (and the adapters whose factors will not) are exactly those the real merge with
# the same arguments reports in its `fallback:` lines; the predicted output bytes and shard
# count equal the real output's (llmerge.json and the shard files' data bytes); --json parses;
# the text lines are there; bad arguments are exit status 2, as for the merge.
# Usage: e2e_plan.sh LLMERGE FIXTURES JSONQ
set -u
llmerge=$1 fx=$2 jsonq=$3
work=$(mktemp -d /tmp/lm_e2e_plan_XXXXXX)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0

ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*" >&2; }

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
  if ! "$llmerge" "$@" -o "$out" --threads 2 >"$work/$name.merge.out" 2>&1; then
    bad "$name: merge $* failed: $(head -c 600 "$work/$name.merge.out")"
    return
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

echo "e2e_plan: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
