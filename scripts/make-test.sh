#!/usr/bin/env bash
# `make test`: every stage, ordered so that two cores stay busy and the wall time stays short.
#
#   1. setup and system packages
#   2. the checks (lint, mypy, unit tests in parallel) beside the Kubernetes binaries' build;
#      meanwhile, at the lowest CPU priority, the e2e LoRA adapters train and (as root) the
#      node's images build and go into its containerd store
#   3. e2e in two streams side by side: the tests on real processes (make e2e-local) in the
#      foreground; beside them the tests on a real API server (make e2e-kube), which wait
#      mostly on the API server and controllers, then, at a lower CPU priority, the node tests
#      (real pods), which wait mostly on kubelet and containerd (their pods inherit the
#      priority, so the process tests keep first call on the CPU); the second stream's
#      output is printed when it ends
# Exits non-zero when any stage fails. Logs of the background steps: ~/.cache/servefleet/.
set -uo pipefail
cd "$(dirname "$0")/.."

make_() { make --no-print-directory "$@"; }
logs="$HOME/.cache/servefleet"
adapters_log="$logs/e2e-adapters.log" images_log="$logs/e2e-images.log"
cluster_log="$logs/e2e-cluster.log" images_done="$logs/e2e-images.status"
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start))s"; }
# How busy the cores were since a mark (/proc/stat's busy and total jiffies): whether a stage
# left room for more work beside it.
cpu_mark() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat 2>/dev/null; }
busy_since() {
  local b0 t0 b1 t1
  read -r b0 t0 <<<"$1"
  read -r b1 t1 <<<"$(cpu_mark)"
  [ -n "$t0" ] && [ "$((t1 - t0))" -gt 0 ] && echo "cores $((100 * (b1 - b0) / (t1 - t0)))% busy"
}

make_ setup system-deps || exit 1
mkdir -p "$logs"
nice -n 19 make --no-print-directory e2e-adapters >"$adapters_log" 2>&1 &
adapters=$!
rm -f "$images_done"
if [ "$(id -u)" -eq 0 ]; then
  { nice -n 19 make --no-print-directory e2e-images; echo $? >"$images_done"; } >"$images_log" 2>&1 &
else
  echo "not root: no images" >"$images_done"
fi

mark=$(cpu_mark)
make_ -j2 k8s-bins checks || exit 1
echo "make test: checks and Kubernetes binaries done after $(elapsed) ($(busy_since "$mark"))"
wait "$adapters" || tail -5 "$adapters_log"  # e2e/test_lora_local.py trains them then

# The API-server tests, then the node tests once the images are in place (a failed image
# step leaves the node's own start to build them, as `make e2e-node` alone does).
(
  make --no-print-directory e2e-kube
  kube_status=$?
  echo "make test: e2e-kube done after $(elapsed) (status $kube_status)"
  while [ ! -s "$images_done" ]; do sleep 5; done
  [ "$(cat "$images_done")" = 0 ] || tail -5 "$images_log"
  nice -n 10 make --no-print-directory e2e-node
  node_status=$?
  echo "make test: e2e-node done after $(elapsed) (status $node_status)"
  [ "$kube_status" -eq 0 ] && [ "$node_status" -eq 0 ]
) >"$cluster_log" 2>&1 &
cluster=$!

mark=$(cpu_mark)
make_ e2e-local
e2e_status=$?
echo "make test: e2e-local done after $(elapsed) (status $e2e_status, $(busy_since "$mark")); waiting for e2e-kube and e2e-node"
wait "$cluster"
cluster_status=$?
echo "---- make e2e-kube, then make e2e-node (status $cluster_status) ----"
cat "$cluster_log"
if [ "$e2e_status" -ne 0 ] || [ "$cluster_status" -ne 0 ]; then
  echo "make test: failed after $(elapsed) (e2e-local $e2e_status, e2e-kube and e2e-node $cluster_status)"
  exit 1
fi
echo "make test: everything passed in $(elapsed)"
