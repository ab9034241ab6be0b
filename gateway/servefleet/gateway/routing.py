"""Pick a replica: least outstanding work, with prefix affinity, health and a concurrency cap.

Affinity uses rendezvous hashing of the prompt's prefix key over the routable replicas: no
table to keep, stable when replicas come and go (only the keys of a removed replica move), and
every gateway replica makes the same choice, so a prefix stays warm in one engine's cache. The
affine replica loses to the least-loaded one only when it is clearly busier (more than `slack`
requests ahead of it) or full.

A request for a LoRA adapter goes among the replicas that hold it (or are loading it), by the
same rules; it goes to the least-loaded replica instead, which then loads the adapter too,
when every holder is full or more than `slack` requests busier: a hot adapter spreads to a
second replica exactly when its holder is the bottleneck.

A replica that fails or times out is ejected for a back-off that doubles on each consecutive
failure; after it, one trial request is let through (half-open). A replica that answers 503 is
draining: it gets no new requests until its readiness probe says otherwise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from servefleet.api.gateway_stats import GatewayReplicaStats, ReplicaHealth


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _mix(key: int, seed: int) -> int:
    # splitmix64 finaliser: cheap, and well spread for rendezvous scores.
    z = (key ^ seed) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


@dataclass(slots=True, eq=False)
class Replica:
    endpoint: str  # base URL, e.g. http://10.0.0.5:8000
    cap: int
    state: ReplicaHealth = ReplicaHealth.STARTING
    seed: int = 0
    outstanding: int = 0
    outstanding_tokens: int = 0
    failures: int = 0
    ejected_until: float = 0.0
    first_seen: float = 0.0
    ready_at: float | None = None
    served: int = 0
    adapters: set[str] = field(default_factory=set)  # LoRA adapters it holds (as last seen)
    loading: set[str] = field(default_factory=set)  # adapters the gateway is loading there

    def holds(self, adapter: str) -> bool:
        return adapter in self.adapters or adapter in self.loading

    def routable(self, now: float) -> bool:
        if self.state is ReplicaHealth.READY:
            return True
        # Half-open after the back-off: one trial request at a time.
        return (
            self.state is ReplicaHealth.EJECTED
            and now >= self.ejected_until
            and self.outstanding == 0
        )

    def has_room(self, reserve: int = 0) -> bool:
        """A slot free beyond the `reserve` last ones (batch keeps those for interactive)."""
        return self.outstanding < self.cap - reserve


@dataclass(slots=True)
class ReplicaSet:
    """The replicas of one deployment and their load, as the gateway sees them."""

    cap: int
    eject_base_s: float = 1.0
    eject_max_s: float = 30.0
    replicas: dict[str, Replica] = field(default_factory=dict)

    def set_endpoints(
        self, endpoints: Iterable[str], now: float, *, ready: Iterable[str] | None = None
    ) -> None:
        """Replace the replica list, keeping the state and load of replicas that stay.

        `ready` (when given) names the endpoints known to be ready (EndpointSlices say so);
        otherwise new replicas start as STARTING until their readiness probe passes.
        """
        wanted = [e.rstrip("/") for e in endpoints]
        ready_set = None if ready is None else {e.rstrip("/") for e in ready}
        for endpoint in list(self.replicas):
            if endpoint not in wanted:
                del self.replicas[endpoint]
        for endpoint in wanted:
            replica = self.replicas.get(endpoint)
            if replica is None:
                replica = self.replicas[endpoint] = Replica(
                    endpoint, self.cap, seed=stable_hash(endpoint), first_seen=now
                )
            if ready_set is not None:
                self.mark_probe(replica, endpoint in ready_set, now)

    def __len__(self) -> int:
        return len(self.replicas)

    def ready_count(self, now: float) -> int:
        return sum(1 for r in self.replicas.values() if r.routable(now))

    def free_slots(self, now: float, reserve: int = 0) -> int:
        """Free slots on routable replicas, leaving `reserve` slots of each one out."""
        return sum(
            r.cap - reserve - r.outstanding
            for r in self.replicas.values()
            if r.routable(now) and r.has_room(reserve)
        )

    def starting(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state is ReplicaHealth.STARTING]

    def stats(self) -> list[GatewayReplicaStats]:
        return [
            GatewayReplicaStats(
                endpoint=r.endpoint,
                state=r.state,
                outstanding=r.outstanding,
                cap=r.cap,
                served=r.served,
                adapters=sorted(r.adapters),
            )
            for r in self.replicas.values()
        ]

    def others_ready(self, replica: Replica) -> bool:
        """Whether a replica other than `replica` is ready (busy or not)."""
        others = (r for r in self.replicas.values() if r is not replica)
        return any(r.state is ReplicaHealth.READY for r in others)

    def outstanding(self) -> int:
        return sum(r.outstanding for r in self.replicas.values())

    def pick(
        self,
        affinity_key: int | None,
        now: float,
        *,
        slack: int,
        exclude: Replica | None = None,
        adapter: str | None = None,
        reserve: int = 0,
    ) -> Replica | None:
        """The replica for a request that may take a slot only beyond each one's `reserve`."""
        candidates = [r for r in self.replicas.values() if r is not exclude and r.routable(now)]
        chosen = _choose(candidates, affinity_key, slack, reserve)
        if adapter is None or chosen is None:
            return chosen
        holder = _choose([r for r in candidates if r.holds(adapter)], affinity_key, slack, reserve)
        if holder is not None and holder.outstanding <= chosen.outstanding + slack:
            return holder
        return chosen

    def kv_source(self, affinity_key: int | None, chosen: Replica) -> Replica | None:
        """The ready replica a request's prefix is affine to, when the request goes to
        another one (the affine replica was busy): its cache most likely holds the prefix,
        so `chosen` may pull the prefix's KV from it rather than recompute it."""
        if affinity_key is None:
            return None
        ready = (r for r in self.replicas.values() if r.state is ReplicaHealth.READY)
        affine = max(ready, key=lambda r: _mix(affinity_key, r.seed), default=None)
        return None if affine is chosen else affine

    def acquire(self, replica: Replica, tokens: int) -> None:
        replica.outstanding += 1
        replica.outstanding_tokens += tokens

    def release(self, replica: Replica, tokens: int) -> None:
        replica.outstanding -= 1
        replica.outstanding_tokens -= tokens

    # -- health -------------------------------------------------------------------------
    def record_success(self, replica: Replica) -> None:
        replica.served += 1
        if replica.state is ReplicaHealth.EJECTED:
            replica.state = ReplicaHealth.READY
        replica.failures = 0

    def eject(self, replica: Replica, now: float) -> None:
        replica.failures += 1
        backoff = min(self.eject_max_s, self.eject_base_s * 2 ** (replica.failures - 1))
        replica.state = ReplicaHealth.EJECTED
        replica.ejected_until = now + backoff

    def mark_draining(self, replica: Replica) -> None:
        replica.state = ReplicaHealth.DRAINING

    def mark_probe(self, replica: Replica, ready: bool, now: float) -> None:
        """Apply a readiness probe (or an EndpointSlice condition) to a replica's state."""
        if ready:
            if replica.state in (ReplicaHealth.STARTING, ReplicaHealth.DRAINING):
                replica.state = ReplicaHealth.READY
                if replica.ready_at is None:
                    replica.ready_at = now
            elif replica.state is ReplicaHealth.EJECTED and now >= replica.ejected_until:
                replica.state = ReplicaHealth.READY
        elif replica.state is ReplicaHealth.READY:
            # Once ready, "not ready" means draining (or dying): stop sending to it.
            replica.state = ReplicaHealth.DRAINING


def _choose(
    candidates: Iterable[Replica], affinity_key: int | None, slack: int, reserve: int = 0
) -> Replica | None:
    """The affine replica unless it is full or more than `slack` requests busier than the
    least-loaded one with room; None when no candidate has room."""
    least: Replica | None = None
    affine: Replica | None = None
    best_score = -1
    for replica in candidates:
        if affinity_key is not None:
            score = _mix(affinity_key, replica.seed)
            if score > best_score:
                best_score, affine = score, replica
        if replica.has_room(reserve) and (
            least is None
            or (replica.outstanding, replica.outstanding_tokens)
            < (least.outstanding, least.outstanding_tokens)
        ):
            least = replica
    if least is None:
        return None
    if (
        affine is not None
        and affine.has_room(reserve)
        and affine.outstanding <= least.outstanding + slack
    ):
        return affine
    return least
