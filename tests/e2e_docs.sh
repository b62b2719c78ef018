#!/usr/bin/env bash
# End-to-end checks of the documentation against the source tree and the binary: no file points
# at a document the repository does not hold; every `docs/FILE.md "Heading"` pointer in the code,
# tests and docs names a file of docs/ and a heading in it; every relative Markdown link of the
# docs and READMEs reaches a file and, with #anchor, a heading there; the man page has every
# command `llmerge --help` lists, in its synopsis and its command list, and renders the same
# notation in an ASCII and a UTF-8 terminal (no glyph either cannot show), without groff
# warnings; docs/mergekit.md says before its first section that mergekit's default density is
# 1.0 and llmerge's 0.2, and its recipe for mergekit's `linear` holds on the fixtures, where
# `task-arithmetic --normalize` does not give it.
# Usage: e2e_docs.sh LLMERGE FIXTURES SOURCE_DIR ST_DIFF
set -u
llmerge=$1 fx=$2 src=$3 st_diff=$4
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_docs
export LC_ALL=C

check() { if eval "$1"; then ok; else bad "$2"; fi; }

# The text files of the source tree (not the build trees).
find "$src" \( -path "$src/.git" -o -path "$src/build*" \) -prune -o -type f \
  \( -name '*.[ch]' -o -name '*.cu' -o -name '*.cuh' -o -name '*.sh' -o -name '*.md' -o -name '*.1' \
     -o -name Makefile -o -name CMakeLists.txt \) -print | sort >"$work/files"
check '[ "$(wc -l <"$work/files")" -gt 50 ] && grep -q "/docs/design.md$" "$work/files"' \
  "the source tree's files were not found under $src: $(head -c 400 "$work/files")"

# ---- no pointer leaves the repository ----------------------------------------------------------
# (the pattern is written so that this file does not match it)
xargs grep -nE 'METHODS\.md|DESIGN\.md|FORMATS\.md|\.\./shared' <"$work/files" >"$work/outside"
check '[ ! -s "$work/outside" ]' "pointers to documents the repository does not hold: $(head -c 1500 "$work/outside")"

# ---- docs/FILE.md "Heading" pointers ------------------------------------------------------------
# headings FILE: its headings' text, one a line, without the #s
headings() { sed -n 's/^#\{1,6\} \{1,\}//p' "$1"; }
xargs grep -ohE 'docs/[a-z_]+\.md( "[^"]+")?' <"$work/files" | sort -u >"$work/pointers"
check '[ "$(grep -c " \"" "$work/pointers")" -ge 10 ]' "fewer pointers to docs sections than expected: $(cat "$work/pointers")"
while IFS= read -r p; do
  f=${p%%.md*}.md
  if [ ! -f "$src/$f" ]; then
    bad "$p: $f does not exist"
    continue
  fi
  case $p in
    *' "'*)
      h=${p#*\"} h=${h%\"}
      if headings "$src/$f" | awk -v h="$h" 'index($0, h) == 1 { found = 1 } END { exit !found }'; then ok; else
        bad "$p: $f has no heading that starts with \"$h\""
      fi ;;
    *) ok ;;
  esac
done <"$work/pointers"

