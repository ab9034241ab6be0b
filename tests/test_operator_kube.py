"""Credential loading and request paths of the operator's small API client."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from servefleet.operator.kube import load_credentials, load_kubeconfig, resource_path


def write(path: Path, user: Mapping[str, object], cluster: Mapping[str, object]) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "c", "cluster": {"server": "https://k:6443/", **cluster}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [
                    {"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "team"}}
                ],
                "current-context": "x",
            }
        )
    )
    return path


def test_token_and_inline_ca(tmp_path: Path) -> None:
    ca = base64.b64encode(b"CA").decode()
    creds = load_kubeconfig(
        write(tmp_path / "k", {"token": "t"}, {"certificate-authority-data": ca})
    )
    assert (creds.server, creds.token, creds.ca_data, creds.namespace) == (
        "https://k:6443",
        "t",
        b"CA",
        "team",
    )
    assert not creds.insecure


def test_client_certificate_files_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    (tmp_path / "c.crt").write_bytes(b"CERT")
    (tmp_path / "c.key").write_bytes(b"KEY")
    user = {"client-certificate": "c.crt", "client-key": "c.key"}
    creds = load_kubeconfig(write(tmp_path / "k", user, {"insecure-skip-tls-verify": True}))
    assert (creds.cert_data, creds.key_data, creds.token, creds.insecure) == (
        b"CERT",
        b"KEY",
        None,
        True,
    )


def test_kubeconfig_env_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(write(tmp_path / "k", {"token": "env"}, {})))
    assert load_credentials().token == "env"


def test_missing_context_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_text(yaml.safe_dump({"current-context": "nope", "contexts": []}))
    with pytest.raises(ValueError, match="current-context 'nope' not found"):
        load_kubeconfig(path)


def test_resource_paths() -> None:
    assert resource_path("v1", "Service", "ns", "a") == "/api/v1/namespaces/ns/services/a"
    assert resource_path("apps/v1", "Deployment", "ns") == "/apis/apps/v1/namespaces/ns/deployments"
    assert (
        resource_path("servefleet.io/v1alpha1", "LLMDeployment", "ns", "m")
        == "/apis/servefleet.io/v1alpha1/namespaces/ns/llmdeployments/m"
    )
