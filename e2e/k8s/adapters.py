"""LLMAdapters on a real cluster, as the node tests declare and watch them.

An adapter is served from the Hub-compatible server on this machine (`hub.py`); the
operator's verdict (`Accepted`), the route it renders, and the autoscaler's report of where
it is loaded (`Loaded`, `status.loadedReplicas`) are read back through kubectl. Requests go
through the gateway with the official `openai` client.
"""

from __future__ import annotations

from typing import Any

import openai
import yaml
from k8s.hub import HubServer
from k8s.kubectl import Kube, condition, wait_for

from servefleet.api.conventions import ROUTE_GATEWAY_KEY, route_object_name

MAX_TOKENS = 24


def llm_adapter(name: str, deployment: str, hub: HubServer, tenants: list[str]) -> dict[str, Any]:
    """An LLMAdapter of `deployment` whose files are the hub's repository `e2e/<name>`."""
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": name},
        "spec": {
            "deployment": deployment,
            "source": {"huggingface": {"repo": f"e2e/{name}", "endpoint": hub.url}},
            "tenants": tenants,
        },
    }


def accepted_adapter(kube: Kube, name: str, namespace: str) -> dict[str, Any] | None:
    """The LLMAdapter once the operator accepted its current generation; fails at once if
    it refused it (Unknown: its config could not be read yet, asked again next pass)."""
    obj = kube.get("llma", name, namespace)
    found = condition(obj, "Accepted")
    if obj is None or found is None:
        return None
    if found.get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    assert found["status"] != "False", found
    return obj if found["status"] == "True" else None


def route_adapters(kube: Kube, deployment: str, namespace: str) -> list[dict[str, Any]]:
    """The adapters in the deployment's route ConfigMap, as the operator rendered them."""
    route = kube.get("configmap", route_object_name(deployment), namespace)
    assert route is not None
    (rendered,) = yaml.safe_load(route["data"][ROUTE_GATEWAY_KEY])["deployments"]
    return sorted(rendered.get("adapters", []), key=lambda a: str(a["name"]))


def ask(client: openai.OpenAI, model: str, prompt: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert reply.model == model, reply.model
    return reply.choices[0].message.content or ""


def first_answer(client: openai.OpenAI, model: str, prompt: str) -> str:
    """The first answer once the gateway serves `model` (it reads the new route within
    seconds; until then the adapter is a model it does not know)."""
    errors: list[str] = []

    def answer() -> str | None:
        try:
            return ask(client, model, prompt)
        except (openai.NotFoundError, openai.AuthenticationError) as exc:
            errors.append(repr(exc))
            return None

    try:
        return wait_for(f"an answer from {model} through the gateway", answer, 120, 1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last errors: {errors[-3:]}") from None


def loaded_state(kube: Kube, name: str, namespace: str) -> tuple[str, list[str]] | None:
    """(the Loaded condition's status, the pods reported holding the adapter), or None
    before the autoscaler has reported on it."""
    obj = kube.get("llma", name, namespace)
    loaded = condition(obj, "Loaded")
    if obj is None or loaded is None:
        return None
    return str(loaded["status"]), list(obj["status"].get("loadedReplicas") or [])


def loaded_on(kube: Kube, name: str, namespace: str) -> list[str] | None:
    """The engine pods the autoscaler reports holding the adapter, once Loaded is True."""
    state = loaded_state(kube, name, namespace)
    if state is None or state[0] != "True":
        return None
    return state[1] or None
