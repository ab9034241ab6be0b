"""Fixtures for the Kubernetes e2e tests: a real control plane, the chart, the operator.

With KUBECONFIG set, the tests use that cluster (its kubectl/helm from PATH or the
cache); otherwise `e2e/k8s/build.sh` builds the binaries once (cached) and a fresh
etcd + kube-apiserver + kube-controller-manager run on random local ports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The repository root too: e2e reuses the real servers of `tests.support` (an OCI registry).
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from k8s.cluster import LocalControlPlane
from k8s.kubectl import Kube, OperatorProcess
from k8s.node import LocalNode, NodeCluster

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "servefleet"
SYSTEM_NAMESPACE = "servefleet"
RELEASE = "servefleet"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kube: uses the session's API server (the `kube` fixture); `make test` runs these "
        "beside the others (make e2e-kube, make e2e-local)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs the API server, so the two halves can run side by side."""
    for item in items:
        if "kube" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kube)


@pytest.fixture(scope="session")
def k8s_bin() -> Path:
    """Directory with kubectl, helm (and the control-plane binaries when we run our own)."""
    done = subprocess.run(
        ["bash", str(ROOT / "e2e" / "k8s" / "build.sh")],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(
            "e2e/k8s/build.sh failed to build the Kubernetes binaries (see its output above)"
        )
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def helm(k8s_bin: Path) -> Path:
    """The helm binary: $KUBECONFIG's cluster's on the PATH, else ours."""
    found = shutil.which("helm") if os.environ.get("KUBECONFIG") else None
    return Path(found) if found else k8s_bin / "helm"


@pytest.fixture(scope="session")
def kube(k8s_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    """Admin access to a real API server (ours, or $KUBECONFIG's)."""
    if os.environ.get("KUBECONFIG"):
        kubectl = shutil.which("kubectl") or str(k8s_bin / "kubectl")
        helm = shutil.which("helm") or str(k8s_bin / "helm")
        yield Kube(Path(os.environ["KUBECONFIG"]), Path(kubectl), Path(helm))
        return
    plane = LocalControlPlane(bin_dir=k8s_bin, work_dir=tmp_path_factory.mktemp("control-plane"))
    try:
        plane.start()
        yield Kube(plane.kubeconfig, k8s_bin / "kubectl", k8s_bin / "helm")
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def node_cluster(k8s_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    """A cluster whose pods really run: our single node, or $KUBECONFIG's cluster.

    Our node builds the images from the Dockerfile into its containerd. A cluster named by
    KUBECONFIG cannot see those, so the images it runs are named in
    SERVEFLEET_E2E_CONTROL_PLANE_IMAGE and SERVEFLEET_E2E_ENGINE_IMAGE.
    """
    if os.environ.get("KUBECONFIG"):
        images = {
            "control-plane": os.environ.get("SERVEFLEET_E2E_CONTROL_PLANE_IMAGE", ""),
            "engine": os.environ.get("SERVEFLEET_E2E_ENGINE_IMAGE", ""),
        }
        if not all(images.values()):
            pytest.fail(
                "with KUBECONFIG set, name images that cluster can run in "
                "SERVEFLEET_E2E_CONTROL_PLANE_IMAGE and SERVEFLEET_E2E_ENGINE_IMAGE "
                "(Dockerfile targets control-plane and engine-cpu)"
            )
        kubectl = shutil.which("kubectl") or str(k8s_bin / "kubectl")
        helm = shutil.which("helm") or str(k8s_bin / "helm")
        kube = Kube(Path(os.environ["KUBECONFIG"]), Path(kubectl), Path(helm))
        yield NodeCluster(kube, images, "IfNotPresent")
        return
    node = LocalNode(bin_dir=k8s_bin, run_dir=tmp_path_factory.mktemp("node"))
    try:
        node.start()
        assert node.plane is not None
        print(f"\ne2e node up: {node.timings} (seconds); images {node.images}")
        kube = Kube(node.plane.kubeconfig, k8s_bin / "kubectl", k8s_bin / "helm")
        yield NodeCluster(kube, node.images, "Never", node.containerd_socket)
    finally:
        node.stop()


@pytest.fixture(scope="session")
def rendered_chart(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`helm template` of the chart with ServiceMonitors and Redis on (everything rendered),
    and RBAC cluster-wide (the documented opt-in): the tests make a namespace each. The
    namespaced default is proven by e2e/test_attacks_cluster.py."""
    out = tmp_path_factory.mktemp("chart") / "rendered.yaml"
    text = kube.helm(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        SYSTEM_NAMESPACE,
        "--include-crds",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "redis.enabled=true",
        "--set",
        "rbac.clusterWide=true",
    )
    out.write_text(text)
    return out


@pytest.fixture(scope="session")
def installed_chart(kube: Kube, rendered_chart: Path) -> Path:
    """The rendered chart applied to the API server (CRDs, RBAC, ServiceAccounts, workloads).

    The Prometheus Operator is not installed, so a minimal ServiceMonitor CRD is,
    which also lets the operator's ServiceMonitor path run.
    """
    kube.apply_text(SERVICE_MONITOR_CRD)
    kube.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/servicemonitors.monitoring.coreos.com",
        "--timeout=60s",
    )
    kube.kubectl("create", "namespace", SYSTEM_NAMESPACE, check=False)
    kube.kubectl("apply", "--server-side", "--field-manager=helm", "-f", str(rendered_chart))
    for crd in ("llmdeployments.servefleet.io", "llmadapters.servefleet.io"):
        kube.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    return rendered_chart


@pytest.fixture(scope="session")
def operator_kubeconfig(
    kube: Kube, installed_chart: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A kubeconfig whose identity is the chart's operator ServiceAccount (RBAC is proven)."""
    return kube.service_account_kubeconfig(
        SYSTEM_NAMESPACE, f"{RELEASE}-operator", tmp_path_factory.mktemp("operator") / "kubeconfig"
    )


@pytest.fixture(scope="session")
def route_key_file(
    kube: Kube, installed_chart: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The installed chart's route signing key, as the operator and gateway pods mount it."""
    return kube.secret_file(
        SYSTEM_NAMESPACE,
        f"{RELEASE}-route-signing",
        "route-signing-key",
        tmp_path_factory.mktemp("route-signing") / "route-signing-key",
    )


@pytest.fixture(scope="session")
def operator(
    operator_kubeconfig: Path, route_key_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    proc = OperatorProcess(
        operator_kubeconfig, tmp_path_factory.mktemp("operator-logs"), route_key_file
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


SERVICE_MONITOR_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: servicemonitors.monitoring.coreos.com
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names:
    kind: ServiceMonitor
    listKind: ServiceMonitorList
    plural: servicemonitors
    singular: servicemonitor
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec: {type: object, x-kubernetes-preserve-unknown-fields: true}
"""
