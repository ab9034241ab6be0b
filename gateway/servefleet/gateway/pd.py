"""Disaggregated prefill/decode, the gateway's half: a long prompt's prefill goes to the
prefill pool, its decode (and the answer the client sees) to the decode pool.

A deployment with `GatewayDeployment.prefill` has a second replica set: its prefill pool, a
`DeploymentPool` of its own (`prefill_deployment`) so EndpointSlice discovery and readiness
probing work as for any pool; it takes no tenant traffic. A request whose prompt has at
least `prefill.threshold` tokens (the token counter's count) gets a prefill replica picked
by load (queued prompt tokens) and is joined to its decode replica by the engines' protocol:
- `servefleet`: the decode replica gets `kv_transfer_params.remote_prefill` = the prefill
  replica; the decode engine has it compute the prompt and streams the blocks in (`engine
  kv_puller`), recomputing on any failure. Nothing else changes here.
- `vllm` (its toy proxy's flow, NIXL connector): the prefill replica first gets the request
  with `kv_transfer_params.do_remote_decode`, `max_tokens: 1`, not streamed; the decode
  replica then gets the request with the `kv_transfer_params` the prefill answer carried.
  A failed prefill sends the plain request on (the decode engine computes the prompt).
- `sglang`: `bootstrap_host` (the prefill replica's host), `bootstrap_port` and a random
  63-bit `bootstrap_room` are added to the request, sent to the prefill replica and the
  decode replica at once; the decode replica's answer is relayed.
Either way the relay, splice and failover code sees one upstream: the decode replica.
A continuation after a broken stream goes to a decode replica alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from servefleet.api.kv_transfer import MAX_DEADLINE_S
from servefleet.api.stream_resume import KV_TRANSFER_PARAMS
from servefleet.gateway.pd_pool import PrefillLease, PrefillOverflow
from servefleet.gateway.upstream import UpstreamError, UpstreamPool

if TYPE_CHECKING:
    from servefleet.gateway.call import Call
    from servefleet.gateway.pool import DeploymentPool

log = logging.getLogger("servefleet.gateway.pd")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
VLLM_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What vLLM's prefill replica is sent (its NIXL connector then keeps the blocks for D)."""
_background: set[asyncio.Task[None]] = set()


def with_prefill(pools: Iterable[DeploymentPool]) -> list[DeploymentPool]:
    """Pools and their prefill pools: what is probed and whose Service is watched."""
    return [p for pool in pools for p in (pool, pool.prefill) if p is not None]


def pick_prefill(pool: DeploymentPool, call: Call) -> PrefillLease | None:
    """A prefill replica for `call` when it goes disaggregated: a generation request whose
    prompt reaches the threshold, and a ready prefill replica with room (least queued
    prompt tokens first); else None, and the decode replica prefills itself (counted as the
    prefill pool's unmet demand while it runs, when the prompt reached the threshold)."""
    prefill, settings = pool.prefill, pool.config.prefill
    if prefill is None or settings is None or call.path not in GENERATION_PATHS:
        return None
    if call.prompt_tokens < max(1, settings.threshold):
        return None
    now = prefill.now()
    ready = [r for r in prefill.replicas.replicas.values() if r.routable(now) and r.has_room()]
    if not ready:
        pool.prefill_overflow.value += call.prompt_tokens
        call.prefill_overflow = PrefillOverflow(pool.prefill_overflow, call.prompt_tokens)
        return None
    replica = min(ready, key=lambda r: (r.outstanding_tokens, r.outstanding))
    prefill.replicas.acquire(replica, call.prompt_tokens)
    return PrefillLease(prefill.replicas, replica, call.prompt_tokens)


def servefleet_fields(call: Call) -> dict[str, Any]:
    """What our decode engine is sent: the prefill replica to have compute the prompt."""
    lease, config = call.prefill, call.route.pool.config
    if lease is None or config.prefill is None or config.prefill.protocol != "servefleet":
        return {}
    params = {
        "remote_prefill": lease.replica.endpoint,
        "prefill_threshold": config.prefill.threshold,
        "deadline_s": min(MAX_DEADLINE_S, config.upstream_timeout_seconds),
    }
    return {KV_TRANSFER_PARAMS: params}


class PrefillJoiner:
    """The vLLM and SGLang flows: the gateway itself talks to the prefill replica."""

    def __init__(self, upstream: UpstreamPool) -> None:
        self._upstream = upstream

    async def decode_body(
        self, call: Call, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> bytes:
        """The body the decode replica gets (the prefill replica has been asked by then)."""
        lease, config = call.prefill, call.route.pool.config
        if lease is None or lease.released or config.prefill is None:
            return body
        protocol = config.prefill.protocol
        if protocol == "vllm":
            return await self._vllm(call, lease, body, headers)
        if protocol == "sglang":
            return self._sglang(call, lease, body, headers, config.prefill.bootstrap_port)
        return body

    async def _vllm(
        self, call: Call, lease: PrefillLease, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> bytes:
        request = json.loads(body)
        first = {**request, KV_TRANSFER_PARAMS: dict(VLLM_PREFILL_PARAMS)}
        first.update(stream=False, max_tokens=1)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        first.pop("stream_options", None)
        try:
            answer = await self._post(call, lease, json.dumps(first).encode(), headers)
            params = json.loads(answer).get(KV_TRANSFER_PARAMS) if answer else None
        except (UpstreamError, ValueError, AttributeError) as exc:
            log.info("vllm_prefill_failed replica=%s error=%r", lease.replica.endpoint, exc)
            params = None
        finally:
            lease.release()
        if not isinstance(params, dict):
            return body  # the decode replica computes the prompt itself
        return json.dumps({**request, KV_TRANSFER_PARAMS: params}).encode()

    def _sglang(
        self,
        call: Call,
        lease: PrefillLease,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        port: int,
    ) -> bytes:
        host = urlsplit(lease.replica.endpoint).hostname or ""
        room = secrets.randbits(63)
        joined = {**json.loads(body), "bootstrap_host": host, "bootstrap_port": port}
        joined["bootstrap_room"] = room
        encoded = json.dumps(joined).encode()
        task = asyncio.create_task(self._sglang_prefill(call, lease, encoded, headers))
        _background.add(task)  # runs beside the decode request, which is what is relayed
        task.add_done_callback(_background.discard)
        return encoded

    async def _sglang_prefill(
        self, call: Call, lease: PrefillLease, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        try:
            await self._post(call, lease, body, headers)
        except UpstreamError as exc:
            log.info("sglang_prefill_failed replica=%s error=%r", lease.replica.endpoint, exc)
        finally:
            lease.release()

    async def _post(
        self, call: Call, lease: PrefillLease, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> bytes | None:
        """The prefill replica's whole answer (None: it refused or failed)."""
        config = call.route.pool.config
        response = await self._upstream.request(
            "POST",
            lease.replica.endpoint + call.path,
            body,
            headers,
            connect_timeout=config.connect_timeout_seconds,
            read_timeout=config.upstream_timeout_seconds,
        )
        try:
            data = await response.read()
        finally:
            response.close()
        return data if response.status == 200 else None
