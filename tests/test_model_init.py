"""Model sources in the CR, the pod parts rendered for each, and the ModelLoading
condition read back from the fetch init container's real log lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from servefleet.api.crd import crd_manifest
from servefleet.api.fetch_progress import FETCH_CONTAINER, FetchProgress, last_report, parse_line
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.model_source import ModelSource
from servefleet.operator import render
from servefleet.operator.model_loading import fetching_pods, model_loading
from servefleet.operator.status import Observed, compute_status, transition_events

SETTINGS = render.RenderSettings(
    engine_image="servefleet:test",
    gateway_url="http://gw:8080",
    route_signing_key=b"route-signing-key-for-tests",
    host_path_prefixes=("/var/cache",),
)
HF = {
    "huggingface": {
        "repo": "acme/llama",
        "revision": "v1",
        "tokenSecretRef": {"name": "hf", "key": "token"},
    }
}
S3 = {
    "s3": {
        "url": "s3://models/llama/",
        "endpoint": "http://minio:9000",
        "credentialsSecret": "s3-creds",
    }
}


def make(
    source: dict[str, Any], cache: dict[str, Any] | None = None, kind: str = "vllm"
) -> LLMDeployment:
    model: dict[str, Any] = {"name": "m", "source": source}
    if cache is not None:
        model["cache"] = cache
    return LLMDeployment.model_validate(
        {
            "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 2},
            "spec": {"model": model, "engine": {"kind": kind}},
        }
    )


def pod_spec(dep: LLMDeployment) -> dict[str, Any]:
    result: dict[str, Any] = render.engine_pod_template(dep, SETTINGS)["spec"]
    return result


def engine_model_arg(spec: dict[str, Any]) -> str:
    args: list[str] = spec["containers"][0]["args"]
    return args[args.index("--model") + 1]


# --------------------------------------------------------------------------- the spec


def test_exactly_one_source_and_a_cache_only_for_downloads() -> None:
    with pytest.raises(ValidationError, match="exactly one of builtin, pvc, url"):
        ModelSource.model_validate({**HF, **S3})
    with pytest.raises(ValidationError, match=r"model\.cache applies only"):
        make({"pvc": {"claimName": "c"}}, cache={"pvc": {"claimName": "cache"}})
    with pytest.raises(ValidationError, match="exactly one of pvc or hostPath"):
        make(HF, cache={})
    rules = json.dumps(crd_manifest())
    assert "has(self.huggingface)" in rules and "!has(self.cache) ||" in rules


def test_cache_entries_are_distinct_stable_and_free_of_secrets() -> None:
    a = ModelSource.model_validate(HF)
    other_token = ModelSource.model_validate(
        {"huggingface": {**HF["huggingface"], "tokenSecretRef": {"name": "x", "key": "y"}}}
    )
    other_revision = ModelSource.model_validate(
        {"huggingface": {**HF["huggingface"], "revision": "v2"}}
    )
    assert a.cache_entry() == other_token.cache_entry()  # the token is not the content
    assert a.cache_entry() != other_revision.cache_entry()
    assert a.cache_entry().startswith("huggingface--acme-llama-v1--")
    single = ModelSource.model_validate({"s3": {"url": "s3://models/gguf/m.gguf"}})
    assert single.fetched_path() == f"{single.cache_entry()}/m.gguf"
    folder = ModelSource.model_validate(S3)
    assert folder.fetched_path() == folder.cache_entry()


def test_progress_lines_round_trip() -> None:
    report = FetchProgress(state="progress", done_bytes=5, total_bytes=None, message="5 B so far")
    assert parse_line(report.line()) == report
    failed = FetchProgress(state="failed", message="HTTP 401 for x\n(check the Secret)")
    assert parse_line(failed.line()) == failed.model_copy(
        update={"message": "HTTP 401 for x (check the Secret)"}
    )
    assert last_report(f"noise\n{report.line()}\nmore noise\n") == report
    assert parse_line("model fetch progressing: nothing") is None


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize(
    ("cache", "volume"),
    [
        (None, {"name": "model", "emptyDir": {}}),
        (
            {"pvc": {"claimName": "cache"}},
            {"name": "model", "persistentVolumeClaim": {"claimName": "cache"}},
        ),
        (
            {"hostPath": {"path": "/var/cache/models"}},
            # The admin's allowed prefix (made by the admin: Directory), "models" a subPath.
            {"name": "model", "hostPath": {"path": "/var/cache", "type": "Directory"}},
        ),
    ],
)
def test_huggingface_source_fetches_into_the_cache(
    cache: dict[str, Any] | None, volume: dict[str, Any]
) -> None:
    dep = make(HF, cache)
    spec = pod_spec(dep)
    assert spec["volumes"][0] == volume
    (fetch,) = spec["initContainers"]
    assert fetch["name"] == FETCH_CONTAINER
    assert fetch["image"] == "servefleet:test"  # our image fetches, also for vLLM pods
    assert fetch["command"] == ["servefleet", "model", "fetch"]
    source = json.loads(fetch["args"][fetch["args"].index("--source") + 1])
    assert ModelSource.model_validate(source) == dep.spec.model.source
    assert fetch["args"][-2:] == ["--cache", "/models"]
    sub_path = {"subPath": "models"} if cache and "hostPath" in cache else {}
    assert {"name": "model", "mountPath": "/models", **sub_path} in fetch["volumeMounts"]
    token = next(e for e in fetch["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    engine = spec["containers"][0]
    read_only = {"name": "model", "mountPath": "/models", "readOnly": True, **sub_path}
    assert read_only in engine["volumeMounts"]
    assert engine_model_arg(spec) == f"/models/{dep.spec.model.source.fetched_path()}"
    if cache and "pvc" in cache:
        assert spec["securityContext"]["fsGroup"] == 10001


def test_s3_credentials_come_from_the_secret_and_url_keeps_its_file_name() -> None:
    (fetch,) = pod_spec(make(S3))["initContainers"]
    assert fetch["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert not any("AWS" in e["name"] for e in fetch["env"])
    spec = pod_spec(make({"url": "https://example.com/w/model.Q4_1.gguf?x=1"}, kind="servefleet"))
    assert engine_model_arg(spec).endswith("/model.Q4_1.gguf")
    assert "HF_TOKEN" not in json.dumps(spec)


def test_oci_image_is_a_read_only_image_volume_without_a_fetch() -> None:
    source = {"oci": {"reference": "registry.example/models/llama:1", "path": "weights"}}
    spec = pod_spec(make(source))
    assert spec["volumes"][0] == {
        "name": "model",
        "image": {"reference": "registry.example/models/llama:1", "pullPolicy": "IfNotPresent"},
    }
    assert "initContainers" not in spec
    assert engine_model_arg(spec) == "/models/weights"


# --------------------------------------------------------------------------- ModelLoading


def pod(name: str, **state: dict[str, Any]) -> dict[str, Any]:
    status = {"name": FETCH_CONTAINER, "state": state}
    return {"metadata": {"name": name}, "status": {"initContainerStatuses": [status]}}


def lines_of(*reports: FetchProgress) -> str:
    return "\n".join(r.line() for r in reports) + "\n"


PROGRESS = FetchProgress(state="progress", done_bytes=3 << 30, total_bytes=12 << 30)
FAILED = FetchProgress(
    state="failed",
    message="acme/llama@v1: repository not found or not accessible with the given token "
    "(HTTP 401); next try in 300s",
)


def test_model_loading_reports_bytes_then_done() -> None:
    pods = [pod("a", running={}), pod("b", waiting={"reason": "PodInitializing"})]
    assert fetching_pods(pods) == ["a"]
    status, reason, message = model_loading(pods, {"a": lines_of(PROGRESS)})
    assert (status, reason) == (True, "Downloading")
    assert "3.0 GiB of 12.0 GiB (25%)" in message and f"{3 << 30}/{12 << 30} bytes" in message
    assert model_loading([pod("b", waiting={"reason": "PodInitializing"})], {})[:2] == (
        True,
        "Pending",
    )
    done = [pod("a", terminated={"exitCode": 0}), pod("b", terminated={"exitCode": 0})]
    assert model_loading(done, {})[:2] == (False, "Downloaded")
    assert model_loading([], {})[:2] == (False, "NoReplicas")


@pytest.mark.parametrize(
    ("state", "log", "cause"),
    [
        ({"running": {}}, lines_of(PROGRESS, FAILED), "not accessible with the given token"),
        (
            {
                "waiting": {
                    "reason": "CreateContainerConfigError",
                    "message": 'secret "hf" not found',
                }
            },
            "",
            'secret "hf" not found',
        ),
    ],
)
def test_a_failed_download_is_a_clear_reason(state: dict[str, Any], log: str, cause: str) -> None:
    status, reason, message = model_loading([pod("a", **state)], {"a": log})
    assert (status, reason) == (False, "DownloadFailed")
    assert message.startswith("pod a: ") and cause in message


def test_status_carries_model_loading_and_warns_once_on_failure() -> None:
    dep = make(HF)
    observed = Observed(None, pods=[pod("a", running={})], fetch_logs={"a": lines_of(PROGRESS)})
    loading = compute_status(dep, observed, "http://gw/v1", "2025-01-01T00:00:00Z")
    condition = loading.condition("ModelLoading")
    assert condition is not None and (condition.status, condition.reason) == ("True", "Downloading")
    dep.status = loading
    failed = compute_status(
        dep,
        Observed(None, pods=[pod("a", running={})], fetch_logs={"a": lines_of(FAILED)}),
        "http://gw/v1",
        "2025-01-01T00:01:00Z",
    )
    events = transition_events(loading, failed)
    assert [(e.type, e.reason) for e in events] == [("Warning", "DownloadFailed")]
    dep.status = failed
    unread = compute_status(dep, Observed(None), "http://gw/v1", "2025-01-01T00:02:00Z")
    assert unread.condition("ModelLoading") == failed.condition("ModelLoading")  # kept
    builtin = make({"builtin": "smollm2-135m-instruct"}, kind="servefleet")
    no_download = compute_status(builtin, Observed(None), "http://gw/v1", "2025-01-01T00:03:00Z")
    assert no_download.condition("ModelLoading") is None


def test_loading_is_read_from_what_the_fetcher_really_logs(tmp_path: Path) -> None:
    """The fetcher's own lines (not hand-written ones) drive the condition."""
    from servefleet.engine.fetch.progress import ProgressLog

    folder = tmp_path / "partial"
    folder.mkdir()
    (folder / "part").write_bytes(bytes(1000))
    logged: list[str] = []
    ProgressLog(folder, 4000, logged.append, interval=60).report()
    status, reason, message = model_loading([pod("a", running={})], {"a": "\n".join(logged)})
    assert (status, reason) == (True, "Downloading") and "1000/4000 bytes" in message


def test_the_huggingface_example_renders_a_cached_fetch() -> None:
    from servefleet.api.manifests import load_llmdeployments

    root = Path(__file__).resolve().parents[1]
    (dep,) = load_llmdeployments(root / "examples" / "llmdeployment-huggingface.yaml")
    dep.metadata.uid = "u"
    spec = pod_spec(dep)
    assert spec["volumes"][0]["persistentVolumeClaim"] == {"claimName": "model-cache"}
    assert [c["name"] for c in spec["initContainers"]] == [FETCH_CONTAINER]
    assert engine_model_arg(spec).startswith("/models/huggingface--Qwen-Qwen2.5-7B-Instruct-main")
