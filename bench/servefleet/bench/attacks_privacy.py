"""Attacks on what one tenant may learn of another's requests through the shared engines.

The prefix cache is the channel: a tenant that sends a guessed prompt would learn from
`usage.prompt_tokens_details.cached_tokens` (or from its time to first token) whether another
tenant sent that prefix. The gateway salts every request with its tenant by default
(`servefleet.api.cache_salt`), so another tenant's prefixes are never a hit.
"""

from __future__ import annotations

import json
import secrets
import time

import httpx

from servefleet.api.cache_salt import tenant_salt
from servefleet.bench import attack_payloads as payloads
from servefleet.bench.attack_common import AttackResult
from servefleet.bench.attack_stack import ATTACKER, VICTIM, AttackStack
from servefleet.bench.fault_stack import MODEL


def _cached(response: httpx.Response) -> int | None:
    """The answer's cached prompt tokens, None when it was not a 200 with usage."""
    if response.status_code != 200:
        return None
    details = (response.json().get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) else None


REPEATS = 3  # a repeat may land on the other replica (the victim's load is running): try again
# Between two requests: no victim request shares its steps with two prefills of the probe's.
# The probe is ordinary load, as large as the victim's own requests; on two cores two of them
# back to back pushed one victim request to 2x its quiet p99 (what the stall attacks are
# judged by), which says nothing about the cache.
PACE_S = 1.0


def _tokens(stack: AttackStack, content: str) -> list[int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    answer = stack.post("/tokenize", json.dumps(body).encode())
    tokens = answer.json().get("tokens") if answer.status_code == 200 else None
    assert isinstance(tokens, list), answer.text[:200]
    return tokens


def _opening(stack: AttackStack, one: str, other: str, block: int = 16) -> int:
    """Tokens in the full blocks two chats share before their texts differ: what any prompt
    of the attacker's may hit of its own earlier chats (the chat template's opening)."""
    a, b = _tokens(stack, one), _tokens(stack, other)
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    return common // block * block


def prefix_cache_probe(stack: AttackStack, result: AttackResult) -> None:
    """A tenant replays another tenant's prompt to learn from cached_tokens that it was sent.

    The victim's prompt is a hit beyond the chat template's opening for the victim's own repeat
    (the cache works) and never for the attacker, neither as sent nor with the victim's salt
    as its own `cache_salt` (the derivation is public: the gateway salts the salt again). The
    opening (the blocks every chat shares before the secret) may be a hit of the attacker's
    own: it is computed from the two prompts' tokens, not measured, so it holds on any replica."""
    # short: a probe costs the victim no more than one of its own requests (a prefill on two
    # cores delays every step it shares); two blocks, the second holding the secret
    secret, unseen = (f"Account {secrets.token_hex(8)}" for _ in range(2))

    def ask(tenant: str, text: str, **extra: str) -> int | None:
        time.sleep(PACE_S)
        body = {**payloads.chat(text, max_tokens=1, temperature=0), **extra}
        return _cached(stack.post("/v1/chat/completions", json.dumps(body).encode(), tenant=tenant))

    def repeat(tenant: str, opening: int) -> list[int | None]:
        hits = [ask(tenant, secret)]
        while len(hits) < REPEATS and not (hits[-1] or 0) > opening:
            hits.append(ask(tenant, secret))
        return hits

    opening = _opening(stack, secret, unseen)
    sent = ask(VICTIM, secret)
    again = repeat(VICTIM, opening)
    probes = {
        "as sent": ask(ATTACKER, secret),
        "with the victim's salt": ask(ATTACKER, secret, cache_salt=tenant_salt(VICTIM, None)),
    }
    own = repeat(ATTACKER, opening)  # the attacker's own repeats: its own prefix is a hit
    result.figures.update(opening=opening, victim=[sent, *again], attacker=probes, own=own)
    result.require(sent is not None, f"the victim's first request answered {sent}")
    result.require((again[-1] or 0) > opening, f"the victim's repeats hit {again}: no cache")
    result.require((own[-1] or 0) > opening, f"the attacker's own repeats hit {own}: no cache")
    for label, cached in probes.items():
        result.require(
            cached is not None and cached <= opening,
            f"attacker {label}: {cached} cached tokens, more than the opening ({opening})",
        )
    result.outcome = (
        f"victim's repeat {again[-1]} cached tokens; attacker's probes "
        + ", ".join(f"{label} {cached}" for label, cached in probes.items())
        + f", at most the template's opening ({opening}); its own repeat {own[-1]}"
    )
