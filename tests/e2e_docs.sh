#!/usr/bin/env bash
# End-to-end checks of the documentation against the source tree: no file points at a document
# the repository does not hold; every `docs/FILE.md "Heading"` pointer in the code, tests and
# docs names a file of docs/ and a heading in it; every relative Markdown link of the docs and
# READMEs reaches a file and, with #anchor, a heading there.
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

e2e_end
