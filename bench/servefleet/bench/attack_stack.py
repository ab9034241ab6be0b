"""The stack the serving attacks run against: the fault suite's real processes (engines on the
real model, a gateway, Redis) with the defaults a deployment gets, plus who attacks whom.

Tenants: `alpha` attacks with generous limits, `beta` is the victim, `mallory` attacks with a
small token budget (1,000 tokens a minute) to show limits cannot be walked around, `penny`
with a small daily budget (400 tokens) to show a tenant cannot reset or raise its own. Engines
require their key, as pods and local engines do, so a tenant cannot bypass the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from servefleet.api.gateway_config import (
    ApiKeyRef,
    GatewayConfig,
    GatewayTenant,
    SecretValueRef,
    TenantAccess,
    hash_api_key,
)
from servefleet.api.llmdeployment import TenantLimits
from servefleet.bench.fault_stack import Part, Stack, StackShape, api_key, internal_headers

ATTACKER = "alpha"
VICTIM = "beta"
CAPPED_ATTACKER = "mallory"
CAPPED_TOKENS_PER_MINUTE = 1_000
BUDGETED = "penny"
BUDGETED_DAILY_TOKENS = 400
ENGINE_KEY = "sk-engine-attack-suite"
SHAPE = StackShape(engines=2, gateways=1, max_num_seqs=4, max_queue_depth=16)


@dataclass
class AttackStack(Stack):
    """`Stack` with engine keys and the capped attacker."""

    def _engine_part(self, index: int) -> Part:
        part = super()._engine_part(index)
        part.argv += ["--api-key", ENGINE_KEY]
        return part

    def gateway_config(self) -> GatewayConfig:
        config = super().gateway_config()
        capped = [
            GatewayTenant(
                name=name,
                api_keys=[ApiKeyRef(sha256=hash_api_key(api_key(name)))],
                limits=limits,
            )
            for name, limits in (
                (CAPPED_ATTACKER, TenantLimits(tokens_per_minute=CAPPED_TOKENS_PER_MINUTE)),
                (BUDGETED, TenantLimits(daily_token_budget=BUDGETED_DAILY_TOKENS)),
            )
        ]
        key_file = self.workdir / "engine-key"
        key_file.write_text(ENGINE_KEY)
        deployments = [
            d.model_copy(
                update={
                    "engine_api_key": SecretValueRef(file=str(key_file)),
                    "tenants": [*d.tenants, *(TenantAccess(name=t.name) for t in capped)],
                }
            )
            for d in config.deployments
        ]
        return config.model_copy(
            update={"tenants": [*config.tenants, *capped], "deployments": deployments}
        )

    @property
    def gateway(self) -> Part:
        return self.gateways[0]

    @property
    def url(self) -> str:
        """Where tenants call: the gateway's tenant port."""
        return self.gateway.url

    def tenant_headers(self, tenant: str) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key(tenant)}", "content-type": "application/json"}

    @staticmethod
    def internal_headers() -> dict[str, str]:
        return internal_headers()

    def post(self, path: str, body: bytes, tenant: str = ATTACKER, **kw: float) -> httpx.Response:
        """One request as `tenant` through the gateway, raw body."""
        return httpx.post(
            self.gateway.url + path,
            content=body,
            headers=self.tenant_headers(tenant),
            timeout=kw.get("timeout", 180.0),
        )
