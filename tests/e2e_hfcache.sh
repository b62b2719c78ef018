#!/usr/bin/env bash
# End-to-end tests of models given by their Hub ids, through the binary, on a Hugging Face cache
# laid out here from the fixtures as huggingface_hub lays one out (files in blobs/ named by their
# hash, symbolic links to them under snapshots/COMMIT/, refs/main and a tag holding commits):
# `llmerge ties ORG/BASE ORG/LORA ORG/FT@REVISION` writes the same tensors as the same merge
# given the fixtures' paths, records the snapshots in llmerge.json and the Hub ids in the card's
# base_model; `llmerge inspect` and `llmerge eval` take Hub ids (an adapter checked against a
# base given by its id); a directory on disk wins over the cache whatever it reads like; a model,
# a revision or a snapshot the cache lacks is exit status 2 with a message naming the cache, the
# entry it expected and the download command, and nothing is downloaded or written.
# Usage: e2e_hfcache.sh LLMERGE FIXTURES JSONQ
set -u
llmerge=$1 fx=$2 jsonq=$3
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_hfcache

check() { if eval "$1"; then ok; else bad "$2"; fi; }

# The cache, in $work only: every variable that could name another is unset.
hub=$work/hub
unset HUGGINGFACE_HUB_CACHE HF_HOME XDG_CACHE_HOME
export HF_HUB_CACHE=$hub HOME=$work/home

# put REPO COMMIT DIR: DIR's files as snapshot COMMIT of REPO (ORG/NAME or NAME), each a
# symbolic link into blobs/.
put() {
  local entry=$hub/models--${1/\//--} commit=$2 src=$3 f blob
  mkdir -p "$entry/blobs" "$entry/snapshots/$commit" "$entry/refs" || return 1
  for f in "$src"/*; do
    blob=$(sha256sum "$f" | cut -d' ' -f1)
    cp "$f" "$entry/blobs/$blob" && ln -sf "../../blobs/$blob" "$entry/snapshots/$commit/${f##*/}" || return 1
  done
}
# ref REPO NAME COMMIT: refs/NAME of REPO holds COMMIT (without a newline, as huggingface_hub writes it).
ref() { printf %s "$3" >"$hub/models--${1/\//--}/refs/$2"; }

c_base=1111111111111111111111111111111111111111
c_lora=2222222222222222222222222222222222222222
c_ft_old=3333333333333333333333333333333333333333
c_ft=4444444444444444444444444444444444444444
layout_ok=true
put org/base $c_base "$fx/base" && ref org/base main $c_base &&
  put org/lora $c_lora "$fx/lora_plain" && ref org/lora main $c_lora &&
  put org/ft $c_ft "$fx/ft_full" && put org/ft $c_ft_old "$fx/ft_full2" &&
  ref org/ft main $c_ft && ref org/ft v1 $c_ft_old || layout_ok=false
check '$layout_ok && [ -L "$hub/models--org--base/snapshots/$c_base/config.json" ]' "the cache was not laid out: $(ls -R "$hub" | head -40)"
# listing: every file of the cache with its size and time, to show that nothing changes it
listing() { find "$hub" -printf '%p %y %s %T@\n' | sort; }
listing >"$work/cache.before"

# ---- a merge of Hub ids ------------------------------------------------------------------------
# org/ft@v1 is ft_full2 (the tag), org/ft would be ft_full (main)
run hub ties org/base org/lora org/ft@v1 -o "$work/hub-out" --density 0.5
run path ties "$fx/base" "$fx/lora_plain" "$fx/ft_full2" -o "$work/path-out" --density 0.5
m=$work/hub-out/llmerge.json
"$jsonq" "$m" outputs.tensors >"$work/hub.tensors" && "$jsonq" "$work/path-out/llmerge.json" outputs.tensors >"$work/path.tensors"
check '[ -s "$work/hub.tensors" ] && cmp -s "$work/hub.tensors" "$work/path.tensors"' \
  "the merge of Hub ids differs from the merge of the paths: $(diff "$work/hub.tensors" "$work/path.tensors" | head -5)"
check 'cmp -s "$work/hub-out/model.safetensors" "$work/path-out/model.safetensors"' "the shards differ"
real_hub=$(cd "$hub" && pwd -P)
json "$m" base.path "$real_hub/models--org--base/snapshots/$c_base"
json "$m" inputs.0.path "$real_hub/models--org--lora/snapshots/$c_lora"
json "$m" inputs.0.kind adapter
json "$m" inputs.1.path "$real_hub/models--org--ft/snapshots/$c_ft_old"
# the card names the Hub ids in base_model, and its command line the ids as given
check 'grep -qxF -- "- \"org/base\"" "$work/hub-out/README.md" && grep -qxF -- "- \"org/lora\"" "$work/hub-out/README.md" &&
  grep -qxF -- "- \"org/ft\"" "$work/hub-out/README.md"' "the card's base_model lacks the Hub ids: $(head -20 "$work/hub-out/README.md")"
check 'grep -qF "llmerge ties org/base org/lora org/ft@v1 -o" "$work/hub-out/README.md"' \
  "the card's command line: $(grep -F "llmerge ties" "$work/hub-out/README.md")"
# main of org/ft is another model: another result
run main ties org/base org/lora org/ft -o "$work/main-out" --density 0.5
# two revisions of one repository are one Hub id in base_model, and the card has no note asking
# for ids it has
run two ties org/base org/ft org/ft@v1 -o "$work/two-out" --density 0.5
check '[ "$(grep -cxF -- "- \"org/ft\"" "$work/two-out/README.md")" = 1 ] &&
  ! grep -q "add their Hub ids" "$work/two-out/README.md"' \
  "org/ft twice in base_model: $(head -8 "$work/two-out/README.md")"
