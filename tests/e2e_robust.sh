#!/usr/bin/env bash
# End-to-end tests of how long runs end when they do not end well, through the binary, on the
# fixtures: SIGINT and SIGTERM in the middle of a merge stop it with exit status 130 / 143, a
# message naming the partial output removed, an "interrupted" event in --log-json, and nothing
# left beside OUT (no OUT, no OUT.tmp-*, no OUT.lock); `llmerge eval` stops the same way; two
# runs writing one OUT at once: the second is refused with exit status 2 naming the first's
# pid, also with --force, and the first's output is whole; a lock file left by a killed run
# does not block the next one, and no run that ends leaves OUT.lock.
#
# Also: SIGHUP and SIGQUIT stop a merge as SIGINT does (129, 131); a second signal that comes
# before the run reaches a check ends it at once, but only after removing the partial output and
# the lock; the run after a SIGKILL removes (and names) the temporary directories the killed one
# left, and an OUT.old-* of a replace killed half-way; OUT.lock is never followed when it is a
# symbolic link, nor used when it is not a regular file; an input truncated while a merge reads
# it (SIGBUS) is named, exit status 1, and nothing is left; and, where strace can trace, every
# file of OUT and OUT itself are fsynced before the rename and the parent directory after it.
#
# The fixtures merge in a fraction of a second, so the runs that must be caught in the middle
# set LLMERGE_TEST_DELAY_MS (a testing aid of lib/signals.h: a pause after each tensor or
# batch). Background jobs of a script ignore SIGINT unless job control is on, and llmerge keeps
# an ignored SIGINT ignored: hence `set -m`.
# Usage: e2e_robust.sh LLMERGE FIXTURES JSONQ
set -u
llmerge=$1 fx=$2 jsonq=$3
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_robust
set -m
ulimit -c 0  # a run that dies of SIGQUIT leaves no core file

check() { if eval "$1"; then ok; else bad "$2"; fi; }

B=$fx/base lp=$fx/lora_plain

# no_output DIR: neither DIR nor anything named DIR* (DIR.tmp-*, DIR.lock) is left beside it.
no_output() {
  local left
  left=$(find "$(dirname "$1")" -maxdepth 1 -name "$(basename "$1")*" | head -3)
  if [ -z "$left" ]; then ok; else bad "left behind: $left"; fi
}

# wait_for CMD: polls CMD (up to 20 s); false when it never held.
wait_for() {
  local i
  for ((i = 0; i < 200; i++)); do
    eval "$1" && return 0
    sleep 0.1
  done
  return 1
}

# loads DIR: llmerge reads DIR back as a model and its check passes.
loads() {
  if "$llmerge" inspect "$1" >"$work/inspect" 2>&1 && grep -q "^check: ok" "$work/inspect"; then ok; else
    bad "inspect $1: $(head -c 600 "$work/inspect")"
  fi
}

# ---- a signal in the middle of a merge ----------------------------------------------------------
# interrupt SIG WANT: a slowed merge is sent SIG once it has written a tensor; it must exit WANT,
# say which partial output it removed (and that must be gone), log the event, leave nothing.
interrupt() {
  local sig=$1 want=$2 x=$work/int-$1 log=$work/log-$1.jsonl pid rc tmp
  LLMERGE_TEST_DELAY_MS=150 "$llmerge" ties "$B" "$lp" -o "$x" --log-json "$log" >"$work/out" 2>&1 &
  pid=$!
  # the work has started: its temporary directory exists and a tensor is done
  if ! wait_for '[ -n "$(ls -d "$x".tmp-* 2>/dev/null)" ] && grep -q "\"event\":\"tensor\"" "$log" 2>/dev/null'; then
    bad "$sig: the merge never started: $(head -c 600 "$work/out")"
  fi
  tmp=$(ls -d "$x".tmp-* 2>/dev/null | head -1)
  check '[ -f "$x.lock" ] && [ "$(cat "$x.lock")" = "$pid" ]' "$sig: OUT.lock does not hold the pid $pid: $(cat "$x.lock" 2>&1)"
  kill -s "$sig" "$pid"
  wait "$pid"
  rc=$?
  check '[ $rc -eq $want ]' "$sig: exit $rc (want $want): $(head -c 600 "$work/out")"
  check 'grep -qF "error: interrupted by SIG$sig: removed the partial output $tmp" "$work/out"' \
    "$sig: no message naming $tmp: $(head -c 600 "$work/out")"
  check '[ -n "$tmp" ] && [ ! -e "$tmp" ]' "$sig: the partial output $tmp is still there"
  check '! grep -q "wrote " "$work/out"' "$sig: the merge went on to the end: $(head -c 600 "$work/out")"
  # it stopped at the next tensor rather than merging them all first
  local n_done n_total
  n_done=$(grep -c '"event":"tensor"' "$log")
  n_total=$(grep -m1 '"event":"start"' "$log" | "$jsonq" - n_tensors)
  check '[ "$n_done" -lt "$n_total" ]' "$sig: $n_done of $n_total tensors merged before it stopped"
  no_output "$x"
  local ev
  ev=$(grep -m1 '"event":"interrupted"' "$log")
  check '[ "$(echo "$ev" | "$jsonq" - signal)" = "SIG$sig" ] && [ "$(echo "$ev" | "$jsonq" - exit_status)" = "$want" ] &&
    [ "$(echo "$ev" | "$jsonq" - removed)" = "$tmp" ]' "$sig: interrupted event: '$ev'"
  check 'grep -q "\"event\":\"error\".*\"exit_status\":$want" "$log" && ! grep -q "\"event\":\"end\"" "$log"' \
    "$sig: the log's last events: $(tail -2 "$log")"
}
interrupt INT 130
interrupt TERM 143
interrupt HUP 129
interrupt QUIT 131

