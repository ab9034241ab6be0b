"""GitOps against a real API server: the YAML in Git, applied as Argo CD and Flux apply it.

Both use server-side apply under their own field manager; the autoscaler writes
`spec.replicas` through the scale subresource under its own. Re-applying the unchanged
YAML must neither conflict nor reset the replica count, and a server-side diff of that
YAML against the live object must be empty (no `ignoreDifferences` needed).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import RELEASE, SYSTEM_NAMESPACE
from k8s.kubectl import Kube, OperatorProcess, wait_for

from servefleet.api.conventions import FIELD_MANAGER_AUTOSCALER, FIELD_MANAGER_OPERATOR
from servefleet.kube import KubeAccess
from servefleet.kube.resources import LLM_DEPLOYMENTS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llmdeployment.yaml"
GITOPS = "argocd-controller"


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> str:
    name = "gitops-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].strip("-")
    kube.create_namespace(name)
    return name


def gitops_apply(kube: Kube, namespace: str, path: Path, *extra: str) -> str:
    """What Argo CD (and Flux) do: server-side apply, own field manager, no forced takeover."""
    return kube.kubectl(
        "apply",
        "--server-side",
        f"--field-manager={GITOPS}",
        "-n",
        namespace,
        "-f",
        str(path),
        *extra,
    )


def managers_of(obj: dict[str, Any], field: str) -> set[str]:
    """Field managers that own `field` (e.g. 'f:replicas' under f:spec) of an object."""
    return {
        entry["manager"]
        for entry in obj["metadata"].get("managedFields", [])
        if field in (entry.get("fieldsV1") or {}).get("f:spec", {})
    }


def autoscaler_scale(kube: Kube, namespace: str, replicas: int, tmp_path: Path) -> None:
    kubeconfig = kube.service_account_kubeconfig(
        SYSTEM_NAMESPACE, f"{RELEASE}-autoscaler", tmp_path / "autoscaler.kubeconfig"
    )

    async def scale() -> None:
        async with await KubeAccess(kubeconfig=str(kubeconfig)).connect() as client:
            await client.set_scale(
                LLM_DEPLOYMENTS, namespace, "smollm2", replicas, FIELD_MANAGER_AUTOSCALER
            )

    asyncio.run(scale())


def live_llmd(kube: Kube, namespace: str) -> dict[str, Any]:
    """The live object with its managedFields (kubectl hides them unless asked)."""
    text = kube.kubectl(
        "get", "llmd", "smollm2", "-n", namespace, "-o", "json", "--show-managed-fields"
    )
    result: dict[str, Any] = json.loads(text)
    return result


def engine_replicas(kube: Kube, namespace: str) -> int | None:
    deployment = kube.get("deployment", "smollm2-engine", namespace)
    return None if deployment is None else int(deployment["spec"]["replicas"])


def test_reapplying_the_yaml_after_autoscaling_neither_conflicts_nor_resets(
    kube: Kube, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    example = yaml.safe_load_all(EXAMPLE.read_text())
    assert all("replicas" not in doc.get("spec", {}) for doc in example if doc), (
        "spec.replicas in the YAML would fight the autoscaler on every sync"
    )
    gitops_apply(kube, namespace, EXAMPLE)
    wait_for("the engine Deployment", lambda: engine_replicas(kube, namespace) == 1, timeout=60)
    # What an HPA or KEDA reads first: the scale of the object, although the YAML has no replicas.
    scale = json.loads(
        kube.kubectl("get", "llmd", "smollm2", "-n", namespace, "--subresource=scale", "-o", "json")
    )
    assert scale["spec"]["replicas"] == 1

    # The autoscaler scales through the scale subresource (as an HPA does), with its own
    # client, field manager and the chart's RBAC.
    autoscaler_scale(kube, namespace, 3, tmp_path)
    wait_for("3 engine replicas", lambda: engine_replicas(kube, namespace) == 3, timeout=60)
    live = live_llmd(kube, namespace)
    # The YAML's manager must not own spec.replicas, else every sync would reset it. (A write
    # through a custom resource's scale subresource records no manager in managedFields on
    # this API server, so the autoscaler is not named as its owner either.)
    assert GITOPS not in managers_of(live, "f:replicas")
    # The operator writes only status (and kopf's bookkeeping annotations), never spec.
    assert FIELD_MANAGER_OPERATOR not in {
        m for f in ("f:model", "f:pool") for m in managers_of(live, f)
    }

    # A sync: the unchanged YAML again, without --force-conflicts. No conflict, no reset.
    gitops_apply(kube, namespace, EXAMPLE)
    after = live_llmd(kube, namespace)
    assert after["spec"]["replicas"] == 3
    assert after["metadata"]["generation"] == live["metadata"]["generation"]
    assert engine_replicas(kube, namespace) == 3

    # The GitOps diff is clean: a server-side dry run of the YAML changes nothing...
    diff = kube.kubectl_result(
        "diff", "--server-side", f"--field-manager={GITOPS}", "-n", namespace, "-f", str(EXAMPLE)
    )
    assert diff.returncode == 0, f"kubectl diff shows changes:\n{diff.stdout}{diff.stderr}"
    dry = json.loads(gitops_apply(kube, namespace, EXAMPLE, "--dry-run=server", "-o", "json"))
    (dry_llmd,) = [i for i in dry.get("items", [dry]) if i["kind"] == "LLMDeployment"]
    assert dry_llmd["spec"] == after["spec"]
    # ...and the status the operator wrote is not the user's to diff.
    wait_for(
        "status.desiredReplicas 3",
        lambda: (
            (kube.get("llmd", "smollm2", namespace) or {}).get("status", {}).get("desiredReplicas")
            == 3
        ),
        timeout=60,
    )
    assert GITOPS not in managers_of(after, "f:replicas")

    # Why the example leaves spec.replicas out: a YAML that sets it takes the field back on
    # the next sync and resets the pool the autoscaler sized.
    pinned = tmp_path / "pinned.yaml"
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    for doc in docs:
        if doc["kind"] == "LLMDeployment":
            doc["spec"]["replicas"] = 1
    pinned.write_text(yaml.safe_dump_all(docs))
    gitops_apply(kube, namespace, pinned)
    wait_for("the pool reset to 1", lambda: engine_replicas(kube, namespace) == 1, timeout=60)


def test_engine_pods_are_isolated_and_keyed(
    kube: Kube, operator: OperatorProcess, namespace: str
) -> None:
    """The isolation objects GitOps users never write: the operator's NetworkPolicy and
    engine key Secret, accepted by the API server under the chart's RBAC."""
    gitops_apply(kube, namespace, EXAMPLE)
    wait_for(
        "NetworkPolicy", lambda: kube.get("networkpolicy", "smollm2-engine", namespace), timeout=60
    )
    secret = kube.get("secret", "smollm2-engine-key", namespace)
    assert secret is not None and secret["data"]["api-key"]
    owner = kube.get("llmd", "smollm2", namespace)
    assert owner is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    deployment = kube.get("deployment", "smollm2-engine", namespace)
    assert deployment is not None
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    env = pod["containers"][0]["env"]
    assert env[0]["valueFrom"]["secretKeyRef"] == {"name": "smollm2-engine-key", "key": "api-key"}
    # The key is created once: a restarted operator's reconcile (proven by the deleted
    # NetworkPolicy coming back) leaves it alone, so running pods keep a valid key.
    first = secret["data"]["api-key"]
    operator.restart()
    kube.kubectl("delete", "networkpolicy", "smollm2-engine", "-n", namespace)
    wait_for(
        "the NetworkPolicy put back",
        lambda: kube.get("networkpolicy", "smollm2-engine", namespace),
        timeout=60,
    )
    again = kube.get("secret", "smollm2-engine-key", namespace)
    assert again is not None and again["data"]["api-key"] == first
