#!/usr/bin/env bash
# Installs the Debian packages the tests run for real, when they are missing:
#   redis-server, prometheus          shared gateway limits, dashboards
#   containerd runc containernetworking-plugins iptables conntrack
#                                     the e2e node (container runtime, pod network, kube-proxy)
#   ipset                             the e2e node's NetworkPolicy firewall (kube-router)
#   buildah debootstrap catatonit     the e2e images (base rootfs, builds, pause process)
#   gcc libc6-dev                     the static pause binary of the e2e node
#   docker-registry                   adapters pulled from an OCI registry (CNCF distribution)
set -euo pipefail
declare -A probe=(
  [redis-server]=redis-server
  [prometheus]=prometheus
  [containerd]=containerd
  [runc]=runc
  [containernetworking-plugins]=/usr/lib/cni/bridge
  [iptables]=iptables
  [conntrack]=conntrack
  [ipset]=ipset
  [buildah]=buildah
  [debootstrap]=debootstrap
  [catatonit]=catatonit
  [gcc]=gcc
  [libc6-dev]=/usr/include/stdio.h
  [docker-registry]=docker-registry
)
need=()
for package in "${!probe[@]}"; do
  what="${probe[$package]}"
  if [[ "$what" == /* ]]; then
    [[ -e "$what" ]] || need+=("$package")
  else
    command -v "$what" >/dev/null 2>&1 || [[ -x "/usr/sbin/$what" ]] || need+=("$package")
  fi
done
[ ${#need[@]} -eq 0 ] && exit 0
echo "system-deps: installing ${need[*]}"
sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
  "${need[@]}" >/dev/null
echo "system-deps: done"
