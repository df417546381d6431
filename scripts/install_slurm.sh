#!/usr/bin/env bash
# Installs Slurm (controller, node daemon, client tools) and munge from Debian's packages, for the slurm engine's
# tests. Idempotent: does nothing when they are there. Needs root (CI and the dev machines run as root).
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
   && command -v munged >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_slurm.sh: needs root and apt-get (Debian/Ubuntu); install slurmctld, slurmd, slurm-client and" \
       "munge by hand" >&2
  exit 1
fi
echo "installing Slurm and munge (Debian packages, ~15 s) ..."
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