# A second signal before the run reaches a check: two signals sent while the run is stopped
# (SIGSTOP) both arrive when it goes on, so one of them is always the second. The run ends of
# one of them (128 + its number, as a shell reports either way), and removes everything first.
twice() {
  local first=$1 second=$2 x=$work/twice-$1-$2 log=$work/log-twice-$1-$2.jsonl pid rc
  LLMERGE_TEST_DELAY_MS=150 "$llmerge" ties "$B" "$lp" -o "$x" --log-json "$log" >"$work/out" 2>&1 &
  pid=$!
  wait_for '[ -n "$(ls -d "$x".tmp-* 2>/dev/null)" ] && grep -q "\"event\":\"tensor\"" "$log" 2>/dev/null' ||
    bad "$first+$second: the merge never started: $(head -c 600 "$work/out")"
  set +m  # (it was on when the job started; with it on, wait would report the stop)
  kill -STOP "$pid"
  kill -s "$first" "$pid"
  kill -s "$second" "$pid"
  kill -CONT "$pid"
  wait "$pid"
  rc=$?
  set -m
  local want1 want2
  want1=$((128 + $(kill -l "$first"))) want2=$((128 + $(kill -l "$second")))
  check '[ $rc -eq $want1 ] || [ $rc -eq $want2 ]' "$first+$second: exit $rc (want $want1 or $want2): $(head -c 600 "$work/out")"
  check 'grep -q "error: interrupted by SIG\|again: removed" "$work/out"' "$first+$second: no message: $(head -c 600 "$work/out")"
  no_output "$x"
}
twice INT HUP
twice TERM QUIT
twice INT TERM

# A merge that is not interrupted leaves its output and no lock file (the slowed one too).
x=$work/whole
if LLMERGE_TEST_DELAY_MS=10 "$llmerge" ties "$B" "$lp" -o "$x" >"$work/out" 2>&1; then ok; else
  bad "a slowed merge failed: $(head -c 600 "$work/out")"
fi
loads "$x"
check '[ ! -e "$x.lock" ] && [ -z "$(ls -d "$x".tmp-* 2>/dev/null)" ]' "a finished merge left: $(ls -d "$x".* 2>&1)"

# ---- two runs, one OUT ------------------------------------------------------------------------
x=$work/shared
LLMERGE_TEST_DELAY_MS=100 "$llmerge" ties "$B" "$lp" -o "$x" >"$work/first" 2>&1 &
first=$!
wait_for '[ -s "$x.lock" ]' || bad "the first run never took the lock: $(head -c 600 "$work/first")"
for force in "" --force; do
  "$llmerge" dare "$B" "$lp" -o "$x" $force >"$work/second" 2>&1
  rc=$?
  check '[ $rc -eq 2 ] && grep -qF "error: $x: another llmerge (pid $first) is writing it" "$work/second"' \
    "second run ${force:-without --force}: exit $rc (want 2, naming pid $first): $(head -c 600 "$work/second")"
  check '[ "$(ls -d "$x".tmp-* 2>/dev/null | wc -l)" -eq 1 ]' "second run ${force}: temporary directories: $(ls -d "$x".tmp-* 2>&1)"
