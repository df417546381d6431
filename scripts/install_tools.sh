#!/usr/bin/env bash
# Installs the system tools pdctl's tests drive for real: tmux (the 80-column terminal test). Debian packages;
# idempotent: does nothing when they are there. Needs root and apt-get (CI and the dev machines run as root).
set -euo pipefail
missing=()
for tool in tmux; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_tools.sh: needs root and apt-get (Debian/Ubuntu); install ${missing[*]} by hand" >&2
  exit 1
fi
echo "installing ${missing[*]} (Debian packages) ..."
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
