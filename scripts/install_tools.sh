#!/usr/bin/env bash
# Installs the system tools pdctl's tests drive for real: tmux (the 80-column terminal test), prometheus and
# promtool (`pdctl up --monitoring`, its rules and dashboard checks). Debian packages; idempotent: does nothing when
# they are there. Needs root and apt-get (CI and the dev machines run as root).
set -euo pipefail
declare -A package=([tmux]=tmux [prometheus]=prometheus [promtool]=prometheus)
missing=()
for tool in tmux prometheus promtool; do
  command -v "$tool" >/dev/null || missing+=("${package[$tool]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_tools.sh: needs root and apt-get (Debian/Ubuntu); install ${missing[*]} by hand" >&2
  exit 1
fi
echo "installing ${missing[*]} (Debian packages) ..."
export DEBIAN_FRONTEND=noninteractive
# The prometheus package starts a system service on :9090 where an init system lets it; pdctl runs its own
# Prometheus per topology on that port, so no service may start while installing (policy-rc.d: 101 = refused).
guard=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  guard=/usr/sbin/policy-rc.d
  printf '#!/bin/sh\nexit 101\n' >"$guard"
  chmod +x "$guard"
  trap 'rm -f "$guard"' EXIT
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
