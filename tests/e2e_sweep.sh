#!/usr/bin/env bash
# End-to-end test of examples/sweep/Makefile on the fixtures, at small size (ties and dare-ties
# at densities 0.2 and 0.5) with `make -j2`: results.csv has the header and one row per point
# with a finite positive perplexity and a positive token count; the evaluations use the held-out
# tokens, none of whose sequences is in the calibration file; each llmerge gets the cores
# divided among make's jobs as --threads; references.csv holds the base's and each input's own
# perplexity, as `llmerge eval` gives it, and gnuplot is given them as level lines; the plot is
# a PNG (when gnuplot is installed); a second make does nothing and touches no file; a point
# whose model directory is removed (as after an interrupted run) is redone alone; a failing
# point leaves the others to `make -k`, its log says why, and `make summary` lists it; the Makefile
# copied alone into a directory of models runs there, with llmerge from the PATH. Then
# `make install DESTDIR=...` from the top-level Makefile puts the binary and the man page in
# place.
# Usage: e2e_sweep.sh LLMERGE FIXTURES SOURCE_DIR
set -u
llmerge=$1 fx=$2 src=$3
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_sweep

check() { if eval "$1"; then ok; else bad "$2"; fi; }

# ctest may run under make (make test): its job server and flags are not for these makes; and the
# Makefile's variables may also come from the environment (OUT is a common name), not here
unset MAKEFLAGS MFLAGS MAKELEVEL
unset LLMERGE FIXTURES OUT BASE FTS DATA CALIB CACHE METHODS DENSITIES WEIGHTS SEED THREADS MERGE_FLAGS EVAL_FLAGS \
  GNUPLOT ROOT

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

# ---- held-out data: not the calibration tokens -------------------------------------------------
heldout=$fx/calib/heldout.jsonl
for p in $points; do
  m=${p%,*} d=${p#*,}
  f=$out/eval/$m-d$d-w1_1_1.json
  check 'grep -qF "\"data\":\"$heldout\"" "$f"' "$f does not evaluate on $heldout: $(cat "$f" 2>&1)"
done
# the sequences of a .jsonl file as space-separated ids, one a line, as calib.txt has them
ids() { sed 's/[^0-9 ,]//g; s/,//g; s/^ *//; s/ *$//' "$1"; }
check '[ "$(ids "$heldout" | wc -l)" -ge 8 ] && [ -z "$(ids "$heldout" | grep -Fxf "$fx/calib/calib.txt")" ]' \
  "$heldout does not hold 8 or more sequences, none of them in $fx/calib/calib.txt"

# ---- threads: the cores shared among make's jobs -------------------------------------------------
cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
# threads_of LOG: the --threads values of the llmerge commands LOG shows, distinct
threads_of() { grep "^$llmerge " "$1" | sed -n 's/.* --threads \([^ ]*\) .*/\1/p' | sort -u | tr '\n' ' '; }
want=$((cores / 2)); [ "$want" -ge 1 ] || want=1
check '[ "$(threads_of "$work/run1.log")" = "$want " ] &&
       [ "$(grep -c "^$llmerge .* --threads " "$work/run1.log")" -eq 12 ]' \
  "make -j2 on $cores cores: --threads '$(threads_of "$work/run1.log")' in $(grep -c "^$llmerge .* --threads " \
  "$work/run1.log") of its commands, wanted $want in each of 12 (4 merges, 4 evaluations, 4 references)"

# ---- references: the base and each input alone, on the same data ---------------------------------
refs=$out/references.csv
check '[ "$(head -n 1 "$refs" 2>/dev/null)" = "model,path,perplexity,tokens" ] && [ "$(wc -l <"$refs")" -eq 5 ]' \
  "references.csv is not a header and 4 rows: $(cat "$refs" 2>&1)"
# ref NAME PATH EVAL-ARGS...: its row names PATH and has the perplexity and tokens llmerge eval gives
ref() {
  local name=$1 path=$2 got want wp wt
  shift 2
  got=$(grep "^$name,$path," "$refs" 2>/dev/null)
  want=$("$llmerge" eval "$@" --data "$heldout" --json -q 2>&1)
  wp=$(printf '%s' "$want" | sed -n 's/.*"perplexity":\([^,}]*\).*/\1/p')
  wt=$(printf '%s' "$want" | sed -n 's/.*"tokens":\([^,}]*\).*/\1/p')
  if [ -n "$got" ] && awk -v row="$got" -v p="$wp" -v t="$wt" 'BEGIN { n = split(row, f, ",")
        d = f[3] - p; if (d < 0) d = -d; exit !(n == 4 && p > 0 && d <= 1e-6 * p && f[4] == t) }'; then ok; else
    bad "references.csv row for $name ($path): '$got', where llmerge eval gives $want"
  fi
}
ref base "$fx/base" "$fx/base"
ref ft1 "$fx/lora_plain" "$fx/base" --adapter "$fx/lora_plain"
ref ft2 "$fx/lora_rslora" "$fx/base" --adapter "$fx/lora_rslora"
ref ft3 "$fx/ft_full" "$fx/ft_full"
check 'grep -q "^base .* $fx/base\$" "$out/summary.txt"' "the summary has no reference rows: $(cat "$out/summary.txt" 2>&1)"
# the plot draws every reference as a level line: a stand-in gnuplot records how it is called
printf '%s\n' '#!/bin/sh' 'printf "%s\n" "$@" >"${0%/*}/gnuplot.args"' \
  'out=$(printf "%s\n" "$2" | sed -n "s/^out='"'"'\([^'"'"']*\)'"'"'.*/\1/p")' 'printf PNG >"$out"' >"$work/gnuplot"
