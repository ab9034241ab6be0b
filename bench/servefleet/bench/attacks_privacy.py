"""Attacks on what one tenant may learn of another's requests through the shared engines.

The prefix cache is the channel: a tenant that sends a guessed prompt would learn from
`usage.prompt_tokens_details.cached_tokens` (or from its time to first token) whether another
tenant sent that prefix. The gateway salts every request with its tenant by default
(`servefleet.api.cache_salt`), so another tenant's prefixes are never a hit.
"""

from __future__ import annotations

import json
import secrets

import httpx

from servefleet.api.cache_salt import tenant_salt
from servefleet.bench import attack_payloads as payloads
from servefleet.bench.attack_common import AttackResult
from servefleet.bench.attack_stack import ATTACKER, VICTIM, AttackStack


def _cached(response: httpx.Response) -> int | None:
    """The answer's cached prompt tokens, None when it was not a 200 with usage."""
    if response.status_code != 200:
        return None
    details = (response.json().get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) else None


def prefix_cache_probe(stack: AttackStack, result: AttackResult) -> None:
    """A tenant replays another tenant's prompt to learn from cached_tokens that it was sent.

    The victim's prompt is a hit for the victim's own second request (the cache works) and
    never for the attacker, neither as sent nor with the victim's salt as its own
    `cache_salt` (the derivation is public: the gateway salts the salt again). Every chat
    shares the template's opening, which the attacker's own earlier chats cached: a probe
    may hit as much as a prompt of the attacker's own that it never sent, and no more."""

    def ask(tenant: str, nonce: str, **extra: str) -> int | None:
        text = f"Account {nonce} may be closed."  # short: its prefill delays the victim
        raw = json.dumps({**payloads.chat(text, max_tokens=1, temperature=0), **extra}).encode()
        return _cached(stack.post("/v1/chat/completions", raw, tenant=tenant))

    secret, unseen = secrets.token_hex(8), secrets.token_hex(8)
    sent, again = ask(VICTIM, secret), ask(VICTIM, secret)
    opening = ask(ATTACKER, unseen)  # what any prompt of the attacker's hits: the opening
    probes = {
        "as sent": ask(ATTACKER, secret),
        "with the victim's salt": ask(ATTACKER, secret, cache_salt=tenant_salt(VICTIM, None)),
    }
    own = ask(ATTACKER, secret)  # the attacker's own repeat: its own prefix is a hit
    result.figures.update(victim=[sent, again], opening=opening, attacker=probes, own=own)
    ok = None not in (sent, again, opening, own)
    result.require(ok, f"answers without usage: {sent}, {again}, {opening}, {own}")
    if not ok:
        return
    assert sent is not None and again is not None and opening is not None and own is not None
    result.require(again > sent, f"the victim's repeat hit {again} of {sent}: nothing to probe")
    result.require(own > opening, f"the attacker's own repeat hit {own}, an unseen one {opening}")
    for label, cached in probes.items():
        result.require(
            cached is not None and cached <= opening,
            f"attacker {label}: {cached} cached tokens, its own unseen prompt {opening}",
        )
    result.outcome = (
        f"victim's repeat {again} cached tokens (first {sent}); attacker's probes "
        + ", ".join(f"{label} {cached}" for label, cached in probes.items())
        + f", as many as its unseen prompt ({opening}); its own repeat {own}"
    )
