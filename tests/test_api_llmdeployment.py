"""The LLMDeployment pydantic model: defaults, aliases, and the cross-field rules."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.manifests import (
    ManifestError,
    load_llmadapters,
    load_llmdeployments,
    load_secrets,
    resolve_secret,
    secret_env_name,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llmdeployment.yaml"


def minimal() -> dict[str, Any]:
    return {
        "apiVersion": "servefleet.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "demo"},
        "spec": {"model": {"name": "m", "source": {"builtin": "smollm2-135m-instruct"}}},
    }


def with_spec(**changes: Any) -> dict[str, Any]:
    doc = minimal()
    doc["spec"].update(copy.deepcopy(changes))
    return doc


def test_defaults_fill_every_section() -> None:
    dep = LLMDeployment.model_validate(minimal())
    assert dep.spec.engine.kind == "servefleet"
    assert dep.spec.pool.min_replicas == 1
    assert dep.spec.admission.max_queue_depth == 256
    assert dep.spec.spillover is None
    assert dep.spec.desired_replicas() == 1
    assert dep.status.conditions == []


def test_wire_form_is_camel_case_and_round_trips() -> None:
    dep = LLMDeployment.model_validate(with_spec(pool={"minReplicas": 2, "maxReplicas": 5}))
    wire = dep.to_wire()
    assert wire["apiVersion"] == "servefleet.io/v1alpha1"
    assert wire["spec"]["pool"]["minReplicas"] == 2
    assert "min_replicas" not in wire["spec"]["pool"]
    assert LLMDeployment.model_validate(wire) == dep


def test_python_names_are_accepted_too() -> None:
    dep = LLMDeployment.model_validate(with_spec(pool={"min_replicas": 0, "max_replicas": 2}))
    assert dep.spec.pool.min_replicas == 0


NGRAM = {"method": "ngram", "numSpeculativeTokens": 4}


@pytest.mark.parametrize(
    ("spec_changes", "message"),
    [
        (
            {"pool": {"minReplicas": 3, "maxReplicas": 2}},
            "pool.minReplicas must be <= pool.maxReplicas",
        ),
        (
            {"spillover": {"enabled": True, "baseURL": "https://x/v1", "model": "m"}},
            "needs baseURL, model and apiKeySecretRef",
        ),
        (
            {"model": {"name": "m", "source": {}}},
            "exactly one of builtin, pvc, url, huggingface, s3 or oci",
        ),
        (
            {
                "model": {
                    "name": "m",
                    "source": {"builtin": "smollm2-135m-instruct", "url": "https://x/y.gguf"},
                }
            },
            "exactly one",
        ),
        (
            {
                "engine": {
                    "tensorParallelSize": 2,
                    "resources": {"limits": {"nvidia.com/gpu": 2}},
                }
            },
            "servefleet runs one rank per pod",
        ),
        (
            {"engine": {"tensorParallelSize": 8, "pipelineParallelSize": 9}},
            "must not exceed 64",
        ),
        (
            {
                "model": {"name": "m", "source": {"url": "https://x/m"}},
                "engine": {
                    "kind": "vllm",
                    "tensorParallelSize": 2,
                    "pipelineParallelSize": 2,
                    "resources": {"limits": {"nvidia.com/gpu": 3}},
                },
            },
            "runs one pipeline stage per pod",
        ),
        (
            {"engine": {"pipelineParallelSize": 0}},
            "greater than or equal to 1",
        ),
        ({"engine": {"kind": "vllm"}}, "builtin models run only on engine.kind servefleet"),
        ({"engine": {"kvCacheMemory": "lots"}}, "kvCacheMemory"),
        (
            {"engine": {"resources": {"limits": {"memory": "four gigs"}}}},
            "not a Kubernetes quantity",
        ),
        ({"engine": {"kind": "warp"}}, "Input should be 'servefleet', 'vllm' or 'sglang'"),
        ({"unknownField": 1}, "Extra inputs are not permitted"),
        (
            {"tenants": [{"name": "a", "apiKeySecretRef": {"name": "s", "key": "k"}}] * 2},
            "duplicate name(s) a",
        ),
        (
            {
                "tenants": [{"name": "a", "apiKeySecretRef": {"name": "s", "key": "k"}}],
                "spillover": {"tenants": ["b"]},
            },
            "unknown: b",
        ),
        (
            {"tenants": [{"name": "Bad_Name", "apiKeySecretRef": {"name": "s", "key": "k"}}]},
            "should match pattern",
        ),
        ({"tenants": [{"name": "a"}]}, "apiKeySecretRef"),
        (
            {"model": {"name": "m", "source": {"builtin": "llama-9000"}}},
            "Input should be 'smollm2-135m-instruct'",
        ),
        (
            {
                "model": {"name": "m", "source": {"url": "https://x/m"}},
                "engine": {
                    "kind": "vllm",
                    "tensorParallelSize": 4,
                    "resources": {"limits": {"nvidia.com/gpu": 1}},
                },
            },
            "tensorParallelSize must not exceed the GPUs of one replica",
        ),
        (
            {
                "model": {"name": "m", "source": {"url": "https://x/m"}},
                "engine": {"kind": "sglang", "tensorParallelSize": 2},
            },
            "tensorParallelSize must not exceed the GPUs of one replica",
        ),
        (
            {
                "model": {
                    "name": "m",
                    "source": {"builtin": "smollm2-135m-instruct"},
                    "quantization": "awq",
                }
            },
            "awq, gptq and fp8 need engine.kind vllm or sglang",
        ),
        ({"engine": {"maxModelLen": 8}}, "greater than or equal to 16"),
        (
            {
                "model": {"name": "m", "source": {"url": "https://x/m"}},
                "engine": {"kind": "sglang", "speculative": NGRAM},
            },
            "engine.speculative needs engine.kind servefleet or vllm",
        ),
        (
            {
                "model": {"name": "m", "source": {"url": "https://x/m"}},
                "engine": {"kind": "vllm", "speculative": {**NGRAM, "minAcceptanceRate": 0.2}},
            },
            "minAcceptanceRate is read by engine.kind servefleet only",
        ),
        (
            {"engine": {"speculative": {**NGRAM, "promptLookupMin": 6}}},
            "promptLookupMin must not exceed promptLookupMax",
        ),
        ({"engine": {"speculative": {**NGRAM, "method": "eagle"}}}, "Input should be 'ngram'"),
        (
            {"engine": {"speculative": {**NGRAM, "numSpeculativeTokens": 0}}},
            "greater than or equal",
        ),
        ({"scheduling": {"tolerations": [{"key": "k", "efect": "NoSchedule"}]}}, "efect"),
        ({"scheduling": {"tolerations": [{"operator": "Maybe"}]}}, "'Exists' or 'Equal'"),
        ({"scheduling": {"priorityClassName": "Not_A_Name"}}, "should match pattern"),
        (
            {"scheduling": {"topologySpreadConstraints": [{"maxSkew": 0, "topologyKey": "z"}]}},
            "whenUnsatisfiable",
        ),
        # Paths that would climb out of their volume, image or node folder.
        *[
            (
                {"model": {"name": "m", "source": {"pvc": {"claimName": "c", "path": path}}}},
                "model.source.pvc.path must be a path inside its volume",
            )
            for path in ("../../../etc", "llama/../../x", "/etc", "..")
        ],
        (
            {"model": {"name": "m", "source": {"oci": {"reference": "r/m:1", "path": "a/../.."}}}},
            "model.source.oci.path must be a path inside its volume",
        ),
        (
            {
                "model": {
                    "name": "m",
                    "source": {"url": "https://x/m.gguf"},
                    "cache": {"hostPath": {"path": "/var/cache/servefleet/../../../etc"}},
                }
            },
            "model.cache.hostPath.path must be an absolute folder without '..' segments",
        ),
        (
            {"model": {"name": "m", "source": {"s3": {"url": "s3://bucket/a/../../b/"}}}},
            "model.source.s3.url must not contain '..' segments",
        ),
        (
            {"model": {"name": "m", "source": {"url": "https://x/models/.."}}},
            "model.source.url must not contain '..' segments",
        ),
        (
            {
                "model": {
                    "name": "m",
                    "source": {"huggingface": {"repo": "a/b", "revision": "x/../y"}},
                }
            },
            "model.source.huggingface.revision must not contain '..' segments",
        ),
    ],
)
def test_invalid_specs_are_rejected_with_a_clear_message(
    spec_changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError) as err:
        LLMDeployment.model_validate(with_spec(**spec_changes))
    assert message in str(err.value)


def test_replicas_outside_the_pool_are_clamped_not_refused() -> None:
    """A GitOps re-apply lowering maxReplicas after a scale-up must validate (HPA clamps too)."""
    above = LLMDeployment.model_validate(
        with_spec(replicas=9, pool={"minReplicas": 1, "maxReplicas": 3})
    )
    assert above.spec.desired_replicas() == 3
    assert above.spec.replicas_limit() == "spec.replicas 9 is above pool.maxReplicas 3"
    below = LLMDeployment.model_validate(
        with_spec(replicas=1, pool={"minReplicas": 2, "maxReplicas": 3})
    )
    assert below.spec.desired_replicas() == 2
    assert below.spec.replicas_limit() == "spec.replicas 1 is below pool.minReplicas 2"
    inside = LLMDeployment.model_validate(
        with_spec(replicas=2, pool={"minReplicas": 1, "maxReplicas": 3})
    )
    assert inside.spec.replicas_limit() is None


def test_desired_replicas_follow_spec_replicas_within_bounds() -> None:
    dep = LLMDeployment.model_validate(
        with_spec(replicas=3, pool={"minReplicas": 1, "maxReplicas": 4})
    )
    assert dep.spec.desired_replicas() == 3
    zero = LLMDeployment.model_validate(with_spec(pool={"minReplicas": 0, "maxReplicas": 2}))
    assert zero.spec.desired_replicas() == 0


def test_kv_cache_memory_forms() -> None:
    for value in (1 << 30, "0.9", "4Gi", "512M"):
        LLMDeployment.model_validate(with_spec(engine={"kvCacheMemory": value}))
    with pytest.raises(ValidationError):
        LLMDeployment.model_validate(with_spec(engine={"kvCacheMemory": 0}))


def test_the_example_loads_with_its_demo_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    deps = load_llmdeployments(EXAMPLE)
    assert [d.name for d in deps] == ["smollm2"]
    dep = deps[0]
    assert dep.spec.model.source.builtin == "smollm2-135m-instruct"
    assert (dep.spec.pool.min_replicas, dep.spec.pool.max_replicas) == (1, 3)
    ref = dep.spec.tenants[0].api_key_secret_ref
    secrets = load_secrets(EXAMPLE)
    assert resolve_secret(ref, secrets, environ={}) == "sk-servefleet-demo-change-me"
    assert secret_env_name(ref) == "SERVEFLEET_SECRET_SMOLLM2_DEMO_KEY_API_KEY"
    assert resolve_secret(ref, secrets, environ={secret_env_name(ref): "from-env"}) == "from-env"


def test_loader_reports_document_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\ndata: {k: aGk=}\n---\n"
        "apiVersion: servefleet.io/v1alpha1\nkind: LLMDeployment\nmetadata: {name: x}\n"
        "spec:\n  model: {name: m, source: {builtin: smollm2-135m-instruct}}\n"
        "  pool: {minReplicas: 5, maxReplicas: 1}\n"
    )
    with pytest.raises(ManifestError) as err:
        load_llmdeployments(bad)
    text = str(err.value)
    assert "document 2 (LLMDeployment x)" in text
    assert "spec.pool: pool.minReplicas must be <= pool.maxReplicas" in text
    assert load_secrets(bad) == {("s", "k"): "hi"}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("a: [1,\n", "not valid YAML"),
        ("apiVersion: v1\nkind: Secret\nmetadata: {name: s}\n", "no LLMDeployment documents"),
        ("- 1\n- 2\n", "is not a mapping"),
        (
            "kind: LLMDeployment\napiVersion: servefleet.io/v9\n",
            "expected 'servefleet.io/v1alpha1'",
        ),
        ("just: text\n", "has no apiVersion/kind"),
    ],
)
def test_loader_rejects_bad_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(content)
    with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_llmdeployments(path)


def test_loader_rejects_duplicates_and_missing_files(tmp_path: Path) -> None:
    doc = (
        "apiVersion: servefleet.io/v1alpha1\nkind: LLMDeployment\nmetadata: {name: x}\n"
        "spec: {model: {name: m, source: {builtin: smollm2-135m-instruct}}}\n"
    )
    path = tmp_path / "twice.yaml"
    path.write_text(doc + "---\n" + doc)
    with pytest.raises(ManifestError, match="appears twice"):
        load_llmdeployments(path)
    with pytest.raises(ManifestError, match="cannot read"):
        load_llmdeployments(tmp_path / "missing.yaml")


def test_every_example_is_valid() -> None:
    files = sorted(EXAMPLE.parent.glob("*.yaml"))
    assert len(files) >= 2
    served = 0
    for path in files:
        deployments = {(d.namespace, d.name): d for d in load_llmdeployments(path)}
        for adapter in load_llmadapters(path):  # each on a deployment of its file with lora
            deployment = deployments[adapter.namespace, adapter.spec.deployment]
            assert deployment.spec.engine.lora is not None, path
            served += 1
    assert served  # examples/llmadapter.yaml


def test_gpus_per_replica_bound_tensor_parallelism() -> None:
    engine = {"kind": "vllm", "tensorParallelSize": 4}
    for resources in ({"limits": {"nvidia.com/gpu": 4}}, {"requests": {"nvidia.com/gpu": "8"}}):
        doc = with_spec(
            model={"name": "m", "source": {"url": "https://x/m"}},
            engine={**engine, "resources": resources},
        )
        assert LLMDeployment.model_validate(doc).spec.engine.tensor_parallel_size == 4


def test_scheduling_defaults_to_nothing_and_reads_pod_spelling() -> None:
    assert LLMDeployment.model_validate(minimal()).spec.scheduling.to_wire() == {
        "nodeSelector": {},
        "tolerations": [],
        "topologySpreadConstraints": [],
    }
    spread = {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}
    dep = LLMDeployment.model_validate(
        with_spec(scheduling={"topologySpreadConstraints": [spread]})
    )
    assert dep.spec.scheduling.topology_spread_constraints[0].to_wire() == {
        **spread,
        "matchLabelKeys": [],
    }


def test_paths_with_dots_that_do_not_climb_are_fine() -> None:
    source = {"pvc": {"claimName": "c", "path": "models/..hidden/v1..2/./x"}}
    dep = LLMDeployment.model_validate(with_spec(model={"name": "m", "source": source}))
    assert dep.spec.model.source.pvc is not None


def test_servefleet_splits_a_replica_over_ranks_without_gpus() -> None:
    """Our engine's tensor parallelism runs on CPU ranks too (gloo): no GPU bound."""
    doc = with_spec(engine={"tensorParallelSize": 3})
    assert LLMDeployment.model_validate(doc).spec.engine.tensor_parallel_size == 3
