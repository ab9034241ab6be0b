"""API key -> tenant. Only SHA-256 digests of keys are held; a key is never logged."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from servefleet.api.openai_errors import OpenAIError


class KeyRing:
    def __init__(self, digests: Mapping[str, str]) -> None:
        """`digests` maps a key's SHA-256 (hex) to its tenant's name."""
        self._by_digest = {bytes.fromhex(d): tenant for d, tenant in digests.items()}

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer <key>` header, or None."""
        key = bearer_token(authorization)
        if key is None:
            return None
        digest = hashlib.sha256(key).digest()
        # A dict lookup on a digest leaks nothing useful about the key itself.
        return self._by_digest.get(digest)

    def require_tenant(self, authorization: str | None) -> str:
        """The tenant, or the 401 OpenAI answers to a bad key."""
        tenant = self.tenant_for(authorization)
        if tenant is None:
            raise OpenAIError(
                status=401,
                message="Incorrect API key provided.",
                code="invalid_api_key",
                type="invalid_request_error",
            )
        return tenant


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of a Bearer header, as the bytes the client sent (headers are decoded as
    latin-1, so encoding back gives them exactly); None when there is none."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    token = key.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token.encode("latin-1", errors="replace")


def bearer_matches(authorization: str | None, expected: str) -> bool:
    """Constant-time comparison on bytes: a non-ASCII header is simply not the key."""
    token = bearer_token(authorization)
    return token is not None and hmac.compare_digest(token, expected.encode())
