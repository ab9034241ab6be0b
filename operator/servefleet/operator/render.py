"""Pure functions: an LLMDeployment in, the child objects it needs out (plain dicts).

No I/O here, so every child is unit- and snapshot-tested, and the handlers only
apply what these return. The engine workload is a Deployment (see README: rolling
updates with maxUnavailable 0 keep the warm minimum ready, and the ReplicaSet
controller honours `controller.kubernetes.io/pod-deletion-cost`, which is how the
autoscaler makes the idlest replica the one removed on scale-down).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from servefleet.api.conventions import (
    ANNOTATION_ROUTE_SIGNATURE,
    COMPONENT_ENGINE,
    COMPONENT_GATEWAY_ROUTE,
    ENGINE_CONTAINER,
    ENGINE_PORT_NAME,
    LABEL_COMPONENT,
    LABEL_ENGINE,
    LABEL_GATEWAY_ROUTE,
    ROUTE_GATEWAY_KEY,
    SCRATCH_MOUNT,
    SCRATCH_VOLUME,
    SECRETS_MOUNT,
    engine_key_secret_name,
    engine_object_name,
    label_selector,
    route_object_name,
)
from servefleet.api.disaggregation import Role
from servefleet.api.engine_resources import engine_resources
from servefleet.api.engines import engine_adapter
from servefleet.api.gateway_config import ServiceRef
from servefleet.api.gateway_render import MountedSecretKeys, render_gateway_config
from servefleet.api.llmadapter import LLMAdapter
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.route_signature import route_signature
from servefleet.operator.child_meta import child_meta as _meta
from servefleet.operator.child_meta import common_labels
from servefleet.operator.groups import (
    group_disruption_budget,
    is_group,
    leader_worker_set,
    replica_selector,
)
from servefleet.operator.isolation import (
    CONTAINER_SECURITY,
    POD_SECURITY,
    EnginePeers,
    engine_key_env,
    engine_key_ref,
    engine_key_secret,
    network_policy,
    scratch_env,
)
from servefleet.operator.model_init import model_location
from servefleet.operator.placement import placement
from servefleet.operator.pod_parts import (
    EXIT_GRACE_SECONDS,
    lora_env,
    probes,
    seed_container,
    user_env,
)
from servefleet.operator.policy import (
    ClusterPolicy,
    Refusal,
    default_allowed_images,
    engine_image,
)
from servefleet.operator.policy import refusal as policy_refusal
from servefleet.operator.pools import (
    decode_role,
    pool_component,
    pool_min_replicas,
    pool_name,
    pool_replicas,
    pool_selector,
    prefill_object_name,
    role_container_env,
    role_container_ports,
    role_labels,
)


@dataclass(frozen=True)
class RenderSettings:
    """Cluster-wide choices the chart passes to the operator."""

    engine_image: str
    gateway_url: str
    route_signing_key: bytes = field(repr=False)
    image_pull_policy: str = "IfNotPresent"
    system_namespace: str = "servefleet"
    metrics_namespaces: tuple[str, ...] = ()
    allowed_images: tuple[str, ...] = field(default_factory=default_allowed_images)
    host_path_prefixes: tuple[str, ...] = ()

    @property
    def policy(self) -> ClusterPolicy:
        return ClusterPolicy(self.engine_image, self.allowed_images, self.host_path_prefixes)

    @property
    def peers(self) -> EnginePeers:
        return EnginePeers(self.system_namespace, self.metrics_namespaces)


def refusal(dep: LLMDeployment, settings: RenderSettings) -> Refusal | None:
    """Why the admin's lists refuse this deployment (nothing is rendered then), or None."""
    return policy_refusal(dep, settings.policy)


def engine_name(dep: LLMDeployment) -> str:
    return engine_object_name(dep.name)


def route_name(dep: LLMDeployment) -> str:
    return route_object_name(dep.name)


def selector_labels(dep: LLMDeployment) -> dict[str, str]:
    """The pods standing for replicas: every engine pod, or each group's leader (`groups`)."""
    return replica_selector(dep)


def selector_string(dep: LLMDeployment) -> str:
    """The engine pods' selector as text, for status.selector (the scale subresource)."""
    return label_selector(selector_labels(dep))


# --------------------------------------------------------------------------- engine pods


