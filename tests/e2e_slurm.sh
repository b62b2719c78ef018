#!/usr/bin/env bash
# End-to-end test of examples/sweep on a real Slurm: a throwaway single-node cluster
# (scripts/slurm-local.sh, its state under $work, stopped at the end from its pid files) runs the
# fixture sweep (ties and sparsegpt at two densities) both ways docs/cluster.md gives: each
# merge and evaluation an srun job step from outside (SRUN), and the whole sweep inside one
# `sbatch --wait` allocation, its steps asking for their CPUs. Each way's results.csv and
# references.csv must be byte for byte the local run's; every step's log names its Slurm job
# (one job for all in the allocation); the sparsegpt points, which share the Hessians of each
# FT, capture them once (the other point waits for the lock or reads the cache); llmerge's
# threads follow the step's CPUs. Then a merge job cancelled in the middle (scancel) leaves no
# partial model, temporary file or lock, `make -k` finishes the other points, `make summary`
# lists it as failed with its log, and the next make redoes that point alone. No daemon is left.
# Without Slurm's programs (or root) the test says so and is skipped (77): scripts/bootstrap.sh
# --test installs them.
# Usage: e2e_slurm.sh LLMERGE FIXTURES SOURCE_DIR
set -u
llmerge=$1 fx=$2 src=$3
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_slurm

check() { if eval "$1"; then ok; else bad "$2"; fi; }
slurm=$src/scripts/slurm-local.sh
if ! bash "$slurm" check 2>"$work/check.err"; then
  echo "e2e_slurm: SKIPPED: no Slurm here ($(cat "$work/check.err")): scripts/bootstrap.sh --test installs it" >&2
  exit 77
fi

unset MAKEFLAGS MFLAGS MAKELEVEL
unset LLMERGE FIXTURES OUT BASE FTS DATA CALIB CACHE METHODS DENSITIES WEIGHTS SEED THREADS MERGE_FLAGS EVAL_FLAGS \
  GNUPLOT ROOT SRUN PARTITION MERGE_CPUS MERGE_GPUS MERGE_TIME EVAL_CPUS EVAL_GPUS EVAL_TIME LLMERGE_TEST_DELAY_MS
unset $(env | sed -n 's/^\(SLURM_[A-Z_]*\)=.*/\1/p')  # when the tests themselves run inside a Slurm job

# the cluster, stopped whatever happens (before $work goes)
trap 'bash "$slurm" stop "$work/slurm" >/dev/null 2>&1; rm -rf "$work"' EXIT
if bash "$slurm" start "$work/slurm" >"$work/start.out" 2>&1; then ok; else
  bad "the cluster did not start: $(cat "$work/start.out")"
  e2e_end
  exit
fi
export SLURM_CONF=$work/slurm/slurm.conf

