#!/usr/bin/env bash
# Builds the project's images from its own Dockerfile with buildah and imports them into a
# containerd (namespace k8s.io), for the e2e node. Nothing is pulled from a registry:
#   base    Debian bookworm minbase + python3.11 (debootstrap), cached as a tarball
#   uv      this machine's uv binary (the Dockerfile's UV_IMAGE)
#   pause   catatonit -P, the pod sandbox process
#   redis   Debian's redis-server on the base (the chart's Redis, when a test enables it)
# Images are tagged with a hash of what goes into them; one already in containerd is not
# built again. Prints `role=reference` lines (pause, redis, control-plane, engine).
#
# usage: images.sh CONTAINERD_SOCKET
#        images.sh --build-only    builds into buildah's storage only (no containerd needed);
#                                  `make test` runs it, then k8s/preload.py imports into the
#                                  node's cached store, while the checks run: the node tests
#                                  find every image in place.
set -euo pipefail

socket="$1"
build_only=""
[[ "$socket" == "--build-only" ]] && build_only=1
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${SERVEFLEET_CACHE_DIR:-$HOME/.cache/servefleet}/images"
uv_cache="${UV_CACHE_DIR:-$HOME/.cache/uv}"
suite="bookworm"
mirror="${SERVEFLEET_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
mkdir -p "$cache" "$uv_cache"
# The builds download from PyPI (what this machine's uv cache lacks) with this machine's CAs.
ca_args=()
if [[ -n "${SSL_CERT_FILE:-}" && -f "$SSL_CERT_FILE" ]]; then
  ca_args=(--volume "$SSL_CERT_FILE:/etc/ssl/host-ca.crt:ro" --build-arg SSL_CERT_FILE=/etc/ssl/host-ca.crt)
fi

bah() { buildah --root "$cache/storage" --runroot "$cache/run" --storage-driver overlay "$@"; }
ctr_() { ctr --address "$socket" --namespace k8s.io "$@"; }
log() { echo "images.sh: $*" >&2; }
# grep reads the whole list (no -q): stopping at the match would SIGPIPE ctr, which writes a
# line at a time, and pipefail would call a present image missing.
in_containerd() { [[ -z "$build_only" ]] && ctr_ images ls -q | grep -xF "$1" >/dev/null; }

import_into_containerd() {  # REFERENCE
  [[ -n "$build_only" ]] && return 0
  # Through a pipe, not an archive file: the engine image is 4 GB, written and read once less.
  local ref="$1" fifo importer
  fifo="$(mktemp -u "$cache/archive.XXXXXX")"
  mkfifo "$fifo"
  ctr_ images import "$fifo" >/dev/null & importer=$!
  if ! bah push --quiet "$ref" "docker-archive:$fifo:$ref" >/dev/null; then
    kill "$importer" 2>/dev/null || true
    rm -f "$fifo"
    return 1
  fi
  wait "$importer" || { rm -f "$fifo"; return 1; }
  rm -f "$fifo"
}

base_image() {
  local ref="localhost/servefleet-e2e-base:$suite-python3.11"
  local tarball="$cache/$suite-python3.11.tar"
  if ! bah inspect --type image "$ref" >/dev/null 2>&1; then
    if [[ ! -s "$tarball" ]]; then
      log "debootstrap $suite minbase + python3.11 (about a minute, once)"
      local rootfs
      rootfs="$(mktemp -d "$cache/rootfs.XXXXXX")"
      debootstrap --variant=minbase --include=python3.11,ca-certificates \
        "$suite" "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1
      rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
      tar -C "$rootfs" -cf "$tarball.tmp" .
      mv "$tarball.tmp" "$tarball"
      rm -rf "$rootfs"
    fi
    local ctr
    ctr="$(bah from scratch)"
    bah add "$ctr" "$tarball" / >/dev/null
    bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --cmd /bin/bash "$ctr"
    bah commit --quiet --rm "$ctr" "$ref" >/dev/null
  fi
  echo "$ref"
}

uv_image() {
  local uv_bin version ref ctr
  uv_bin="$(command -v uv || echo "$HOME/.local/bin/uv")"
  version="$("$uv_bin" --version | awk '{print $2}')"
  ref="localhost/servefleet-e2e-uv:$version"
  if ! bah inspect --type image "$ref" >/dev/null 2>&1; then
    ctr="$(bah from scratch)"
    bah copy "$ctr" "$uv_bin" /uv >/dev/null
    bah commit --quiet --rm "$ctr" "$ref" >/dev/null
  fi
  echo "$ref"
}

