"""Names that pass between components: labels, annotation keys, mounts, route keys, managers.

The operator writes these and the gateway, the autoscaler and the tests read them; a name
spelled in two places drifts, so each lives here once and everyone imports it.
"""

from __future__ import annotations

from servefleet.api.llmdeployment import API_GROUP

# --------------------------------------------------------------------------- our labels

LABEL_DEPLOYMENT = f"{API_GROUP}/llmdeployment"
"""On every child object: the name of the LLMDeployment that owns it."""
LABEL_COMPONENT = f"{API_GROUP}/component"
"""What a child object is: COMPONENT_ENGINE or COMPONENT_GATEWAY_ROUTE."""
LABEL_ENGINE = f"{API_GROUP}/engine"
"""On engine pods: the engine kind (servefleet, vllm, sglang)."""
LABEL_GATEWAY_ROUTE = f"{API_GROUP}/gateway-route"
"""'true' on the route ConfigMaps the gateway watches."""
ANNOTATION_ROUTE_SIGNATURE = f"{API_GROUP}/route-signature"
"""On a route ConfigMap: the operator's HMAC of it (`servefleet.api.route_signature`); the
gateway serves no route without a valid one."""

COMPONENT_ENGINE = "engine"
COMPONENT_PREFILL_ENGINE = "prefill-engine"
"""The prefill pool's pods (`servefleet.api.disaggregation`): a component of their own, so the
decode pool's selector, Service and scale subresource never count them."""
COMPONENT_GATEWAY_ROUTE = "gateway-route"

# --------------------------------------------------------------------------- Kubernetes' labels

LABEL_APP_NAME = "app.kubernetes.io/name"
LABEL_APP_INSTANCE = "app.kubernetes.io/instance"
LABEL_APP_PART_OF = "app.kubernetes.io/part-of"
LABEL_APP_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_APP_COMPONENT = "app.kubernetes.io/component"
"""On the chart's pods: which component (CHART_COMPONENT_GATEWAY, CHART_COMPONENT_AUTOSCALER)."""
CHART_COMPONENT_GATEWAY = "gateway"
GATEWAY_INTERNAL_PORT_NAME = "internal"
"""Named port of the gateway's /metrics and /internal/* (the autoscaler and Prometheus use it)."""
INTERNAL_API_KEY_ENV = "SERVEFLEET_INTERNAL_API_KEY"
"""Environment variable holding the gateway's internal API key (gateway and autoscaler), where
no `--internal-api-key-file` is given."""
CHART_COMPONENT_AUTOSCALER = "autoscaler"
PART_OF = "servefleet"
ENGINE_APP_NAME = "servefleet-engine"

LABEL_SERVICE_NAME = "kubernetes.io/service-name"
"""Set by Kubernetes on an EndpointSlice: the Service it belongs to."""
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"
"""Set by the API server on every Namespace (its name; nobody else can set it): what
NetworkPolicies select a namespace by."""
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
"""The ReplicaSet controller removes the pod with the lowest cost first on scale-down."""

# --------------------------------------------------------------------------- field managers

FIELD_MANAGER_OPERATOR = "servefleet-operator"
"""Server-side apply owner of the operator's children (also their managed-by label)."""
FIELD_MANAGER_AUTOSCALER = "servefleet-autoscaler"
"""Owner of the autoscaler's writes (scale, status) and source of its Events."""

# --------------------------------------------------------------------------- route ConfigMaps

ROUTE_LABEL_SELECTOR = f"{LABEL_GATEWAY_ROUTE}=true"
ROUTE_GATEWAY_KEY = "gateway.yaml"
"""ConfigMap key of the deployment's GatewayConfig fragment."""


def route_scoped(namespace: str, name: str) -> str:
    """How the gateway names a route's tenants and deployments (and how they appear in its
    metrics, stats and logs, and in the autoscaler's): `<namespace>/<name>`. A route's names
    are visible only inside its own namespace, so no other namespace can take them."""
    return f"{namespace}/{name}"


# --------------------------------------------------------------------------- pods

ENGINE_CONTAINER = "engine"
ENGINE_PORT_NAME = "http"
"""Named container port of the engine: probes, the Service and the autoscaler use it."""
MODEL_VOLUME = "model"
MODEL_MOUNT = "/models"
SHM_VOLUME = "dshm"
SHM_MOUNT = "/dev/shm"
SECRETS_MOUNT = "/etc/servefleet/secrets"
"""Where tenant and spill-over Secret keys are referenced: <this>/<namespace>/<secret>/<key>."""
SCRATCH_VOLUME = "scratch"
SCRATCH_MOUNT = "/tmp"
"""The engine pods' writable emptyDir (their root filesystems are read-only): HOME, caches,
temporary files."""
ENGINE_USER = 10001
"""The user every engine-pod container runs as (our images' user; vLLM's and SGLang's run
as it too, with HOME in the scratch volume)."""


def engine_object_name(deployment: str) -> str:
    """Name of the engine Deployment, Service, PodDisruptionBudget and ServiceMonitor."""
    return f"{deployment}-engine"


def engine_key_secret_name(deployment: str) -> str:
    """Name of the Secret the operator creates with the engine API key (when the spec names
    none); its key is ENGINE_KEY_SECRET_KEY."""
    return f"{deployment}-engine-key"


ENGINE_KEY_SECRET_KEY = "api-key"


def route_object_name(deployment: str) -> str:
    """Name of the deployment's route ConfigMap."""
    return f"{deployment}-gateway-route"


def engine_selector(deployment: str) -> dict[str, str]:
    """Labels selecting one deployment's engine pods."""
    return {LABEL_DEPLOYMENT: deployment, LABEL_COMPONENT: COMPONENT_ENGINE}


def prefill_selector(deployment: str) -> dict[str, str]:
    """Labels selecting one deployment's prefill engine pods (disaggregated P/D)."""
    return {LABEL_DEPLOYMENT: deployment, LABEL_COMPONENT: COMPONENT_PREFILL_ENGINE}


def label_selector(labels: dict[str, str]) -> str:
    """A label selector as text (sorted, so it is stable), as in status.selector."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