chmod +x "$work/gnuplot"
if sweep OUT="$work/sweep-gp" METHODS=ties DENSITIES=0.5 GNUPLOT="$work/gnuplot" >"$work/gp.log" 2>&1; then ok; else
  bad "the sweep with a stand-in gnuplot failed: $(tail -c 800 "$work/gp.log")"
fi
want=$(awk -F, 'NR > 1 { printf "%s%s", s, $3; s = " " }' "$work/sweep-gp/references.csv" 2>/dev/null)
check 'grep -q "refnames=.base lora_plain lora_rslora ft_full *.;" "$work/gnuplot.args" &&
       grep -q "refvals=.$want *.\$" "$work/gnuplot.args" && [ -n "$want" ]' \
  "gnuplot was not given the references ($want): $(cat "$work/gnuplot.args" 2>&1)"
check 'grep -q "word(refvals, i)" "$(tail -n 1 "$work/gnuplot.args")"' "the plot script draws no refvals"

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

# make summary on a finished sweep changes no table or plot, and leaves the next make nothing to do
sleep 0.05
if sweep summary >"$work/sum.log" 2>&1; then ok; else bad "make summary failed: $(cat "$work/sum.log")"; fi
# (OUT's own entry changes: a .new file came and went in it)
snapshot | grep -v -e '^summary.txt ' -e '^ ' >"$work/after-sum"
grep -v -e '^summary.txt ' -e '^ ' "$work/before" >"$work/before-sum"
check 'cmp -s "$work/before-sum" "$work/after-sum" && grep -q "points and references: 8 done, 0 failed, 0 not done" "$work/sum.log"' \
  "make summary on a finished sweep: $(diff "$work/before-sum" "$work/after-sum" | head) $(tail -3 "$work/sum.log")"
