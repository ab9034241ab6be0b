"""LLMAdapters in the gateway config: `render_gateway_config` fills each deployment's
`adapters` (both modes call it), and `GatewayConfig` refuses what would make a model name
ambiguous or reach a tenant the deployment does not serve."""

from __future__ import annotations

import posixpath
from typing import Any

import pytest
from pydantic import ValidationError

from servefleet.api.conventions import MODEL_MOUNT
from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayAdapter,
    GatewayConfig,
    GatewayDeployment,
    GatewayTenant,
    TenantAccess,
)
from servefleet.api.gateway_render import (
    MountedSecretKeys,
    ResolvedSecretKeys,
    adapter_path,
    render_gateway_config,
)
from servefleet.api.llmadapter import LLMAdapter
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.model_source import ModelSource

KEYS = ResolvedSecretKeys(lambda ref: f"sk-{ref.name}")
VOLUMES = {"adapters": "/srv/adapters"}


def deployment(
    name: str = "smol", model: str = "smollm2", namespace: str = "default"
) -> LLMDeployment:
    tenants = [{"name": t, "apiKeySecretRef": {"name": f"{t}-key", "key": "k"}} for t in ("a", "b")]
    spec = {
        "model": {"name": model, "source": {"builtin": "smollm2-135m-instruct"}},
        "engine": {"lora": {}},
        "tenants": tenants,
    }
    return LLMDeployment.model_validate(
        {"metadata": {"name": name, "namespace": namespace}, "spec": spec}
    )


def adapter(name: str, *, on: str = "smol", namespace: str = "default", **spec: Any) -> LLMAdapter:
    body = {"deployment": on, "source": {"pvc": {"claimName": "adapters", "path": name}}, **spec}
    return LLMAdapter.model_validate(
        {"metadata": {"name": name, "namespace": namespace}, "spec": body}
    )


def render(deps: list[LLMDeployment], adapters: list[LLMAdapter]) -> GatewayConfig:
    return render_gateway_config(deps, {}, KEYS, adapters=adapters, local_volumes=VOLUMES)


def test_local_mode_renders_name_folder_and_tenants() -> None:
    config = render(
        [deployment()],
        [adapter("fox", tenants=["a"]), adapter("owl", model="team/owl-v2")],
    )
    (dep,) = config.deployments
    assert [a.model_dump() for a in dep.adapters] == [
        {"name": "fox", "path": "/srv/adapters/fox", "tenants": ["a"]},
        # The served name (spec.model) is what clients send; no tenants: all of them.
        {"name": "team/owl-v2", "path": "/srv/adapters/owl", "tenants": None},
    ]
    assert [t.name for t in dep.adapter_tenants(dep.adapters[0])] == ["a"]
    assert [t.name for t in dep.adapter_tenants(dep.adapters[1])] == ["a", "b"]


def test_adapters_go_to_the_deployment_they_name_only() -> None:
    other = deployment("big", "other-model")
    config = render([deployment(), other], [adapter("fox"), adapter("owl", on="big")])
    assert {d.name: [a.name for a in d.adapters] for d in config.deployments} == {
        "smol": ["fox"],
        "big": ["owl"],
    }


def test_no_adapters_renders_none_as_before() -> None:
    (dep,) = render_gateway_config([deployment()], {}, KEYS).deployments
    assert dep.adapters == []


def test_an_adapter_of_a_deployment_not_rendered_is_an_error_not_dropped() -> None:
    with pytest.raises(ValueError, match="LLMAdapter fox: deployment gone"):
        render([deployment()], [adapter("fox", on="gone")])
    # Same name, other namespace: not the same deployment.
    with pytest.raises(ValueError, match="namespace team"):
        render([deployment()], [adapter("fox", namespace="team")])


def test_local_mode_reads_pvc_folders_of_mapped_claims_and_fetches_the_rest() -> None:
    hub = LLMAdapter.model_validate(
        {
            "metadata": {"name": "hub"},
            "spec": {"deployment": "smol", "source": {"huggingface": {"repo": "o/r"}}},
        }
    )
    (rendered,) = render([deployment()], [hub]).deployments[0].adapters  # the engine fetches it
    assert rendered.path == "hf://o/r@main"
    with pytest.raises(ValueError, match=r"claim adapters .*--volume adapters=DIR"):
        render_gateway_config([deployment()], {}, KEYS, adapters=[adapter("x")], local_volumes={})


