"""The LLMAdapter CRD on a real API server: the chart installs it, its CEL rules refuse what
the pydantic models refuse (with the same message), and `kubectl get llma` prints the
columns from the status the operator writes (through the status subresource).

No operator runs here: the status is written by hand, as the operator would write it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s.kubectl import Kube, wait_for

from servefleet.api.llmadapter import ADAPTER_SOURCE_MESSAGE, ADAPTER_URL_MESSAGE


@pytest.fixture
def namespace(kube: Kube, installed_chart: Path, request: pytest.FixtureRequest) -> str:
    name = "e2e-llma-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].strip("-")
    kube.create_namespace(name)
    return name


def llma(name: str, **spec: Any) -> str:
    body = {
        "deployment": "smol",
        "source": {"pvc": {"claimName": "models", "path": f"adapters/{name}"}},
        **spec,
    }
    doc = {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": name},
        "spec": body,
    }
    return yaml.safe_dump(doc)


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("builtin", {"source": {"builtin": "smollm2-135m-instruct"}}, ADAPTER_SOURCE_MESSAGE),
    ("url", {"source": {"url": "https://example.com/a.gguf"}}, ADAPTER_URL_MESSAGE),
    ("twin-tenants", {"tenants": ["a", "a"]}, 'Duplicate value: "a"'),
    ("bad-deployment", {"deployment": "Not_A_Label"}, "spec.deployment"),
    (
        "climbing",
        {"source": {"pvc": {"claimName": "models", "path": "../etc"}}},
        "must be a path inside its volume",
    ),
]


def test_invalid_adapters_are_refused_with_the_models_messages(kube: Kube, namespace: str) -> None:
    for name, spec, message in INVALID:
        done = kube.kubectl_result("create", "-n", namespace, "-f", "-", stdin=llma(name, **spec))
        assert done.returncode != 0, f"{name} was accepted"
        assert message in done.stderr, f"{name}: {done.stderr}"
    assert kube.list("llma", namespace) == []


def test_kubectl_get_shows_where_an_adapter_is_loaded(kube: Kube, namespace: str) -> None:
    kube.apply_text(llma("fox", model="team/fox-v2", tenants=["a"]), namespace)
    status = {
        "status": {
            "observedGeneration": 1,
            "baseModel": "smollm2",
            "rank": 8,
            "targetModules": ["q_proj", "v_proj"],
            "loadedReplicas": ["smol-engine-0", "smol-engine-1"],
            "conditions": [
                {
                    "type": "Accepted",
                    "status": "True",
                    "reason": "Fits",
                    "message": "rank 8 <= 16",
                    "lastTransitionTime": "2025-01-01T00:00:00Z",
                },
                {
                    "type": "Loaded",
                    "status": "True",
                    "reason": "Loaded",
                    "message": "on 2 replicas",
                    "lastTransitionTime": "2025-01-01T00:00:00Z",
                },
            ],
        }
    }

    def shown_as_patched() -> str | None:
        """The table once it shows our status: the session's operator judges adapters in
        every namespace, and this one names no deployment, so its drift pass may rewrite the
        status between our patch and our read."""
        kube.kubectl(
            "patch", "llmadapter", "fox", "-n", namespace,
            "--subresource=status", "--type=merge", "-p", json.dumps(status),
        )  # fmt: skip
        table = kube.kubectl("get", "llma", "-n", namespace, "-o", "wide")
        return table if "Loaded" in table and " True " in table else None

    table = wait_for("the patched status in the table", shown_as_patched, timeout=30)
    print(table)
    header, row = table.splitlines()
    assert header.split()[:7] == [
        "NAME", "DEPLOYMENT", "MODEL", "RANK", "ACCEPTED", "LOADED", "REASON",
    ]  # fmt: skip
    cells = row.split()
    assert cells[:5] == ["fox", "smol", "team/fox-v2", "8", "True"]
    assert "smol-engine-0" in row and "smol-engine-1" in row
    # The servefleet category lists adapters beside deployments.
    assert "llmadapter.servefleet.io/fox" in kube.kubectl("get", "servefleet", "-n", namespace)
    explain = wait_for("kubectl explain", lambda: kube.kubectl("explain", "llma.spec.tenants"))
    assert "404 model_not_found" in explain
