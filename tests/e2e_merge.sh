#!/usr/bin/env bash
# End-to-end tests of the merge commands (ties, dare, dare-ties, task-arithmetic) through the
# binary, on the fixtures: each method runs and its output loads (`llmerge inspect`: check ok);
# the output directory carries what docs/formats.md "Files a merged model directory carries"
# lists (shards and index, config.json with the dtype updated, the base's tokenizer and
# generation files, llmerge.json) and the model card README.md, whose front matter names Hub ids
# only and whose command line makes the same merge again (no card with --no-card); llmerge.json's
# per-tensor and input-file hashes equal xxHash64 of the data, computed here by st_hash; the
# same seed gives byte-identical shards on 1 and 2 threads and another seed changes dare's
# output; --log-json writes valid JSON Lines; every bad input is exit status 2 with a message
# naming it and leaves no output; a run that fails while writing is exit status 1 and leaves
# nothing behind. sparsegpt's cache: a second run of a point reads each FT's masks back and
# neither captures nor selects, another density reads the U_cc² back, a run without U_cc² and
# masks computes them from the kept Hessians, another calibration file misses; every output is
# byte-identical to the same merge without any cache (--topk tensor and global, the simulated
# device with fallbacks); damaged and truncated entries are said and computed again;
# LLMERGE_CACHE_HESSIANS=0 keeps no Hessians; a cache that cannot be written is a warning.
# An adapter's modules that its adapter_config.json does not select (target_modules as names
# or a Python regex, layers_to_transform, exclude_modules) are not merged, a warning names
# their keys and `inspect` lists them; a target_modules that selects no layer of the base, or
# a regex that does not compile or runs past its limits, is exit status 2 naming the file and
# the key.
# A tensor in a dtype llmerge cannot compute with is refused where base and FT differ (or an
# adapter changes it) and copied where they are equal. A full FT's tensor the base does not have
# is left out with a warning and counted in llmerge.json, and refused with --strict. NaN and Inf
# in the base, a full FT and a LoRA factor are counted per input and in the output, said in a
# warning and recorded in llmerge.json, the same on the simulated device as on the CPU.
# Usage: e2e_merge.sh LLMERGE FIXTURES JSONQ ST_HASH
set -u
llmerge=$1 fx=$2 jsonq=$3 st_hash=$4
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_merge
export XDG_CACHE_HOME=$work/cache  # sparsegpt's default cache: never the user's

check() { if eval "$1"; then ok; else bad "$2"; fi; }

# merge ARGS...: a merge that must succeed.
merge() {
  if "$llmerge" "$@" >"$work/out" 2>&1; then ok; else bad "llmerge $* failed: $(head -c 600 "$work/out")"; fi
}

# loads DIR: llmerge reads DIR back as a model and its check against the architecture passes.
loads() {
  if "$llmerge" inspect "$1" >"$work/inspect" 2>&1 && grep -q "^check: ok" "$work/inspect"; then ok; else
    bad "inspect $1: $(head -c 600 "$work/inspect")"
  fi
}

# no_output DIR: neither DIR nor a temporary directory beside it is left.
no_output() {
  local left
  left=$(find "$(dirname "$1")" -maxdepth 1 -name "$(basename "$1")*" | head -3)
  if [ -z "$left" ]; then ok; else bad "left behind: $left"; fi
}

