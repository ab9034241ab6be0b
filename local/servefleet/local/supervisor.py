"""Engine replicas as local processes: what a ReplicaSet and kubelet do, for one deployment.

The supervisor keeps `desired` live replicas: it starts processes (each on its own port),
marks them ready when `/ready` answers 200, replaces any that die or never become ready
(with exponential back-off while they keep crashing, their last log lines on the console),
and on scale-down drains the chosen one with SIGTERM (the engine stops admitting, finishes
in-flight requests, exits 0). Children run in their own session so a terminal Ctrl-C reaches
only us, and we stop them in order; if we die, the kernel sends them SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from servefleet.api.engines import engine_adapter
from servefleet.autoscaler.observe import ReplicaTarget
from servefleet.autoscaler.signals import ReplicaState

from .crash_backoff import CrashBackoff, last_lines
from .ports import free_port

log = logging.getLogger(__name__)

# Local mode runs only our engine (see engine_command).
READY_PATH = engine_adapter("servefleet").ready_path

CommandFor = Callable[[int], list[str]]
OnChange = Callable[[list[str], list[str]], None]
"""Called with (endpoints of starting + ready replicas, endpoints of ready ones)."""


@dataclass(eq=False)
class ReplicaProcess:
    name: str
    port: int
    base_url: str
    process: asyncio.subprocess.Process
    started_at: float
    log_file: IO[bytes]
    log_path: Path
    state: ReplicaState = ReplicaState.STARTING
    ready_at: float | None = None

    @property
    def exited(self) -> bool:
        return self.process.returncode is not None


@dataclass(frozen=True)
class TimelineEntry:
    at: float
    replica: str
    event: str


def _die_with_parent() -> None:
    """preexec: SIGTERM this child when the supervisor process dies (Linux prctl)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class DeploymentSupervisor:
    def __init__(
        self,
        name: str,
        command_for: CommandFor,
        *,
        host: str = "127.0.0.1",
        log_dir: Path,
        on_change: OnChange | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 900.0,
        stop_timeout_s: float = 5.0,
        poll_interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        backoff: CrashBackoff | None = None,
        ports: Sequence[int] = (),
    ) -> None:
        """`ports`: fixed ports, for a pool whose addresses the gateway's config names (a
        prefill pool): each replica takes one no live process holds; empty: a free port each."""
        self.name = name
        self._ports = tuple(ports)
        self._command_for = command_for
        self._host = host
        self._log_dir = log_dir
        self._on_change = on_change or (lambda _all, _ready: None)
        self._env = dict(os.environ if env is None else env)
        self._ready_timeout_s = ready_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self.backoff = backoff or CrashBackoff()
        self._ids = itertools.count()
        self.desired = 0
        self.replicas: dict[str, ReplicaProcess] = {}
        self.timeline: list[TimelineEntry] = []
        self._prefer_victim: str | None = None
        self._client = httpx.AsyncClient(timeout=2.0)
        self._published: tuple[list[str], list[str]] | None = None
        self._stopping = False

    # -- what others read -------------------------------------------------------------------
    def live(self) -> list[ReplicaProcess]:
        return [r for r in self.replicas.values() if r.state is not ReplicaState.DRAINING]

    def targets(self) -> list[ReplicaTarget]:
        return [
            ReplicaTarget(name=r.name, base_url=r.base_url, state=r.state)
            for r in self.replicas.values()
        ]

    def pids(self) -> dict[str, int]:
        return {r.name: r.process.pid for r in self.replicas.values()}

    # -- what the autoscaler asks ----------------------------------------------------------
    def scale(self, desired: int, victim: str | None = None) -> None:
        self.desired = max(0, desired)
        self._prefer_victim = victim

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        while not self._stopping:
            await self.reconcile()
            await asyncio.sleep(self._poll_interval_s)

    async def reconcile(self) -> None:
        """One pass: reap exits, start or drain toward `desired`, then probe readiness."""
        now = self._clock()
        for replica in list(self.replicas.values()):
            if replica.exited:
                self._reap(replica)
        # Replace and drain before probing: the probe awaits, and nobody may observe the pool
        # between a death and its replacement.
        live = self.live()
        for _ in range(self.desired - len(live)):
            if not self.backoff.may_start(self._clock()):
                break
            await self._start()
        if len(live) > self.desired:
            for victim in self._victims(live, len(live) - self.desired):
                self._drain(victim)
        starting = [r for r in self.replicas.values() if r.state is ReplicaState.STARTING]
        await asyncio.gather(*(self._probe(r, now) for r in starting))
        self._publish()

    async def stop(self) -> None:
        """Stop every process: SIGTERM, then SIGKILL after the stop timeout."""
        self._stopping = True
        for replica in self.replicas.values():
            if not replica.exited:
                with contextlib.suppress(ProcessLookupError):
                    replica.process.send_signal(signal.SIGTERM)
        deadline = self._clock() + self._stop_timeout_s
        for replica in list(self.replicas.values()):
            remaining = max(0.0, deadline - self._clock())
            try:
                await asyncio.wait_for(replica.process.wait(), remaining)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    replica.process.kill()
                await replica.process.wait()
            self._reap(replica)
        await self._client.aclose()

    # -- internals -------------------------------------------------------------------------
    async def _start(self) -> None:
        port = self._next_port()
        if port is None:
            return  # every fixed port is still held (a draining replica): next pass
        name = f"{self.name}-{next(self._ids)}"
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._log_dir / f"{name}.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 (lives with the process)
        argv = self._command_for(port)
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            env=self._env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        replica = ReplicaProcess(
            name=name,
            port=port,
            base_url=f"http://{self._host}:{port}",
            process=process,
            started_at=self._clock(),
            log_file=log_file,
            log_path=log_path,
        )
        self.replicas[name] = replica
        self._note(replica, f"started pid {process.pid} port {port}")

    def _next_port(self) -> int | None:
        if not self._ports:
            return free_port(self._host)
        held = {r.port for r in self.replicas.values() if not r.exited}
        return next((p for p in self._ports if p not in held), None)

    async def _probe(self, replica: ReplicaProcess, now: float) -> None:
        try:
            response = await self._client.get(replica.base_url + READY_PATH)
            ready = response.status_code == 200
        except httpx.HTTPError:
            ready = False
        if ready and replica.state is ReplicaState.STARTING:
            replica.state = ReplicaState.READY
            replica.ready_at = self._clock()
            self._note(replica, f"ready after {replica.ready_at - replica.started_at:.1f}s")
        elif not ready and now - replica.started_at > self._ready_timeout_s:
            self._note(replica, "not ready in time; replacing it")
            replica.process.kill()

    def _victims(self, live: list[ReplicaProcess], count: int) -> list[ReplicaProcess]:
        """The autoscaler's choice first, then starting replicas, then the newest ready ones."""
        ordered = sorted(
            live,
            key=lambda r: (
                r.name != self._prefer_victim,
                r.state is not ReplicaState.STARTING,
                -r.started_at,
            ),
        )
        return ordered[:count]

    def _drain(self, replica: ReplicaProcess) -> None:
        replica.state = ReplicaState.DRAINING
        with contextlib.suppress(ProcessLookupError):
            replica.process.send_signal(signal.SIGTERM)
        self._note(replica, "draining (SIGTERM)")

    def _reap(self, replica: ReplicaProcess) -> None:
        if self.replicas.pop(replica.name, None) is None:
            return
        replica.log_file.close()
        code = replica.process.returncode
        if replica.state is ReplicaState.DRAINING or self._stopping:
            self._note(replica, f"exited {code}")
            return
        now = self._clock()
        ready_for = None if replica.ready_at is None else now - replica.ready_at
        delay = self.backoff.crashed(now, ready_for)
        self._note(
            replica,
            f"exited {code} unexpectedly (crash {self.backoff.crashes} in a row); "
            f"replacing it in {delay:.0f}s; its last lines ({replica.log_path}):",
            level=logging.WARNING,
        )
        for line in last_lines(replica.log_path):
            log.warning("%s| %s", replica.name, line)

    def _publish(self) -> None:
        endpoints = [r.base_url for r in self.live()]
        ready = [r.base_url for r in self.live() if r.state is ReplicaState.READY]
        if self._published != (endpoints, ready):
            self._published = (endpoints, ready)
            self._on_change(endpoints, ready)

    def _note(self, replica: ReplicaProcess, event: str, level: int = logging.INFO) -> None:
        self.timeline.append(TimelineEntry(self._clock(), replica.name, event))
        log.log(level, "%s: %s", replica.name, event)