check '! cmp -s "$work/hub-out/model.safetensors" "$work/main-out/model.safetensors"' "org/ft and org/ft@v1 gave the same merge"
# a commit, abbreviated
run commit task-arithmetic org/base org/ft@3333333 -o "$work/commit-out"
run commit_path task-arithmetic "$fx/base" "$fx/ft_full2" -o "$work/commit-path-out"
check 'cmp -s "$work/commit-out/model.safetensors" "$work/commit-path-out/model.safetensors"' "org/ft@3333333 is not ft_full2"

# ---- inspect, eval ----------------------------------------------------------------------------
expect 0 "LlamaForCausalLM" inspect org/base
expect 0 "check: ok" inspect org/base
expect 0 "(org/base: the model directory $hub/models--org--base/snapshots/$c_base, from the Hugging Face cache)" inspect org/base
expect 0 "base $hub/models--org--base/snapshots/$c_base: ok, every module fits" inspect org/lora --base org/base
if "$llmerge" inspect --json org/lora --base org/base >"$work/json" 2>"$work/err"; then ok; else bad "inspect --json org/lora: $(cat "$work/err")"; fi
json "$work/json" kind adapter
run eval_hub eval org/base --adapter org/lora --data "$fx/calib/heldout.jsonl"
run eval_path eval "$fx/base" --adapter "$fx/lora_plain" --data "$fx/calib/heldout.jsonl"
check '[ -s "$work/eval_hub.out" ] && cmp -s "$work/eval_hub.out" "$work/eval_path.out"' \
  "eval of Hub ids: $(cat "$work/eval_hub.out") vs $(cat "$work/eval_path.out")"

# ---- a path on disk wins ------------------------------------------------------------------------
# ./org/base, an adapter directory here, is what inspect reads, not the cache's model
mkdir -p "$work/cwd/org" && cp -r "$fx/lora_plain" "$work/cwd/org/base"
(cd "$work/cwd" && "$llmerge" inspect org/base) >"$work/out" 2>&1
check 'grep -q "adapter" "$work/out" && ! grep -q "$c_base" "$work/out"' "./org/base did not win over the cache: $(head -5 "$work/out")"
(cd "$work/cwd" && "$llmerge" ties org/base "$fx/lora_plain" -o "$work/cwd/out") >"$work/out" 2>&1
rc=$?
check '[ $rc -eq 2 ] && grep -qF "BASE org/base is not a model directory (it is an adapter directory)" "$work/out"' \
  "./org/base as BASE: exit $rc: $(head -3 "$work/out")"

# the commands above read the cache and wrote nothing there
listing >"$work/cache.after"
check 'cmp -s "$work/cache.before" "$work/cache.after"' "the cache changed: $(diff "$work/cache.before" "$work/cache.after" | head -5)"

# ---- not in the cache: exit status 2, where it looked, how to download it, nothing written -------------
expect 2 "FT 2: org/nope: no such file or directory, nor a model in the Hugging Face cache: no models--org--nope in $hub (set by \$HF_HUB_CACHE); llmerge downloads nothing: get it with \`huggingface-cli download org/nope\` or \`hf download org/nope\`" \
  ties org/base org/lora org/nope -o "$work/nope-out"
check '[ ! -e "$work/nope-out" ]' "a failed merge left $work/nope-out"
expect 2 "\`huggingface-cli download org/nope --revision v2\` or \`hf download org/nope --revision v2\`" inspect org/nope@v2
expect 2 "org/ft@v9: the Hugging Face cache's models--org--ft (in $hub) has no revision v9: no branch or tag refs/v9 (it has: main, v1)" \
  ties org/base org/ft@v9 -o "$work/nope-out"
expect 2 "org/ft@5555555: the Hugging Face cache's models--org--ft (in $hub) has no revision 5555555" inspect org/ft@5555555
# refs/main gone: the snapshots there are and how to name one
rm "$hub/models--org--ft/refs/main"
expect 2 "org/ft: the Hugging Face cache's models--org--ft (in $hub) has no refs/main to say which snapshot is the model (snapshots: 333333333333, 444444444444); name one as org/ft@COMMIT" \
  inspect org/ft
# a snapshot gone: refs/main names it
rm -r "$hub/models--org--base/snapshots/$c_base"
expect 2 "org/base: $hub/models--org--base/refs/main names commit $c_base, but the Hugging Face cache has no models--org--base/snapshots/$c_base" \
  eval org/base --data "$fx/calib/heldout.jsonl"
# HF_HOME when HF_HUB_CACHE is unset, then the default under HOME
(unset HF_HUB_CACHE; HF_HOME=$work/hfhome "$llmerge" inspect org/lora) >"$work/out" 2>&1
check 'grep -qF "no models--org--lora in $work/hfhome/hub (\$HF_HOME/hub)" "$work/out"' "HF_HOME: $(cat "$work/out")"
(unset HF_HUB_CACHE; "$llmerge" inspect gpt2) >"$work/out" 2>&1
check 'grep -qF "gpt2: no such file or directory, nor a model in the Hugging Face cache: no models--gpt2 in $work/home/.cache/huggingface/hub (the default, ~/.cache/huggingface/hub)" "$work/out"' \
  "the default cache: $(cat "$work/out")"
# not a Hub id: a missing path, nothing said of the cache
expect 2 "org/a/b: no such file or directory" inspect org/a/b
check '! grep -q "Hugging Face" "$work/out"' "a path that is no Hub id mentions the cache: $(cat "$work/out")"
e2e_end
