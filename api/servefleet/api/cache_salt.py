"""Who may share a prefix's KV: the cache salt of a request.

A prefix cache shared by every tenant of a pool leaks what others asked: a tenant that sends
a guessed prompt learns from `usage.prompt_tokens_details.cached_tokens`, or from how fast its
first token came, whether someone sent that prefix before (prompt stealing through the
cache). Requests with different salts never share a block (`servefleet.api.kv_blocks`).
`cache_salt` is vLLM's and SGLang's request field of that meaning; our engine honours it too.

By default (`tenant`) the gateway salts every request to its engines with its tenant, so only
a tenant's own requests share prefixes; the tenant's own `cache_salt` splits its part further
(per end user, say) but can never name another tenant's. `deployment` forwards the tenant's
own salt unchanged, so tenants without one share the deployment's cache (more hits on a
common system prompt, and the leak above between those tenants).
"""

from __future__ import annotations

import hashlib
from typing import Literal

CACHE_SALT = "cache_salt"
MAX_CACHE_SALT_CHARS = 256
PrefixCacheSharing = Literal["tenant", "deployment"]
SHARING_TENANT: PrefixCacheSharing = "tenant"


def _part(text: str) -> bytes:
    data = text.encode()
    return len(data).to_bytes(4, "little") + data


def tenant_salt(tenant: str, own: str | None) -> str:
    """The salt the gateway sends for `tenant` (and its own salt, if it sent one): a digest of
    both, length-prefixed, so no choice of `own` by one tenant yields another's salt."""
    data = b"servefleet-cache-salt-v1" + _part(tenant) + (b"\x00" if own is None else _part(own))
    return "t1-" + hashlib.blake2b(data, digest_size=16).hexdigest()


def effective_salt(sharing: PrefixCacheSharing, tenant: str, own: str | None) -> str | None:
    """The salt the engine is sent for a tenant's request (None: unsalted, shared)."""
    return tenant_salt(tenant, own) if sharing == SHARING_TENANT else own
