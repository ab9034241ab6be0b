"""Pure functions: an LLMDeployment in, the child objects it needs out (plain dicts).

No I/O here, so every child is unit- and snapshot-tested, and the handlers only
apply what these return. The engine workload is a Deployment (see README: rolling
updates with maxUnavailable 0 keep the warm minimum ready, and the ReplicaSet
controller honours `controller.kubernetes.io/pod-deletion-cost`, which is how the
autoscaler makes the idlest replica the one removed on scale-down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from servefleet.api.conventions import (
    COMPONENT_ENGINE,
    COMPONENT_GATEWAY_ROUTE,
    ENGINE_APP_NAME,
    ENGINE_CONTAINER,
    ENGINE_PORT_NAME,
    FIELD_MANAGER_OPERATOR,
    LABEL_APP_INSTANCE,
    LABEL_APP_MANAGED_BY,
    LABEL_APP_NAME,
    LABEL_APP_PART_OF,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_ENGINE,
    LABEL_GATEWAY_ROUTE,
    PART_OF,
    ROUTE_GATEWAY_KEY,
    SECRETS_MOUNT,
    SHM_MOUNT,
    SHM_VOLUME,
    engine_key_secret_name,
    engine_object_name,
    engine_selector,
    label_selector,
    route_object_name,
)
from servefleet.api.engines import EngineAdapter, engine_adapter
from servefleet.api.gateway_config import MountedSecretKeys, ServiceRef, render_gateway_config
from servefleet.api.llmdeployment import FULL_API_VERSION, KIND, LLMDeployment
from servefleet.operator.isolation import (
    CONTAINER_SECURITY,
    engine_key_env,
    engine_key_ref,
    engine_key_secret,
    network_policy,
    pod_security,
)
from servefleet.operator.model_init import model_location
from servefleet.operator.placement import placement

PROBE_PERIOD_SECONDS = 5
# Time between SIGKILL and the end of the engine's own drain, for the process to exit.
EXIT_GRACE_SECONDS = 10


@dataclass(frozen=True)
class RenderSettings:
    """Cluster-wide choices the chart passes to the operator."""

    engine_image: str
    gateway_url: str
    image_pull_policy: str = "IfNotPresent"


def engine_name(dep: LLMDeployment) -> str:
    return engine_object_name(dep.name)


def route_name(dep: LLMDeployment) -> str:
    return route_object_name(dep.name)


def selector_labels(dep: LLMDeployment) -> dict[str, str]:
    return engine_selector(dep.name)


def selector_string(dep: LLMDeployment) -> str:
    """The engine pods' selector as text, for status.selector (the scale subresource)."""
    return label_selector(selector_labels(dep))


def common_labels(dep: LLMDeployment) -> dict[str, str]:
    return {
        LABEL_APP_NAME: ENGINE_APP_NAME,
        LABEL_APP_INSTANCE: dep.name,
        LABEL_APP_PART_OF: PART_OF,
        LABEL_APP_MANAGED_BY: FIELD_MANAGER_OPERATOR,
        LABEL_DEPLOYMENT: dep.name,
    }


