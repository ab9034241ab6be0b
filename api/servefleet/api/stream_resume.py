"""The gateway ↔ engine contract for continuing a broken stream on another replica.

Two request fields, internal to the pair (a tenant never sends them; the gateway refuses them
with a 400 and an engine honours them only from a caller holding its key):

- `return_token_ids` (vLLM's name and meaning): each streamed choice carries the `token_ids` of
  the text it delivers, so the gateway knows exactly which tokens reached the client.
- `resume_token_ids`: the token ids already delivered. The engine puts them into the sequence's
  output before its first step — prefilled with the prompt, never streamed again, and counted
  toward `max_tokens`, penalties and stop checks — so sampling goes on at position
  `len(resume_token_ids)`. With seeded (counter-based) sampling the continuation is identical to
  an uninterrupted run.
"""

from __future__ import annotations

RETURN_TOKEN_IDS = "return_token_ids"
RESUME_TOKEN_IDS = "resume_token_ids"
KV_TRANSFER_PARAMS = "kv_transfer_params"  # where to pull KV blocks from (`api.kv_transfer`)

# Fields only the gateway may send an engine: refused from tenants, named in the 400.
INTERNAL_FIELDS: tuple[str, ...] = (RETURN_TOKEN_IDS, RESUME_TOKEN_IDS, KV_TRANSFER_PARAMS)

# Response header of a stream the gateway would continue after a broken replica: `exact` (from
# token ids: our engine) or `text` (vLLM, SGLang: the delivered text as a prefix, so sampled
# output may differ from an uninterrupted run's; greedy output matches).
CONTINUATION_HEADER = "x-servefleet-continuation"

# Response header of the same streams: the seed they are sampled with, the client's own or the
# one the gateway gave a request without one. Sending it back as `seed` asks for the same text,
# so a client (or a test) can reproduce a sampled answer it did not seed itself.
SEED_HEADER = "x-servefleet-seed"


def internal_fields_in(body: dict[str, object]) -> list[str]:
    """The internal fields a request body sets (a false/empty value sets nothing)."""
    return [name for name in INTERNAL_FIELDS if body.get(name) not in (None, False, [])]
