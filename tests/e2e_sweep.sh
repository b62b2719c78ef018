#!/usr/bin/env bash
# End-to-end test of examples/sweep/Makefile on the fixtures, at small size (ties and dare-ties
# at densities 0.2 and 0.5) with `make -j2`: results.csv has the header and one row per point
# with a finite positive perplexity and a positive token count; the plot is a PNG (when gnuplot
# is installed); a second make does nothing and touches no file; a point whose model directory
# is removed (as after an interrupted run) is redone alone. Then `make install DESTDIR=...`
# from the top-level Makefile puts the binary and the man page in place.
# Usage: e2e_sweep.sh LLMERGE FIXTURES SOURCE_DIR
set -u
llmerge=$1 fx=$2 src=$3
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_sweep

check() { if eval "$1"; then ok; else bad "$2"; fi; }

# ctest may run under make (make test): its job server and flags are not for these makes
unset MAKEFLAGS MFLAGS MAKELEVEL

out=$work/sweep
sweep() {
  make --no-print-directory -C "$src/examples/sweep" LLMERGE="$llmerge" FIXTURES="$fx" OUT="$out" \
    METHODS="ties dare-ties" DENSITIES="0.2 0.5" WEIGHTS="1,1,1" "$@"
}
points="ties,0.2 ties,0.5 dare-ties,0.2 dare-ties,0.5"

# ---- the sweep -------------------------------------------------------------------------------
if sweep -j2 >"$work/run1.log" 2>&1; then ok; else bad "make -j2 failed: $(tail -c 1500 "$work/run1.log")"; fi
csv=$out/results.csv
if [ "$(head -n 1 "$csv" 2>/dev/null)" = "method,density,weights,perplexity,tokens" ]; then ok; else
  bad "results.csv header is '$(head -n 1 "$csv" 2>/dev/null)'"
fi
rows=$(($(wc -l <"$csv" 2>/dev/null || echo 0) - 1))
if [ "$rows" -eq 4 ]; then ok; else bad "results.csv has $rows rows, wanted 4: $(cat "$csv" 2>/dev/null)"; fi
for p in $points; do
  m=${p%,*} d=${p#*,}
  n=$(awk -F, -v m="$m" -v d="$d" 'NR > 1 && $1 == m && $2 == d' "$csv" 2>/dev/null | wc -l)
  if [ "$n" -eq 1 ]; then ok; else bad "results.csv has $n rows for $m at density $d"; fi
  # a finite positive perplexity (awk's numeric test rejects nan, inf and empty fields)
  if awk -F, -v m="$m" -v d="$d" 'NR > 1 && $1 == m && $2 == d {
        found = 1
        if ($3 != "1 1 1" || $4 !~ /^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$/ || $4 + 0 <= 0 ||
            $5 !~ /^[0-9]+$/ || $5 + 0 <= 0) exit 1
      } END { exit !found }' "$csv" 2>/dev/null; then ok; else
    bad "row for $m at density $d is not 'method,density,1 1 1,positive perplexity,tokens': $(grep "^$m,$d," "$csv" 2>/dev/null)"
  fi
done
# the sparser merges are different models: not every point can have the same perplexity
if [ "$(awk -F, 'NR > 1 { print $4 }' "$csv" 2>/dev/null | sort -u | wc -l)" -gt 1 ]; then ok; else
  bad "every point has the same perplexity: $(cat "$csv" 2>/dev/null)"
fi
if grep -q '^ties  *0.2  *1 1 1 ' "$work/run1.log"; then ok; else bad "no summary table printed: $(tail -c 800 "$work/run1.log")"; fi

if command -v gnuplot >/dev/null; then
  if [ "$(head -c 8 "$out/perplexity.png" 2>/dev/null | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; then ok; else
    bad "$out/perplexity.png is missing or not a PNG"
  fi
else
  echo "e2e_sweep: gnuplot is not installed: the PNG is not checked (scripts/bootstrap.sh installs gnuplot-nox)"
fi

# ---- nothing to do the second time -----------------------------------------------------------
snapshot() { find "$out" -printf '%P %s %T@\n' | sort; }
snapshot >"$work/before"
if sweep -q >/dev/null 2>&1; then ok; else bad "make -q says the sweep is not up to date"; fi
sleep 0.05  # so that a rewritten file would show a different mtime
if sweep -j2 >"$work/run2.log" 2>&1; then ok; else bad "the second make failed: $(tail -c 800 "$work/run2.log")"; fi
snapshot >"$work/after"
if cmp -s "$work/before" "$work/after"; then ok; else
  bad "the second make changed files: $(diff "$work/before" "$work/after" | head -20)"
fi
if ! grep -q "$llmerge" "$work/run2.log"; then ok; else bad "the second make ran llmerge: $(head -c 800 "$work/run2.log")"; fi

# ---- resuming: only the missing point is redone ----------------------------------------------
rm -rf "$out/models/dare-ties-d0.5-w1_1_1"
if sweep -j2 >"$work/run3.log" 2>&1; then ok; else bad "the resumed make failed: $(tail -c 800 "$work/run3.log")"; fi
merges=$(grep -c "^$llmerge \(ties\|dare-ties\) " "$work/run3.log")
if [ "$merges" -eq 1 ] && grep -q -- "-o $out/models/dare-ties-d0.5-w1_1_1 " "$work/run3.log"; then ok; else
  bad "the resumed make ran $merges merges, wanted only dare-ties at 0.5: $(grep "^$llmerge" "$work/run3.log")"
fi
if [ "$(($(wc -l <"$csv") - 1))" -eq 4 ]; then ok; else bad "results.csv after resuming: $(cat "$csv")"; fi
if sweep -q >/dev/null 2>&1; then ok; else bad "make -q says the resumed sweep is not up to date"; fi

# ---- sparsegpt points share their Hessians through the cache ----------------------------------
sg=$work/sweep-sg
if sweep OUT="$sg" METHODS=sparsegpt DENSITIES="0.2 0.5" MERGE_FLAGS= -j1 >"$work/sg.log" 2>&1; then ok; else
  bad "the sparsegpt sweep failed: $(tail -c 1500 "$work/sg.log")"
fi
captured=$(grep -c "Hessians of .* tokens" "$work/sg.log")
cached=$(grep -c "Hessians of .* from the cache" "$work/sg.log")
check '[ "$captured" -eq 3 ] && [ "$cached" -eq 3 ]' "sparsegpt sweep: $captured captures and $cached cache reads (want 3 and 3)"
check '[ "$(grep -c "^sparsegpt," "$sg/results.csv")" -eq 2 ]' "sparsegpt sweep: $(cat "$sg/results.csv" 2>&1)"
check '[ -n "$(ls "$sg/cache"/ucc2-*.bin 2>/dev/null)" ]' "sparsegpt sweep: no cache entries in $sg/cache"

# ---- make install ----------------------------------------------------------------------------
dest=$work/dest
if make --no-print-directory -C "$src" install DESTDIR="$dest" PREFIX=/opt/lm BUILD="$(dirname "$llmerge")" \
     >"$work/install.log" 2>&1; then ok; else bad "make install failed: $(tail -c 800 "$work/install.log")"; fi
if [ -x "$dest/opt/lm/bin/llmerge" ] && "$dest/opt/lm/bin/llmerge" --version | grep -q '^llmerge '; then ok; else
  bad "make install put no working llmerge in $dest/opt/lm/bin"
fi
if cmp -s "$src/docs/llmerge.1" "$dest/opt/lm/share/man/man1/llmerge.1"; then ok; else
  bad "make install put no llmerge.1 in $dest/opt/lm/share/man/man1"
fi

e2e_end