sweep() {
  make --no-print-directory -C "$src/examples/sweep" LLMERGE="$llmerge" FIXTURES="$fx" METHODS="ties sparsegpt" \
    DENSITIES="0.2 0.5" MERGE_FLAGS= "$@"
}
same_tables() {  # DIR: its results.csv and references.csv are the local run's
  local d=$1
  check 'cmp -s "$d/results.csv" "$work/local/results.csv" && cmp -s "$d/references.csv" "$work/local/references.csv"' \
    "$d: other tables than the local run's: $(diff "$d/results.csv" "$work/local/results.csv" 2>&1 | head -6)"
}
# the number of the 3 FTs' Hessian captures in DIR's logs, and of the points' steps run as Slurm jobs
captures() { cat "$1"/logs/sparsegpt-*.merge.log | grep -c "Hessians of .* tokens"; }
jobs_of() { sed -n 's/^# on .*, Slurm job \([0-9]*\), step .*/\1/p' "$1"/logs/*.log | sort -u; }

# ---- the reference: the sweep run here --------------------------------------------------------
if sweep OUT="$work/local" -j2 >"$work/local.log" 2>&1; then ok; else bad "the local sweep failed: $(tail -c 1500 "$work/local.log")"; fi
check '[ "$(grep -c "Slurm job none" "$work"/local/logs/*.log | awk -F: "{ n += \$2 } END { print n }")" -eq 12 ]' \
  "the local run's 12 logs do not all say they ran outside Slurm: $(head -3 "$work"/local/logs/ties-d0.2*.merge.log)"

# ---- each step an srun job step, from outside an allocation (as from a login node) -----------------
if sweep OUT="$work/srun" -j4 SRUN="srun --quiet" MERGE_CPUS=1 EVAL_CPUS=1 >"$work/srun.log" 2>&1; then ok; else
  bad "the sweep through srun failed: $(tail -c 1500 "$work/srun.log")"
fi
same_tables "$work/srun"
n_logs=$(ls "$work"/srun/logs/*.log 2>/dev/null | wc -l)
check '[ "$n_logs" -eq 12 ] && [ "$(jobs_of "$work/srun" | wc -l)" -eq 12 ] && ! grep -q "Slurm job none" "$work"/srun/logs/*.log' \
  "srun: $n_logs logs, jobs $(jobs_of "$work/srun" | tr '\n' ' ') (want 12 logs, each its own job)"
check '[ "$(captures "$work/srun")" -eq 3 ]' "srun: the Hessians were captured $(captures "$work/srun") times, not once per FT"
check 'head -n 1 "$work/srun/logs/ties-d0.2-w1_1_1.merge.log" | grep -q -- "^# srun --quiet --ntasks=1 --quit-on-interrupt --job-name=llmerge-merge-ties-d0.2-w1_1_1 --cpus-per-task=1 $llmerge ties "' \
  "no srun and its options in a merge's log: $(head -n 1 "$work/srun/logs/ties-d0.2-w1_1_1.merge.log")"
check '! grep -q -- "--threads" "$work/srun.log" && grep -q "cpu, 1 thread)" "$work"/srun/logs/ties-d0.2-w1_1_1.merge.log' \
  "srun: --threads given, or the merge not on the step's one CPU: $(grep -h "thread" "$work"/srun/logs/ties-d0.2*.merge.log)"
check '[ -z "$(ls -A "$work/srun/cache" | grep -v "\.bin$")" ]' "srun: left in the cache: $(ls -A "$work/srun/cache")"

# two sparsegpt merges started at once (make -j2 models), each capture held 1 s: one job captures
# each FT's Hessians, the other waits for its lock and reads them
if LLMERGE_TEST_DELAY_MS=1000 sweep OUT="$work/lock" METHODS=sparsegpt -j2 SRUN="srun --quiet" MERGE_CPUS=1 models \
     >"$work/lock.log" 2>&1; then ok; else bad "the sparsegpt merges through srun failed: $(tail -c 1500 "$work/lock.log")"; fi
check '[ "$(captures "$work/lock")" -eq 3 ] && cat "$work"/lock/logs/*.merge.log | grep -q "waiting for .*, which holds .*/hess-[0-9a-f]*\.lock"' \
  "two jobs at once: $(captures "$work/lock") captures; $(grep -h "Hessians of" "$work"/lock/logs/*.merge.log)"

# ---- the whole sweep inside one allocation ---------------------------------------------------------
q=\'
if sbatch --wait --quiet -c 2 -o "$work/alloc.out" --wrap "make --no-print-directory -C $src/examples/sweep \
     LLMERGE=$llmerge FIXTURES=$fx METHODS=${q}ties sparsegpt${q} DENSITIES=${q}0.2 0.5${q} MERGE_FLAGS= \
     OUT=$work/alloc -j2 SRUN=${q}srun --quiet${q} MERGE_CPUS=1" >"$work/sbatch.log" 2>&1; then ok; else
  bad "the sweep inside sbatch failed: $(cat "$work/sbatch.log") $(tail -c 1500 "$work/alloc.out")"
fi
same_tables "$work/alloc"
steps=$(sed -n 's/^# on .*, Slurm job [0-9]*, step \([0-9]*\)$/\1/p' "$work"/alloc/logs/*.log | sort -u | wc -l)
check '[ "$(jobs_of "$work/alloc" | wc -l)" -eq 1 ] && [ "$steps" -eq 12 ]' \
  "sbatch: jobs $(jobs_of "$work/alloc" | tr '\n' ' ') and $steps steps (want one job, 12 steps)"
check '[ "$(captures "$work/alloc")" -eq 3 ]' "sbatch: the Hessians were captured $(captures "$work/alloc") times"

# ---- a merge job cancelled in the middle ---------------------------------------------------------
# every step slowed (LLMERGE_TEST_DELAY_MS reaches the steps through srun's environment); the
# merge of ties at 0.5 is cancelled once it runs
kill_out=$work/cancel
LLMERGE_TEST_DELAY_MS=400 sweep OUT="$kill_out" -k -j4 SRUN="srun --quiet" MERGE_CPUS=1 EVAL_CPUS=1 \
  >"$work/cancel.log" 2>&1 &
mk=$!
name=llmerge-merge-ties-d0.5-w1_1_1
for i in $(seq 300); do
  [ "$(squeue -h -n "$name" -o %T 2>/dev/null)" = RUNNING ] && [ -s "$kill_out/logs/ties-d0.5-w1_1_1.merge.log" ] && break
  sleep 0.1
done
sleep 0.5  # into the merge
check 'scancel -n "$name"' "scancel failed"
wait $mk
rc=$?
check '[ "$rc" -ne 0 ] && [ ! -e "$kill_out/models/ties-d0.5-w1_1_1" ] && [ -z "$(ls -A "$kill_out/models" | grep -v "^\(ties\|sparsegpt\)-d0\.[25]-w1_1_1$")" ]' \
  "after scancel (make exit $rc): $(ls -A "$kill_out/models")"
check '[ -z "$(ls -A "$kill_out/cache" 2>/dev/null | grep -v "\.bin$")" ] && [ -z "$(ls -A "$kill_out/eval" | grep tmp)" ]' \
  "after scancel, left: $(ls -A "$kill_out/cache" "$kill_out/eval")"
check '[ "$(ls "$kill_out"/models | wc -l)" -eq 3 ] && [ "$(ls "$kill_out"/eval/*.json | wc -l)" -eq 7 ]' \
  "make -k did not finish the other points: $(ls "$kill_out/models" "$kill_out/eval")"
sweep OUT="$kill_out" summary >"$work/summary.log" 2>&1
check 'grep -q "^failed: ties-d0.5-w1_1_1: llmerge ties: error: interrupted by SIGTERM.* (.*logs/ties-d0.5-w1_1_1.merge.log)$" "$work/summary.log" &&
  grep -q "points and references: 7 done, 1 failed, 0 not done" "$work/summary.log" &&
  [ "$(wc -l <"$kill_out/results.csv")" -eq 4 ] && grep -q "^ties  *0.2 " "$work/summary.log"' \
  "make summary after the cancel: $(cat "$work/summary.log")"
if sweep OUT="$kill_out" -j4 SRUN="srun --quiet" MERGE_CPUS=1 EVAL_CPUS=1 >"$work/redo.log" 2>&1; then ok; else
  bad "the make after the cancel failed: $(tail -c 1500 "$work/redo.log")"
fi
check '[ "$(grep -c "^$llmerge \(ties\|sparsegpt\) " "$work/redo.log")" -eq 1 ] && grep -q -- "-o $kill_out/models/ties-d0.5-w1_1_1 " "$work/redo.log"' \
  "the make after the cancel ran: $(grep "^$llmerge" "$work/redo.log")"
same_tables "$kill_out"

# ---- nothing left running --------------------------------------------------------------------------
pids=$(cat "$work"/slurm/{slurmctld,slurmd,munged}.pid 2>/dev/null)
check '[ "$(echo $pids | wc -w)" -eq 3 ]' "the daemons' pid files: $(ls "$work/slurm")"
bash "$slurm" stop "$work/slurm"
for pid in $pids; do
  check '[ ! -r "/proc/$pid/stat" ] || grep -q "^[0-9]* ([^)]*) [ZX]" "/proc/$pid/stat"' "pid $pid still runs: $(cat /proc/$pid/cmdline | tr "\0" " ")"
done
# nor a job's process (slurmstepd passes the configuration's path on to everything it starts)
left=
for p in /proc/[0-9]*; do
  [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] && { tr '\0' '\n' <"$p/environ"; } 2>/dev/null |
    grep -qx "SLURM_CONF=$work/slurm/slurm.conf" && ! grep -q "^[0-9]* ([^)]*) [ZX]" "$p/stat" && left="$left ${p#/proc/}"
done
check '[ -z "$left" ]' "slurmstepd left running:$left"

e2e_end
