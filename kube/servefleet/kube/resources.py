"""The kinds servefleet reads or writes, and their URL paths.

A resource is named once here (API version, kind, plural) instead of as path fragments in
each component; the facade builds every URL from these.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from servefleet.api.llmadapter import ADAPTER_KIND, ADAPTER_PLURAL
from servefleet.api.llmdeployment import FULL_API_VERSION, KIND, PLURAL

from .errors import KubeError


class Resource(BaseModel):
    """One API resource: `apiVersion`, `kind` and the plural used in its URLs."""

    model_config = ConfigDict(frozen=True)

    api_version: str
    kind: str
    plural: str

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """`/api/v1/namespaces/ns/pods/p/status` and the like; no namespace: cluster-wide."""
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = root + (f"/namespaces/{namespace}" if namespace else "") + f"/{self.plural}"
        if name:
            path += f"/{name}"
        return path + (f"/{subresource}" if subresource else "")


CONFIG_MAPS = Resource(api_version="v1", kind="ConfigMap", plural="configmaps")
SECRETS = Resource(api_version="v1", kind="Secret", plural="secrets")
SERVICES = Resource(api_version="v1", kind="Service", plural="services")
PODS = Resource(api_version="v1", kind="Pod", plural="pods")
EVENTS = Resource(api_version="v1", kind="Event", plural="events")
DEPLOYMENTS = Resource(api_version="apps/v1", kind="Deployment", plural="deployments")
ENDPOINT_SLICES = Resource(
    api_version="discovery.k8s.io/v1", kind="EndpointSlice", plural="endpointslices"
)
POD_DISRUPTION_BUDGETS = Resource(
    api_version="policy/v1", kind="PodDisruptionBudget", plural="poddisruptionbudgets"
)
NETWORK_POLICIES = Resource(
    api_version="networking.k8s.io/v1", kind="NetworkPolicy", plural="networkpolicies"
)
SERVICE_MONITORS = Resource(
    api_version="monitoring.coreos.com/v1", kind="ServiceMonitor", plural="servicemonitors"
)
LEADER_WORKER_SETS = Resource(
    api_version="leaderworkerset.x-k8s.io/v1", kind="LeaderWorkerSet", plural="leaderworkersets"
)
LLM_DEPLOYMENTS = Resource(api_version=FULL_API_VERSION, kind=KIND, plural=PLURAL)
LLM_ADAPTERS = Resource(api_version=FULL_API_VERSION, kind=ADAPTER_KIND, plural=ADAPTER_PLURAL)

KNOWN: dict[tuple[str, str], Resource] = {
    (r.api_version, r.kind): r
    for r in (
        CONFIG_MAPS,
        SECRETS,
        SERVICES,
        PODS,
        EVENTS,
        DEPLOYMENTS,
        ENDPOINT_SLICES,
        POD_DISRUPTION_BUDGETS,
        NETWORK_POLICIES,
        SERVICE_MONITORS,
        LEADER_WORKER_SETS,
        LLM_DEPLOYMENTS,
        LLM_ADAPTERS,
    )
}


def resource_of(obj: dict[str, object]) -> Resource:
    """The resource of a manifest, from its `apiVersion` and `kind`."""
    key = (str(obj.get("apiVersion")), str(obj.get("kind")))
    if key not in KNOWN:
        raise KubeError(0, f"no resource known for apiVersion {key[0]!r} kind {key[1]!r}")
    return KNOWN[key]
