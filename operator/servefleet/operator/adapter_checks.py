"""Pure: whether an LLMAdapter fits its LLMDeployment, as the `Accepted` condition says.

The CRD cannot check one object against another (CEL sees only the object itself), and
there is no admission webhook to run (nor one to keep available), so this is the admission:
at reconcile, each refusal a condition `Accepted=False` with a CamelCase reason and a message
naming both sides, and a Warning Event. A refused adapter is never rendered into a route.

In order: the deployment exists (same namespace) and sets `engine.lora`; `spec.tenants` are
its tenants; the served name is not its model's and not taken (another adapter of the same
deployment, or a model or adapter another deployment of the namespace serves to one of the
same tenants: the gateway would refuse the whole route, so the later adapter is refused
instead, oldest first); the engine pods can reach the source (`api.lora_source`); and its
`adapter_config.json`, when the operator can read it, is one the engines serve (rank, target
modules) and was trained on the deployment's model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from servefleet.api.deployment_status import Condition
from servefleet.api.llmadapter import ADAPTER_ACCEPTED, LLMAdapter, LLMAdapterStatus
from servefleet.api.llmdeployment import LLMDeployment
from servefleet.api.lora import ADAPTER_CONFIG, LoraConfigError, base_model_problem
from servefleet.api.lora_source import AdapterSourceRefused, kube_lora_path, model_names
from servefleet.operator.adapter_config import ConfigRead

ACCEPTED = ADAPTER_ACCEPTED
ConditionStatus = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class Verdict:
    """The Accepted condition of one adapter, and what a route needs of an accepted one."""

    status: ConditionStatus
    reason: str
    message: str
    read: ConfigRead | None = None  # the config, when one was read

    @property
    def accepted(self) -> bool:
        return self.status == "True"


def refused(reason: str, message: str) -> Verdict:
    return Verdict("False", reason, message)


def tenants_of(adapter: LLMAdapter, dep: LLMDeployment) -> set[str]:
    """Who may use the adapter: its own list, or every tenant of the deployment."""
    return set(adapter.spec.tenants) or {t.name for t in dep.spec.tenants}


@dataclass
class NameClaims:
    """Model names served in one namespace, per deployment and tenant: the deployments'
    own models first, then accepted adapters in the order they were judged."""

    claims: list[tuple[str, str, set[str], str]] = field(default_factory=list)
    # (model name, deployment, tenants, who: "LLMDeployment x" / "LLMAdapter y")

    @classmethod
    def of(cls, deployments: list[LLMDeployment]) -> NameClaims:
        found = cls()
        for dep in deployments:
            tenants = {t.name for t in dep.spec.tenants}
            found.claims.append(
                (dep.spec.model.name, dep.name, tenants, f"LLMDeployment {dep.name}")
            )
        return found

    def conflict(self, adapter: LLMAdapter, dep: LLMDeployment) -> str | None:
        name, tenants = adapter.served_name, tenants_of(adapter, dep)
        for model, owner, users, who in self.claims:
            if model != name:
                continue
            if owner == dep.name and who.startswith("LLMAdapter"):
                return f"{who} already serves model name {name} on deployment {dep.name}"
            shared = sorted(users & tenants)
            if owner != dep.name and shared:
                return (
                    f"{who} already serves model name {name} to tenants {', '.join(shared)} "
                    f"(deployment {owner})"
                )
        return None

    def claim(self, adapter: LLMAdapter, dep: LLMDeployment) -> None:
        who = f"LLMAdapter {adapter.name}"
        self.claims.append((adapter.served_name, dep.name, tenants_of(adapter, dep), who))


def fit_verdict(adapter: LLMAdapter, dep: LLMDeployment, claims: NameClaims) -> Verdict:
    """Everything that needs no file: lora on, tenants, the name, the source. Accepted
    means "so far"; `config_verdict` completes it."""
    spec = dep.spec
    if spec.engine.lora is None:
        return refused(
            "LoraNotEnabled",
            f"deployment {dep.name} does not set engine.lora: its engines serve no adapters",
        )
    unknown = sorted(set(adapter.spec.tenants) - {t.name for t in spec.tenants})
    if unknown:
        known = ", ".join(sorted(t.name for t in spec.tenants)) or "none"
        return refused(
            "UnknownTenants",
            f"spec.tenants {', '.join(unknown)} are not tenants of deployment {dep.name} "
            f"(its tenants: {known})",
        )
    if adapter.served_name == spec.model.name:
        return refused(
            "NameConflict",
            f"model name {adapter.served_name} is the model deployment {dep.name} serves itself; "
            "set spec.model to another name",
        )
    conflict = claims.conflict(adapter, dep)
    if conflict is not None:
        return refused("NameConflict", f"{conflict}; set spec.model to another name")
    try:  # the same call renders the route's lora_path (gateway_render.adapter_path)
        kube_lora_path(adapter.spec.source, spec.model, spec.engine)
    except AdapterSourceRefused as exc:
        return refused(exc.reason, exc.message)
    return Verdict("True", "Accepted", "")


def config_verdict(
    adapter: LLMAdapter, dep: LLMDeployment, fit: Verdict, read: ConfigRead
) -> Verdict:
    """The fit verdict completed with what the adapter's own config says."""
    if not fit.accepted:
        return fit
    where = f"deployment {dep.name}"
    served = f"served on {where} as model {adapter.served_name}"
    if read.state == "refused":
        return refused(read.reason, read.message)
    if read.state == "retry":
        return _while_unreadable(adapter, read)
    if read.state == "unchecked" or read.config is None:
        return Verdict("True", "Accepted", f"{served}; {read.message}", read)
    config = read.config
    lora = dep.spec.engine.lora
    assert lora is not None  # fit_verdict refused it otherwise
    try:
        config.check_servable(lora.max_lora_rank)
    except LoraConfigError as exc:
        return refused(
            "AdapterNotServable",
            f"{ADAPTER_CONFIG}: {exc} (engine.lora.maxLoraRank of {where})",
        )
    problem = base_model_problem(
        config.base_model_name_or_path, model_names(dep.spec.model.name, dep.spec.model.source)
    )
    if problem is not None:
        return refused("BaseModelMismatch", f"{ADAPTER_CONFIG}: {problem} ({where})")
    modules = ", ".join(config.target_modules)
    return Verdict("True", "Accepted", f"{served} (rank {config.r}, {modules})", read)


