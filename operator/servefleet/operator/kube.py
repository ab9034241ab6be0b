"""A small async Kubernetes client: server-side apply, get, status patches, discovery.

kopf watches and dispatches; it has no server-side apply. Rather than a second
heavy client library, this speaks the few REST calls we need over httpx, with the
same credentials kopf logs in with (kubeconfig, or the pod's ServiceAccount).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

# kind -> (api prefix, plural); the only kinds the operator touches.
RESOURCES: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
    ("servefleet.io/v1alpha1", "LLMDeployment"): "llmdeployments",
}


class KubeError(RuntimeError):
    """An API call that failed; carries the HTTP status and the server's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Credentials:
    server: str
    token: str | None = None
    ca_data: bytes | None = None
    cert_data: bytes | None = None
    key_data: bytes | None = None
    insecure: bool = False
    namespace: str = "default"


def _file_or_data(entry: dict[str, Any], key: str, base: Path) -> bytes | None:
    if data := entry.get(f"{key}-data"):
        return base64.b64decode(data)
    if path := entry.get(key):
        return (base / path).read_bytes()
    return None


def load_kubeconfig(path: str | os.PathLike[str]) -> Credentials:
    """Credentials of the current context of a kubeconfig file."""
    file = Path(path).expanduser()
    config = yaml.safe_load(file.read_text()) or {}
    base = file.parent
    context_name = config.get("current-context")
    contexts = {c["name"]: c["context"] for c in config.get("contexts", [])}
    if context_name not in contexts:
        raise ValueError(f"{file}: current-context {context_name!r} not found")
    context = contexts[context_name]
    cluster = {c["name"]: c["cluster"] for c in config.get("clusters", [])}[context["cluster"]]
    user = {u["name"]: u["user"] for u in config.get("users", [])}.get(context.get("user", ""), {})
    token = user.get("token")
    if token is None and user.get("tokenFile"):
        token = (base / user["tokenFile"]).read_text().strip()
    return Credentials(
        server=cluster["server"].rstrip("/"),
        token=token,
        ca_data=_file_or_data(cluster, "certificate-authority", base),
        cert_data=_file_or_data(user, "client-certificate", base),
        key_data=_file_or_data(user, "client-key", base),
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        namespace=context.get("namespace", "default"),
    )


def load_in_cluster() -> Credentials:
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    return Credentials(
        server=f"https://{host}:{port}",
        token=(SA_DIR / "token").read_text().strip(),
        ca_data=(SA_DIR / "ca.crt").read_bytes(),
        namespace=(SA_DIR / "namespace").read_text().strip(),
    )


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """--kubeconfig, else $KUBECONFIG, else in-cluster, else ~/.kube/config."""
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        return load_kubeconfig(path.split(os.pathsep)[0])
    if "KUBERNETES_SERVICE_HOST" in os.environ and (SA_DIR / "token").exists():
        return load_in_cluster()
    return load_kubeconfig(Path.home() / ".kube" / "config")


def _ssl_context(creds: Credentials) -> ssl.SSLContext | bool:
    if creds.insecure:
        return False
    ctx = ssl.create_default_context(cadata=creds.ca_data.decode() if creds.ca_data else None)
    if creds.cert_data and creds.key_data:
        # ssl can only load a client certificate from files: write them privately, briefly.
        with tempfile.TemporaryDirectory() as tmp:
            cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
            cert.write_bytes(creds.cert_data)
            key.write_bytes(creds.key_data)
            os.chmod(key, 0o600)
            ctx.load_cert_chain(cert, key)
    return ctx


def resource_path(
    api_version: str, kind: str, namespace: str | None, name: str | None = None
) -> str:
    plural = RESOURCES[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    return path + (f"/{name}" if name else "")


class KubeClient:
    """The handful of calls the operator makes, as one pooled HTTP client."""

    def __init__(self, creds: Credentials, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {creds.token}"} if creds.token else {}
        self._http = httpx.AsyncClient(
            base_url=creds.server, headers=headers, verify=_ssl_context(creds), timeout=timeout
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = await self._http.request(method, path, **kwargs)
        if response.status_code >= 400 and response.status_code != 404:
            try:
                message = response.json().get("message", response.text)
            except (json.JSONDecodeError, AttributeError):
                message = response.text
            raise KubeError(response.status_code, message)
        return response

    async def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply (force: this manager owns every field it sets)."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        response = await self._call(
            "PATCH",
            path,
            params={"fieldManager": field_manager, "force": "true"},
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        if response.status_code == 404:
            raise KubeError(404, f"{obj['kind']} API not found at {path}")
        result: dict[str, Any] = response.json()
        return result

    async def get(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        response = await self._call("GET", resource_path(api_version, kind, namespace, name))
        if response.status_code == 404:
            return None
        result: dict[str, Any] = response.json()
        return result

    async def list(
        self, api_version: str, kind: str, namespace: str | None
    ) -> list[dict[str, Any]]:
        """All objects of a kind (namespace None: across the cluster), following pagination."""
        items: list[dict[str, Any]] = []
        params: dict[str, str] = {"limit": "500"}
        while True:
            response = await self._call(
                "GET", resource_path(api_version, kind, namespace), params=params
            )
            if response.status_code == 404:
                return items
            page = response.json()
            items += page.get("items", [])
            token = page.get("metadata", {}).get("continue")
            if not token:
                return items
            params["continue"] = token

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any] | None:
        response = await self._call(
            "PATCH",
            resource_path(api_version, kind, namespace, name) + "/status",
            content=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if response.status_code == 404:
            return None
        result: dict[str, Any] = response.json()
        return result

    async def has_api(self, group_version: str, plural: str) -> bool:
        """Whether the cluster serves a resource (ServiceMonitor: only with Prometheus Operator)."""
        response = await self._call("GET", f"/apis/{group_version}")
        if response.status_code == 404:
            return False
        return any(r.get("name") == plural for r in response.json().get("resources", []))