# hashes_match DIR: every tensor of llmerge.json has the xxh64 of its data in its shard, and every
# tensor of the shards is listed.
hashes_match() {
  local dir=$1 n i name shard want got
  "$st_hash" "$dir"/model*.safetensors >"$work/hashes" 2>&1 || { bad "st_hash $dir: $(cat "$work/hashes")"; return; }
  n=$("$jsonq" "$dir/llmerge.json" outputs.tensors.#)
  [ "$n" -eq "$(wc -l <"$work/hashes")" ] && ok || bad "$dir: llmerge.json lists $n tensors, the shards hold $(wc -l <"$work/hashes")"
  local mismatches=0
  for ((i = 0; i < n; i++)); do
    name=$("$jsonq" "$dir/llmerge.json" outputs.tensors.$i.name)
    shard=$("$jsonq" "$dir/llmerge.json" outputs.tensors.$i.shard)
    want=$("$jsonq" "$dir/llmerge.json" outputs.tensors.$i.xxh64)
    got=$("$st_hash" "$dir/$shard" | awk -v n="$name" '$1 == n { print $2 }')
    if [ "$got" != "$want" ]; then
      mismatches=$((mismatches + 1))
      echo "  $dir: $name in $shard: data xxh64 $got, llmerge.json says $want" >&2
    fi
  done
  [ $mismatches -eq 0 ] && ok || bad "$dir: $mismatches tensor hashes differ from the data"
}

# inputs_match DIR: every input file hash in llmerge.json (base and inputs) equals the file's.
inputs_match() {
  local dir=$1 m="$1/llmerge.json" nin nf i j path name want got mismatches=0 files=0
  local sections=(base)
  nin=$("$jsonq" "$m" inputs.#)
  for ((i = 0; i < nin; i++)); do sections+=("inputs.$i"); done
  for sec in "${sections[@]}"; do
    path=$("$jsonq" "$m" "$sec.path")
    nf=$("$jsonq" "$m" "$sec.files.#")
    for ((j = 0; j < nf; j++)); do
      name=$("$jsonq" "$m" "$sec.files.$j.name")
      want=$("$jsonq" "$m" "$sec.files.$j.xxh64")
      got=$("$st_hash" --file "$path/$name" | awk '{ print $1 }')
      files=$((files + 1))
      if [ "$got" != "$want" ] || [ "$("$jsonq" "$m" "$sec.files.$j.bytes")" != "$(stat -c %s "$path/$name")" ]; then
        mismatches=$((mismatches + 1))
        echo "  $m: $sec $name: file xxh64 $got, llmerge.json says $want" >&2
      fi
    done
  done
  [ $mismatches -eq 0 ] && [ $files -gt 0 ] && ok || bad "$m: $mismatches of $files input file hashes differ"
}

# same_shards A B: the weight files and configs of two outputs are byte-identical.
same_shards() {
  local f diff=0
  for f in "$1"/model*.safetensors "$1"/model.safetensors.index.json "$1"/config.json; do
    [ -e "$f" ] || continue
    cmp -s "$f" "$2/$(basename "$f")" || { diff=1; echo "  $f differs from $2/$(basename "$f")" >&2; }
  done
  [ "$(ls "$1" | grep -c '^model')" = "$(ls "$2" | grep -c '^model')" ] || diff=1
  [ $diff -eq 0 ] && ok || bad "$1 and $2 differ"
}

# card_cmd DIR: the command line DIR/README.md gives for making the same merge (its ```sh block),
# with llmerge as this test runs it.
card_cmd() {
  awk '/^```+sh$/ { on = 1; next } on && /^```+$/ { exit } on' "$1/README.md" | sed "s|^llmerge |'$llmerge' |"
}

# card_again DIR AGAIN: runs the card's command line of DIR into AGAIN (a later -o wins), which must
# give the same shards.
card_again() {
  local cmd
  cmd=$(card_cmd "$1")
  if [ -n "$cmd" ] && eval "$cmd -o '$2' -q" >"$work/again.out" 2>&1; then ok; else
    bad "the command line of $1/README.md failed: $cmd: $(head -c 600 "$work/again.out")"
    return
  fi
  same_shards "$1" "$2"
}

# front DIR: the YAML front matter of DIR/README.md, without its --- lines.
front() { awk 'NR == 1 && $0 == "---" { on = 1; next } on && $0 == "---" { exit } on' "$1/README.md"; }

B=$fx/base
lp=$fx/lora_plain lr=$fx/lora_rslora ff=$fx/ft_full
version=$("$llmerge" --version | awk '{ print $2 }')

# ---- ties of two adapters and a full fine-tune -----------------------------------------------
o=$work/ties
merge ties "$B" "$lp" "$lr" "$ff" -o "$o" --device cpu  # the default, auto, takes a GPU where there is one
loads "$o"
"$llmerge" inspect --json "$o" >"$work/json" 2>/dev/null
json "$work/json" n_tensors 21
json "$work/json" dtypes.BF16 21
json "$work/json" shards.# 1
check '[ -f "$o/model.safetensors" ] && [ ! -e "$o/model.safetensors.index.json" ]' "ties: one model.safetensors, no index"
json "$o/config.json" torch_dtype bfloat16
# config.json is the base's, unchanged when the dtype stays
check 'cmp -s "$B/config.json" "$o/config.json"' "ties: config.json differs from the base's"
for f in tokenizer_config.json special_tokens_map.json generation_config.json; do
  check 'cmp -s "$B/$f" "$o/$f"' "ties: $f not copied from the base"
done
check '[ ! -e "$o/model-00001-of-00002.safetensors" ]' "ties: a base shard was copied"
m=$o/llmerge.json
json "$m" method ties
json "$m" options.normalize true
json "$m" options.densities '[0.2,0.2,0.2]'
json "$m" options.weights '[1,1,1]'
json "$m" options.dtype bf16
json "$m" options.shard_size 5000000000
json "$m" inputs.# 3
json "$m" inputs.0.kind adapter
json "$m" inputs.2.kind model
json "$m" inputs.0.files.1.name adapter_model.safetensors
json "$m" base.files.# 4
json "$m" devices.cpu 21
json "$m" stats.tensors_merged 21
json "$m" outputs.shards.0.name model.safetensors
for k in load_s merge_s write_s total_s; do
  check '"$jsonq" "$m" timings.$k >/dev/null' "llmerge.json: no timings.$k"
done
hashes_match "$o"
inputs_match "$o"
# the model card: README.md with the Hub's front matter (no base_model: the fixtures are local
# paths, not Hub ids, and the body says to add them), the method, the inputs with their weights
# and densities, the options, the version, and a command line that makes the same merge
check '[ -f "$o/README.md" ] && [ "$(head -1 "$o/README.md")" = "---" ]' "ties: no README.md with front matter: $(ls "$o")"
front "$o" >"$work/front"
check 'diff "$work/front" - >/dev/null <<EOF
library_name: transformers
tags:
- merge
- llmerge
EOF' "ties: README.md front matter: $(cat "$work/front")"
check 'grep -qF "llmerge $version" "$o/README.md" && grep -qiF "ties" "$o/README.md"' "ties: README.md lacks the version or method"
check 'grep -qF "\`$lr\` (LoRA adapter): weight 1, density 0.2" "$o/README.md" && grep -qF "\`$ff\` (model): weight 1, density 0.2" "$o/README.md"' \
  "ties: README.md lacks the inputs: $(cat "$o/README.md")"
check 'card_cmd "$o" | grep -qF -- " --densities 0.2,0.2,0.2 --lambda 1 --normalize --sign sum --topk tensor --dtype bf16"' \
  "ties: README.md's command line: $(card_cmd "$o")"
json "$m" outputs.card README.md
card_again "$o" "$work/ties_again"
check 'grep -qF "wrote $o: 1 shard, config.json, 3 tokenizer/generation files, README.md, llmerge.json" "$work/out"' \
  "ties: the wrote line: $(tail -1 "$work/out")"
# a summary line on stderr (not a terminal: the final progress line and the summary), with the
# tensors merged and copied as llmerge.json counts them, and sizes and rates in binary units only
check 'grep -q "tensor 21/21" "$work/out" && grep -q "merged 21 tensors, copied 0 from the base (" "$work/out" && grep -q "peak memory" "$work/out"' \
  "ties: no progress or summary on stderr: $(cat "$work/out")"
check 'grep -qF "llmerge ties: merging 3 fine-tunes onto $B into $o (bf16, " "$work/out"' "ties: no 'merging' line: $(head -3 "$work/out")"
check 'grep -qE "tensor 21/21, [0-9.]+ KiB/[0-9.]+ KiB, [0-9.]+ MiB/s, took" "$work/out" &&
  grep -qE "\([0-9.]+ KiB\) in [0-9.]+ s \([0-9.]+ MiB/s\), peak memory [0-9.]+ MiB" "$work/out" && ! grep -qE "[0-9] ?[KMGT]B\b|[KMGT]B/s" "$work/out"' \
  "ties: units of two systems on stderr: $(cat "$work/out")"

# The same merge on 1 and 2 threads: byte-identical.
merge ties "$B" "$lp" "$lr" "$ff" -o "$work/ties_t1" --threads 1 -q
merge ties "$B" "$lp" "$lr" "$ff" -o "$work/ties_t2" --threads=2 -q
same_shards "$work/ties_t1" "$work/ties_t2"
same_shards "$o" "$work/ties_t1"
check '[ ! -s "$work/out" ]' "-q: stderr not empty: $(cat "$work/out")"

# ---- dare: seeds -----------------------------------------------------------------------------
# without --threads: the cores it may use, fewer in a Slurm job's SLURM_CPUS_PER_TASK or under
# an affinity of one core
# (on a machine of one core every run has one thread: nothing to check there)
if [ "$(nproc)" -gt 1 ]; then
  SLURM_CPUS_PER_TASK=1 merge ties "$B" "$lp" -o "$work/ties_slurm" --device cpu
  check 'grep -q "(bf16, cpu, 1 thread)" "$work/out"' "SLURM_CPUS_PER_TASK=1: $(head -1 "$work/out")"
fi
if command -v taskset >/dev/null && [ "$(nproc)" -gt 1 ]; then
  if taskset -c 0 "$llmerge" ties "$B" "$lp" -o "$work/ties_aff" --device cpu >"$work/out" 2>&1; then ok; else
    bad "taskset: $(cat "$work/out")"
  fi
  check 'grep -q "(bf16, cpu, 1 thread)" "$work/out"' "an affinity of one core: $(head -1 "$work/out")"
fi
merge dare "$B" "$lp" "$ff" -o "$work/dare1" --seed 7 --density 0.5 --threads 1
merge dare "$B" "$lp" "$ff" -o "$work/dare2" --seed=7 --densities=0.5 --threads 2
merge dare "$B" "$lp" "$ff" -o "$work/dare3" --seed 8 --density 0.5
loads "$work/dare1"
same_shards "$work/dare1" "$work/dare2"
check '! cmp -s "$work/dare1/model.safetensors" "$work/dare3/model.safetensors"' "dare: seeds 7 and 8 gave the same output"
json "$work/dare1/llmerge.json" options.seed 7
json "$work/dare1/llmerge.json" options.normalize false
json "$work/dare1/llmerge.json" options.densities '[0.5,0.5]'
check 'card_cmd "$work/dare1" | grep -qF -- " --seed 7 " && card_cmd "$work/dare1" | grep -qF -- " --rescale inv "' \
  "dare: README.md's command line: $(card_cmd "$work/dare1")"
card_again "$work/dare1" "$work/dare1_again"
# --no-card: no README.md, and llmerge.json says so
merge dare "$B" "$lp" "$ff" -o "$work/dare_nocard" --seed 7 --density 0.5 --no-card
check '[ ! -e "$work/dare_nocard/README.md" ] && ! grep -q README.md "$work/out"' "--no-card wrote a card: $(ls "$work/dare_nocard")"
json "$work/dare_nocard/llmerge.json" outputs.card null
same_shards "$work/dare1" "$work/dare_nocard"
# paths YAML and the shell must quote: a colon and space, a double quote, a hash, a backslash, a quote
odd="$work/ba se: \"x\" #1 \\ it's"
ln -s "$B" "$odd"
merge task-arithmetic "$odd" "$lp" -o "$work/odd-out" --weights 0.3
front "$work/odd-out" >"$work/front"
check '! grep -q "ba se" "$work/front" && grep -qF -- "Base model: \`$odd\`" "$work/odd-out/README.md" &&
  grep -qF "add their Hub ids there" "$work/odd-out/README.md"' "a local path in the card: $(cat "$work/odd-out/README.md")"
card_again "$work/odd-out" "$work/odd-again"
# a base in the Hub's cache layout is named by its Hub id in base_model; the local adapter is not
hub=$work/hub/models--org--tiny-base/snapshots/0123abc
mkdir -p "$hub" && cp -r "$B"/. "$hub"
merge task-arithmetic "$hub" "$lp" -o "$work/hub-out"
front "$work/hub-out" >"$work/front"
check 'diff "$work/front" - >/dev/null <<EOF
base_model:
- "org/tiny-base"
base_model_relation: merge
library_name: transformers
tags:
- merge
- llmerge
EOF' "a Hub-cache base in the front matter: $(cat "$work/front")"
hashes_match "$work/dare1"

# ---- task-arithmetic in f32, sharded ---------------------------------------------------------
o=$work/ta
merge task-arithmetic "$B" "$lp" "$fx/ft_full2" -o "$o" --weights 0.5,0.5 --dtype f32 --shard-size 100KB
loads "$o"
"$llmerge" inspect --json "$o" >"$work/json" 2>/dev/null
json "$work/json" dtypes.F32 21
check '[ "$("$jsonq" "$work/json" shards.#)" -gt 1 ]' "task-arithmetic --shard-size 100KB: one shard"
check '[ -f "$o/model.safetensors.index.json" ] && [ -f "$o/model-00001-of-00005.safetensors" ]' \
  "task-arithmetic: no index or shard files: $(ls "$o")"
json "$o/model.safetensors.index.json" metadata.total_size 427264
json "$o/config.json" torch_dtype float32
json "$o/llmerge.json" outputs.index model.safetensors.index.json
json "$o/llmerge.json" options.weights '[0.5,0.5]'
# the rest of config.json is kept as the base wrote it
check 'diff <(grep -v torch_dtype "$B/config.json") <(grep -v torch_dtype "$o/config.json") >/dev/null' \
  "task-arithmetic: config.json changed beyond the dtype"
hashes_match "$o"
inputs_match "$o"

# ties in f32 updates the dtype too; f16 likewise
merge ties "$B" "$lp" -o "$work/ties_f16" --dtype f16
# an adapter leaves most tensors alone: the summary says how many were merged and how many copied
n_m=$("$jsonq" "$work/ties_f16/llmerge.json" stats.tensors_merged) n_c=$("$jsonq" "$work/ties_f16/llmerge.json" stats.tensors_copied)
check '[ "$n_c" -gt 0 ] && [ $((n_m + n_c)) -eq 21 ] && grep -q "llmerge ties: merged $n_m tensors, copied $n_c from the base (" "$work/out"' \
  "ties of one adapter: the summary does not say $n_m merged and $n_c copied: $(cat "$work/out")"
check 'grep -qF "merging 1 fine-tune onto $B into $work/ties_f16 (f16, " "$work/out"' "ties of one adapter: $(head -2 "$work/out")"
json "$work/ties_f16/config.json" torch_dtype float16
loads "$work/ties_f16"

# ---- dare-ties, and the other adapter kinds --------------------------------------------------
o=$work/dt
merge dare-ties "$B" "$lp" "$fx/lora_dora" "$fx/lora_mts" -o "$o" --seed 3 --density 0.5 --lambda 0.8 --sign count
loads "$o"
json "$o/llmerge.json" method dare-ties
json "$o/llmerge.json" options.sign count
json "$o/llmerge.json" options.lambda 0.80000000000000004
hashes_match "$o"

# The nested layout gives the same result as the adapter itself.
merge task-arithmetic "$B" "$lp" -o "$work/nest_a" -q
merge task-arithmetic "$B" "$fx/lora_nested" -o "$work/nest_b" -q
same_shards "$work/nest_a" "$work/nest_b"

# Qwen2 with a LoRA-bias adapter (made for it); F32 from its config.
o=$work/qwen
merge ties "$fx/qwen" "$fx/lora_bias" -o "$o" --density 0.3
loads "$o"
json "$o/config.json" torch_dtype float32
json "$o/llmerge.json" options.dtype f32

# ---- --log-json ------------------------------------------------------------------------------
log=$work/log.jsonl
merge ties "$B" "$lp" "$ff" -o "$work/logged" --log-json "$log"
n=$(wc -l <"$log")
bad_lines=0
while IFS= read -r line; do
  printf '%s' "$line" | "$jsonq" - event >/dev/null 2>&1 || bad_lines=$((bad_lines + 1))
  printf '%s' "$line" | "$jsonq" - time >/dev/null 2>&1 || bad_lines=$((bad_lines + 1))
done <"$log"
check '[ $bad_lines -eq 0 ] && [ $n -eq 23 ]' "--log-json: $n lines (want 23), $bad_lines without event/time"
check '[ "$(head -1 "$log" | "$jsonq" - event)" = start ]' "--log-json: first event is not start"
check '[ "$(tail -1 "$log" | "$jsonq" - event)" = end ]' "--log-json: last event is not end"
check '[ "$(grep -c "\"event\":\"tensor\"" "$log")" -eq 21 ]' "--log-json: not 21 tensor events"
check '[ "$(sed -n 2p "$log" | "$jsonq" - index)" = 1 ]' "--log-json: tensor events not numbered from 1"
# a usage error is logged too
"$llmerge" ties "$B" "$lp" -o "$work/x" --density 2 --log-json "$log" 2>/dev/null
check '[ "$(tail -1 "$log" | "$jsonq" - event)" = error ] && [ "$(tail -1 "$log" | "$jsonq" - exit_status)" = 2 ]' \
  "--log-json: no error event for a usage error: $(cat "$log")"

# ---- OUT exists ------------------------------------------------------------------------------
mkdir "$work/exists" && echo keep >"$work/exists/marker"
expect 2 "already exists (use --force" ties "$B" "$lp" -o "$work/exists"
check '[ -f "$work/exists/marker" ] && [ ! -e "$work/exists/model.safetensors" ]' "OUT without --force was touched"
merge ties "$B" "$lp" -o "$work/exists" --force
check '[ ! -e "$work/exists/marker" ] && [ -f "$work/exists/model.safetensors" ]' "--force did not replace OUT"
check '[ -z "$(ls "$work" | grep -e "\.tmp-" -e "\.old-")" ]' "--force left $(ls "$work" | grep -e "\.tmp-" -e "\.old-")"
# never over an input, even with --force
expect 2 "refusing" ties "$B" "$lp" -o "$B" --force
loads "$B"

# ---- no output, log or cache inside an input ------------------------------------------------
# -o, --log-json, --cache-dir (and OUT.lock) must not be, hold or lie inside BASE, an FT or a
# calibration file, whatever --force says: exit 2 naming both, and every input as it was. On
# copies, so that a run that gets this wrong damages nothing the other tests read.
gb=$work/g-base gl=$work/g-lora gc=$work/g-calib.jsonl
cp -r "$B" "$gb" && cp -r "$lp" "$gl" && cp "$fx/calib/calib.jsonl" "$gc"
ln "$gb/model-00001-of-00002.safetensors" "$work/g-hardlink"
ln -s "$gl" "$work/g-symlink"
inputs_state() { (cd "$work" && find g-base g-lora g-calib.jsonl g-hardlink -exec stat -c '%n %F %s %Y' {} + | sort &&
  cat g-base/* g-lora/* g-calib.jsonl | md5sum); }
g_before=$(inputs_state)
# guarded NEEDLE ARGS...: llmerge ARGS exits 2 saying NEEDLE and "refusing", and no input changed
guarded() {
  local needle=$1
  shift
  expect 2 "$needle" "$@"
  check 'grep -q "refusing" "$work/out"' "llmerge $*: no 'refusing': $(head -c 400 "$work/out")"
  local now
  now=$(inputs_state)
  check '[ "$now" = "$g_before" ]' "llmerge $*: an input changed: $(diff <(echo "$g_before") <(echo "$now") | head -5)"
}
guarded "-o $gb/config.json is inside BASE $gb" ties "$gb" "$gl" -o "$gb/config.json" --force
guarded "-o $gb/merged is inside BASE $gb" ties "$gb" "$gl" -o "$gb/merged"
check '[ ! -e "$gb/merged" ] && [ -z "$(ls -d "$gb"/merged.* 2>/dev/null)" ]' "-o inside BASE created something there"
guarded "is inside FT 1 $gl" dare "$gb" "$gl" -o "$gl/../g-lora/out" --force
guarded "-o $work/g-symlink is FT 2 $work/g-symlink" ties "$gb" "$fx/lora_rslora" "$work/g-symlink" -o "$work/g-symlink" --force
guarded "-o $work/g-hardlink is" ties "$gb" "$gl" -o "$work/g-hardlink" --force
guarded "holds BASE" ties "$gb" "$gl" -o "$work" --force
guarded "--log-json $gb/config.json is inside BASE $gb" ties "$gb" "$gl" -o "$work/g-out" --log-json "$gb/config.json"
guarded "--log-json $work/g-hardlink is BASE" task-arithmetic "$gb" "$gl" -o "$work/g-out" --log-json "$work/g-hardlink"
guarded "--log-json $gc is --calib $gc" sparsegpt "$gb" "$gl" -o "$work/g-out" --calib "$gc" --log-json "$gc"
# a command line that does not parse: its log is not opened over an input either
expect 2 "(0, 1]" ties "$gb" "$gl" -o "$work/g-out" --density 2 --log-json "$gb/config.json"
check '[ "$(inputs_state)" = "$g_before" ]' "a usage error's --log-json emptied an input"
guarded "-o $gc is --calib $gc" sparsegpt "$gb" "$gl" -o "$gc" --calib "$gc" --force
guarded "--cache-dir $gb/cache is inside BASE $gb" sparsegpt "$gb" "$gl" -o "$work/g-out" --calib "$gc" --cache-dir "$gb/cache"
guarded "--cache-dir $work holds BASE" sparsegpt "$gb" "$gl" -o "$work/g-out" --calib "$gc" --cache-dir "$work"
# the default cache directory ($XDG_CACHE_HOME/llmerge) is checked as --cache-dir is
XDG_CACHE_HOME=$gb guarded "the cache directory $gb/llmerge is inside BASE $gb" sparsegpt "$gb" "$gl" -o "$work/g-out" --calib "$gc"
# OUT.lock is written too: a calibration file called OUT.lock is refused, not truncated
cp "$gc" "$work/g-out.lock"
g_lock=$(md5sum <"$work/g-out.lock")
expect 2 "$work/g-out.lock is --calib" sparsegpt "$gb" "$gl" -o "$work/g-out" --calib "$work/g-out.lock"
check '[ "$(md5sum <"$work/g-out.lock")" = "$g_lock" ]' "the calibration file called OUT.lock was changed"
rm -f "$work/g-out.lock"
no_output "$work/g-out"
# plan reads the same command line and refuses the same
expect 2 "refusing" plan ties "$gb" "$gl" -o "$gb/config.json" --force
# a merge beside the inputs is fine, and its log beside them too
merge ties "$gb" "$gl" -o "$work/g-out" --log-json "$work/g-out.jsonl"
loads "$work/g-out"
rm -rf "$work/g-out" "$work/g-out.jsonl" "$work/g-symlink" "$work/g-hardlink"

# ---- bad input: exit 2, a message naming it, nothing written ---------------------------------
x=$work/bad
expect 2 "--weights gives 2 weights for 3 FTs" ties "$B" "$lp" "$lr" "$ff" -o "$x" --weights 1,2
no_output "$x"
expect 2 "--densities gives 2 densities for 3 FTs" ties "$B" "$lp" "$lr" "$ff" -o "$x" --densities 0.1,0.2
no_output "$x"
expect 2 "(0, 1]" ties "$B" "$lp" -o "$x" --density 0
no_output "$x"
expect 2 "(0, 1]" dare "$B" "$lp" -o "$x" --density 1.5
no_output "$x"
expect 2 "item 2 is -0.1" dare "$B" "$lp" "$ff" -o "$x" --densities 0.5,-0.1
expect 2 "'abc' is not a number" ties "$B" "$lp" -o "$x" --lambda abc
expect 2 "'x' is not a number" ties "$B" "$lp" -o "$x" --weights 1,x
expect 2 "give -o OUT" ties "$B" "$lp"
expect 2 "at least one FT" ties "$B" -o "$x"
expect 2 "Usage" ties
no_output "$x"
# adapters made for another base: the key and both shapes (or the missing tensor) are named
expect 2 "k_proj.lora_B.bias" ties "$B" "$fx/lora_bias" -o "$x"
expect 2 "[8, 48]" ties "$B" "$fx/broken/lora_bad_shape" -o "$x"
expect 2 "[64, 64]" ties "$B" "$fx/broken/lora_bad_shape" -o "$x"
# a full model of another architecture: the missing tensor is named
expect 2 "k_proj.bias" task-arithmetic "$fx/qwen" "$ff" -o "$x"
expect 2 "lm_head.weight" ties "$B" "$fx/qwen" -o "$x"
expect 2 "no such file or directory" ties "$B" "$work/no-such-ft" -o "$x"
expect 2 "adapter_model.bin" ties "$B" "$fx/broken/adapter_bin" -o "$x"
expect 2 "IA3" ties "$B" "$fx/broken/peft_ia3" -o "$x"
expect 2 "not a model directory" ties "$lp" "$lr" -o "$x"
expect 2 "model-00002-of-00002.safetensors" ties "$fx/broken/missing_shard" "$lp" -o "$x"
no_output "$x"
expect 2 "did you mean '--density'" ties "$B" "$lp" -o "$x" --desnity 0.5
expect 2 "did you mean '--no-normalize'" ties "$B" "$lp" -o "$x" --no-normalise
expect 2 "did you mean '--force'" ties "$B" "$lp" -o "$x" -force
expect 2 "not an output dtype" ties "$B" "$lp" -o "$x" --dtype int8
expect 2 "use sum or count" ties "$B" "$lp" -o "$x" --sign max
expect 2 "use tensor or global" ties "$B" "$lp" -o "$x" --topk=layer
expect 2 "use inv, l1 or none" dare "$B" "$lp" -o "$x" --rescale l2
expect 2 "--seed" dare "$B" "$lp" -o "$x" --seed -1
expect 2 "--threads" ties "$B" "$lp" -o "$x" --threads many
expect 2 "unknown suffix" ties "$B" "$lp" -o "$x" --shard-size 5XB
# mergekit's --out-shard-size 1B counts parameters: refused, not taken as one byte per shard
expect 2 "--shard-size: size '1B' is 1 byte" ties "$B" "$lp" -o "$x" --shard-size 1B
check 'grep -q "billion parameters" "$work/out" && grep -q "2GB" "$work/out"' "--shard-size 1B: $(cat "$work/out")"
no_output "$x"
expect 2 "size '5B' is 5 bytes" ties "$B" "$lp" -o "$x" --gpu-mem 5B
expect 2 "size '64B'" ties "$B" "$lp" -o "$x" --device sim:64B
expect 2 "--gpu-mem" ties "$B" "$lp" -o "$x" --gpu-mem lots
expect 2 "cuda:99" ties "$B" "$lp" -o "$x" --device cuda:99
expect 2 "size above 0" ties "$B" "$lp" -o "$x" --device sim:0
expect 2 "sim:12parsecs" ties "$B" "$lp" -o "$x" --device sim:12parsecs
expect 2 "tpu" ties "$B" "$lp" -o "$x" --device tpu
expect 2 "takes no value" ties "$B" "$lp" -o "$x" --force=yes
expect 2 "needs a value" ties "$B" "$lp" -o "$x" --weights
expect 2 "parent directory" ties "$B" "$lp" -o "$work/no-such-dir/out"
no_output "$x"

# ---- which modules of an adapter are merged -------------------------------------------------
# As PEFT loads an adapter: target_modules (names or a Python regex), exclude_modules and
# layers_to_transform decide which modules of the base get LoRA; the keys of any other module
# are not merged, and a warning names them. A target_modules that selects no layer of the base
# is exit status 2 naming adapter_config.json and the key, before any work. Each adapter here
# holds lora_plain's factors (q_proj and v_proj of layers 0 and 1) under another config; each
# tensor of the output is either the one lora_plain alone gives or the base's, bit for bit.
thash() { "$st_hash" "$1"/model*.safetensors | awk -v n="$2" '$1 == n { print $2 }'; }
# sel_adapter NAME: lora_plain's factors under the adapter_config.json read from stdin
sel_adapter() {
  mkdir -p "$work/$1" && cp "$lp/adapter_model.safetensors" "$work/$1/" && cat >"$work/$1/adapter_config.json"
}
# changed NAME MODULES...: merged from adapter NAME, exactly the q/v projections named
# (layer.q or layer.v) are lora_plain's, the others the base's
sel_all=$work/sel_all
merge task-arithmetic "$B" "$lp" -o "$sel_all"
changed() {
  local name=$1 l p t want got
  shift
  merge task-arithmetic "$B" "$work/$name" -o "$work/${name}_out"
  cp "$work/out" "$work/$name.log"
  for l in 0 1; do
    for p in q v; do
      t=model.layers.$l.self_attn.${p}_proj.weight
      if [[ " $* " == *" $l.$p "* ]]; then want=$(thash "$sel_all" "$t"); else want=$(thash "$B" "$t"); fi
      got=$(thash "$work/${name}_out" "$t")
      [ -n "$got" ] && [ "$got" = "$want" ] && ok || bad "$name: $t is $got, wanted $want ($*)"
    done
  done
}
warned() {
  if grep -qF -- "warning: FT 1 $work/$1: $2" "$work/$1.log"; then ok; else
    bad "$1: no warning '$2': $(head -c 800 "$work/$1.log")"
  fi
}
sel_adapter sel_q <<'EOF'
{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
EOF
changed sel_q 0.q 1.q
warned sel_q "keys 'base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight', 'base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight' are not merged"
check 'grep -qF "model.layers.1.self_attn.v_proj: target_modules does not select it" "$work/sel_q.log"' "sel_q: no reason: $(head -c 800 "$work/sel_q.log")"
# llmerge inspect lists what is set aside and why, with --base and without
run sel_q_inspect inspect "$work/sel_q" --base "$B"
check 'grep -qF "not loaded (PEFT would not load them; not merged): 2" "$work/sel_q_inspect.out"' \
  "inspect sel_q: $(head -c 1200 "$work/sel_q_inspect.out")"
check 'grep -qF "module model.layers.0.self_attn.v_proj: target_modules does not select it" "$work/sel_q_inspect.out"' \
  "inspect sel_q: no reason"
check 'grep -qF "base $B: ok" "$work/sel_q_inspect.out"' "inspect sel_q: base not ok"
run sel_q_json inspect --json "$work/sel_q"
json "$work/sel_q_json.out" modules.# 2
json "$work/sel_q_json.out" not_loaded.# 2
json "$work/sel_q_json.out" not_loaded.1.module model.layers.1.self_attn.v_proj
json "$work/sel_q_json.out" not_loaded.1.reason "target_modules does not select it"
json "$work/sel_q_json.out" not_loaded.1.keys.1 base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight
sel_adapter sel_layer1 <<'EOF'
{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]}
EOF
changed sel_layer1 1.q 1.v
warned sel_layer1 "keys 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'"
check 'grep -qF "its layer 0 is not in layers_to_transform" "$work/sel_layer1.log"' "sel_layer1: no reason: $(head -c 800 "$work/sel_layer1.log")"
sel_adapter sel_exclude <<'EOF'
{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ["model.layers.0.self_attn.q_proj"]}
EOF
changed sel_exclude 0.v 1.q 1.v
check 'grep -qF "exclude_modules excludes it" "$work/sel_exclude.log"' "sel_exclude: no reason: $(head -c 800 "$work/sel_exclude.log")"
# Python's regex syntax, matched as Python matches it: a look-ahead, (?i), \b, \d
sel_adapter sel_regex <<'EOF'
{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": "(?i).*\\.LAYERS\\.(?!0\\b)\\d+\\.self_attn\\.[qv]_proj"}
EOF
changed sel_regex 1.q 1.v
sel_adapter sel_rank <<'EOF'
{"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "rank_pattern": {"(?<=self_attn\\.)[qv]_proj": 8}, "alpha_pattern": {"^(?!model\\.layers\\.9)\\w+\\.layers\\.\\d\\.self_attn\\.(q|v)_proj": 16}}
EOF
changed sel_rank 0.q 0.v 1.q 1.v
# nothing selected, or a regex that does not compile or runs past its limits: exit 2, no output
x=$work/sel_x
sel_adapter sel_none <<'EOF'
{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["xq_proj"]}
EOF
expect 2 "$work/sel_none/adapter_config.json: key 'target_modules' ([\"xq_proj\"]) selects no layer of the base model" task-arithmetic "$B" "$work/sel_none" -o "$x"
no_output "$x"
expect 2 "selects no layer of the base model" inspect "$work/sel_none" --base "$B"
sel_adapter sel_none2 <<'EOF'
{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "layers_to_transform": [5]}
EOF
expect 2 "selects no layer of the base model" ties "$B" "$lp" "$work/sel_none2" -o "$x"
no_output "$x"
sel_adapter sel_bad_re <<'EOF'
{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ".*(q_proj"}
EOF
expect 2 "$work/sel_bad_re/adapter_config.json: key 'target_modules': regex '.*(q_proj' does not compile" ties "$B" "$work/sel_bad_re" -o "$x"
no_output "$x"
sel_adapter sel_slow_re <<'EOF'
{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "rank_pattern": {"(.*.*)*[.]{2}": 4}}
EOF
expect 2 "key 'rank_pattern': regex '(.*.*)*[.]{2}' runs past its limits matching module" ties "$B" "$work/sel_slow_re" -o "$x"
no_output "$x"

# ---- the JSON files and the files they name, checked when the inputs are opened ---------------
# timed ARGS...: llmerge with a bound, so that a command that would block on a FIFO fails the
# test instead of hanging it (a correct run ends at once)
timed() { timeout 60 "$real_llmerge" "$@"; }
real_llmerge=$llmerge
copy() { rm -rf "$2" && cp -r "$1" "$2"; }
bom() { { printf '\357\273\277'; cat "$1"; } >"$1.new" && mv "$1.new" "$1"; }
# a UTF-8 byte order mark (transformers and PEFT refuse one): refused at the start, naming the file
copy "$B" "$work/bom_base" && bom "$work/bom_base/config.json"
expect 2 "$work/bom_base/config.json: starts with a UTF-8 byte order mark" ties "$work/bom_base" "$lp" -o "$x"
check '! grep -q "merging" "$work/out"' "a BOM in BASE's config.json was found after the work started: $(cat "$work/out")"
no_output "$x"
copy "$ff" "$work/bom_ft" && bom "$work/bom_ft/config.json"
expect 2 "$work/bom_ft/config.json: starts with a UTF-8 byte order mark" ties "$B" "$work/bom_ft" -o "$x"
copy "$lp" "$work/bom_lora" && bom "$work/bom_lora/adapter_config.json"
expect 2 "$work/bom_lora/adapter_config.json: starts with a UTF-8 byte order mark" ties "$B" "$work/bom_lora" -o "$x"
no_output "$x"
# the index: nothing but whitespace after its object, as in every other JSON file
copy "$B" "$work/idx_tail" && printf '}\n' >>"$work/idx_tail/model.safetensors.index.json"
expect 2 "$work/idx_tail/model.safetensors.index.json: text after the JSON value (line" ties "$work/idx_tail" "$lp" -o "$x"
copy "$B" "$work/idx_dup" && sed -i '0,/"weight_map": {/s//"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors",/' \
  "$work/idx_dup/model.safetensors.index.json"
expect 2 "key 'lm_head.weight' in 'weight_map' appears twice" ties "$work/idx_dup" "$lp" -o "$x"
# a shard that is a directory or a FIFO is named as such, not as missing (and never opened)
s2=model-00002-of-00002.safetensors
copy "$B" "$work/shard_dir" && rm "$work/shard_dir/$s2" && mkdir "$work/shard_dir/$s2"
expect 2 "shard '$s2' (holding tensor 'lm_head.weight') is a directory: $work/shard_dir/$s2" \
  ties "$work/shard_dir" "$lp" -o "$x"
copy "$B" "$work/shard_fifo" && rm "$work/shard_fifo/$s2" && mkfifo "$work/shard_fifo/$s2"
llmerge=timed
expect 2 "shard '$s2' (holding tensor 'lm_head.weight') is not a regular file (a FIFO)" \
  ties "$work/shard_fifo" "$lp" -o "$x"
llmerge=$real_llmerge
no_output "$x"
# numbers beyond range say so
copy "$lp" "$work/alpha_big" && sed -i 's/"lora_alpha": 16/"lora_alpha": 1e400/' "$work/alpha_big/adapter_config.json"
expect 2 "$work/alpha_big/adapter_config.json: key 'lora_alpha': 1e400 is out of range" ties "$B" "$work/alpha_big" -o "$x"
copy "$B" "$work/hidden_big" && sed -i 's/"hidden_size": 64/"hidden_size": 9223372036854775808/' "$work/hidden_big/config.json"
expect 2 "key 'hidden_size': 9223372036854775808 is out of range (at most 9007199254740992)" \
  ties "$work/hidden_big" "$lp" -o "$x"
no_output "$x"

# options that do not apply are accepted with a note
expect 0 "--sign has no effect on dare" dare "$B" "$lp" -o "$work/noted" --sign count --gpu-mem 1GiB --cache-dir "$work" \
  --device cpu
check 'grep -q "gpu-mem has no effect" "$work/out"' "no note for --gpu-mem on the cpu"
# sce's weights are the task vectors' mean squares and it always divides: --weights, --no-normalize
# and --lambda are noted and change nothing, and its help says so
"$llmerge" sce "$B" "$ff" "$fx/ft_full2" -o "$work/sce_plain" -q
expect 0 "note: --weights has no effect on sce" sce "$B" "$ff" "$fx/ft_full2" -o "$work/sce_noted" --weights 1,3 \
  --no-normalize --lambda 2
check 'grep -q "note: --no-normalize has no effect on sce" "$work/out" &&
  grep -q "note: --lambda has no effect on sce" "$work/out"' "sce: --no-normalize or --lambda not noted"
same_shards "$work/sce_plain" "$work/sce_noted"
expect 0 "note: --normalize has no effect on sce" sce "$B" "$ff" "$fx/ft_full2" -o "$work/sce_noted" --normalize --force
check '"$llmerge" sce --help | grep -A1 -- "--normalize " | grep -q "no effect on this method" &&
  ! "$llmerge" sce --help | grep -q "default for sce"' "sce --help: --normalize's default given"
expect 0 "note: --no-normalize has no effect on ramplus-tl" ramplus-tl "$B" "$ff" "$fx/ft_full2" \
  -o "$work/ramplus_noted" --no-normalize --weights 1,2
check 'grep -q "note: --weights has no effect on ramplus-tl (each FT.s weight is its lambda_i)" "$work/out"' \
  "ramplus-tl: --weights not noted"
# the interpolations read no --lambda (nothing to scale), slerp, karcher, model-stock and
# nearswap no --weights, and those and nuslerp no --normalize: each noted, with its reason, and
# changing no byte
"$llmerge" slerp "$B" "$ff" -o "$work/slerp_plain" --t 0.3 -q
expect 0 "note: --weights has no effect on slerp (it interpolates by --t)" slerp "$B" "$ff" -o "$work/slerp_noted" \
  --t 0.3 --weights 0.5 --no-normalize --lambda 2
check 'grep -q "note: --no-normalize has no effect on slerp" "$work/out" &&
  grep -q "note: --lambda has no effect on slerp" "$work/out"' "slerp: --no-normalize or --lambda not noted"
same_shards "$work/slerp_plain" "$work/slerp_noted"
# the card's command line spells out only the options the method reads: made again, no note
check '! card_cmd "$work/slerp_noted" | grep -q -- "--weights\|--lambda\|normalize"' \
  "slerp's card: an option it does not read: $(card_cmd "$work/slerp_noted")"
card_again "$work/slerp_noted" "$work/slerp_again"
check 'eval "$(card_cmd "$work/slerp_noted") -o \"$work/slerp_again2\"" >"$work/again.out" 2>&1 &&
  ! grep -q "note:" "$work/again.out"' "slerp's card command: notes: $(head -c 300 "$work/again.out")"
"$llmerge" karcher "$B" "$ff" "$fx/ft_full2" -o "$work/karcher_plain" -q
expect 0 "note: --weights has no effect on karcher (its models weigh equally)" karcher "$B" "$ff" "$fx/ft_full2" \
  -o "$work/karcher_noted" --weights 1,2,3 --lambda 2
same_shards "$work/karcher_plain" "$work/karcher_noted"
"$llmerge" nuslerp "$B" "$ff" "$fx/ft_full2" -o "$work/nuslerp_plain" --weights 1,3 -q
expect 0 "note: --no-normalize has no effect on nuslerp" nuslerp "$B" "$ff" "$fx/ft_full2" -o "$work/nuslerp_noted" \
  --weights 1,3 --no-normalize --lambda 0.5
check 'grep -q "note: --lambda has no effect on nuslerp" "$work/out" && ! grep -q "note: --weights" "$work/out"' \
  "nuslerp: --lambda not noted, or --weights noted"
same_shards "$work/nuslerp_plain" "$work/nuslerp_noted"
expect 0 "note: --lambda has no effect on linear" linear "$B" "$ff" "$fx/ft_full2" -o "$work/linear_noted" --lambda 2 \
  --weights 1,2,1 --no-normalize
check '! grep -q "note: --weights\|note: --no-normalize" "$work/out"' "linear: an option it reads noted"
# a magnitude trim that keeps nothing of a tensor (floor(density · numel) = 0: the 64-entry norms
# at density 0.01) says so, naming the first such tensor and counting them (5), but not under -q
expect 0 "note: ties keeps nothing of FT 1 ($ff) in 'model.layers.0.input_layernorm.weight'" \
  ties "$B" "$ff" -o "$work/empty_trim" --density 0.01 --force
check 'grep -q "5 tensors lose an FT.s task vector so (mergekit.s ties stops at the first)" "$work/out"' \
  "the empty trims are not counted"
expect 0 "lose an FT's task vector so (mergekit's breadcrumbs keeps nothing there too, silently)" \
  breadcrumbs "$B" "$ff" -o "$work/empty_trim" --density 0.01 --force
check '"$llmerge" ties "$B" "$ff" -o "$work/empty_trim" --density 0.01 --force -q >"$work/out" 2>&1 &&
  [ ! -s "$work/out" ]' "ties -q with empty trims: not quiet"
expect 0 "merged 21 tensors" ties "$B" "$ff" -o "$work/empty_trim" --density 0.02 --force
check '! grep -q "keeps nothing" "$work/out"' "a note about empty trims where each keeps an entry"

# ---- a failure during the work: exit 1, nothing left -----------------------------------------
# A file size limit (RLIMIT_FSIZE, SIGXFSZ ignored so writes fail with EFBIG) below the size of
# the output shard makes writing it fail once the work has started.
x=$work/fsize
(trap '' XFSZ; ulimit -f 64; exec "$llmerge" ties "$B" "$lp" -o "$x") >"$work/out" 2>&1
rc=$?
check '[ $rc -eq 1 ] && grep -q "llmerge ties: error: " "$work/out"' "file size limit: exit $rc (want 1): $(cat "$work/out")"
# the message names the shard file being written and the system's reason
check 'grep -q "error: $x\.tmp-[A-Za-z0-9]*/model\.safetensors: .*File too large" "$work/out"' \
  "file size limit: the message does not name the file and the reason: $(cat "$work/out")"
no_output "$x"  # nor OUT.lock

# ---- tensors llmerge cannot compute with: refused where they differ, copied where equal ------
od=$fx/odd x=$work/odd-bad
expect 2 "model.norm.weight" ties "$B" "$od/ft_i32" -o "$x"
check 'grep -q "I32" "$work/out" && grep -q "odd/ft_i32" "$work/out"' "an I32 norm: dtype or input not named: $(cat "$work/out")"
no_output "$x"
expect 2 "model.norm.weight" task-arithmetic "$B" "$lp" "$od/ft_f8" -o "$x"
check 'grep -q "F8_E4M3" "$work/out" && grep -q "FT 2" "$work/out"' "an F8 norm: dtype or input not named: $(cat "$work/out")"
no_output "$x"
expect 2 "model.layers.0.self_attn.q_proj.weight" ties "$od/base_u8" "$lp" -o "$x"
check 'grep -q "U8" "$work/out" && grep -q "lora_plain" "$work/out"' "a LoRA on a U8 base tensor: $(cat "$work/out")"
no_output "$x"
expect 2 "model.layers.0.self_attn.q_proj.weight" dare "$od/base_u8" "$ff" -o "$x"
expect 2 "model.norm.weight" plan ties "$B" "$od/ft_i32" -o "$x"
expect 2 "model.norm.weight" sparsegpt "$B" "$od/ft_i32" -o "$x" --calib "$fx/calib/calib.jsonl"
no_output "$x"
# equal in base and FT: copied as it is
merge ties "$od/base_u8" "$od/ft_u8" -o "$work/odd-u8"
q0=model.layers.0.self_attn.q_proj.weight
check '[ "$("$st_hash" "$work/odd-u8/model.safetensors" | grep "^$q0 ")" = "$("$st_hash" "$od/base_u8/model.safetensors" | grep "^$q0 ")" ]' \
  "the equal U8 tensor was not copied as it is"
"$llmerge" inspect --json "$work/odd-u8" >"$work/json" 2>/dev/null
json "$work/json" dtypes.U8 1

# ---- FT tensors the base does not have: a warning each, counted, refused with --strict --------
merge ties "$B" "$od/ft_extra" -o "$work/odd-extra"
check 'grep -q "warning: FT 1 (.*odd/ft_extra): tensor '"'"'model.layers.0.self_attn.rotary_emb.inv_freq'"'"' is not in the base" "$work/out"' \
  "no warning for the FT's extra tensor: $(head -c 600 "$work/out")"
json "$work/odd-extra/llmerge.json" dropped.tensors 1
json "$work/odd-extra/llmerge.json" dropped.list.0.ft 1
json "$work/odd-extra/llmerge.json" dropped.list.0.tensor model.layers.0.self_attn.rotary_emb.inv_freq
merge ties "$B" "$ff" -o "$work/odd-extra-ref" -q
same_shards "$work/odd-extra" "$work/odd-extra-ref"
json "$work/odd-extra-ref/llmerge.json" dropped.tensors 0
expect 2 "rotary_emb.inv_freq" ties "$B" "$lp" "$od/ft_extra" -o "$x" --strict
check 'grep -q "FT 2" "$work/out" && grep -q -- "--strict" "$work/out"' "--strict: the FT or the option is not named: $(cat "$work/out")"
no_output "$x"
expect 2 "rotary_emb.inv_freq" plan task-arithmetic "$B" "$od/ft_extra" -o "$x" --strict
expect 2 "rotary_emb.inv_freq" sparsegpt "$B" "$od/ft_extra" -o "$x" --strict --calib "$fx/calib/calib.jsonl"
no_output "$x"
# an FT with an lm_head of its own over a base that ties it to the embeddings
merge ties "$fx/qwen" "$od/qwen_head" -o "$work/odd-head"
check 'grep -q "warning: FT 1 .*'"'"'lm_head.weight'"'"' is not in the base .*tie_word_embeddings" "$work/out"' \
  "no warning for the FT's own lm_head: $(head -c 600 "$work/out")"
json "$work/odd-head/llmerge.json" dropped.tensors 1
expect 2 "lm_head.weight" dare "$fx/qwen" "$od/qwen_head" -o "$x" --strict
no_output "$x"

# ---- NaN and Inf: counted in every input and in the output, said, recorded ---------------------
# ties: a NaN entry of a task vector never agrees with the elected sign, an Inf one wins it
m=$work/nf-ties/llmerge.json
merge ties "$B" "$lp" "$od/ft_nonfinite" -o "$work/nf-ties"
json "$m" nonfinite.inputs.1.nan 3
json "$m" nonfinite.inputs.1.inf 2
json "$m" nonfinite.inputs.1.tensors.0.name model.layers.0.mlp.down_proj.weight
json "$m" nonfinite.inputs.1.tensors.1.inf 2
json "$m" nonfinite.inputs.0.nan 0
json "$m" nonfinite.base.nan 0
json "$m" nonfinite.output.nan 0
json "$m" nonfinite.output.inf 2
json "$m" nonfinite.output.tensors.0.name model.layers.1.self_attn.o_proj.weight
check 'grep -q "warning: FT 2 (.*odd/ft_nonfinite): 3 NaN and 2 Inf values in 2 tensors" "$work/out" &&
  grep -q "warning: the output holds 0 NaN and 2 Inf values in 1 tensor" "$work/out"' \
  "no NaN/Inf warnings: $(head -c 800 "$work/out")"
# task arithmetic: they reach the output
merge task-arithmetic "$B" "$od/ft_nonfinite" -o "$work/nf-ta"
json "$work/nf-ta/llmerge.json" nonfinite.output.nan 3
json "$work/nf-ta/llmerge.json" nonfinite.output.inf 2
# Inf in the base: the FT's finite value makes its task vector -Inf there, and the sum NaN
merge ties "$od/base_inf" "$ff" -o "$work/nf-base"
json "$work/nf-base/llmerge.json" nonfinite.base.inf 1
json "$work/nf-base/llmerge.json" nonfinite.base.tensors.0.name model.layers.0.mlp.up_proj.weight
json "$work/nf-base/llmerge.json" nonfinite.output.nan 1
check 'grep -q "warning: the base (.*odd/base_inf): 0 NaN and 1 Inf value in 1 tensor" "$work/out"' \
  "no warning for the base's Inf: $(head -c 800 "$work/out")"
# a NaN in a LoRA factor: counted in the factor; its column of s·B@A vanishes under ties, 64 NaN
# under task arithmetic
merge ties "$B" "$od/lora_nan" -o "$work/nf-lora"
json "$work/nf-lora/llmerge.json" nonfinite.inputs.0.nan 1
json "$work/nf-lora/llmerge.json" nonfinite.inputs.0.tensors.0.name \
  base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
json "$work/nf-lora/llmerge.json" nonfinite.output.nan 0
merge task-arithmetic "$B" "$od/lora_nan" -o "$work/nf-lora-ta"
json "$work/nf-lora-ta/llmerge.json" nonfinite.output.nan 64
# clean inputs: zeros and no warning
merge ties "$B" "$lp" "$ff" -o "$work/nf-clean"
json "$work/nf-clean/llmerge.json" nonfinite.output.nan 0
json "$work/nf-clean/llmerge.json" nonfinite.inputs.1.inf 0
json "$work/nf-clean/llmerge.json" nonfinite.inputs.# 2
check '! grep -q "NaN\|warning" "$work/out"' "a clean merge warned: $(head -c 400 "$work/out")"
# the same counts on the simulated device, with and without fallbacks
for dev in sim:1GiB sim:96KiB; do
  for c in "ties $B $lp $od/ft_nonfinite" "task-arithmetic $od/base_inf $ff $od/lora_nan" "dare $B $od/lora_nan $od/ft_nonfinite --seed 3"; do
    # shellcheck disable=SC2086
    "$llmerge" $c -o "$work/nf-cpu" --device cpu -q && "$llmerge" $c -o "$work/nf-dev" --device $dev -q
    want=$("$jsonq" "$work/nf-cpu/llmerge.json" nonfinite) got=$("$jsonq" "$work/nf-dev/llmerge.json" nonfinite)
    check '[ -n "$want" ] && [ "$want" = "$got" ]' "$c on $dev: nonfinite $got, the cpu's $want"
    rm -rf "$work/nf-cpu" "$work/nf-dev"
  done
done

# ---- sparsegpt: Hessian importance from calibration data ---------------------------------------
cj=$fx/calib/calib.jsonl ct=$fx/calib/calib.txt
o=$work/sgpt
merge sparsegpt "$B" "$lp" "$ff" -o "$o" --calib "$cj" --density 0.3
loads "$o"
hashes_match "$o"
json "$o/llmerge.json" method sparsegpt
json "$o/llmerge.json" options.normalize true
json "$o/llmerge.json" options.hessian_from ft
json "$o/llmerge.json" options.calib.0.xxh64 "$("$st_hash" --file "$cj" | cut -d' ' -f1)"
check 'card_cmd "$o" | grep -qF -- " --calib $cj --hessian-from ft"' "sparsegpt: README.md's command line: $(card_cmd "$o")"
card_again "$o" "$work/sgpt_again"
check 'grep -q "Hessians of .*lora_plain on .*calib.jsonl" "$work/out"' "sparsegpt: no Hessian line: $(head -c 400 "$work/out")"
merge ties "$B" "$lp" "$ff" -o "$work/sgpt-ties" --density 0.3
check '! cmp -s "$o/model.safetensors" "$work/sgpt-ties/model.safetensors"' "sparsegpt gave the same output as ties"
# the same data as .txt, and the same merge on the simulated device with and without room
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-txt" --calib "$ct" --density 0.3
same_shards "$o" "$work/sgpt-txt"
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-sim" --calib "$cj" --density 0.3 --device sim:48KiB
same_shards "$o" "$work/sgpt-sim"
check 'grep -q "fallback: merge" "$work/out"' "sparsegpt on sim:48KiB: nothing fell back"
# one file per FT, and the base's Hessians for all: another output
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-two" --calib "$cj" --calib "$ct" --density 0.3
same_shards "$o" "$work/sgpt-two"
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-base" --calib "$cj" --density 0.3 --hessian-from base
check '! cmp -s "$o/model.safetensors" "$work/sgpt-base/model.safetensors"' "--hessian-from base changed nothing"
json "$work/sgpt-base/llmerge.json" options.hessian_from base
# fewer sequences: other Hessians, another output
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-few" --calib "$cj" --density 0.3 --calib-samples 2 --seq-len 5
check '! cmp -s "$o/model.safetensors" "$work/sgpt-few/model.safetensors"' "--calib-samples/--seq-len changed nothing"
# ---- sparsegpt's cache: Hessians, U_cc² and masks under --cache-dir --------------------------
# The reference: the same merge with no cache at all (no --cache-dir, XDG_CACHE_HOME and HOME
# unset, so nothing can be named: nothing read, nothing kept).
sg() { "$llmerge" sparsegpt "$B" "$lp" "$ff" --calib "$cj" "$@"; }
count() { grep -c -- "$1" "$work/out"; }
entries() { ls "$cache" | grep -c "^$1-[0-9a-f]\{16\}\.bin$"; }
if env -u XDG_CACHE_HOME HOME= "$llmerge" sparsegpt "$B" "$lp" "$ff" --calib "$cj" --density 0.3 -o "$work/sgpt-nc" \
     >"$work/out" 2>&1; then ok; else bad "sparsegpt without a cache failed: $(head -c 600 "$work/out")"; fi
check 'grep -q "no cache directory" "$work/out"' "no note that nothing is kept: $(head -c 400 "$work/out")"
cache=$work/ucache
# a first run captures both models and keeps their Hessians, U_cc² and each FT's masks
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-c1" --calib "$cj" --density 0.3 --cache-dir "$cache" --log-json "$work/c1.log"
check '[ "$(count "from the cache")" -eq 0 ] && [ "$(count "Hessians of .* tokens")" -eq 2 ]' "first cached run: $(head -c 400 "$work/out")"
check '[ "$(entries hess)" -eq 2 ] && [ "$(entries ucc2)" -eq 2 ] && [ "$(entries mask)" -eq 2 ]' "first cached run kept: $(ls -a "$cache")"
check '[ -z "$(ls -A "$cache" | grep tmp)" ]' "temporary files left in the cache: $(ls -A "$cache")"
check '[ "$(grep -c "\"event\":\"cache\".*\"result\":\"stored\"" "$work/c1.log")" -eq 6 ]' "--log-json cache events: $(grep cache "$work/c1.log" | head -c 600)"
same_shards "$work/sgpt-nc" "$work/sgpt-c1"
# the same point again: both FTs' masks from the cache, no capture, no selection, the same bytes
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-c2" --calib "$cj" --density 0.3 --cache-dir "$cache"
check '[ "$(count "top-k masks of FT [12] .*: from the cache")" -eq 2 ] && [ "$(count "Hessians of .*: not needed")" -eq 2 ]' \
  "second run did not use the masks: $(head -c 600 "$work/out")"
check '[ "$(count "tokens")" -eq 0 ]' "second run captured: $(head -c 600 "$work/out")"
same_shards "$work/sgpt-nc" "$work/sgpt-c2"
# another density: the masks miss, the U_cc² hit (no capture), and the output is the one without a cache
env -u XDG_CACHE_HOME HOME= "$llmerge" sparsegpt "$B" "$lp" "$ff" --calib "$cj" --density 0.6 -o "$work/sgpt-nc6" >/dev/null 2>&1
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-c3" --calib "$cj" --density 0.6 --cache-dir "$cache"
check '[ "$(count "masks of FT")" -eq 0 ] && [ "$(count "Hessians of .*: from the cache (.*/ucc2-")" -eq 2 ] && [ "$(count "tokens")" -eq 0 ]' \
  "another density: $(head -c 600 "$work/out")"
same_shards "$work/sgpt-nc6" "$work/sgpt-c3"
check '[ "$(entries mask)" -eq 4 ]' "the new density's masks were not kept: $(ls "$cache")"
# --topk global: its own masks, read back on the next run, the same bytes as without a cache
env -u XDG_CACHE_HOME HOME= "$llmerge" sparsegpt "$B" "$lp" "$ff" --calib "$cj" --density 0.3 --topk global -o "$work/sgpt-ncg" \
  >/dev/null 2>&1
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-g1" --calib "$cj" --density 0.3 --topk global --cache-dir "$cache"
check '[ "$(count "masks of FT")" -eq 0 ]' "--topk global used --topk tensor's masks: $(head -c 600 "$work/out")"
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-g2" --calib "$cj" --density 0.3 --topk global --cache-dir "$cache"
check '[ "$(count "masks of FT .*: from the cache")" -eq 2 ]' "--topk global's masks were not read back: $(head -c 600 "$work/out")"
same_shards "$work/sgpt-ncg" "$work/sgpt-g1"
same_shards "$work/sgpt-ncg" "$work/sgpt-g2"
# on the simulated device with fallbacks, the stored masks give the same bytes too
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-csim" --calib "$cj" --density 0.3 --cache-dir "$cache" --device sim:48KiB
check '[ "$(count "masks of FT .*: from the cache")" -eq 2 ] && grep -q "fallback: merge" "$work/out"' "sim:48KiB with masks: $(head -c 600 "$work/out")"
same_shards "$work/sgpt-nc" "$work/sgpt-csim"
# without the U_cc² and masks (what a changed damping leaves): U_cc² from the kept Hessians
rm -f "$cache"/ucc2-*.bin "$cache"/mask-*.bin
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-c4" --calib "$cj" --density 0.3 --cache-dir "$cache"
check '[ "$(count "Hessians of .*: from the cache (.*/hess-.*), their U_cc² computed")" -eq 2 ] && [ "$(count "tokens")" -eq 0 ]' \
  "U_cc² from the kept Hessians: $(head -c 600 "$work/out")"
check '[ "$(entries ucc2)" -eq 2 ] && [ "$(entries mask)" -eq 2 ]' "U_cc² and masks not kept again: $(ls "$cache")"
same_shards "$work/sgpt-nc" "$work/sgpt-c4"
# another calibration file misses everything
head -n 4 "$cj" >"$work/short.jsonl"
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-c5" --calib "$work/short.jsonl" --density 0.3 --cache-dir "$cache"
check '[ "$(count "from the cache")" -eq 0 ] && [ "$(count "Hessians of .* tokens")" -eq 2 ]' "another calibration file hit the cache: $(head -c 400 "$work/out")"
# damaged entries are said, removed and computed again; the output stays the same
mask1=$(ls "$cache"/mask-*.bin | head -1)
for m in "$cache"/mask-*.bin; do  # this point's masks: the ones of the first run's keys
  grep -q "$(basename "$m")" "$work/c1.log" && mask1=$m && break
done
printf "X" | dd of="$mask1" bs=1 seek=60 conv=notrunc 2>/dev/null
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-d1" --calib "$cj" --density 0.3 --cache-dir "$cache"
check 'grep -q "cache: .*$(basename "$mask1") has a record .*: computing it again" "$work/out"' "a damaged mask was not reported: $(head -c 600 "$work/out")"
check '[ "$(count "masks of FT .*: from the cache")" -eq 1 ] && [ "$(count "Hessians of .*: from the cache (.*/ucc2-")" -eq 1 ]' \
  "a damaged mask: $(head -c 600 "$work/out")"
same_shards "$work/sgpt-nc" "$work/sgpt-d1"
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-d2" --calib "$cj" --density 0.3 --cache-dir "$cache"
check '[ "$(count "masks of FT .*: from the cache")" -eq 2 ]' "the damaged mask was not computed again and kept: $(head -c 600 "$work/out")"
# a damaged U_cc² entry (masks gone): the Hessians serve instead
rm -f "$cache"/mask-*.bin
for u in "$cache"/ucc2-*.bin; do printf "X" | dd of="$u" bs=1 seek=100 conv=notrunc 2>/dev/null; done
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-d3" --calib "$cj" --density 0.3 --cache-dir "$cache"
check '[ "$(count "cache: .*ucc2-.* checksum .*: computing it again")" -ge 2 ] && [ "$(count "their U_cc² computed")" -eq 2 ]' \
  "damaged U_cc² entries: $(head -c 800 "$work/out")"
same_shards "$work/sgpt-nc" "$work/sgpt-d3"
# a truncated Hessian entry (U_cc² and masks gone): captured again
rm -f "$cache"/mask-*.bin "$cache"/ucc2-*.bin
for h in "$cache"/hess-*.bin; do truncate -s -100 "$h"; done
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-d4" --calib "$cj" --density 0.3 --cache-dir "$cache"
check '[ "$(count "cache: .*hess-.*: computing it again")" -ge 2 ] && [ "$(count "Hessians of .* tokens")" -eq 2 ]' \
  "truncated Hessian entries: $(head -c 800 "$work/out")"
same_shards "$work/sgpt-nc" "$work/sgpt-d4"
# LLMERGE_CACHE_HESSIANS=0: U_cc² and masks are kept, the Hessians are not
cache=$work/ucache-small
if LLMERGE_CACHE_HESSIANS=0 "$llmerge" sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-s1" --calib "$cj" --density 0.3 \
     --cache-dir "$cache" >"$work/out" 2>&1; then ok; else bad "LLMERGE_CACHE_HESSIANS=0: $(head -c 400 "$work/out")"; fi
check '[ "$(entries hess)" -eq 0 ] && [ "$(entries ucc2)" -eq 2 ] && [ "$(entries mask)" -eq 2 ]' "LLMERGE_CACHE_HESSIANS=0 kept: $(ls "$cache")"
same_shards "$work/sgpt-nc" "$work/sgpt-s1"
# a cache directory that cannot be written: said, and the merge goes on
: >"$work/not-a-dir"
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-ro" --calib "$cj" --density 0.3 --cache-dir "$work/not-a-dir/cache"
check 'grep -q "warning: .* not kept in the cache" "$work/out"' "an unwritable cache was not said: $(head -c 600 "$work/out")"
same_shards "$work/sgpt-nc" "$work/sgpt-ro"

# two jobs that need the same Hessians at once: the first takes the cache's lock on them and
# captures, the other waits for it and reads them back (LLMERGE_TEST_DELAY_MS holds the capture
# 1.5 s so that they overlap); each merge is the one without a cache; no lock is left
cache=$work/ucache-lock
LLMERGE_TEST_DELAY_MS=1500 "$llmerge" sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-j1" --calib "$cj" --density 0.3 \
  --cache-dir "$cache" >"$work/j1.out" 2>&1 &
j1=$!
for i in $(seq 100); do ls "$cache"/hess-*.lock >/dev/null 2>&1 && break; sleep 0.05; done
check 'ls "$cache"/hess-*.lock >/dev/null 2>&1' "the first job took no lock: $(ls -A "$cache" 2>&1) $(head -c 400 "$work/j1.out")"
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-j2" --calib "$cj" --density 0.6 --cache-dir "$cache"
cp "$work/out" "$work/j2.out"
check 'wait $j1' "the first job failed: $(head -c 600 "$work/j1.out")"
# (each FT's Hessians captured once between the two; which job captures the second FT's is up
# to the moment each reaches it)
check '[ "$(cat "$work/j1.out" "$work/j2.out" | grep -c "Hessians of .* tokens")" -eq 2 ]' \
  "the two FTs' Hessians were not captured once each: $(grep -h "Hessians of" "$work/j1.out" "$work/j2.out")"
check 'grep -q "Hessians of $lp: waiting for $(hostname) pid $j1, which holds $cache/hess-[0-9a-f]*\.lock" "$work/j2.out" &&
  grep -q "Hessians of $lp on .*: from the cache" "$work/j2.out"' "the second job did not wait and read: $(head -c 800 "$work/j2.out")"
check '[ -z "$(ls -A "$cache" | grep -v "\.bin$")" ]' "left in the cache: $(ls -A "$cache")"
same_shards "$work/sgpt-nc" "$work/sgpt-j1"
same_shards "$work/sgpt-c3" "$work/sgpt-j2"
# a holder killed outright (SIGKILL) leaves its lock; the next job finds its pid gone and takes over
cache=$work/ucache-dead
LLMERGE_TEST_DELAY_MS=20000 "$llmerge" sparsegpt "$B" "$lp" -o "$work/sgpt-k1" --calib "$cj" --density 0.3 \
  --cache-dir "$cache" >"$work/k1.out" 2>&1 &
k1=$!
for i in $(seq 100); do ls "$cache"/hess-*.lock >/dev/null 2>&1 && break; sleep 0.05; done
kill -9 $k1; wait $k1 2>/dev/null
check 'ls "$cache"/hess-*.lock >/dev/null 2>&1' "SIGKILL left no lock (nothing to take over): $(ls -A "$cache" 2>&1)"
merge sparsegpt "$B" "$lp" -o "$work/sgpt-k2" --calib "$cj" --density 0.3 --cache-dir "$cache"
check 'grep -q "Hessians of $lp: the lock $cache/hess-[0-9a-f]*\.lock of $(hostname) pid $k1, which is gone, is taken over" "$work/out" &&
  [ "$(count "Hessians of .* tokens")" -eq 1 ]' "a dead holder's lock: $(head -c 800 "$work/out")"
check '[ -z "$(ls -A "$cache" | grep -v "\.bin$")" ]' "left in the cache: $(ls -A "$cache")"
# SIGTERM (a job's time limit, scancel) removes the lock as it removes the partial output
cache=$work/ucache-term
LLMERGE_TEST_DELAY_MS=20000 "$llmerge" sparsegpt "$B" "$lp" -o "$work/sgpt-t1" --calib "$cj" --density 0.3 \
  --cache-dir "$cache" >"$work/t1.out" 2>&1 &
t1=$!
for i in $(seq 100); do ls "$cache"/hess-*.lock >/dev/null 2>&1 && break; sleep 0.05; done
kill -TERM $t1; wait $t1 2>/dev/null
check '[ -z "$(ls -A "$cache" | grep -v "\.bin$")" ] && [ ! -e "$work/sgpt-t1" ]' \
  "SIGTERM left: $(ls -A "$cache" "$work" | grep -e lock -e sgpt-t1) $(head -c 300 "$work/t1.out")"

x=$work/sgpt-bad
expect 2 "needs calibration data" sparsegpt "$B" "$lp" -o "$x"
printf '{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 100000]}\n' >"$work/bad.jsonl"
expect 2 "bad.jsonl:2" sparsegpt "$B" "$lp" -o "$x" --calib "$work/bad.jsonl"
expect 2 "given 3 times for 2 FTs" sparsegpt "$B" "$lp" "$ff" -o "$x" --calib "$cj" --calib "$cj" --calib "$cj"
expect 2 "one --calib file" sparsegpt "$B" "$lp" "$ff" -o "$x" --calib "$cj" --calib "$cj" --hessian-from base
expect 2 "use ft or base" sparsegpt "$B" "$lp" -o "$x" --calib "$cj" --hessian-from mine
expect 2 "--seq-len" sparsegpt "$B" "$lp" -o "$x" --calib "$cj" --seq-len 0
no_output "$x"
# a FIFO as --calib is refused without blocking on it
mkfifo "$work/fifo.jsonl"
llmerge=timed
expect 2 "$work/fifo.jsonl is a FIFO, not a regular file" sparsegpt "$B" "$lp" -o "$x" --calib "$work/fifo.jsonl"
llmerge=$real_llmerge
no_output "$x"
# a rope scaling the forward pass does not compute (yarn): refused before any work, naming the
# file and the key, whichever model the Hessians come from; merges that run no model take it
yarn='"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}'
copy "$ff" "$work/yarn_ft" && sed -i "s/\"rope_scaling\": null/$yarn/" "$work/yarn_ft/config.json"
copy "$B" "$work/yarn_base" && sed -i "s/\"rope_scaling\": null/$yarn/" "$work/yarn_base/config.json"
for args in "$B $work/yarn_ft" "$work/yarn_base $lp" "$work/yarn_base $ff --hessian-from base"; do
  set -- $args
  expect 2 "config.json: key 'rope_scaling.rope_type': rope scaling type 'yarn' is not supported" \
    sparsegpt "$@" -o "$x" --calib "$cj" --cache-dir "$work/yarn-cache"
  check '! grep -q "Hessians of" "$work/out"' "sparsegpt $args: the yarn config was refused after the work started"
  no_output "$x"
done
merge ties "$B" "$work/yarn_ft" -o "$work/yarn_merged"
expect 0 "--calib has no effect on ties" ties "$B" "$lp" -o "$work/sgpt-note" --calib "$cj"
expect 0 "--hessian-from ft|base" sparsegpt --help
check 'grep -q -- "--sticky-fallback" "$work/out"' "sparsegpt --help lacks --sticky-fallback"
check 'grep -q "tau_jc^2 / U_cc^2" "$work/out" && grep -q -- "--calib-samples N" "$work/out"' "sparsegpt --help: $(head -c 300 "$work/out")"
merge sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-sticky" --calib "$cj" --density 0.3 --device sim:450KiB --sticky-fallback \
  --cache-dir "$work/sticky-cache"
same_shards "$o" "$work/sgpt-sticky"
check 'grep -q "every later sequence runs on cpu too (--sticky-fallback)" "$work/out"' \
  "sparsegpt --sticky-fallback on sim:450KiB: $(head -c 600 "$work/out")"
# A device fault in the second FT's capture, the first FT's U_cc² already computed (a fresh
# cache, so both are captured): exit 1 naming that FT, nothing left at OUT, and nothing of the
# first FT's U_cc² leaked (the sanitizer build's leak check reports into the output).
for fault in alloc:77 launch:136; do
  x=$work/sgpt-fault
  LLMERGE_SIM_FAIL=$fault expect 1 "Hessians of $ff: " sparsegpt "$B" "$lp" "$ff" -o "$x" --calib "$cj" \
    --device sim:1GiB --cache-dir "$work/fault-cache-${fault%%:*}"
  check '! grep -q "Sanitizer" "$work/out"' "sparsegpt with LLMERGE_SIM_FAIL=$fault: $(grep -A3 Sanitizer "$work/out" | head -c 600)"
  no_output "$x"
done
# a fault while a capture places the weights names them, with the adapter and the tensor
LLMERGE_SIM_FAIL=alloc:1 expect 1 "error: Hessians of $lp: placing the weights of $B with adapter $lp on sim:1GiB: tensor 'model.embed_tokens.weight': sim: injected failure of allocation 1" \
  sparsegpt "$B" "$lp" "$ff" -o "$work/sgpt-fault" --calib "$cj" --device sim:1GiB --cache-dir "$work/fault-cache-place"
no_output "$work/sgpt-fault"

# ---- devices: the simulated accelerator and its fallbacks ------------------------------------
# An ample budget: every merged tensor on the device, the same output as the CPU's.
merge ties "$B" "$lp" "$ff" -o "$work/dev-cpu" --device cpu
merge ties "$B" "$lp" "$ff" -o "$work/dev-sim" --device sim:1GiB
same_shards "$work/dev-cpu" "$work/dev-sim"
check 'grep -q "devices: 21 tensors merged on sim:1GiB, 0 on cpu" "$work/out"' "sim:1GiB: no device summary: $(cat "$work/out")"
json "$work/dev-sim/llmerge.json" devices.sim:1GiB 21
json "$work/dev-sim/llmerge.json" fallbacks.merge 0
# A budget the largest tensors do not fit: each falls back to the CPU with a line, a log event
# and a count; the output is still the CPU's.
log=$work/fallback.jsonl
merge ties "$B" "$lp" "$ff" -o "$work/dev-small" --device sim:96KiB --log-json "$log"
same_shards "$work/dev-cpu" "$work/dev-small"
check 'grep -q "fallback: merge model.embed_tokens.weight on cpu (sim:96KiB: out of memory allocating" "$work/out"' \
  "sim:96KiB: no fallback line for the embeddings: $(head -c 600 "$work/out")"
n_lines=$(grep -c "fallback: merge " "$work/out")
n_events=$(grep -c '"event":"fallback"' "$log")
n_manifest=$("$jsonq" "$work/dev-small/llmerge.json" fallbacks.merge)
check '[ "$n_lines" -ge 1 ] && [ "$n_lines" = "$n_events" ] && [ "$n_lines" = "$n_manifest" ]' \
  "fallbacks: $n_lines lines, $n_events log events, $n_manifest in llmerge.json"
ev=$(grep -m1 '"event":"fallback"' "$log")
check '[ "$(echo "$ev" | "$jsonq" - phase)" = merge ] && [ "$(echo "$ev" | "$jsonq" - from)" = sim:96KiB ] &&
  [ "$(echo "$ev" | "$jsonq" - to)" = cpu ] && echo "$ev" | "$jsonq" - reason | grep -q "out of memory"' \
  "fallback event lacks phase/from/to/reason: $ev"
json "$work/dev-small/llmerge.json" fallbacks.units.0.unit model.embed_tokens.weight
check 'grep -q "fallbacks: place 0, select 0, merge $n_lines" "$work/out"' "no fallback summary: $(tail -3 "$work/out")"
# A budget nothing fits: the adapter's factors stay on the CPU too.
merge ties "$B" "$lp" "$ff" -o "$work/dev-none" --device sim:1KiB
same_shards "$work/dev-cpu" "$work/dev-none"
check 'grep -q "fallback: place .*lora_plain on cpu" "$work/out"' "sim:1KiB: no place fallback: $(head -c 600 "$work/out")"
# --gpu-mem caps the device's budget.
merge ties "$B" "$lp" "$ff" -o "$work/dev-capped" --device sim:1GiB --gpu-mem 1KiB
check 'grep -q "fallback: place" "$work/out"' "--gpu-mem 1KiB did not cap sim:1GiB"
# Any other device error stops the run: exit 1, the phase and tensor named, nothing left.
x=$work/dev-fail
LLMERGE_SIM_FAIL=launch:40 expect 1 "merging tensor 'model." ties "$B" "$lp" "$ff" -o "$x" --device sim:1GiB
check 'grep -q "injected failure of operation 40" "$work/out"' "launch:40: $(cat "$work/out")"
no_output "$x"
LLMERGE_SIM_FAIL=alloc:1 expect 1 "placing the LoRA factors on sim:1GiB" ties "$B" "$lp" -o "$x" --device sim:1GiB
no_output "$x"
LLMERGE_SIM_FAIL=alloc:3 expect 1 "merging tensor" ties "$B" "$ff" -o "$x" --device sim:1GiB
no_output "$x"
LLMERGE_SIM_FAIL=boom expect 2 "LLMERGE_SIM_FAIL" ties "$B" "$lp" -o "$x" --device sim:1GiB
no_output "$x"
# auto says what it chose and why
expect 0 "device auto: " ties "$B" "$lp" -o "$work/dev-auto" --device auto

# ---- help ------------------------------------------------------------------------------------
"$llmerge" ties --help >"$work/help" 2>&1
check '[ $? -eq 0 ]' "ties --help failed"
for opt in -o, --output --weights --density --densities --lambda --normalize --no-normalize --sign \
  --topk --rescale --seed --dtype --shard-size --device --gpu-mem --threads --cache-dir --log-json \
  -q, --quiet -v --force --no-card --strict -h, --help; do
  check 'grep -qF -- "$opt" "$work/help"' "ties --help does not explain $opt"
done
expect 0 "default for ties: on" ties --help
expect 0 "default for dare: off" dare --help
expect 0 "default for task-arithmetic: off" task-arithmetic -h
expect 0 "default for dare-ties: off" dare-ties --help
expect 0 "task-arithmetic" --help
expect 2 "llmerge: error: unknown command 'daer'; did you mean 'dare'" daer "$B" "$lp" -o "$x"
# mergekit's method names: its spellings run llmerge's methods (dare_linear is dare); one llmerge
# does not have is refused, with llmerge's methods and the page that maps mergekit's to them
methods="ties, dare, dare-ties, task-arithmetic, sparsegpt, linear, slerp, nuslerp, multislerp, karcher, model-stock, nearswap, breadcrumbs, breadcrumbs-ties, della, della-linear, sce, ram, ramplus-tl"
for m in arcee_fusion; do
  expect 2 "llmerge: error: unknown command '$m': mergekit's ${m//-/_} is not in llmerge (yet)" "$m" "$B" "$lp" -o "$x"
  check 'grep -qF "merge methods: $methods" "$work/out" && grep -qF "docs/mergekit.md" "$work/out"' "$m: $(cat "$work/out")"
done
for m in dare_linear dare_ties task_arithmetic model_stock breadcrumbs_ties della_linear; do
  run "mk-$m" "$m" "$B" "$lp" "$lp" -o "$x" -q
  rm -rf "$x"
done
expect 0 "Usage: llmerge dare BASE FT [FT...] -o OUT" dare_linear --help
expect 0 "Usage: llmerge model-stock BASE FT FT [FT...] -o OUT" model_stock --help
expect 0 "Usage: llmerge linear MODEL MODEL [MODEL...] -o OUT" linear --help
expect 0 "llmerge nuslerp --models-only MODEL MODEL -o OUT" nuslerp --help
expect 2 "slerp takes 1 fine-tuned input besides the base, not 2" slerp "$B" "$lp" "$lp" -o "$x"
expect 2 "model-stock takes at least 2 fine-tuned inputs besides the base, not 1" model-stock "$B" "$lp" -o "$x"
expect 2 "--weights gives 1 weight for 2 models (one per MODEL, the first one's first)" linear "$B" "$lp" -o "$x" --weights 1
# blanks around a number, as around a setting
if "$llmerge" linear "$B" "$lp" -o "$x" --weights '1, 0.5' -q; then ok; else bad "--weights '1, 0.5' refused"; fi
rm -rf "$x"
# normalised weights that sum to 0: refused before any work, naming the first such tensor
expect 2 "linear: the weights of the models sum to 0 in tensor 'model.embed_tokens.weight'" \
  linear "$B" "$fx/ft_full" -o "$x" --weights 1,-1
no_output "$x"
expect 0 "note: --t has no effect on linear" linear "$B" "$lp" -o "$x" --t 0.3
rm -rf "$x"
# any other unknown command: the error, the commands and the methods
expect 2 "llmerge: error: unknown command 'frobnicate'" frobnicate "$B"
check 'grep -qF "merge methods: $methods" "$work/out" && grep -qF "llmerge --help" "$work/out"' "frobnicate: $(cat "$work/out")"
# llmerge plan takes a method too
expect 2 "llmerge plan: error: 'arcee_fusion' is not a merge method of llmerge ($methods): mergekit's arcee_fusion is not in llmerge (yet)" \
  plan arcee_fusion "$B" "$lp" -o "$x"
check 'grep -qF "docs/mergekit.md" "$work/out"' "plan arcee_fusion: $(cat "$work/out")"
expect 0 "merge: largest tensor" plan dare_ties "$B" "$lp" -o "$x"
no_output "$x"

e2e_end