def _while_unreadable(adapter: LLMAdapter, read: ConfigRead) -> Verdict:
    """A transient failure keeps an adapter accepted for this generation accepted (a Hub
    outage must not take adapters out of the routes); a new one waits, Unknown."""
    previous = adapter.status.condition(ACCEPTED)
    if (
        previous is not None
        and previous.status == "True"
        and previous.observed_generation == adapter.metadata.generation
    ):
        return Verdict("True", previous.reason, previous.message)
    return Verdict(
        "Unknown", "AdapterConfigUnavailable", f"{read.message}; asked again at the next pass"
    )


def missing_deployment(adapter: LLMAdapter, why: str) -> Verdict:
    """The adapter's deployment is not there to serve it (`why`: "does not exist", ...)."""
    return refused(
        "DeploymentNotFound",
        f"deployment {adapter.spec.deployment} {why} in namespace {adapter.namespace}",
    )


def adapter_status(
    adapter: LLMAdapter, verdict: Verdict, dep: LLMDeployment | None, now: str
) -> LLMAdapterStatus:
    """The adapter's new status: Accepted set, the config's fields when read; what others
    write (Loaded, loadedReplicas) kept."""
    old = adapter.status
    previous = old.condition(ACCEPTED)
    since = now
    if previous is not None and previous.status == verdict.status:
        since = previous.last_transition_time or now
    accepted = Condition(
        type=ACCEPTED,
        status=verdict.status,
        reason=verdict.reason,
        message=verdict.message,
        last_transition_time=since,
        observed_generation=adapter.metadata.generation,
    )
    config = verdict.read.config if verdict.read is not None else None
    keep = verdict.accepted and verdict.read is None  # accepted through a transient failure
    return old.model_copy(
        update={
            "observed_generation": adapter.metadata.generation or 0,
            "base_model": dep.spec.model.name if dep is not None else "",
            "rank": config.r if config is not None else (old.rank if keep else None),
            "target_modules": (
                list(config.target_modules)
                if config is not None
                else (old.target_modules if keep else [])
            ),
            "conditions": [
                *(c for c in old.conditions if c.type != ACCEPTED),
                accepted,
            ],
        }
    )


def adapter_event(
    old: LLMAdapterStatus, new: LLMAdapterStatus
) -> tuple[Literal["Normal", "Warning"], str, str] | None:
    """(type, reason, message) of the Event for a change of Accepted, or None."""
    before, after = old.condition(ACCEPTED), new.condition(ACCEPTED)
    if after is None or (
        before is not None and (before.status, before.reason) == (after.status, after.reason)
    ):
        return None
    kind: Literal["Normal", "Warning"] = "Normal" if after.status == "True" else "Warning"
    return kind, after.reason, f"Accepted={after.status}: {after.message}"