def test_the_folder_is_inside_the_claim_folder() -> None:
    nested = adapter("fox")
    nested.spec.source.pvc.path = "teams/a/./fox/"  # type: ignore[union-attr]
    assert adapter_path(nested, deployment(), True, VOLUMES) == "/srv/adapters/teams/a/fox"
    root = adapter("fox")
    root.spec.source.pvc.path = ""  # type: ignore[union-attr]
    assert adapter_path(root, deployment(), True, VOLUMES) == "/srv/adapters"


def test_kubernetes_mode_renders_the_engine_pods_path() -> None:
    """Without local volumes the path is the pods' (`lora_source.kube_lora_path`): here a
    folder on the claim the engine pods already mount for the model."""
    dep = deployment()
    dep.spec.model.source = ModelSource.model_validate({"pvc": {"claimName": "adapters"}})
    (rendered,) = render_gateway_config(
        [dep], {}, MountedSecretKeys("/secrets"), adapters=[adapter("fox", tenants=["b"])]
    ).deployments
    assert rendered.adapters == [
        GatewayAdapter(name="fox", path=posixpath.join(MODEL_MOUNT, "fox"), tenants=["b"])
    ]


def test_a_rendered_adapter_named_like_the_base_model_is_refused() -> None:
    with pytest.raises(ValidationError, match="adapter smollm2 is the base model"):
        render([deployment()], [adapter("base", model="smollm2")])


def test_two_adapters_with_one_name_on_a_deployment_are_refused() -> None:
    with pytest.raises(ValidationError, match="adapters: duplicate names"):
        render([deployment()], [adapter("fox"), adapter("fox2", model="fox")])


# GatewayConfig itself: the gateway refuses a config file the operator did not render, too.


def gateway_deployment(name: str, model: str, adapters: list[GatewayAdapter]) -> GatewayDeployment:
    return GatewayDeployment(
        name=name,
        model=model,
        tenants=[TenantAccess(name="a"), TenantAccess(name="b")],
        adapters=adapters,
    )


def config(*deps: GatewayDeployment) -> GatewayConfig:
    key = ApiKeyRef(sha256="0" * 64)
    tenants = [GatewayTenant(name=t, api_keys=[key]) for t in ("a", "b")]
    return GatewayConfig(tenants=tenants, deployments=list(deps), internal_port=None)


def fox(tenants: list[str] | None = None, name: str = "fox") -> GatewayAdapter:
    return GatewayAdapter(name=name, path="/a/fox", tenants=tenants)


def test_gateway_config_accepts_adapters_and_refuses_duplicates() -> None:
    assert config(gateway_deployment("smol", "m", [fox(), fox(name="owl")]))
    with pytest.raises(ValidationError, match="deployment smol: adapters: duplicate names"):
        gateway_deployment("smol", "m", [fox(), fox()])


def test_gateway_config_refuses_an_adapter_named_like_its_base_model() -> None:
    with pytest.raises(ValidationError, match="deployment smol: adapter m is the base model"):
        gateway_deployment("smol", "m", [fox(name="m")])


def test_gateway_config_refuses_adapter_tenants_the_deployment_does_not_serve() -> None:
    with pytest.raises(ValidationError, match="adapter fox: tenants c, d do not use"):
        gateway_deployment("smol", "m", [fox(["a", "d", "c"])])


def test_two_deployments_may_not_serve_one_adapter_name_to_one_tenant() -> None:
    one = gateway_deployment("one", "m1", [fox(["a"])])
    with pytest.raises(ValidationError, match="two deployments serve the same model name fox"):
        config(one, gateway_deployment("two", "m2", [fox(["a", "b"])]))
    # ... nor an adapter name another deployment serves as its model.
    with pytest.raises(ValidationError, match="same model name fox to tenant a"):
        config(one, gateway_deployment("two", "fox", []))
    # Disjoint tenants may each have their own "fox".
    assert config(one, gateway_deployment("two", "m2", [fox(["b"])]))
