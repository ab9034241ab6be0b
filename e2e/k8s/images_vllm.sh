#!/usr/bin/env bash
# The vLLM engine image for e2e/test_vllm_node.py: built with buildah from vllm/Dockerfile
# (vLLM's CPU build from PyPI, plus the built-in model converted at build time to a Hugging
# Face folder), on the same base, uv, stores and containerd as images.sh (whose functions it
# sources), and imported into the node's containerd. The model folder is also copied out of
# the image once per build, for the test's volume. Tagged with a hash of what goes into it;
# nothing is built again while it is unchanged. Prints `engine-vllm=REFERENCE` and
# `vllm-model=FOLDER`.
#
# usage: images_vllm.sh CONTAINERD_SOCKET
set -euo pipefail

# shellcheck source=images.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/images.sh" "$1"
context="$here/vllm"
repository="localhost/servefleet-engine-vllm"
model_in_image="/opt/models/smollm2-135m-instruct"

vllm_tag() {  # BUILD INPUTS
  (cd "$context" && sha256sum Dockerfile convert_builtin.py && echo "$1") | sha256sum | cut -c1-16
}

build_vllm() {  # REFERENCE BASE UV
  local ref="$1" base="$2" uv="$3" start=$SECONDS
  log "building $ref (vLLM's CPU build and the model: minutes, once)"
  bah build --pull-never --layers --network host --target engine-vllm \
    --build-arg "BASE_IMAGE=$base" --build-arg "UV_IMAGE=$uv" \
    --volume "$uv_cache:/host/uv-cache" --build-arg UV_CACHE_DIR=/host/uv-cache \
    "${ca_args[@]}" -t "$ref" -f "$context/Dockerfile" "$context" \
    >"$cache/build-engine-vllm.log" 2>&1 \
    || { tail -40 "$cache/build-engine-vllm.log" >&2; exit 1; }
  log "built $ref in $((SECONDS - start))s ($(bah images --noheading --format '{{.Size}}' "$ref" 2>/dev/null || true))"
}

copy_model_out() {  # REFERENCE FOLDER: the image's model folder, onto this machine
  local ref="$1" dest="$2" ctr mnt
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp"
  ctr="$(bah from --pull-never "$ref")"
  mnt="$(bah mount "$ctr")"
  cp -a "$mnt$model_in_image/." "$dest.tmp/"
  bah umount "$ctr" >/dev/null
  bah rm "$ctr" >/dev/null
  mv "$dest.tmp" "$dest"
}

vllm_image() {  # BASE UV
  local base="$1" uv="$2" tag ref models dest start
  tag="$(vllm_tag "$base $uv")"
  ref="$repository:$tag"
  models="$cache/vllm-model"
  dest="$models/$tag"
  if ! bah inspect --type image "$ref" >/dev/null 2>&1 \
    && { ! in_containerd "$ref" || [[ ! -d "$dest" ]]; }; then
    build_vllm "$ref" "$base" "$uv"
  fi
  if ! in_containerd "$ref"; then
    start=$SECONDS
    import_into_containerd "$ref"
    log "imported $ref into containerd in $((SECONDS - start))s"
    forget_older "$repository" "$ref"
  fi
  if [[ ! -d "$dest" ]]; then
    copy_model_out "$ref" "$dest"
    find "$models" -mindepth 1 -maxdepth 1 ! -name "$tag" -exec rm -rf {} +
  fi
  echo "engine-vllm=$ref"
  echo "vllm-model=$dest"
}

vllm_image "$(base_image)" "$(uv_image)"