if sweep -q >/dev/null 2>&1; then ok; else bad "make -q after make summary says the sweep is not up to date"; fi

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
captured=$(cat "$sg"/logs/*.merge.log | grep -c "Hessians of .* tokens")
cached=$(cat "$sg"/logs/*.merge.log | grep -c "Hessians of .* from the cache")
check '[ "$captured" -eq 3 ] && [ "$cached" -eq 3 ]' "sparsegpt sweep: $captured captures and $cached cache reads (want 3 and 3)"
check '[ "$(grep -c "^sparsegpt," "$sg/results.csv")" -eq 2 ]' "sparsegpt sweep: $(cat "$sg/results.csv" 2>&1)"
check '[ -n "$(ls "$sg/cache"/ucc2-*.bin 2>/dev/null)" ]' "sparsegpt sweep: no cache entries in $sg/cache"
# without -j, one job: each llmerge gets every core; THREADS overrides
check '[ "$(threads_of "$work/sg.log")" = "$cores " ]' "make -j1 on $cores cores: --threads '$(threads_of "$work/sg.log")'"
if sweep OUT="$work/sweep-t3" METHODS=ties DENSITIES=0.5 THREADS=3 -j2 >"$work/t3.log" 2>&1; then ok; else
  bad "the sweep with THREADS=3 failed: $(tail -c 800 "$work/t3.log")"
fi
check '[ "$(threads_of "$work/t3.log")" = "3 " ]' "THREADS=3: --threads '$(threads_of "$work/t3.log")'"

# ---- SRUN: any command that runs the step (here a wrapper that notes its arguments) -------------------
# a command other than srun gets none of srun's options, and llmerge no --threads (it takes the
# cores it may use)
printf '%s\n' '#!/bin/sh' 'echo "$*" >>"${0%/*}/wrap.args"' 'exec "$@"' >"$work/wrap"
chmod +x "$work/wrap"
if sweep OUT="$work/sweep-wrap" METHODS=ties DENSITIES=0.5 SRUN="$work/wrap" MERGE_CPUS=4 >"$work/wrap.log" 2>&1; then ok; else
  bad "the sweep through a wrapper failed: $(tail -c 800 "$work/wrap.log")"
fi
check '[ "$(wc -l <"$work/wrap.args")" -eq 6 ] && ! grep -q -e "--ntasks" -e "--cpus-per-task" -e "--threads" "$work/wrap.args" &&
  head -n 1 "$work/sweep-wrap/logs/ties-d0.5-w1_1_1.merge.log" | grep -q "^# $work/wrap $llmerge ties "' \
  "a wrapper as SRUN: $(cat "$work/wrap.args" 2>&1 | head -3)"
check 'grep -q "^ties,0.5,1 1 1," "$work/sweep-wrap/results.csv"' "the wrapper's sweep has no result: $(cat "$work/sweep-wrap/results.csv" 2>&1)"

# ---- a failing point: make -k goes on, make summary says why --------------------------------------
# sparsegpt's calibration tokens are past the fixtures' vocabulary: its merge fails (exit 2)
fk=$work/sweep-fail
printf '{"input_ids": [1, 99999]}\n' >"$work/badcalib.jsonl"
sweep OUT="$fk" METHODS="ties sparsegpt" DENSITIES=0.5 CALIB="$work/badcalib.jsonl" -k -j2 >"$work/fail.log" 2>&1
rc=$?
log=$fk/logs/sparsegpt-d0.5-w1_1_1.merge.log
check '[ "$rc" -ne 0 ] && [ -d "$fk/models/ties-d0.5-w1_1_1" ] && [ -f "$fk/eval/ties-d0.5-w1_1_1.json" ] &&
  [ ! -e "$fk/models/sparsegpt-d0.5-w1_1_1" ] && [ "$(ls "$fk"/eval/ref-*.json | wc -l)" -eq 4 ]' \
  "make -k (exit $rc) did not finish the other points: $(ls "$fk/models" "$fk/eval")"
check 'grep -q "^failed (exit status 2): $llmerge sparsegpt " "$work/fail.log" && grep -q "token id 99999" "$work/fail.log"' \
  "make printed no failure with the log's lines: $(tail -c 800 "$work/fail.log")"
check '[ "$(tail -n 1 "$log")" = "# exit 2" ] && grep -q "^# on .*, Slurm job none, step none$" "$log" &&
  [ "$(tail -n 1 "$fk/logs/ties-d0.5-w1_1_1.merge.log")" = "# exit 0" ]' "the step logs: $(cat "$log")"
sweep OUT="$fk" METHODS="ties sparsegpt" DENSITIES=0.5 CALIB="$work/badcalib.jsonl" summary >"$work/fsum.log" 2>&1
check 'grep -q "^failed: sparsegpt-d0.5-w1_1_1: llmerge sparsegpt: error: .*token id 99999.* ($log)$" "$work/fsum.log" &&
  grep -q "points and references: 5 done, 1 failed, 0 not done" "$work/fsum.log" &&
  [ "$(cat "$fk/results.csv" | wc -l)" -eq 2 ] && grep -q "^ties,0.5,1 1 1," "$fk/results.csv" &&
  [ "$(wc -l <"$fk/references.csv")" -eq 5 ]' "make summary after a failure: $(cat "$work/fsum.log")"
# the same before anything ran: every point not done
sweep OUT="$work/sweep-none" METHODS=ties DENSITIES=0.5 summary >"$work/nsum.log" 2>&1
check 'grep -q "points and references: 0 done, 0 failed, 5 not done" "$work/nsum.log" &&
  [ "$(cat "$work/sweep-none/results.csv")" = "method,density,weights,perplexity,tokens" ]' \
  "make summary before anything ran: $(cat "$work/nsum.log")"

# ---- the Makefile copied alone next to models ----------------------------------------------------
copy=$work/mine
mkdir -p "$copy"
cp "$src/examples/sweep/Makefile" "$copy/"
ln -s "$fx/base" "$copy/base" && ln -s "$fx/lora_plain" "$copy/lora" && ln -s "$fx/ft_full" "$copy/full"
cp "$heldout" "$copy/heldout.jsonl" && cp "$fx/calib/calib.txt" "$copy/calib.txt"
if (cd "$copy" && PATH="$(dirname "$llmerge"):$PATH" make --no-print-directory -j2 BASE=base FTS="lora full" \
      DATA=heldout.jsonl CALIB=calib.txt METHODS="ties sparsegpt" DENSITIES=0.5) >"$work/copy.log" 2>&1; then ok; else
  bad "the Makefile copied to $copy failed: $(tail -c 1500 "$work/copy.log")"
fi
check '[ "$(grep -c "^\(ties\|sparsegpt\),0.5,1 1," "$copy/out/results.csv" 2>/dev/null)" -eq 2 ] &&
       [ "$(grep -c "^\(base,base\|ft1,lora\|ft2,full\)," "$copy/out/references.csv" 2>/dev/null)" -eq 3 ]' \
  "the copied Makefile's results: $(cat "$copy/out/results.csv" "$copy/out/references.csv" 2>&1)"
check 'grep -q "^llmerge ties base lora full -o out/models/ties-d0.5-w1_1 " "$work/copy.log"' \
  "the copied Makefile did not run llmerge from the PATH on the models beside it: $(grep llmerge "$work/copy.log" | head -3)"
if command -v gnuplot >/dev/null; then
  check '[ -s "$copy/out/perplexity.png" ]' "the copied Makefile drew no plot: $(tail -c 600 "$work/copy.log")"
fi
# a copy that is not told where the models are says so before it runs anything
(cd "$copy" && make --no-print-directory OUT=out2 >"$work/copy2.log" 2>&1)
rc=$?
check '[ "$rc" -ne 0 ] && grep -q "does not exist: set BASE, FTS, DATA" "$work/copy2.log" && [ ! -e "$copy/out2" ]' \
  "a copy told nothing: $(cat "$work/copy2.log")"

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
