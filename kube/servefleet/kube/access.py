"""Where the API server is and who we are to it: a plain description, cheap to build.

`KubeAccess` can be made anywhere (a command line, a test, a config); `connect()` loads the
credentials with the official client's loaders and returns a client, inside the event loop
that will use it, because the client's HTTP session belongs to one loop. Nothing here
imports the generated client, so a component that never talks to Kubernetes (local mode,
a gateway with static replicas) does not pay for importing it.

Lookup order without an explicit kubeconfig: `$KUBECONFIG` (a list of files, merged), the
pod's ServiceAccount, `~/.kube/config` — what kubectl and kopf do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from .errors import KubeError

if TYPE_CHECKING:
    from kubernetes_asyncio.client import Configuration

    from .client import KubeClient

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = Path("~/.kube/config")


class KubeAccess(BaseModel):
    """How to reach the API server: a kubeconfig (and context), a server URL, or the default."""

    model_config = ConfigDict(frozen=True)

    kubeconfig: str | None = Field(
        default=None, description="kubeconfig file(s), os.pathsep-separated; None: the default"
    )
    context: str | None = Field(default=None, description="kubeconfig context; None: current")
    server: str | None = Field(
        default=None, description="API server URL used as is (a proxy, a test server)"
    )
    token: SecretStr | None = Field(default=None, description="bearer token for `server`")
    service_account_dir: Path = SERVICE_ACCOUNT_DIR

    async def configuration(self) -> tuple[Configuration, str]:
        """The generated client's Configuration and the default namespace."""
        from kubernetes_asyncio.config import ConfigException

        from .config import explicit, from_kubeconfig, in_cluster

        try:
            if self.server is not None:
                return explicit(str(self.server), self.token), "default"
            path = self.kubeconfig or os.environ.get("KUBECONFIG")
            if path:
                return await from_kubeconfig(path, self.context)
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                return in_cluster(self.service_account_dir)
            default = DEFAULT_KUBECONFIG.expanduser()
            if not default.exists():
                raise KubeError(
                    0,
                    "no Kubernetes credentials: no kubeconfig given, $KUBECONFIG unset, not in a "
                    f"pod (KUBERNETES_SERVICE_HOST unset) and no {default}",
                )
            return await from_kubeconfig(str(default), self.context)
        except (ConfigException, OSError, KeyError, AssertionError) as exc:
            raise KubeError(0, f"no usable Kubernetes credentials: {exc}") from exc

    async def connect(self) -> KubeClient:
        """A `KubeClient` on these credentials (call inside the loop that will use it)."""
        from .client import KubeClient

        configuration, namespace = await self.configuration()
        return KubeClient(configuration, namespace)