def owner_reference(dep: LLMDeployment) -> dict[str, Any]:
    if not dep.metadata.uid:
        raise ValueError(
            f"{KIND} {dep.namespace}/{dep.name} has no uid; read it from the API server"
        )
    return {
        "apiVersion": FULL_API_VERSION,
        "kind": KIND,
        "name": dep.name,
        "uid": dep.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(
    dep: LLMDeployment, name: str, extra_labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": dep.namespace,
        "labels": {**common_labels(dep), **(extra_labels or {})},
        "ownerReferences": [owner_reference(dep)],
    }


# --------------------------------------------------------------------------- engine pods


def _env(dep: LLMDeployment) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for var in dep.spec.engine.env:
        if var.secret_key_ref is not None:
            ref = var.secret_key_ref
            out.append(
                {
                    "name": var.name,
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
                }
            )
        else:
            out.append({"name": var.name, "value": var.value or ""})
    return out


def _resources(dep: LLMDeployment) -> dict[str, Any]:
    res = dep.spec.engine.resources
    out: dict[str, Any] = {}
    if res.requests:
        out["requests"] = {k: str(v) for k, v in sorted(res.requests.items())}
    if res.limits:
        out["limits"] = {k: str(v) for k, v in sorted(res.limits.items())}
    return out


def _probes(adapter: EngineAdapter, startup_timeout: int) -> dict[str, Any]:
    def http(path: str) -> dict[str, Any]:
        return {"path": path, "port": ENGINE_PORT_NAME}

    return {
        # Slow model loads get the whole startupTimeoutSeconds before liveness counts.
        "startupProbe": {
            "httpGet": http(adapter.live_path),
            "periodSeconds": PROBE_PERIOD_SECONDS,
            "failureThreshold": max(1, -(-startup_timeout // PROBE_PERIOD_SECONDS)),
        },
        # Ready means the model is loaded and warm; a draining engine answers 503 here.
        "readinessProbe": {
            "httpGet": http(adapter.ready_path),
            "periodSeconds": PROBE_PERIOD_SECONDS,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": http(adapter.live_path),
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


def engine_pod_template(dep: LLMDeployment, settings: RenderSettings) -> dict[str, Any]:
    engine = dep.spec.engine
    adapter = engine_adapter(engine.kind)
    image = engine.image or adapter.default_image or settings.engine_image
    model = model_location(dep.spec.model, settings.engine_image, settings.image_pull_policy)
    model_arg, volumes, mounts = model.model_arg, model.volumes, model.mounts
    init_containers = model.init_containers
    if adapter.needs_shared_memory:
        volumes = [*volumes, {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]
        mounts = [*mounts, {"name": SHM_VOLUME, "mountPath": SHM_MOUNT}]
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(adapter.command),
        "args": adapter.args(dep.spec, model_arg, adapter.pod_listen(), api_key=True),
        "ports": [{"name": ENGINE_PORT_NAME, "containerPort": adapter.port, "protocol": "TCP"}],
        **_probes(adapter, engine.startup_timeout_seconds),
        "securityContext": CONTAINER_SECURITY,
    }
    container["env"] = [*engine_key_env(dep, adapter), *_env(dep)]
    if resources := _resources(dep):
        container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    spec: dict[str, Any] = {
        "containers": [container],
        # The engine drains in-flight requests on SIGTERM; give it that long, plus exit time.
        "terminationGracePeriodSeconds": engine.drain_timeout_seconds + EXIT_GRACE_SECONDS,
        "enableServiceLinks": False,
        "securityContext": {**pod_security(adapter), **model.pod_security},
        **placement(dep),
    }
    if init_containers:
        spec["initContainers"] = [
            {"securityContext": CONTAINER_SECURITY, **init} for init in init_containers
        ]
    if volumes:
        spec["volumes"] = volumes
    return {
        "metadata": {
            "labels": {**common_labels(dep), **selector_labels(dep), LABEL_ENGINE: engine.kind},
        },
        "spec": spec,
    }


def engine_deployment(dep: LLMDeployment, settings: RenderSettings) -> dict[str, Any]:
    """The engine workload. maxUnavailable 0 / maxSurge 1: a rollout adds a new replica,
    waits until it is ready (model warm), then removes an old one, so the number of
    ready replicas never drops below the desired count, hence never below the warm pool."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(dep, engine_name(dep), {LABEL_COMPONENT: COMPONENT_ENGINE}),
        "spec": {
            "replicas": dep.spec.desired_replicas(),
            "selector": {"matchLabels": selector_labels(dep)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "minReadySeconds": 0,
            "progressDeadlineSeconds": dep.spec.engine.startup_timeout_seconds + 300,
            "revisionHistoryLimit": 3,
            "template": engine_pod_template(dep, settings),
        },
    }


def headless_service(dep: LLMDeployment) -> dict[str, Any]:
    """One DNS record / EndpointSlice entry per ready replica: the gateway routes per replica."""
    port = engine_adapter(dep.spec.engine.kind).port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(dep, engine_name(dep), {LABEL_COMPONENT: COMPONENT_ENGINE}),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(dep),
            "publishNotReadyAddresses": False,
            "ports": [
                {
                    "name": ENGINE_PORT_NAME,
                    "port": port,
                    "targetPort": ENGINE_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def pod_disruption_budget(dep: LLMDeployment) -> dict[str, Any]:
    """Voluntary evictions (node drains) may not take the pool below its warm minimum."""
    min_replicas = dep.spec.pool.min_replicas
    budget: dict[str, Any] = (
        {"minAvailable": min_replicas} if min_replicas > 0 else {"maxUnavailable": 1}
    )
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(dep, engine_name(dep), {LABEL_COMPONENT: COMPONENT_ENGINE}),
        "spec": {"selector": {"matchLabels": selector_labels(dep)}, **budget},
    }


def engine_network_policy(dep: LLMDeployment) -> dict[str, Any]:
    return network_policy(dep, _meta(dep, engine_name(dep), {LABEL_COMPONENT: COMPONENT_ENGINE}))


def engine_key_secret_for(dep: LLMDeployment) -> dict[str, Any] | None:
    """The engine key Secret to create once (None: the spec names its own); see isolation."""
    meta = _meta(dep, engine_key_secret_name(dep.name), {LABEL_COMPONENT: COMPONENT_ENGINE})
    return engine_key_secret(dep, meta)


def service_monitor(dep: LLMDeployment) -> dict[str, Any]:
    """Prometheus Operator scrape config for the engine replicas (only when that CRD exists)."""
    adapter = engine_adapter(dep.spec.engine.kind)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(dep, engine_name(dep), {LABEL_COMPONENT: COMPONENT_ENGINE}),
        "spec": {
            "selector": {"matchLabels": {**selector_labels(dep)}},
            "endpoints": [
                {"port": ENGINE_PORT_NAME, "path": adapter.metrics_path, "interval": "15s"}
            ],
        },
    }


def gateway_config(dep: LLMDeployment) -> dict[str, Any]:
    """This deployment's fragment of the gateway config, rendered by the gateway's own
    `render_gateway_config` (one model for Kubernetes and local mode). Keys stay Secret
    *references*: files under SECRETS_MOUNT/<namespace>/<secret>/<key>, never values."""
    config = render_gateway_config(
        [dep],
        {},
        MountedSecretKeys(f"{SECRETS_MOUNT}/{dep.namespace}"),
        services={
            dep.name: ServiceRef(
                namespace=dep.namespace, name=engine_name(dep), port_name=ENGINE_PORT_NAME
            )
        },
        engine_keys={dep.name: engine_key_ref(dep)},
    )
    result: dict[str, Any] = config.model_dump(mode="json", exclude_none=True)
    return result


def gateway_route_configmap(dep: LLMDeployment) -> dict[str, Any]:
    """The route as a ConfigMap the gateway watches (ROUTE_LABEL_SELECTOR): ROUTE_GATEWAY_KEY
    is this deployment's GatewayConfig fragment."""

    # Sorted keys and a fixed width: re-rendering an unchanged spec gives identical bytes,
    # so server-side apply is a no-op and nothing churns.
    def dump(value: dict[str, Any]) -> str:
        return yaml.safe_dump(value, sort_keys=True, width=100)

    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(
            dep,
            route_name(dep),
            {LABEL_COMPONENT: COMPONENT_GATEWAY_ROUTE, LABEL_GATEWAY_ROUTE: "true"},
        ),
        "data": {
            ROUTE_GATEWAY_KEY: dump(gateway_config(dep)),
        },
    }


def children(
    dep: LLMDeployment, settings: RenderSettings, with_service_monitor: bool
) -> list[dict[str, Any]]:
    """Every child object of one LLMDeployment, in apply order."""
    objects = [
        gateway_route_configmap(dep),
        headless_service(dep),
        engine_deployment(dep, settings),
        pod_disruption_budget(dep),
        engine_network_policy(dep),
    ]
    if with_service_monitor:
        objects.append(service_monitor(dep))
    return objects
