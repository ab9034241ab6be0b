#!/usr/bin/env bash
# `make test`: every stage, ordered so that two cores stay busy and the wall time stays short.
#
#   1. setup and system packages
#   2. the checks (lint, mypy, unit tests in parallel) beside the Kubernetes binaries' build;
#      meanwhile, at the lowest CPU priority, the e2e LoRA adapters train and (as root) the
#      node's images build and go into its containerd store
#   3. e2e (real processes, a real API server), and beside it, at a lower CPU priority, the
#      node tests (real pods): they wait mostly on kubelet and containerd, and their pods
#      inherit the priority, so the e2e tests keep first call on the CPU; the node tests'
#      output is printed when they end
# Exits non-zero when any stage fails. Logs of the background steps: ~/.cache/servefleet/.
set -uo pipefail
cd "$(dirname "$0")/.."

make_() { make --no-print-directory "$@"; }
logs="$HOME/.cache/servefleet"
adapters_log="$logs/e2e-adapters.log" images_log="$logs/e2e-images.log"
node_log="$logs/e2e-node.log" images_done="$logs/e2e-images.status"
start=$(date +%s)
elapsed() { echo "$(($(date +%s) - start))s"; }

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

make_ -j2 k8s-bins checks || exit 1
echo "make test: checks and Kubernetes binaries done after $(elapsed)"
wait "$adapters" || tail -5 "$adapters_log"  # e2e/test_lora_local.py trains them then

# The node tests, once the images are in place (a failed image step leaves the node's own
# start to build them, as `make e2e-node` alone does).
(
  while [ ! -s "$images_done" ]; do sleep 5; done
  [ "$(cat "$images_done")" = 0 ] || tail -5 "$images_log"
  nice -n 10 make --no-print-directory e2e-node
) >"$node_log" 2>&1 &
node=$!

make_ e2e
e2e_status=$?
echo "make test: e2e done after $(elapsed) (status $e2e_status); waiting for the node tests"
wait "$node"
node_status=$?
echo "---- make e2e-node (status $node_status) ----"
cat "$node_log"
if [ "$e2e_status" -ne 0 ] || [ "$node_status" -ne 0 ]; then
  echo "make test: failed after $(elapsed) (e2e $e2e_status, e2e-node $node_status)"
  exit 1
fi
echo "make test: everything passed in $(elapsed)"
