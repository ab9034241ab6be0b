"""Credentials loaded by the official client's loaders (what `KubeAccess` describes)."""

from __future__ import annotations

import os
from pathlib import Path

from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.config import load_incluster_config, load_kube_config
from pydantic import BaseModel, ConfigDict, SecretStr

from .errors import KubeError


def explicit(server: str, token: SecretStr | None) -> Configuration:
    """A server URL used as is, with a bearer token if given."""
    config = Configuration(host=server.rstrip("/"))
    if token is not None:
        config.api_key["BearerToken"] = f"Bearer {token.get_secret_value()}"
    return config


async def from_kubeconfig(path: str, context: str | None) -> tuple[Configuration, str]:
    """Any kubeconfig the official loader reads: tokens, client certificates, exec plugins
    (EKS, GKE, AKS, OIDC helpers). An exec token with an expiry is fetched again when it runs
    out, before the request that would have failed with it."""
    if not any(Path(p).expanduser().exists() for p in path.split(os.pathsep) if p):
        raise KubeError(0, f"kubeconfig {path}: no such file")
    config = Configuration()
    loader = await load_kube_config(
        config_file=path, context=context, client_configuration=config, persist_config=False
    )
    if getattr(loader, "exec_plugin_expiry", None) is not None:

        async def refresh(configuration: Configuration) -> None:
            await loader.load_from_exec_plugin()  # runs the plugin only once expired
            configuration.api_key["BearerToken"] = loader.token

        config.refresh_api_key_hook = refresh
    current = loader.current_context or {}
    namespace = (current.get("context") or {}).get("namespace") or "default"
    return config, str(namespace)


def in_cluster(service_account_dir: Path) -> tuple[Configuration, str]:
    """The pod's ServiceAccount; the projected token rotates, so it is re-read every minute."""
    config = Configuration()
    load_incluster_config(
        client_configuration=config,
        token_filename=str(service_account_dir / "token"),
        cert_filename=str(service_account_dir / "ca.crt"),
    )
    namespace_file = service_account_dir / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.exists() else "default"
    return config, namespace or "default"


class Credentials(BaseModel):
    """The current credentials as plain values, for a second client such as kopf's."""

    model_config = ConfigDict(frozen=True)

    server: str
    token: SecretStr | None = None
    scheme: str | None = None
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    insecure: bool = False
    namespace: str = "default"


async def current_credentials(configuration: Configuration, namespace: str) -> Credentials:
    """Credentials as of now: the refresh hook (exec plugin, rotated token) runs first."""
    header = await configuration.get_api_key_with_prefix("BearerToken")
    scheme, _, token = (header or "").partition(" ")
    return Credentials(
        server=str(configuration.host),
        token=SecretStr(token) if token else None,
        scheme=scheme if token else None,
        ca_path=configuration.ssl_ca_cert,
        cert_path=configuration.cert_file,
        key_path=configuration.key_file,
        insecure=not configuration.verify_ssl,
        namespace=namespace,
    )