done
wait "$first"
rc=$?
check '[ $rc -eq 0 ]' "the first run: exit $rc: $(head -c 600 "$work/first")"
loads "$x"
check '[ "$("$jsonq" "$x/llmerge.json" method)" = ties ]' "OUT is not the first run's: $("$jsonq" "$x/llmerge.json" method 2>&1)"
check '[ ! -e "$x.lock" ] && [ -z "$(ls -d "$x".tmp-* 2>/dev/null)" ]' "two runs left: $(ls -d "$x".* 2>&1)"
# once it is done, the ordinary rules: exists without --force is 2, with --force replaced
"$llmerge" dare "$B" "$lp" -o "$x" >"$work/out" 2>&1
rc=$?
check '[ $rc -eq 2 ] && grep -q "already exists (use --force" "$work/out"' "after the first: exit $rc: $(head -c 600 "$work/out")"
"$llmerge" dare "$B" "$lp" -o "$x" --force >"$work/out" 2>&1
rc=$?
check '[ $rc -eq 0 ] && [ "$("$jsonq" "$x/llmerge.json" method)" = dare ] && [ ! -e "$x.lock" ]' \
  "--force after the first: exit $rc: $(head -c 600 "$work/out")"

# A lock file nobody holds (left by a run killed with SIGKILL) is taken over and removed.
x=$work/stale
echo 999999 >"$x.lock"
if "$llmerge" ties "$B" "$lp" -o "$x" >"$work/out" 2>&1; then ok; else bad "a stale OUT.lock blocked the run: $(head -c 600 "$work/out")"; fi
loads "$x"
check '[ ! -e "$x.lock" ]' "the stale OUT.lock is still there"

# SIGKILL cannot be caught: what it leaves (the temporary directory, an unlocked OUT.lock) does
# not stop the next run, which removes the lock file.
x=$work/killed
LLMERGE_TEST_DELAY_MS=150 "$llmerge" ties "$B" "$lp" -o "$x" >"$work/out" 2>&1 &
pid=$!
wait_for '[ -s "$x.lock" ]' || bad "the run to be killed never took the lock"
kill -KILL "$pid"
wait "$pid" 2>/dev/null
check '[ -e "$x.lock" ] && [ -n "$(ls -d "$x".tmp-* 2>/dev/null)" ]' "SIGKILL left no lock file or temporary directory to recover from"
tmp=$(ls -d "$x".tmp-* 2>/dev/null | head -1)
if "$llmerge" ties "$B" "$lp" -o "$x" >"$work/out" 2>&1; then ok; else bad "after a SIGKILL: $(head -c 600 "$work/out")"; fi
loads "$x"
check '[ ! -e "$x.lock" ]' "after a SIGKILL: OUT.lock is still there"
# what the killed run left is removed, and said
check '[ -n "$tmp" ] && [ ! -e "$tmp" ] && [ -z "$(ls -d "$x".tmp-* 2>/dev/null)" ]' "after a SIGKILL: left $(ls -d "$x".tmp-* 2>&1)"
check 'grep -qF "removed $tmp, left by pid $pid" "$work/out"' "after a SIGKILL: no note naming $tmp: $(head -c 600 "$work/out")"

# Leftovers of a replace (--force) killed half-way: an old output moved aside whose new one is in
# place is removed; one whose replacement never got there is put back. Names that are not
# llmerge's own (not six letters or digits, or not a directory) are left alone.
x=$work/leftover
"$llmerge" ties "$B" "$lp" -o "$x" -q || bad "leftover: the first merge failed"
echo 999999 >"$x.lock"
mkdir "$x.tmp-AbC123" "$x.old-XyZ789" "$x.tmp-notmine"
head -c 100000 /dev/zero >"$x.tmp-AbC123/model.safetensors"
echo keep >"$x.tmp-aBc123"
if "$llmerge" dare "$B" "$lp" -o "$x" --force >"$work/out" 2>&1; then ok; else bad "leftover: $(head -c 600 "$work/out")"; fi
check '[ ! -e "$x.tmp-AbC123" ] && [ ! -e "$x.old-XyZ789" ] && [ -d "$x.tmp-notmine" ] && [ -f "$x.tmp-aBc123" ]' \
  "leftover: $(ls -d "$x".* 2>&1)"
