"""Send a request on: to the replica its lease names, or to the hosted API.

A replica that cannot be reached or fails (5xx) before a byte was relayed is ejected and the
request moved once to another replica (`pool.reroute`); a 503 means draining, not failure, so
the replica is only taken out of rotation. A replica that times out is asked whether it is
alive first (`poison`): if it still answers its probe the request is at fault, and it fails once
with a 504 without touching the replica or any other. A 4xx is the request's own answer and is
never sent anywhere else. Everything after the status line is the relay's job. A client that
leaves while the replica has not answered yet drops the upstream connection, which aborts the
generation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from servefleet.api.cache_salt import CACHE_SALT, SHARING_TENANT
from servefleet.api.chargeback import TENANT_HEADER
from servefleet.api.gateway_config import GatewayDeployment
from servefleet.api.openai_errors import OpenAIError
from servefleet.gateway.adapter_loads import LOAD_TIMEOUT_S, AdapterLoadFailed
from servefleet.gateway.asgi import JSON, Receive, Send
from servefleet.gateway.call import Call
from servefleet.gateway.client_watch import ClientGone, unless_client_leaves
from servefleet.gateway.kv_pull import failover_pull_params, kv_pull_params
from servefleet.gateway.limit_headers import retry_after
from servefleet.gateway.metrics import GatewayMetrics
from servefleet.gateway.pd import PrefillJoiner, pick_prefill, servefleet_fields
from servefleet.gateway.poison import PoisonedRequest, is_poisoned, poisoned_error
from servefleet.gateway.pool import DeploymentPool, Lease
from servefleet.gateway.proxy import prepare_body
from servefleet.gateway.queueing import TrafficClass
from servefleet.gateway.relay import Relay
from servefleet.gateway.routing import Replica
from servefleet.gateway.stream_splice import (
    StreamSplice,
    continuation_body,
    encode,
    first_body,
    resumable,
)
from servefleet.gateway.upstream import (
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)

JSON_HEADERS = [(b"content-type", JSON)]
REQUEST_ID_HEADER = b"x-request-id"


def engine_headers(
    config: GatewayDeployment, request_id: str = "", tenant: str = ""
) -> list[tuple[bytes, bytes]]:
    """Headers of a request to a replica: the engine key as a Bearer token when it needs one,
    the gateway's request id (the engine's log lines can name it) and the tenant its steps are
    billed to (`servefleet.api.chargeback`; built here, never copied from the client's)."""
    headers = JSON_HEADERS
    if config.engine_api_key is not None:
        key = config.engine_api_key.read().encode()
        headers = [*headers, (b"authorization", b"Bearer " + key)]
    if request_id:
        headers = [*headers, (REQUEST_ID_HEADER, request_id.encode())]
    if tenant:
        headers = [*headers, (TENANT_HEADER.encode(), tenant.encode())]
    return headers


def engine_fields(call: Call, lease: Lease) -> dict[str, Any]:
    """What the gateway adds to a request for its engines: for those that take ours
    (servefleet) a batch tenant's `priority` (interactive is the engine's default, 0) and
    where a long prompt's prefix KV may be pulled from (`kv_pull_params`); for every kind the
    tenant's `cache_salt` (`servefleet.api.cache_salt`)."""
    config = call.route.pool.config
    if call.path not in ("/v1/chat/completions", "/v1/completions"):
        return {}
    fields = kv_pull_params(config, lease, call.prompt_tokens)
    fields.update(servefleet_fields(call))  # P/D: the decode engine has the prefill one compute
    if config.prefix_cache_sharing == SHARING_TENANT and call.cache_salt is not None:
        fields[CACHE_SALT] = call.cache_salt  # the tenant's, never the client's own as sent
    if call.route.traffic_class is TrafficClass.BATCH and config.engine_priority:
        fields["priority"] = "batch"
    return fields


class Forwarder:
    def __init__(self, upstream: UpstreamPool, metrics: GatewayMetrics, relay: Relay) -> None:
        self._upstream = upstream
        self._metrics = metrics
        self._relay = relay
        self._joiner = PrefillJoiner(upstream)  # P/D with vLLM and SGLang engines

    async def to_pool(self, call: Call, lease: Lease, send: Send, receive: Receive) -> None:
        """Relay the replica's answer; raises OpenAIError when no replica could answer."""
        pool = call.route.pool
        call.prefill = pick_prefill(pool, call)
        if call.prefill is not None:
            pool.count_kv_decision("pd")
        first, body = self._pool_body(call, lease)
        retried = False
        while True:
            try:
                response, failure = await unless_client_leaves(
                    self._try(call, lease, body), receive
                )
            except ClientGone:
                pool.release(lease, ok=False)
                return
            if failure is None:
                break
            if isinstance(failure, PoisonedRequest | AdapterLoadFailed):  # the replica is fine
                pool.release(lease, ok=False)
                failure.headers.update({k.decode(): v.decode() for k, v in call.rl_headers})
                raise failure
            if failure.status != 503:
                pool.eject(lease.replica)
                self._metrics.ejections.labels(pool.model).inc()
            try:
                moved = (
                    None
                    if retried
                    else await unless_client_leaves(self._move(pool, lease), receive)
                )
            except ClientGone:  # left while waiting for another replica's slot
                pool.release(lease, ok=False)
                return
            if moved is None:
                if not retried and pool.replicas.others_ready(lease.replica):
                    failure = _all_busy(pool)  # waited out: a refusal, not a failure
                pool.release(lease, ok=False)
                failure.headers.update({k.decode(): v.decode() for k, v in call.rl_headers})
                raise failure
            retried = True
            lease = moved
            self._metrics.upstream_retries.labels(pool.model).inc()
        assert response is not None
        call.replica = lease.replica.endpoint
        leases = [lease]

        async def resume() -> UpstreamResponse | None:
            if first is None:  # a whole answer (or a stream that cannot be continued): once
                return None if retried or call.stream else await self._again(call, leases, body)
            return await self._continue(call, leases, first)

        ok = False
        try:
            ok = await self._relay.relay(call, response, send, receive, spill=False, resume=resume)
        finally:
            pool.release(leases[-1], ok=ok)

    async def _try(
        self, call: Call, lease: Lease, body: bytes
    ) -> tuple[UpstreamResponse | None, OpenAIError | None]:
        """`_attempt` on the leased replica; a timeout on a replica that still answers its
        probe is the request's fault (`poison`), not the replica's."""
        replica = lease.replica
        pool = call.route.pool
        try:  # P/D: the prefill replica's part is over once the decode replica answers
            body = await self._joiner.decode_body(call, body, engine_headers(pool.config))
            response, failure = await self._attempt(pool, replica, call, body)
        finally:
            if call.prefill is not None:
                call.prefill.release()
            if call.prefill_overflow is not None:
                call.prefill_overflow.release()
        if call.timed_out and await is_poisoned(self._upstream, call, replica):
            return None, poisoned_error(call)
        return response, failure

    @staticmethod
    async def _move(pool: DeploymentPool, lease: Lease) -> Lease | None:
        """Another replica for a request whose replica failed before a byte: a free slot, else
        the next one the busy replicas free, within maxQueueWait (a queued request's bound)."""
        return await pool.reroute_waiting(lease, pool.config.admission.max_queue_wait)

    @staticmethod
    def _pool_body(call: Call, lease: Lease) -> tuple[dict[str, Any] | None, bytes]:
        """(the request as a continuation builds on it, or None: not resumable; what is sent)."""
        config = call.route.pool.config
        extra = engine_fields(call, lease)
        if config.max_continuations == 0 or not resumable(call.parsed, stream=call.stream):
            body = prepare_body(
                call.raw,
                call.parsed,
                stream=call.stream,
                client_wants_usage=call.wants_usage,
                extra=extra,
            )
            return None, body
        first = first_body({**call.parsed, **extra}, exact=config.exact_continuation)
        first["stream_options"] = {**(first.get("stream_options") or {}), "include_usage": True}
        call.splice = StreamSplice(
            chat=call.path.endswith("/chat/completions"),
            exact=config.exact_continuation,
            seed=first["seed"],
        )
        return first, encode(first)

    async def _again(self, call: Call, leases: list[Lease], body: bytes) -> UpstreamResponse | None:
        """The whole request once more on another replica: its replica failed mid-answer."""
        pool = call.route.pool
        if call.timed_out and await is_poisoned(self._upstream, call, leases[-1].replica):
            return None
        pool.eject(leases[-1].replica)
        self._metrics.ejections.labels(pool.model).inc()
        moved = await pool.reroute_waiting(leases[-1], pool.config.upstream_timeout_seconds)
        if moved is None:
            return None
        leases.append(moved)
        self._metrics.upstream_retries.labels(pool.model).inc()
        response, _ = await self._attempt(pool, moved.replica, call, body)
        if response is not None:
            call.replica = moved.replica.endpoint
        return response

    async def _continue(
        self, call: Call, leases: list[Lease], first: dict[str, Any] | None
    ) -> UpstreamResponse | None:
        """The rest of a broken stream from another replica; None when none can give it."""
        pool, splice = call.route.pool, call.splice
        assert first is not None and splice is not None
        while splice.continuations < pool.config.max_continuations:
            if call.timed_out and await is_poisoned(self._upstream, call, leases[-1].replica):
                return None  # silent on this request alone: the request, not the replica
            pool.eject(leases[-1].replica)  # it broke mid-stream: dead or stalled
            self._metrics.ejections.labels(pool.model).inc()
            # Every other replica busy: wait for a slot rather than cut the client's answer, as
            # long as a replica may stay silent mid-stream.
            wait_s = pool.config.upstream_timeout_seconds
            moved = await pool.reroute_waiting(leases[-1], wait_s)
            if moved is None:
                return None
            leases.append(moved)
            splice.continuations += 1
            splice.broken = False
            self._metrics.stream_continuations.labels(pool.model).inc()
            tokens = call.prompt_tokens + len(splice.delivered_ids)
            resumed = continuation_body(first, splice)
            pair = (leases[-2], moved)
            body = encode(failover_pull_params(pool.config, pool.replicas, pair, resumed, tokens))
            response, _ = await self._attempt(pool, moved.replica, call, body)
            if response is not None and response.status == 200:
                call.replica = moved.replica.endpoint
                return response
            if response is not None:
                response.close()  # refused (4xx): this request cannot be continued
                return None
        return None

    async def _attempt(
        self, pool: DeploymentPool, replica: Replica, call: Call, body: bytes
    ) -> tuple[UpstreamResponse | None, OpenAIError | None]:
        """The replica's response, or why it gave none (a 5xx response is closed here). A
        request for an adapter first has it loaded there; an engine that evicted it since
        (404) gets it loaded once more."""
        adapter = call.route.adapter
        deadline_s = pool.config.admission.max_queue_wait
        for attempt in (1, 2):
            if adapter is not None:
                post = self._poster(pool)
                refused = await pool.adapter_loads.ensure(
                    replica, adapter, post, deadline_s=deadline_s
                )
                if refused is not None:
                    return None, refused
            response, failure = await self._send(pool, replica, call, body)
            if adapter is None or response is None or response.status != 404 or attempt == 2:
                return response, failure
            response.close()  # evicted since it was loaded: load it again, once
            pool.adapter_loads.forget(replica, adapter.name)
        raise AssertionError("unreachable")

    def _poster(self, pool: DeploymentPool) -> Callable[[str, bytes], Awaitable[UpstreamResponse]]:
        config = pool.config

        def post(url: str, body: bytes) -> Awaitable[UpstreamResponse]:
            return self._upstream.request(
                "POST",
                url,
                body,
                engine_headers(config),
                connect_timeout=config.connect_timeout_seconds,
                read_timeout=LOAD_TIMEOUT_S,
            )

        return post

    async def _send(
        self, pool: DeploymentPool, replica: Replica, call: Call, body: bytes
    ) -> tuple[UpstreamResponse | None, OpenAIError | None]:
        config = pool.config
        call.timed_out = False
        try:
            response = await self._upstream.request(
                "POST",
                replica.endpoint + call.path,
                body,
                engine_headers(config, call.request_id, call.route.tenant),
                connect_timeout=config.connect_timeout_seconds,
                read_timeout=config.upstream_timeout_seconds,
            )
        except UpstreamTimeout:
            call.timed_out = True
            return None, OpenAIError(
                status=504,
                message="The model replica timed out.",
                type="upstream_error",
                code="timeout",
            )
        except UpstreamError as exc:
            return None, OpenAIError(
                status=502,
                message=f"The model replica could not be reached ({exc}).",
                type="upstream_error",
                code="upstream_unreachable",
            )
        if response.status < 500:
            return response, None
        response.close()
        if response.status == 503:
            pool.mark_draining(replica)
            return None, OpenAIError(
                status=503,
                message="The model replica is draining.",
                type="server_overloaded",
                code="overloaded",
                headers={"retry-after": retry_after(pool.cold_start.value)},
            )
        return None, OpenAIError(
            status=502,
            message=f"The model replica failed with status {response.status}.",
            type="upstream_error",
            code="upstream_error",
        )

    async def to_spill(self, call: Call, send: Send, receive: Receive) -> None:
        """Relay the hosted API's answer; its budget was taken by the pool."""
        target = call.route.spill
        assert target is not None
        body = prepare_body(
            call.raw,
            call.parsed,
            stream=call.stream,
            client_wants_usage=call.wants_usage,
            model=target.model,
            drop=(CACHE_SALT,),  # our engines' cache scope: meaningless to a hosted API
        )
        url = target.base_url + call.path.removeprefix("/v1")
        rl = {k.decode(): v.decode() for k, v in call.rl_headers}
        try:
            response = await self._upstream.request(
                "POST",
                url,
                body,
                [(b"content-type", JSON), (b"authorization", target.authorization.encode())],
                connect_timeout=min(target.timeout_s, 10.0),
                read_timeout=target.timeout_s,
            )
        except UpstreamError as exc:
            raise _spill_error(exc, rl) from None
        await self._relay.relay(call, response, send, receive, spill=True)


def _all_busy(pool: DeploymentPool) -> OpenAIError:
    return OpenAIError(
        status=503,
        message="The model replica failed and every other one stayed busy.",
        type="server_overloaded",
        code="overloaded",
        headers={"retry-after": retry_after(pool.service_time.value)},
    )


def _spill_error(exc: UpstreamError, headers: dict[str, str]) -> OpenAIError:
    if isinstance(exc, UpstreamTimeout):
        return OpenAIError(
            status=504,
            message="The spill-over API timed out.",
            type="upstream_error",
            code="timeout",
            headers=headers,
        )
    return OpenAIError(
        status=502,
        message=f"The spill-over API could not be reached ({exc}).",
        type="upstream_error",
        code="upstream_unreachable",
        headers=headers,
    )
