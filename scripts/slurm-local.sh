#!/usr/bin/env bash
# A throwaway single-node Slurm cluster for tests: munged, slurmctld and slurmd with their own
# configuration, munge key, state, logs and pid files under DIR, on free local ports; nothing
# outside DIR is read or written, and no system service is touched. Needs Debian's slurm-wlm
# (slurmctld, slurmd, slurm-client) and munge, and root (slurmd runs jobs as their user).
#
#   slurm-local.sh start DIR   start it; prints `export SLURM_CONF=DIR/slurm.conf`, which the
#                              clients (srun, sbatch, squeue, scancel) need
#   slurm-local.sh stop DIR    cancel its jobs, end what is left of them (the processes whose
#                              environment names DIR/slurm.conf), stop the daemons from their pid
#                              files, and wait until each is gone
#   slurm-local.sh check       exit 0 when this machine can run it (the programs and root)
#
# The configuration is the least that runs jobs without systemd, cgroups or a database:
# proctrack/linuxproc, task/none, no accounting, select/cons_tres with CR_Core (each job step
# holds the cores it asks for, so steps run side by side), MinJobAge 2 (sbatch --wait then
# polls every second or two, not at 2, 8, 32 s) and a scheduler without its batch and backfill
# delays. The daemons are given absolute paths; munge's socket directory is 755 and its key
# directory 700, as munged demands.
set -euo pipefail

die() { echo "slurm-local: $*" >&2; exit 1; }

# Whether the process in pid file $1 is alive: it exists and is no zombie (an exited daemon can
# linger as one, and kill -0 succeeds on a zombie).
alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  local state
  state=$(sed 's/^.*) \(.\).*/\1/' "/proc/$pid/stat" 2>/dev/null) || return 1
  [ "$state" != Z ] && [ "$state" != X ]
}

# A local TCP port nothing listens on, from $1 up.
free_port() {
  local p=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  echo "$p"
}

check() {
  local p
  for p in munged mungekey slurmctld slurmd srun sbatch squeue scancel scontrol; do
    command -v "$p" >/dev/null || PATH=$PATH:/usr/sbin command -v "$p" >/dev/null || { echo "no $p" >&2; return 1; }
  done
  [ "$(id -u)" -eq 0 ] || { echo "not root" >&2; return 1; }
}

# The pids of what is left of this cluster's jobs: slurmstepd and the jobs' own processes (a
# batch script, a step's tasks, an srun inside an allocation): the processes whose environment
# names its slurm.conf (slurmd exports it to what it starts) and that are slurmstepd or hold a
# SLURM_JOB_ID. (The caller's own processes, an srun waiting outside any allocation, are not
# among them: they end when their job is cancelled.)
job_pids() {
  local dir=$1 p pid env comm
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    [ "$pid" = $$ ] || [ "$pid" = "$BASHPID" ] && continue
    env=$({ tr '\0' '\n' <"$p/environ"; } 2>/dev/null) || continue
    case $env in *"SLURM_CONF=$dir/slurm.conf"*) ;; *) continue ;; esac
    comm=$(cat "$p/comm" 2>/dev/null) || continue
    case $comm in slurmd | slurmctld | munged) continue ;; esac
    if [ "$comm" = slurmstepd ] || case $env in *SLURM_JOB_ID=*) true ;; *) false ;; esac; then echo "$pid"; fi
  done
  return 0
}

stop() {
  local dir f i pids
  dir=$(cd "$1" 2>/dev/null && pwd) || return 0
  PATH=$PATH:/usr/sbin
  # the jobs first, while the controller can still end them; then what is left of them
  if alive "$dir/slurmctld.pid"; then
    SLURM_CONF=$dir/slurm.conf scancel --quiet --user="$(id -un)" 2>/dev/null || true
    for i in $(seq 30); do
      [ -z "$(SLURM_CONF=$dir/slurm.conf squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  pids=$(job_pids "$dir") || true
  [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
  for f in slurmd slurmctld munged; do
    alive "$dir/$f.pid" && kill "$(cat "$dir/$f.pid")" 2>/dev/null || true
  done
  for i in $(seq 100); do
    alive "$dir/slurmd.pid" || alive "$dir/slurmctld.pid" || alive "$dir/munged.pid" || return 0
    sleep 0.1
  done
  for f in slurmd slurmctld munged; do  # still there after 10 s
    alive "$dir/$f.pid" && kill -9 "$(cat "$dir/$f.pid")" 2>/dev/null || true
  done
}

start() {
  local dir host cpus mem ctld_port d_port i
  mkdir -p "$1"
  dir=$(cd "$1" && pwd)
  PATH=$PATH:/usr/sbin
  check || die "cannot run here"
  if alive "$dir/munged.pid" || alive "$dir/slurmctld.pid" || alive "$dir/slurmd.pid"; then
    die "a cluster already runs from $dir: stop it first"
  fi
  trap "stop '$dir'" EXIT  # what started is stopped again when a later step fails
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(awk '/MemTotal/ { print int($2 / 1024 * 0.9) }' /proc/meminfo)
  mkdir -p "$dir/state" "$dir/spool" "$dir/munge/run" "$dir/munge/etc" "$dir/munge/lib" "$dir/munge/log"
  chmod 755 "$dir/munge/run"
  chmod 700 "$dir/munge/etc" "$dir/munge/lib"
  [ -f "$dir/munge/etc/munge.key" ] || mungekey --create --keyfile="$dir/munge/etc/munge.key" --force >/dev/null
  chmod 600 "$dir/munge/etc/munge.key"
  munged --force --socket="$dir/munge/run/munge.socket" --key-file="$dir/munge/etc/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munge/log/munged.log" --seed-file="$dir/munge/lib/munged.seed" ||
    die "munged did not start: $(tail -3 "$dir/munge/log/munged.log" 2>/dev/null)"
  ctld_port=$(free_port 16817)
  d_port=$(free_port $((ctld_port + 1)))
  cat >"$dir/slurm.conf" <<EOF
ClusterName=llmerge-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/run/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MinJobAge=2
KillWait=5
SchedulerParameters=batch_sched_delay=0,bf_interval=2
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$dir/slurm.conf" -i || die "slurmctld did not start: $(tail -3 "$dir/slurmctld.log" 2>/dev/null)"
  slurmd -f "$dir/slurm.conf" -N "$host" || die "slurmd did not start: $(tail -3 "$dir/slurmd.log" 2>/dev/null)"
  for i in $(seq 100); do  # up when the node takes jobs
    if sinfo -h -o %t 2>/dev/null | grep -qx 'idle'; then
      trap - EXIT
      echo "export SLURM_CONF=$dir/slurm.conf"
      return 0
    fi
    sleep 0.1
  done
  die "the node did not come up in 10 s: $(sinfo 2>&1 | tail -2); $(tail -3 "$dir/slurmctld.log")"
}

case "${1:-}" in
  start) [ $# -eq 2 ] || die "usage: slurm-local.sh start DIR"; start "$2" ;;
  stop) [ $# -eq 2 ] || die "usage: slurm-local.sh stop DIR"; stop "$2" ;;
  check) check ;;
  *) die "usage: slurm-local.sh start DIR | stop DIR | check" ;;
esac
