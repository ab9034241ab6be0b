#!/usr/bin/env bash
# Builds (only when missing) the Kubernetes binaries the e2e tests run against:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy,
# kubectl, helm, kube-router (the e2e node's NetworkPolicy firewall) and the LeaderWorkerSet
# controller (sigs.k8s.io/lws: replicas bigger than one pod), from their Go modules, into
# ${SERVEFLEET_CACHE_DIR:-~/.cache/servefleet}/k8s/<version>/bin; LWS's CRD and webhook
# manifests, from the same module, beside it in lws/.
# Prints that bin directory on its last line. Builds run under `nice -n 19`.
set -euo pipefail

KUBE_VERSION="v1.34.4"
HELM_VERSION="v3.19.5"
ETCD_VERSION="v3.6.4"
KUBE_ROUTER_VERSION="v2.1.0"  # the newest kube-router/v2 the Go module proxy serves
LWS_VERSION="v0.9.0"  # the newest sigs.k8s.io/lws whose module the Go module proxy serves

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${SERVEFLEET_CACHE_DIR:-$HOME/.cache/servefleet}"
bin="$cache_root/k8s/$KUBE_VERSION/bin"
mkdir -p "$bin"

if ! command -v go >/dev/null 2>&1; then
  echo "build.sh: the Go toolchain (>= 1.24) is needed to build the Kubernetes binaries" >&2
  exit 1
fi

export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0
jobs="${SERVEFLEET_BUILD_JOBS:-2}"

kube_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=34"
  kube_ldflags+=" -X $pkg.gitTreeState=clean"
done

# One `go build` per module for every binary still missing: the go tool then schedules all
# compiles and links together (no idle core between binaries) and links each package once.
build_module() {  # build_module MODULE_DIR LDFLAGS NAME=PACKAGE...
  local module_dir="$1" ldflags="$2"
  shift 2
  local names=() packages=() spec
  for spec in "$@"; do
    if [[ -x "$bin/${spec%%=*}" ]]; then
      echo "build.sh: ${spec%%=*} is cached ($bin/${spec%%=*})" >&2
    else
      names+=("${spec%%=*}")
      packages+=("${spec#*=}")
    fi
  done
  [[ ${#names[@]} -eq 0 ]] && return
  echo "build.sh: building ${names[*]} (many minutes the first time)..." >&2
  local start=$SECONDS out
  out="$(mktemp -d "$bin/.build.XXXXXX")"
  # go prints a line per module it downloads (hundreds): keep the log to this script's lines.
  (cd "$here/$module_dir" && nice -n 19 go build -p "$jobs" -trimpath -ldflags "$ldflags" \
    -o "$out/" "${packages[@]}") 2> >(grep -v '^go: downloading ' >&2)
  local i built
  for i in "${!names[@]}"; do
    built="$(basename "${packages[$i]}")"  # go names a .../server/v3 main "server"
    [[ "$built" =~ ^v[0-9]+$ ]] && built="$(basename "$(dirname "${packages[$i]}")")"
    mv "$out/$built" "$bin/${names[$i]}"
  done
  rm -rf "$out"
  echo "build.sh: built ${names[*]} in $((SECONDS - start))s" >&2
}

# helm's and kube-router's modules download and compile alongside the (much larger)
# Kubernetes build.
build_module helm "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
  helm=helm.sh/helm/v3/cmd/helm &
helm_build=$!
build_module kube-router \
  "-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION" \
  kube-router=github.com/cloudnativelabs/kube-router/v2/cmd/kube-router &
kube_router_build=$!
build_module kube "$kube_ldflags" \
  etcd=go.etcd.io/etcd/server/v3 \
  kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver \
  kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager \
  kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler \
  kubelet=k8s.io/kubernetes/cmd/kubelet \
  kube-proxy=k8s.io/kubernetes/cmd/kube-proxy \
  kubectl=k8s.io/kubernetes/cmd/kubectl
build_module lws "-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION" \
  lws-controller=sigs.k8s.io/lws/cmd &
lws_build=$!
wait "$helm_build"
wait "$kube_router_build"
wait "$lws_build"
lws_manifests="$cache_root/k8s/$KUBE_VERSION/lws"
if [[ ! -f "$lws_manifests/webhooks.yaml" ]]; then
  lws_dir="$(cd "$here/lws" && go list -m -f '{{.Dir}}' sigs.k8s.io/lws)"
  mkdir -p "$lws_manifests"
  cp "$lws_dir/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" \
    "$lws_manifests/crd.yaml"
  cp "$lws_dir/config/webhook/manifests.yaml" "$lws_manifests/webhooks.yaml"
fi

echo "$bin"
