"""Tenant keys for local mode: the YAML's Secret references, resolved here, or one demo tenant.

A Secret reference is resolved from `SERVEFLEET_SECRET_<NAME>_<KEY>` in the environment,
then from Secret documents in the manifest itself or in a separate secrets file. With no
tenant anywhere, every deployment gets the tenant `demo` with a fresh random key.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from servefleet.api.llmdeployment import LLMDeployment, SecretKeyRef, TenantSpec
from servefleet.api.manifests import load_secrets, resolve_secret, secret_env_name

DEMO_TENANT = "demo"
DEMO_SECRET = SecretKeyRef(name="servefleet-local-demo", key="api-key")


class MissingSecretError(ValueError):
    """A Secret reference that neither the environment nor the files resolve."""


@dataclass(frozen=True)
class LocalTenants:
    deployments: list[LLMDeployment]
    values: dict[tuple[str, str], str]
    demo_key: str | None
    """Set when the demo tenant was created (its key is printed for the user)."""

    def resolve(self, ref: SecretKeyRef) -> str | None:
        return self.values.get((ref.name, ref.key))

    def first_key(self) -> str | None:
        """A key to print in the banner: the demo key, else the first tenant's."""
        if self.demo_key is not None:
            return self.demo_key
        for dep in self.deployments:
            for tenant in dep.spec.tenants:
                return self.resolve(tenant.api_key_secret_ref)
        return None


def resolve_local_tenants(
    deployments: list[LLMDeployment],
    manifest: Path,
    secrets_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> LocalTenants:
    env = os.environ if environ is None else environ
    if not any(dep.spec.tenants for dep in deployments):
        key = "sk-local-" + secrets.token_urlsafe(24)
        demo = TenantSpec(name=DEMO_TENANT, api_key_secret_ref=DEMO_SECRET)
        with_demo = [
            dep.model_copy(
                update={"spec": dep.spec.model_copy(update={"tenants": [demo]})}, deep=True
            )
            for dep in deployments
        ]
        return LocalTenants(with_demo, {(DEMO_SECRET.name, DEMO_SECRET.key): key}, key)

    known = load_secrets(manifest)
    if secrets_file is not None:
        known |= load_secrets(secrets_file)
    values: dict[tuple[str, str], str] = {}
    refs = [t.api_key_secret_ref for dep in deployments for t in dep.spec.tenants]
    refs += [
        dep.spec.spillover.api_key_secret_ref
        for dep in deployments
        if dep.spec.spillover is not None and dep.spec.spillover.api_key_secret_ref is not None
    ]
    for ref in refs:
        value = resolve_secret(ref, known, env)
        if value is None:
            raise MissingSecretError(
                f"Secret {ref.name} key {ref.key} is not available: set "
                f"{secret_env_name(ref)}, or add a Secret document to {manifest}"
                + (f" or {secrets_file}" if secrets_file else " (or pass --secrets FILE)")
            )
        values[(ref.name, ref.key)] = value
    return LocalTenants(list(deployments), values, None)
