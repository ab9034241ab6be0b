#!/usr/bin/env bash
# Builds (only when missing) the Kubernetes binaries the e2e tests run against:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy,
# kubectl and helm, from their Go modules, into ${SERVEFLEET_CACHE_DIR:-~/.cache/servefleet}/k8s/<version>/bin.
# Prints that bin directory on its last line. Builds run under `nice -n 19`.
set -euo pipefail

KUBE_VERSION="v1.34.4"
HELM_VERSION="v3.19.5"
ETCD_VERSION="v3.6.4"

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

build() {  # build NAME MODULE_DIR PACKAGE LDFLAGS
  local name="$1" module_dir="$2" package="$3" ldflags="$4"
  if [[ -x "$bin/$name" ]]; then
    echo "build.sh: $name is cached ($bin/$name)" >&2
    return
  fi
  echo "build.sh: building $name from $package (several minutes the first time)..." >&2
  local start=$SECONDS
  (cd "$here/$module_dir" && nice -n 19 go build -p "$jobs" -trimpath -ldflags "$ldflags" \
    -o "$bin/$name.tmp" "$package")
  mv "$bin/$name.tmp" "$bin/$name"
  echo "build.sh: built $name in $((SECONDS - start))s" >&2
}

build etcd kube "go.etcd.io/etcd/server/v3" "-s -w"
build kube-apiserver kube "k8s.io/kubernetes/cmd/kube-apiserver" "$kube_ldflags"
build kube-controller-manager kube "k8s.io/kubernetes/cmd/kube-controller-manager" "$kube_ldflags"
build kube-scheduler kube "k8s.io/kubernetes/cmd/kube-scheduler" "$kube_ldflags"
build kubelet kube "k8s.io/kubernetes/cmd/kubelet" "$kube_ldflags"
build kube-proxy kube "k8s.io/kubernetes/cmd/kube-proxy" "$kube_ldflags"
build kubectl kube "k8s.io/kubernetes/cmd/kubectl" "$kube_ldflags"
build helm helm "helm.sh/helm/v3/cmd/helm" "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"

echo "$bin"