# ---- relative Markdown links --------------------------------------------------------------------
# slug: a heading as GitHub makes its anchor (lower case; punctuation but - and _ dropped;
# spaces turned into -)
slugs() { headings "$1" | tr 'A-Z' 'a-z' | sed 's/[][!"#$%&'\''()*+,./:;<=>?@\\^`{|}~]//g; s/ /-/g'; }
nlinks=0
for md in $(grep '\.md$' "$work/files"); do
  dir=$(dirname "$md")
  # every ](target) of the file, the target without a title
  grep -oE '\]\([^) ]+\)' "$md" | sed 's/^](//; s/)$//' | grep -vE '^(https?|mailto):' | sort -u >"$work/links"
  while IFS= read -r l; do
    nlinks=$((nlinks + 1))
    path=${l%%#*} anchor=
    case $l in *'#'*) anchor=${l#*#} ;; esac
    target=$md
    [ -n "$path" ] && target=$dir/$path
    if [ ! -e "$target" ]; then
      bad "${md#$src/}: link ($l): ${target#$src/} does not exist"
    elif [ -n "$anchor" ] && ! slugs "$target" | grep -qxF -- "$anchor"; then
      bad "${md#$src/}: link ($l): ${target#$src/} has no heading whose anchor is #$anchor"
    else
      ok
    fi
  done <"$work/links"
done
check '[ "$nlinks" -ge 30 ]' "only $nlinks relative Markdown links found"

# ---- the man page -------------------------------------------------------------------------------
man=$src/docs/llmerge.1
"$llmerge" --help >"$work/help" 2>&1
sed -n '/^Commands:/,/^$/p' "$work/help" | sed -n 's/^  \([a-z][a-z-]*\) .*/\1/p' >"$work/commands"
check '[ "$(wc -l <"$work/commands")" -ge 9 ]' "llmerge --help lists too few commands: $(cat "$work/help")"
# the page's source with \- as -
sed 's/\\-/-/g' "$man" >"$work/man.src"
while IFS= read -r c; do
  check 'grep -qx "\.B llmerge $c" "$work/man.src"' "the man page's SYNOPSIS lacks 'llmerge $c'"
  check 'awk -v c="$c" "/^\\.SH COMMANDS/ { in_c = 1; next } /^\\.SH / { in_c = 0 }
           in_c && prev == \".TP\" && \$0 == \".B \" c { found = 1 } { prev = \$0 } END { exit !found }" "$work/man.src"' \
    "the man page's COMMANDS lack an entry for $c"
done <"$work/commands"
# Only glyphs that an ASCII terminal shows too: no non-ASCII bytes, no Greek letters or arrows.
grep -nP "[^\x00-\x7f]" "$man" >"$work/nonascii"
check '[ ! -s "$work/nonascii" ]' "non-ASCII bytes in $man: $(head -c 400 "$work/nonascii")"
grep -nE '\\\((\*.|ua|da|<-|->|lA|rA|uA|dA)' "$man" >"$work/glyphs"
check '[ ! -s "$work/glyphs" ]' "glyphs an ASCII terminal shows as <name> in $man: $(head -c 400 "$work/glyphs")"
if command -v groff >/dev/null; then
  groff -man -ww -z "$man" >"$work/groff.warn" 2>&1
  check '[ ! -s "$work/groff.warn" ]' "groff warns about $man: $(head -c 600 "$work/groff.warn")"
  for dev in ascii utf8; do
    groff -man -T"$dev" "$man" 2>/dev/null | sed 's/.\x08//g' >"$work/man.$dev"
    check 'grep -q "H = (2 / n_tokens) sum(x x^T)" "$work/man.$dev"' \
      "the Hessian's formula as -T$dev renders it: $(grep -A1 'input Hessians' "$work/man.$dev")"
    grep -nE '<[A-Za-z]+>|'$'\xe2\x86\x91' "$work/man.$dev" >"$work/bad.$dev"
    check '[ ! -s "$work/bad.$dev" ]' "glyphs -T$dev cannot show: $(head -c 400 "$work/bad.$dev")"
  done
else
  echo "e2e_docs: groff is not installed: the man page's rendering is not checked"
fi

# ---- docs/mergekit.md ---------------------------------------------------------------------------
mk=$src/docs/mergekit.md
# what a mergekit user reads first: the page up to its first section
sed '/^## /,$d' "$mk" | tr '\n' ' ' | sed 's/\. /.\n/g' >"$work/mk.top"
check 'grep -q "density. defaults to \*\*0\.2\*\*" "$work/mk.top" && grep -q "mergekit.s .density. defaults to \*\*1\.0\*\*" "$work/mk.top"' \
  "docs/mergekit.md does not say before its first section that llmerge's density defaults to 0.2 and mergekit's to 1.0"
check '"$llmerge" ties --help | grep -A1 -- "--density D" | grep -q "(default 0\.2)"' \
  "llmerge ties --help does not say --density defaults to 0.2, as docs/mergekit.md says"
check 'grep -qF -- "--weights w_1/W,w_2/W" "$mk"' "docs/mergekit.md gives no recipe for mergekit's linear"
# The recipe on the fixtures: mergekit's linear average of the adapter applied to the base and
# of the full fine-tune is, both being full models that hold every tensor, task-arithmetic
# --normalize of the two; the recipe (weights divided by their sum) on the adapter itself must
# give it, and --normalize on the adapter (which touches only q_proj and v_proj) must not.
B=$fx/base
run lora_full task-arithmetic "$B" "$fx/lora_plain" -o "$work/lora_full" --dtype f32 -q
run linear task-arithmetic "$B" "$work/lora_full" "$fx/ft_full" -o "$work/linear" --normalize --dtype f32 -q
run recipe task-arithmetic "$B" "$fx/lora_plain" "$fx/ft_full" -o "$work/recipe" --weights 0.5,0.5 --dtype f32 -q
run normalized task-arithmetic "$B" "$fx/lora_plain" "$fx/ft_full" -o "$work/normalized" --normalize --dtype f32 -q
check '"$st_diff" --rel 1e-6 "$work/linear/model.safetensors" "$work/recipe/model.safetensors" >"$work/diff1" 2>&1' \
  "the recipe of docs/mergekit.md is not mergekit's linear: $(tail -n 5 "$work/diff1" 2>/dev/null)"
# llmerge's own linear (the base weighed 0: not among the averaged models) is that average too
run own linear "$B" "$fx/lora_plain" "$fx/ft_full" -o "$work/own" --weights 0,1,1 --dtype f32 -q
check '"$st_diff" --rel 1e-6 "$work/linear/model.safetensors" "$work/own/model.safetensors" >"$work/diff3" 2>&1' \
  "llmerge linear is not mergekit's linear: $(tail -n 5 "$work/diff3" 2>/dev/null)"
"$st_diff" --rel 1e-3 "$work/linear/model.safetensors" "$work/normalized/model.safetensors" >"$work/diff2" 2>&1
rc=$?
check '[ "$rc" -eq 1 ] && grep -q "mlp.down_proj.weight:" "$work/diff2" && ! grep -q "self_attn.q_proj.weight:" "$work/diff2"' \
  "task-arithmetic --normalize should differ from linear on the tensors the adapter leaves alone only (st_diff exit $rc): $(tail -n 8 "$work/diff2")"


# Every CUDA kernel is loaded when the device opens (LM_CUDA_PRELOAD): one left out would be
# loaded at its first launch, where a full device fails it.
for cu in "$src"/backends/cuda/*.cu; do
  for k in $(sed -n 's/^__global__ void \(k_[a-z0-9_]*\)(.*/\1/p' "$cu"); do
    check 'grep -q "^LM_CUDA_PRELOAD($k[<)]" "$cu"' "$(basename "$cu"): kernel $k is not in its LM_CUDA_PRELOAD list"
  done
done

e2e_end
