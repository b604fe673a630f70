#!/usr/bin/env bash
# Debian packages pdops's lab, tests and demo need on a fresh machine (run as root).
# Installs only what is missing; never starts a service on the machine itself.
set -euo pipefail
# The lab boots one systemd per host, each holding 4 inotify instances; Debian's per-user limit
# of 128 stops a lab at 32 hosts (docs/lab.md). Raised now, and kept for the machine's next boot.
want=1024
if [ "$(id -u)" = 0 ] && [ "$(cat /proc/sys/fs/inotify/max_user_instances)" -lt "$want" ]; then
  echo "fs.inotify.max_user_instances = $want" > /etc/sysctl.d/60-pdops-lab.conf ||
    echo "setup-system: warning: could not write /etc/sysctl.d/60-pdops-lab.conf" >&2
  sysctl -q -w fs.inotify.max_user_instances="$want" ||
    echo "setup-system: warning: could not raise fs.inotify.max_user_instances (lab.up says how many hosts fit)" >&2
fi
need=()
# libibverbs1 and libnl-route-3-200: Mooncake's transfer engine loads them even over TCP (the
# real-engine lab, docs/lab.md); libnuma1 is usually present.
for pkg in openssh-server openssh-client haproxy iproute2 util-linux procps prometheus keepalived etcd-server etcd-client chromium \
    libibverbs1 libnl-route-3-200 libnuma1; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "setup-system: missing Debian packages: ${need[*]}; run as root: apt-get install -y ${need[*]}" >&2
  exit 1
fi
# Package scripts must not start sshd/haproxy on this machine's own addresses:
# a policy-rc.d that denies every start, removed again afterwards (only if we made it).
made_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  made_policy=1
fi
trap '[ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${need[@]}"
# Prometheus, keepalived and etcd are only tools here (the lab test starts its own Prometheus on a
# loopback port; keepalived's parser checks the VRRP config pdops renders; the lab's etcd members
# run from units pdops renders on three lab hosts): the packages' own services stay disabled, so
# no boot (a lab host's included) starts them. keepalived must never run on this machine: it
# would put a virtual address on a real interface.
for svc in prometheus keepalived etcd; do
  if printf '%s\n' "${need[@]}" | grep -qx "$svc\(-server\)\?"; then
    systemctl disable "$svc.service" >/dev/null 2>&1 ||
      rm -f "/etc/systemd/system/multi-user.target.wants/$svc.service"
  fi
done