def engine_pod_template(
    dep: LLMDeployment, settings: RenderSettings, role: Role | None = None
) -> dict[str, Any]:
    """One engine pod; `role` (disaggregated) adds that pool's flags, env, ports and labels."""
    engine = dep.spec.engine
    adapter = engine_adapter(engine.kind)
    image = engine_image(dep, settings.engine_image)
    model = model_location(
        dep.spec.model,
        settings.engine_image,
        settings.image_pull_policy,
        settings.host_path_prefixes,
    )
    resources = engine_resources(dep.spec, role)
    scratch = {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_MOUNT}
    volumes = [*model.volumes, {"name": SCRATCH_VOLUME, "emptyDir": {}}, *resources.volumes()]
    mounts = [*model.mounts, scratch, *resources.mounts()]
    init_containers = list(model.init_containers)
    if adapter.image_scratch:
        seed = seed_container(adapter, image, settings.image_pull_policy)
        init_containers.insert(0, seed)
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(adapter.command),
        "args": adapter.args(
            dep.spec, model.model_arg, adapter.pod_listen(), api_key=True, role=role
        ),
        "ports": [
            {"name": ENGINE_PORT_NAME, "containerPort": adapter.port, "protocol": "TCP"},
            *role_container_ports(dep, role),
        ],
        **probes(adapter, engine.startup_timeout_seconds),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        "env": [
            *engine_key_env(dep, adapter),
            *scratch_env(dep),
            *lora_env(dep, adapter),
            *role_container_env(dep, role),
            *user_env(dep),
        ],
        "volumeMounts": mounts,
    }
    if asked := resources.container():
        container["resources"] = asked
    spec: dict[str, Any] = {
        "containers": [container],
        "initContainers": [
            {"securityContext": copy.deepcopy(CONTAINER_SECURITY), **c} for c in init_containers
        ],
        # The engine drains in-flight requests on SIGTERM; give it that long, plus exit time.
        "terminationGracePeriodSeconds": engine.drain_timeout_seconds + EXIT_GRACE_SECONDS,
        "enableServiceLinks": False,
        # Engines never call the Kubernetes API: no token to steal from them.
        "automountServiceAccountToken": False,
        "securityContext": {**copy.deepcopy(POD_SECURITY), **model.pod_security},
        "volumes": volumes,
        **placement(dep),
    }
    if not init_containers:
        del spec["initContainers"]
    return {
        "metadata": {
            "labels": {
                **common_labels(dep),
                **pool_selector(dep, role),
                LABEL_ENGINE: engine.kind,
                **role_labels(role),
            },
        },
        "spec": spec,
    }


def engine_deployment(
    dep: LLMDeployment, settings: RenderSettings, role: Role | None = None
) -> dict[str, Any]:
    """The engine workload. maxUnavailable 0 / maxSurge 1: a rollout adds a new replica,
    waits until it is ready (model warm), then removes an old one, so the number of
    ready replicas never drops below the desired count, hence never below the warm pool.
    `role` prefill: the prefill pool's (`pools`); otherwise the deployment's own pool."""
    role = decode_role(dep) if role is None else role
    meta = _meta(dep, pool_name(dep, role), {LABEL_COMPONENT: pool_component(role)})
    if is_group(dep):  # replicas bigger than one pod (never disaggregated: the spec says so)
        template = engine_pod_template(dep, settings, role)
        return leader_worker_set(dep, meta, pool_replicas(dep, role), template)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": pool_replicas(dep, role),
            "selector": {"matchLabels": pool_selector(dep, role)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "minReadySeconds": 0,
            "progressDeadlineSeconds": dep.spec.engine.startup_timeout_seconds + 300,
            "revisionHistoryLimit": 3,
            "template": engine_pod_template(dep, settings, role),
        },
    }


def headless_service(dep: LLMDeployment, role: Role | None = None) -> dict[str, Any]:
    """One DNS record / EndpointSlice entry per ready replica: the gateway routes per replica
    (`role` prefill: the prefill pool's Service)."""
    port = engine_adapter(dep.spec.engine.kind).port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(dep, pool_name(dep, role), {LABEL_COMPONENT: pool_component(role)}),
        "spec": {
            "clusterIP": "None",
            "selector": pool_selector(dep, role) if role == "prefill" else selector_labels(dep),
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


def pod_disruption_budget(dep: LLMDeployment, role: Role | None = None) -> dict[str, Any]:
    """Voluntary evictions (node drains) may not take the pool below its warm minimum
    (`role` prefill: the prefill pool's)."""
    min_replicas = pool_min_replicas(dep, role)
    budget: dict[str, Any] = (
        {"minAvailable": min_replicas} if min_replicas > 0 else {"maxUnavailable": 1}
    )
    if is_group(dep):
        budget = group_disruption_budget(dep, pool_replicas(dep, role))
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(dep, pool_name(dep, role), {LABEL_COMPONENT: pool_component(role)}),
        "spec": {"selector": {"matchLabels": pool_selector(dep, role)}, **budget},
    }


def engine_network_policy(dep: LLMDeployment, settings: RenderSettings) -> dict[str, Any]:
    meta = _meta(dep, engine_name(dep), {LABEL_COMPONENT: COMPONENT_ENGINE})
    return network_policy(dep, meta, settings.peers)


