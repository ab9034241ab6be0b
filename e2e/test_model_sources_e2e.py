"""Model sources on a real API server: the CRD's rules for sources and the cache, the
fetch init container the operator renders, and the ModelLoading condition it reports
with the chart's RBAC (engine pods stay unscheduled here: no node)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s.kubectl import Kube, OperatorProcess, condition, wait_for

from servefleet.api.fetch_progress import FETCH_CONTAINER
from servefleet.api.model_source import ModelSource

HF_SOURCE = {
    "huggingface": {
        "repo": "acme/tiny",
        "revision": "0123456789abcdef0123456789abcdef01234567",
        "tokenSecretRef": {"name": "hf-token", "key": "token"},
        "allowPatterns": ["*.json", "*.safetensors"],
    }
}


def llmd(name: str, model: dict[str, Any]) -> str:
    body = {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"name": name, **model}, "engine": {"kind": "vllm"}},
    }
    return yaml.safe_dump(body)


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> str:
    name = "e2e-src-" + request.node.name.removeprefix("test_").replace("_", "-")[:36].strip("-")
    kube.create_namespace(name)
    return name


INVALID = [
    (
        "two-sources",
        {"source": {**HF_SOURCE, "s3": {"url": "s3://models/llama/"}}},
        "exactly one of builtin, pvc, url, huggingface, s3 or oci",
    ),
    (
        "cache-on-pvc",
        {"source": {"pvc": {"claimName": "m"}}, "cache": {"pvc": {"claimName": "c"}}},
        "model.cache applies only to the url, huggingface and s3 sources",
    ),
    (
        "two-caches",
        {"source": HF_SOURCE, "cache": {"pvc": {"claimName": "c"}, "hostPath": {"path": "/c"}}},
        "model.cache needs exactly one of pvc or hostPath",
    ),
    ("bad-s3-url", {"source": {"s3": {"url": "https://models/x"}}}, "spec.model.source.s3.url"),
]


def test_bad_sources_and_caches_are_refused_at_admission(
    kube: Kube, installed_chart: Path, namespace: str
) -> None:
    for name, model, message in INVALID:
        done = kube.kubectl_result("create", "-n", namespace, "-f", "-", stdin=llmd(name, model))
        assert done.returncode != 0, f"{name} was accepted"
        assert message in done.stderr, f"{name}: {done.stderr}"


def test_huggingface_source_renders_a_cached_fetch_and_reports_loading(
    kube: Kube, operator: OperatorProcess, namespace: str
) -> None:
    model = {"source": HF_SOURCE, "cache": {"pvc": {"claimName": "model-cache"}}}
    kube.apply_text(llmd("hf", model), namespace)
    deployment = wait_for(
        "the engine Deployment", lambda: kube.get("deployment", "hf-engine", namespace)
    )
    pod = deployment["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    assert fetch["name"] == FETCH_CONTAINER
    assert {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
    } in fetch["env"]
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "model-cache"}
    entry = ModelSource.model_validate(HF_SOURCE).fetched_path()
    args = pod["containers"][0]["args"]
    assert f"/models/{entry}" in args
    # No node runs the pods, so they wait to start the download: the operator saw them
    # (pods list with the chart's RBAC) and says so.
    loading = wait_for(
        "ModelLoading",
        lambda: condition(kube.get("llmd", "hf", namespace), "ModelLoading"),
        timeout=90,
    )
    assert (loading["status"], loading["reason"]) == ("True", "Pending"), loading
    operator.assert_alive()
    assert "cannot read model downloads" not in operator.logs()
