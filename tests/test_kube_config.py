"""Credential loading of the Kubernetes client: kubeconfig contexts, exec plugins, in-cluster."""

from __future__ import annotations

import base64
import datetime as dt
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.config import incluster_config

from servefleet.kube import KubeAccess, KubeError


def write(
    path: Path,
    user: Mapping[str, object],
    cluster: Mapping[str, object],
    other_user: Mapping[str, object] | None = None,
) -> Path:
    config: dict[str, Any] = {
        "clusters": [{"name": "c", "cluster": {"server": "https://k:6443/", **cluster}}],
        "users": [{"name": "u", "user": user}, {"name": "o", "user": other_user or {}}],
        "contexts": [
            {"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "team"}},
            {"name": "y", "context": {"cluster": "c", "user": "o"}},
        ],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def test_token_inline_ca_and_the_context_namespace(tmp_path: Path) -> None:
    ca = base64.b64encode(b"CA").decode()
    path = write(tmp_path / "k", {"token": "t"}, {"certificate-authority-data": ca})
    config, namespace = await KubeAccess(kubeconfig=str(path)).configuration()
    assert (config.host, namespace) == ("https://k:6443", "team")
    assert config.api_key["BearerToken"] == "Bearer t"
    assert Path(config.ssl_ca_cert).read_bytes() == b"CA"
    assert config.verify_ssl


async def test_another_context_is_chosen_by_name(tmp_path: Path) -> None:
    path = write(tmp_path / "k", {"token": "t"}, {}, other_user={"token": "other"})
    config, namespace = await KubeAccess(kubeconfig=str(path), context="y").configuration()
    assert (config.api_key["BearerToken"], namespace) == ("Bearer other", "default")


async def test_client_certificate_files_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    (tmp_path / "c.crt").write_bytes(b"CERT")
    (tmp_path / "c.key").write_bytes(b"KEY")
    user = {"client-certificate": "c.crt", "client-key": "c.key"}
    path = write(tmp_path / "k", user, {"insecure-skip-tls-verify": True})
    config, _ = await KubeAccess(kubeconfig=str(path)).configuration()
    assert Path(config.cert_file).read_bytes() == b"CERT"
    assert Path(config.key_file).read_bytes() == b"KEY"
    assert "BearerToken" not in config.api_key and not config.verify_ssl


async def test_kubeconfig_env_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(write(tmp_path / "k", {"token": "env"}, {})))
    config, _ = await KubeAccess().configuration()
    assert config.api_key["BearerToken"] == "Bearer env"


def exec_plugin(tmp_path: Path, lifetime_s: float) -> dict[str, Any]:
    """A credential plugin (as EKS/GKE install) that counts its runs and hands out tok-N."""
    script = tmp_path / "plugin.py"
    script.write_text(
        "import datetime, json, pathlib, sys\n"
        f"runs = pathlib.Path({str(tmp_path / 'runs')!r})\n"
        "n = len(runs.read_text()) + 1 if runs.exists() else 1\n"
        "runs.write_text('x' * n)\n"
        "expiry = datetime.datetime.now(datetime.UTC) + "
        f"datetime.timedelta(seconds={lifetime_s})\n"
        "json.dump({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',"
        " 'status': {'token': f'tok-{n}',"
        " 'expirationTimestamp': expiry.strftime('%Y-%m-%dT%H:%M:%SZ')}}, sys.stdout)\n"
    )
    return {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(script)],
            "interactiveMode": "Never",
        }
    }


async def test_exec_plugin_token_is_fetched_again_once_expired(tmp_path: Path) -> None:
    path = write(tmp_path / "k", exec_plugin(tmp_path, lifetime_s=-60), {})
    kube = await KubeAccess(kubeconfig=str(path)).connect()
    try:
        first = await kube.credentials()
        second = await kube.credentials()
    finally:
        await kube.aclose()
    assert first.token is not None and second.token is not None
    assert (first.token.get_secret_value(), second.token.get_secret_value()) == ("tok-2", "tok-3")
    assert first.scheme == "Bearer"


async def test_exec_plugin_token_is_reused_while_valid(tmp_path: Path) -> None:
    path = write(tmp_path / "k", exec_plugin(tmp_path, lifetime_s=3600), {})
    kube = await KubeAccess(kubeconfig=str(path)).connect()
    try:
        tokens = [(await kube.credentials()).token for _ in range(3)]
    finally:
        await kube.aclose()
    assert {t.get_secret_value() for t in tokens if t} == {"tok-1"}
    assert (tmp_path / "runs").read_text() == "x"


def service_account(tmp_path: Path, token: str) -> Path:
    sa = tmp_path / "sa"
    sa.mkdir(exist_ok=True)
    (sa / "token").write_text(token)
    (sa / "ca.crt").write_text("CA")
    (sa / "namespace").write_text("servefleet\n")
    return sa


async def test_in_cluster_token_is_read_again_after_rotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", dt.timedelta(0))
    sa = service_account(tmp_path, "old")
    config, namespace = await KubeAccess(service_account_dir=sa).configuration()
    assert (config.host, namespace) == ("https://10.0.0.1:443", "servefleet")
    assert await config.get_api_key_with_prefix("BearerToken") == "Bearer old"
    (sa / "token").write_text("rotated")
    assert await config.get_api_key_with_prefix("BearerToken") == "Bearer rotated"


async def test_no_credentials_anywhere_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(KubeError, match=r"\$KUBECONFIG unset, not in a pod"):
        await KubeAccess().configuration()
    with pytest.raises(KubeError, match="missing: no such file"):
        await KubeAccess(kubeconfig=str(tmp_path / "missing")).configuration()


def test_explicit_server_and_token() -> None:
    access = KubeAccess(server="http://127.0.0.1:1/", token="s3cret")  # type: ignore[arg-type]
    assert "s3cret" not in repr(access)  # the token is a secret: never in logs
    assert json.loads(access.model_dump_json())["server"] == "http://127.0.0.1:1/"