pause_image() {
  local ref="localhost/servefleet-e2e-pause:catatonit" ctr
  if ! in_containerd "$ref"; then
    if ! bah inspect --type image "$ref" >/dev/null 2>&1; then
      ctr="$(bah from scratch)"
      bah copy "$ctr" "$(command -v catatonit)" /pause >/dev/null
      bah config --entrypoint '["/pause", "-P"]' "$ctr"
      bah commit --quiet --rm "$ctr" "$ref" >/dev/null
    fi
    import_into_containerd "$ref"
  fi
  echo "pause=$ref"
}

redis_image() {  # BASE: redis-server from Debian's archive, started as the official image does
  local base="$1" ref="localhost/servefleet-e2e-redis:$suite" ctr
  if ! in_containerd "$ref"; then
    if ! bah inspect --type image "$ref" >/dev/null 2>&1; then
      log "building $ref (apt-get install redis-server, once)"
      ctr="$(bah from --pull-never "$base")"
      bah run --network host "$ctr" -- sh -c 'apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
          redis-server >/dev/null && rm -rf /var/lib/apt/lists/*' >"$cache/build-redis.log" 2>&1 \
        || { tail -20 "$cache/build-redis.log" >&2; exit 1; }
      # The official image compiles protected mode off: the Service, not a loopback bind,
      # is the door (and the chart's NetworkPolicy the lock).
      bah config --cmd '' --workingdir /data "$ctr"
      bah config --entrypoint '["redis-server", "--protected-mode", "no"]' "$ctr"
      bah commit --quiet --rm "$ctr" "$ref" >/dev/null
    fi
    import_into_containerd "$ref"
  fi
  echo "redis=$ref"
}

source_hash() {  # a tag from every file the build context holds, plus the build inputs
  (
    cd "$repo"
    git ls-files -z --cached --others --exclude-standard \
      | grep -zvE '^(tests|e2e|charts|crds|examples|scripts|bench/results)/' \
      | xargs -0 -r sha256sum 2>/dev/null
    echo "$1"
  ) | sha256sum | cut -c1-16
}

project_image() {  # ROLE TARGET BASE UV
  local role="$1" target="$2" base="$3" uv="$4" tag ref start
  tag="$(source_hash "$target $base $uv")"
  ref="localhost/servefleet-$role:$tag"
  if ! in_containerd "$ref"; then
    if ! bah inspect --type image "$ref" >/dev/null 2>&1; then
      log "building $ref (target $target)"
      start=$SECONDS
      bah build --pull-never --layers --network host --target "$target" \
        --build-arg "BASE_IMAGE=$base" --build-arg "UV_IMAGE=$uv" \
        --volume "$uv_cache:/host/uv-cache" --build-arg UV_CACHE_DIR=/host/uv-cache \
        "${ca_args[@]}" -t "$ref" -f "$repo/Dockerfile" "$repo" >"$cache/build-$role.log" 2>&1 \
        || { tail -40 "$cache/build-$role.log" >&2; exit 1; }
      log "built $ref in $((SECONDS - start))s ($(bah images --noheading --format '{{.Size}}' "$ref" 2>/dev/null || true))"
    fi
    [[ -n "$build_only" ]] && { echo "$role=$ref"; return 0; }
    start=$SECONDS
    import_into_containerd "$ref"
    log "imported $ref into containerd in $((SECONDS - start))s"
    forget_older "localhost/servefleet-$role" "$ref"
  fi
  echo "$role=$ref"
}

forget_older() {  # REPOSITORY KEEP: earlier builds of a role, out of both stores
  local repository="$1" keep="$2" old named
  for old in $(ctr_ images ls -q | grep "^$repository:" | grep -vxF "$keep"); do
    ctr_ images rm "$old" >/dev/null || true
  done
  # The CRI also names each image sha256:<id> (same manifest digest): drop the orphans.
  named="$(ctr_ images ls | awk 'NR > 1 && $1 !~ /^sha256:/ {print $3}')"
  for old in $(ctr_ images ls | awk 'NR > 1 && $1 ~ /^sha256:/ {print $1, $3}' \
    | grep -vF "$named" | awk '{print $1}'); do
    ctr_ images rm "$old" >/dev/null || true
  done
  for old in $(bah images --noheading --format '{{.Name}}:{{.Tag}}' \
    | grep "^$repository:" | grep -vxF "$keep"); do
    bah rmi "$old" >/dev/null 2>&1 || true
  done
  # The untagged intermediate images stay: they are the layer cache of the next build.
}

# Sourced (by images_vllm.sh, for these functions), it builds nothing.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  pause_image
  base="$(base_image)"
  uv="$(uv_image)"
  redis_image "$base"
  project_image control-plane control-plane "$base" "$uv"
  project_image engine engine-cpu "$base" "$uv"
fi
