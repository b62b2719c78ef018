# What every end-to-end test script shares; sourced after the script has set $llmerge (and
# $jsonq where it reads JSON):
#
#   e2e_start NAME   $work, a fresh directory removed on exit, and the pass/fail counts
#   ok / bad MSG     count a check (bad prints MSG)
#   expect STATUS NEEDLE ARGS...   llmerge ARGS exits with STATUS and prints NEEDLE
#   run NAME ARGS... llmerge ARGS succeeds; its stdout in $work/NAME.out, stderr NAME.err
#   json FILE PATH WANT            the value at PATH of the JSON in FILE is WANT
#   e2e_end          prints "NAME: P passed, F failed" and fails when F > 0, or when P and F
#                    are both 0: a test that checked nothing fails (the last command)

e2e_start() {
  e2e_name=$1
  work=$(mktemp -d "/tmp/lm_${1}_XXXXXX")
  trap 'rm -rf "$work"' EXIT
  passed=0 failed=0
}

ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*" >&2; }

expect() {
  local want=$1 needle=$2
  shift 2
  "$llmerge" "$@" >"$work/out" 2>&1
  local rc=$?
  if [ "$rc" -ne "$want" ]; then
    bad "llmerge $* exited $rc, wanted $want: $(head -c 600 "$work/out")"
  elif ! grep -qF -- "$needle" "$work/out"; then
    bad "llmerge $* output lacks '$needle': $(head -c 600 "$work/out")"
  else
    ok
  fi
}

run() {
  local name=$1
  shift
  if "$llmerge" "$@" >"$work/$name.out" 2>"$work/$name.err"; then ok; else
    bad "llmerge $* failed: $(head -c 600 "$work/$name.err")"
  fi
}

json() {
  local got
  got=$("$jsonq" "$1" "$2" 2>&1)
  if [ "$got" = "$3" ]; then ok; else bad "$1: $2 = '$got', wanted '$3'"; fi
}

e2e_end() {
  echo "$e2e_name: $passed passed, $failed failed"
  if [ $((passed + failed)) -eq 0 ]; then
    echo "$e2e_name: no check ran: a test that checks nothing fails" >&2
    return 1
  fi
  [ "$failed" -eq 0 ]
}
