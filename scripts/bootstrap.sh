#!/usr/bin/env bash
# Installs the Debian packages llmerge's build, tests and demo need. Idempotent: when every
# package is already there it only checks and returns (well under a second), so `make test`
# and `make demo` can call it every time. With --test, also what only the tests need: Slurm and
# munge, for tests/e2e_slurm.sh's throwaway cluster (scripts/slurm-local.sh; no service of the
# packages is started or enabled).
#   bootstrap.sh [--test]
set -euo pipefail

pkgs=(cmake make gcc g++ clang pkg-config libopenblas-dev liblapacke-dev libcjson-dev libxxhash-dev
      libpcre2-dev libyaml-dev libutf8proc-dev  # g++ (clang++ comes with clang): the CUDA backend built for cuda-emu
      gnuplot-nox  # gnuplot: the plot of examples/sweep
      strace       # strace: tests/e2e_robust.sh checks the order of fsync and rename with it
      groff-base)  # groff: tests/e2e_docs.sh renders the man page
case "${1:-}" in
  --test) pkgs+=(slurm-wlm slurmctld slurmd slurm-client munge) ;;
  "") ;;
  *) echo "usage: bootstrap.sh [--test]" >&2; exit 2 ;;
esac

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "bootstrap: installing ${missing[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "bootstrap: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# no package's service may start while installing (munge's and Slurm's would, where the machine
# lets them, and slurmd's fails without a configuration): a policy that refuses every start,
# where the machine has none, for the time of the install
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod 755 "$policy"
  trap '$sudo rm -f "$policy"' EXIT
fi
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "bootstrap: done" >&2