def engine_key_secret_for(dep: LLMDeployment) -> dict[str, Any] | None:
    """The engine key Secret to create once (None: the spec names its own); see isolation."""
    meta = _meta(dep, engine_key_secret_name(dep.name), {LABEL_COMPONENT: COMPONENT_ENGINE})
    return engine_key_secret(dep, meta)


def service_monitor(dep: LLMDeployment, role: Role | None = None) -> dict[str, Any]:
    """Prometheus Operator scrape config for the engine replicas (only when that CRD exists;
    `role` prefill: the prefill pool's, selecting its Service)."""
    adapter = engine_adapter(dep.spec.engine.kind)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(dep, pool_name(dep, role), {LABEL_COMPONENT: pool_component(role)}),
        "spec": {
            "selector": {"matchLabels": {**pool_selector(dep, role)}},
            "endpoints": [
                {"port": ENGINE_PORT_NAME, "path": adapter.metrics_path, "interval": "15s"}
            ],
        },
    }


def gateway_config(dep: LLMDeployment, adapters: Sequence[LLMAdapter] = ()) -> dict[str, Any]:
    """This deployment's fragment of the gateway config, rendered by the gateway's own
    `render_gateway_config` (one model for Kubernetes and local mode). Keys stay Secret
    *references*: files under SECRETS_MOUNT/<namespace>/<secret>/<key>, never values.
    `adapters` are the LLMAdapters accepted for it (`adapter_checks`): each with the
    `lora_path` its engine pods load it from (`api.lora_source`)."""
    config = render_gateway_config(
        [dep],
        {},
        MountedSecretKeys(f"{SECRETS_MOUNT}/{dep.namespace}"),
        services={
            dep.name: ServiceRef(
                namespace=dep.namespace, name=engine_name(dep), port_name=ENGINE_PORT_NAME
            )
        },
        prefill_services={
            dep.name: ServiceRef(
                namespace=dep.namespace,
                name=prefill_object_name(dep.name),
                port_name=ENGINE_PORT_NAME,
            )
        },
        engine_keys={dep.name: engine_key_ref(dep)},
        adapters=adapters,
    )
    result: dict[str, Any] = config.model_dump(mode="json", exclude_none=True)
    # No adapters: the route stays what it was before adapters existed (same bytes, same
    # signature), so an upgrade re-signs nothing and a gateway not yet upgraded (which
    # forbids unknown keys) keeps serving it.
    for deployment in result["deployments"]:
        if not deployment.get("adapters"):
            deployment.pop("adapters", None)
    return result


def gateway_route_configmap(
    dep: LLMDeployment, signing_key: bytes, adapters: Sequence[LLMAdapter] = ()
) -> dict[str, Any]:
    """The route as a ConfigMap the gateway watches (ROUTE_LABEL_SELECTOR): ROUTE_GATEWAY_KEY
    is this deployment's GatewayConfig fragment, signed (ANNOTATION_ROUTE_SIGNATURE) over
    its namespace, name, owner and data: the gateway serves no route the operator did not
    render, whoever may write ConfigMaps in the namespace."""

    # Sorted keys and a fixed width: re-rendering an unchanged spec gives identical bytes,
    # so server-side apply is a no-op and nothing churns (the HMAC is deterministic too).
    def dump(value: dict[str, Any]) -> str:
        return yaml.safe_dump(value, sort_keys=True, width=100)

    meta = _meta(
        dep,
        route_name(dep),
        {LABEL_COMPONENT: COMPONENT_GATEWAY_ROUTE, LABEL_GATEWAY_ROUTE: "true"},
    )
    data = {ROUTE_GATEWAY_KEY: dump(gateway_config(dep, adapters))}
    owner = meta["ownerReferences"][0]["uid"]
    signature = route_signature(signing_key, dep.namespace, meta["name"], owner, data)
    meta["annotations"] = {ANNOTATION_ROUTE_SIGNATURE: signature}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def children(
    dep: LLMDeployment,
    settings: RenderSettings,
    with_service_monitor: bool,
    adapters: Sequence[LLMAdapter] = (),
) -> list[dict[str, Any]]:
    """Every child object of one LLMDeployment, in apply order (`adapters`: those accepted
    for it, in its route)."""
    objects = [
        gateway_route_configmap(dep, settings.route_signing_key, adapters),
        headless_service(dep),
        engine_deployment(dep, settings),
        pod_disruption_budget(dep),
        engine_network_policy(dep, settings),
    ]
    prefill = dep.spec.disaggregation is not None
    if prefill:
        objects[3:3] = [
            headless_service(dep, "prefill"),
            engine_deployment(dep, settings, "prefill"),
            pod_disruption_budget(dep, "prefill"),
        ]
    if with_service_monitor:
        objects.append(service_monitor(dep))
        if prefill:
            objects.append(service_monitor(dep, "prefill"))
    return objects