check 'grep -qF "$x.tmp-AbC123" "$work/out" && grep -qF "$x.old-XyZ789" "$work/out"' "leftover: not named: $(head -c 600 "$work/out")"
check '[ "$("$jsonq" "$x/llmerge.json" method)" = dare ] && [ ! -e "$x.lock" ]' "leftover: OUT is not the new one"
rm -rf "$x.tmp-notmine" "$x.tmp-aBc123"
# OUT missing, its old self aside: put back (and so, without --force, refused as existing)
mv "$x" "$x.old-Rst456"
echo 999999 >"$x.lock"
"$llmerge" ties "$B" "$lp" -o "$x" >"$work/out" 2>&1
rc=$?
check '[ $rc -eq 2 ] && grep -qF "put back $x.old-Rst456" "$work/out" && grep -q "already exists" "$work/out"' \
  "restore: exit $rc: $(head -c 600 "$work/out")"
check '[ "$("$jsonq" "$x/llmerge.json" method)" = dare ] && [ ! -e "$x.old-Rst456" ] && [ ! -e "$x.lock" ]' \
  "restore: $(ls -d "$x"* 2>&1)"

# ---- OUT.lock is not followed -----------------------------------------------------------------
# A symbolic link at OUT.lock (to someone's file, or to nowhere) is refused, not written through;
# so is a lock path that is not a regular file, or a file with other links.
x=$work/linked
echo precious >"$work/precious"
locked_out() {  # locked_out WHAT NEEDLE: the merge is refused naming OUT.lock, nothing written
  local what=$1 needle=$2 rc
  "$llmerge" ties "$B" "$lp" -o "$x" >"$work/out" 2>&1
  rc=$?
  check '[ $rc -eq 2 ] && grep -qF "$x.lock" "$work/out" && grep -qF "$needle" "$work/out"' "$what: exit $rc: $(head -c 600 "$work/out")"
  check '[ ! -e "$x" ] && [ -z "$(ls -d "$x".tmp-* 2>/dev/null)" ]' "$1: the merge went on: $(ls -d "$x"* 2>&1)"
  check '[ "$(cat "$work/precious")" = precious ]' "$1: the file was written: $(cat "$work/precious")"
  rm -rf "$x"
}
ln -s "$work/precious" "$x.lock"
locked_out "a symlink to a file" "symbolic link"
rm "$x.lock"
ln -s "$work/nowhere" "$x.lock"
locked_out "a dangling symlink" "symbolic link"
check '[ ! -e "$work/nowhere" ]' "a dangling OUT.lock symlink: its target was created"
rm "$x.lock"
ln "$work/precious" "$x.lock"
locked_out "a hard link" "links"
rm "$x.lock"
mkfifo "$x.lock"
locked_out "a fifo" "not a regular file"
rm "$x.lock"
mkdir "$x.lock"
locked_out "a directory" "not a regular file"
rmdir "$x.lock"

# ---- an input that changes while a merge reads it -----------------------------------------------
# The FT's shard, mapped by the merge, is cut down to its header after the first tensor: reading
# what is gone raises SIGBUS, which must name the file, end the run with exit status 1 and remove
# the partial output and the lock.
x=$work/sigbus ft=$work/ft-copy
cp -r "$fx/ft_full" "$ft"
LLMERGE_TEST_DELAY_MS=150 "$llmerge" ties "$B" "$ft" -o "$x" --log-json "$work/bus.jsonl" >"$work/out" 2>&1 &
pid=$!
wait_for 'grep -q "\"event\":\"tensor\"" "$work/bus.jsonl" 2>/dev/null' || bad "sigbus: the merge never started: $(head -c 600 "$work/out")"
truncate -s $(($(od -An -tu8 -N8 "$ft/model.safetensors" | tr -d ' ') + 8)) "$ft/model.safetensors"
wait "$pid"
rc=$?
check '[ $rc -eq 1 ] && grep -qF "error: $ft/model.safetensors changed while llmerge was reading it" "$work/out"' \
  "sigbus: exit $rc (want 1, naming the shard): $(head -c 600 "$work/out")"
