"""Telling a poisoned request from a dead replica when the read timeout fires.

A replica that stops answering one request may be dead, or the request may be what stalls it
(a prompt or a grammar the engine takes minutes over). Moving the second kind to the next
replica stalls that one too, and the next: one hostile request takes the whole pool, and every
other tenant's requests time out behind it. So when the timeout fires the gateway asks the
replica's readiness path once: a replica that still answers is alive, the request is at fault
— it fails once with a 504, the replica is not ejected, nothing is retried elsewhere, and one
`poisoned_request` line names the tenant and the request id. A replica that does not answer
(or refuses the connection) is dead: the usual ejection and failover follow.
"""

from __future__ import annotations

import logging

from servefleet.api.openai_errors import OpenAIError
from servefleet.gateway.call import Call
from servefleet.gateway.pool import DeploymentPool
from servefleet.gateway.routing import Replica
from servefleet.gateway.upstream import UpstreamError, UpstreamPool

log = logging.getLogger("servefleet.gateway.poison")

PROBE_TIMEOUT_S = 2.0  # as the regular readiness probes


async def replica_answers(upstream: UpstreamPool, pool: DeploymentPool, replica: Replica) -> bool:
    """Whether the replica's readiness path answers 200 now (a short, separate request)."""
    try:
        response = await upstream.request(
            "GET",
            replica.endpoint + pool.config.ready_path,
            b"",
            [],
            connect_timeout=PROBE_TIMEOUT_S,
            read_timeout=PROBE_TIMEOUT_S,
        )
    except UpstreamError:
        return False
    try:
        await response.read()
    except UpstreamError:
        return False
    finally:
        response.close()
    return response.status == 200


async def is_poisoned(upstream: UpstreamPool, call: Call, replica: Replica) -> bool:
    """True (and logged) when `call` timed out on a replica that still answers its probe."""
    pool = call.route.pool
    if not await replica_answers(upstream, pool, replica):
        return False
    log.warning(
        "poisoned_request tenant=%s request_id=%s deployment=%s replica=%s path=%s "
        "timeout_s=%g: the replica answers its probe, so the request is failed once and not "
        "retried elsewhere",
        call.route.tenant,
        call.request_id,
        pool.name,
        replica.endpoint,
        call.path,
        pool.config.upstream_timeout_seconds,
    )
    return True


class PoisonedRequest(OpenAIError):
    """The 504 of a request that stalled a live replica: failed once, never moved."""


def poisoned_error(call: Call) -> PoisonedRequest:
    timeout = call.route.pool.config.upstream_timeout_seconds
    return PoisonedRequest(
        status=504,
        message=f"The model did not answer this request within {timeout:g} s while answering "
        f"others; it is not retried (request id {call.request_id}).",
        type="upstream_error",
        code="timeout",
        headers={"x-request-id": call.request_id},
    )
