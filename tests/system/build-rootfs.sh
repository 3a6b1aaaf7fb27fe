#!/usr/bin/env bash
# Builds (once) the Debian bookworm root the end-to-end test boots with systemd-nspawn, and prints its path.
# Cached outside the repository; the directory name carries a hash of the package list, so a changed list
# builds a new root. Everything the roles need is in it: no apt inside the container.
set -euo pipefail
cache="${APPLIANCE_CI_CACHE:-/var/cache/appliance-ci}"
include="systemd,systemd-sysv,dbus,python3,python3-venv,python3-apt,python3-packaging,redis-server,redis-sentinel,iproute2,procps,ca-certificates"
key=$(printf '%s' "bookworm:$include" | sha256sum | cut -c1-12)
root="$cache/rootfs-bookworm-$key"
if [ -x "$root/usr/bin/redis-server" ] && [ -f "$root/.complete" ]; then
  echo "$root"
  exit 0
fi
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
mirror="${mirror:-http://deb.debian.org/debian}"
mkdir -p "$cache"
tmp="$cache/.build-$key-$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
debootstrap --variant=minbase --include="$include" bookworm "$tmp" "$mirror" >"$cache/debootstrap-$key.log" 2>&1 ||
  { tail -20 "$cache/debootstrap-$key.log" >&2; exit 1; }
# A machine id is generated at first boot of each copy; an empty file keeps systemd from treating it as first boot.
: >"$tmp/etc/machine-id"
rm -f "$tmp"/var/cache/apt/archives/*.deb
touch "$tmp/.complete"
rm -rf "$root"
mv "$tmp" "$root"
trap - EXIT
echo "$root"