check 'grep -qF "removed the partial output $x.tmp-" "$work/out"' "sigbus: no word of the partial output: $(head -c 600 "$work/out")"
no_output "$x"

# ---- durability ---------------------------------------------------------------------------------
# A power cut cannot be tested; the order of the calls that make a rename durable can: each file
# of OUT and the temporary directory itself fsynced before it is renamed to OUT, the parent
# directory after (also for `llmerge hessian -o FILE`).
if ! command -v strace >/dev/null 2>&1 || ! strace -o /dev/null true >/dev/null 2>&1; then
  echo "e2e_robust: NOTE: strace is missing or cannot trace here; the fsync checks were skipped" >&2
else
  real=$(cd "$work" && pwd -P)
  # LeakSanitizer cannot run under ptrace: the traced runs of the sanitizer build go without it
  # (the same runs are checked for leaks elsewhere).
  traced() { ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 strace -f -y -e trace=fsync,fdatasync,rename,renameat,renameat2 "$@"; }
  # synced TRACE TMP OUT FILES...: in strace's TRACE, each of TMP/FILE and TMP is fsynced before
  # the rename of TMP (or TMP/FILE) to OUT, and OUT's directory after it.
  synced() {
    local trace=$1 tmp=$2 out=$3 f n ren par
    shift 3
    ren=$(grep -n "rename[a-z0-9]*(.*\"$tmp[^\"]*\", .*\"$out\"" "$trace" | head -1 | cut -d: -f1)
    if [ -z "$ren" ]; then bad "no rename of $tmp to $out in the trace: $(grep rename "$trace" | head -5)"; return; fi
    for f in "$@"; do
      n=$(grep -n "fsync(.*<$f>" "$trace" | head -1 | cut -d: -f1)
      check '[ -n "$n" ] && [ "$n" -lt "$ren" ]' "$f: fsync at line ${n:-none}, the rename at line $ren"
    done
    par=$(grep -n "fsync(.*<$(dirname "$out")>" "$trace" | awk -F: -v r="$ren" '$1 > r { print $1; exit }')
    check '[ -n "$par" ]' "$(dirname "$out") is not fsynced after the rename (line $ren): $(grep fsync "$trace" | tail -3)"
  }
  x=$real/durable
  mkdir "$x" && echo old >"$x/marker"  # replaced with --force
  if traced -o "$work/trace" \
    "$llmerge" ties "$B" "$lp" "$fx/ft_full" -o "$x" --force --shard-size 100K >"$work/out" 2>&1; then ok; else
    bad "durable: $(head -c 600 "$work/out")"
  fi
  tmp=$(grep -o "\"$x\.tmp-[A-Za-z0-9]*\"" "$work/trace" | head -1 | tr -d '"')
  files=()
  for f in "$x"/*; do files+=("$tmp/$(basename "$f")"); done
  check '[ ${#files[@]} -ge 6 ]' "durable: OUT holds only ${#files[@]} files"
  synced "$work/trace" "$tmp" "$x" "${files[@]}" "$tmp"
  if traced -o "$work/trace-h" \
    "$llmerge" hessian "$B" --calib "$fx/calib/calib.jsonl" -o "$real/durable.safetensors" >"$work/out" 2>&1; then ok; else
    bad "durable hessian: $(head -c 600 "$work/out")"
  fi
  tmp=$(grep -o "\"$real/durable.safetensors\.tmp-[A-Za-z0-9]*/[^\"]*\"" "$work/trace-h" | head -1 | tr -d '"')
  synced "$work/trace-h" "$tmp" "$real/durable.safetensors" "$tmp"
fi

# ---- eval -------------------------------------------------------------------------------------
# Stopped after its batch (the fixtures' data is one batch): 130, no result on stdout.
LLMERGE_TEST_DELAY_MS=5000 "$llmerge" eval "$B" --data "$fx/calib/calib.jsonl" >"$work/eval.out" 2>"$work/eval.err" &
pid=$!
wait_for 'grep -q "sequence " "$work/eval.err"' || bad "eval never reported progress: $(cat "$work/eval.err")"
kill -INT "$pid"
wait "$pid"
rc=$?
check '[ $rc -eq 130 ] && grep -q "error: interrupted by SIGINT" "$work/eval.err" && ! grep -q perplexity "$work/eval.out"' \
  "eval: exit $rc (want 130, no result): $(cat "$work/eval.out" "$work/eval.err")"

e2e_end
