"""The soak through `servefleet up`: the local plane users run (gateway, autoscaler, engines as
processes), under mixed load for a long time, with every process of its tree watched.

    python -m servefleet.bench.soak_up --minutes 30      # `make soak-up`
    python -m servefleet.bench.soak_up --minutes 2       # a quick look

It writes `soak_up.json` (figures and broken invariants) and `soak_up.png` (RSS, open fds and
KV use over time, per process) in `--out`, and the plane's logs in `--out`/logs. Always checked:
no request hung, none answered 5xx or cut, the engines' KV blocks all back (usage 0) once the
load stops, and `servefleet up` stopping cleanly with no process left. RSS slope, fd growth and
every kind of request served are judged only over a window of at least `JUDGE_MIN_MINUTES`
(over a minute or two they are noise on busy cores); the figures are always reported. Exit
status 1 when an invariant broke. Each engine runs one thread by default (`--engine-threads`,
OMP_NUM_THREADS inherited through `servefleet up`): two engines and the clients share two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, Field

from servefleet.bench.engine_process import thread_env
from servefleet.bench.fault_common import poll
from servefleet.bench.fault_load import Outcome
from servefleet.bench.fault_stack import MODEL
from servefleet.bench.processes import free_port, servefleet_command
from servefleet.bench.soak_up_load import MIX, LoadLog, mixed_load
from servefleet.bench.soak_up_probe import (
    ProcessFigures,
    ProcessTree,
    Sample,
    SeriesPoint,
    engines_idle,
    figures,
    plot,
)

TENANTS = ("alpha", "beta")
JUDGE_MIN_MINUTES = 10.0
READY_LINE = "ready:"  # what `servefleet up` prints once the warm pool serves


class SoakOptions(BaseModel):
    minutes: float = Field(default=30.0, gt=0)
    clients: int = Field(default=4, ge=1, description="concurrent closed-loop clients")
    replicas: int = Field(default=2, ge=1, description="engine replicas (a fixed pool)")
    engine_threads: int | None = Field(
        default=1, ge=1, description="OMP_NUM_THREADS of `servefleet up`, which its engines inherit"
    )
    warmup_minutes: float | None = Field(default=None, description="default min(5, minutes/3)")
    sample_s: float = Field(default=5.0, gt=0)
    progress_s: float = Field(default=60.0, gt=0)
    max_slope_mib_per_min: float = 1.0
    fd_tolerance: int = 8
    idle_timeout_s: float = 60.0
    ready_timeout_s: float = 600.0
    out: Path = Path("bench/results/soak_up")

    @property
    def warmup_s(self) -> float:
        minutes = self.warmup_minutes
        return 60 * (min(5.0, self.minutes / 3) if minutes is None else minutes)


class SoakReport(BaseModel):
    options: SoakOptions
    cpus: int | None
    load_seconds: float
    warmup_seconds: float
    requests: int
    outcomes: dict[str, int]
    by_kind: dict[str, dict[str, int]]
    status_codes: dict[str, int]
    server_errors: int
    tokens_delivered: int
    first_problems: list[str]
    processes: list[ProcessFigures]
    fds_idle_before: dict[str, int]
    fds_idle_after: dict[str, int]
    seconds_to_kv_idle: float | None
    kv_usage_at_idle: dict[str, float] | None
    up_exit_code: int | None
    left_running: list[str]
    judged: bool  # RSS slope and fd growth judged (a window of at least JUDGE_MIN_MINUTES)
    violations: list[str]
    series: list[SeriesPoint]  # every sample, the last one at idle after the load


def manifest(keys: dict[str, str], replicas: int) -> str:
    """The YAML `servefleet up` runs: the built-in model, a fixed pool, two tenants whose keys
    are in a Secret document of the same file (as examples/llmdeployment.yaml does)."""
    data = "".join(f"\n  {tenant}: {key}" for tenant, key in keys.items())
    tenants = "".join(
        f"\n    - name: {tenant}\n      apiKeySecretRef: {{name: soak-keys, key: {tenant}}}"
        "\n      limits: {requestsPerMinute: 100000, tokensPerMinute: 100000000}"
        for tenant in keys
    )
    return f"""apiVersion: v1
kind: Secret
metadata: {{name: soak-keys}}
type: Opaque
stringData:{data}
---
apiVersion: servefleet.io/v1alpha1
kind: LLMDeployment
metadata: {{name: soak}}
spec:
  model: {{name: {MODEL}, source: {{builtin: {MODEL}}}}}
  engine: {{maxNumSeqs: 4, drainTimeoutSeconds: 20}}
  pool: {{minReplicas: {replicas}, maxReplicas: {replicas}, perReplicaConcurrency: 4}}
  autoscaling: {{targetPerReplica: 4, interval: 2}}
  admission: {{maxQueueDepth: 64, maxQueueWait: 60}}
  tenants:{tenants}
"""


class UpProcess:
    """`servefleet up FILE` as a child in its own session (a Ctrl-C of the soak reaches it only
    as the SIGINT `stop` sends, after the figures are taken)."""

    def __init__(
        self,
        file: Path,
        log_dir: Path,
        env: dict[str, str] | None,
        batch_dir: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / "up.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        argv = [*servefleet_command(), "up", str(file), "--port", str(self.port)]
        if batch_dir is not None:
            argv += ["--batch-dir", str(batch_dir)]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [*argv, "--log-dir", str(log_dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"servefleet up exited {self.proc.returncode}:\n{self.tail()}")
            if any(line.startswith(READY_LINE) for line in self.log.read_text().splitlines()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"servefleet up not ready in {timeout_s:g} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """Ctrl-C, as a user stops it; its exit status (None: it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            return None


def _progress(started: float, options: SoakOptions, log: LoadLog, sample: Sample) -> str:
    counts = {k: v for k, v in log.outcomes().items() if v}
    rss = " ".join(f"{label} {mib:.0f}" for label, (mib, _) in sorted(sample.processes.items()))
    fds = sum(count for _, count in sample.processes.values())
    minutes = (time.monotonic() - started) / 60
    return (
        f"[{minutes:5.1f}/{options.minutes:g} min] {len(log.records)} requests {counts} | "
        f"RSS MiB: {rss} | fds {fds}"
    )


async def _drive(
    up: UpProcess, tree: ProcessTree, keys: list[str], options: SoakOptions, log: LoadLog
) -> tuple[list[Sample], float]:
    """The load, and beside it a sample every `sample_s` and a progress line every
    `progress_s` (samples are taken on a thread: the clients' loop never waits for them)."""
    samples: list[Sample] = []
    started = time.monotonic()
    seconds = options.minutes * 60
    load = asyncio.ensure_future(mixed_load(up.base, keys, MODEL, options.clients, seconds, log))
    next_progress = started + options.progress_s
    while not load.done():
        samples.append(await asyncio.to_thread(tree.sample, time.monotonic() - started))
        if time.monotonic() >= next_progress:
            print(_progress(started, options, log, samples[-1]), flush=True)
            next_progress += options.progress_s
        await asyncio.wait({load}, timeout=options.sample_s)
    await load
    return samples, time.monotonic() - started


def run_soak(options: SoakOptions, workdir: Path) -> tuple[SoakReport, list[Sample]]:
    keys = {tenant: "sk-soak-" + secrets.token_urlsafe(18) for tenant in TENANTS}
    file = workdir / "soak.yaml"
    file.write_text(manifest(keys, options.replicas))
    up = UpProcess(file, options.out / "logs", thread_env(options.engine_threads))
    log, exit_code = LoadLog(), None
    try:
        up.wait_ready(options.ready_timeout_s)
        tree = ProcessTree(up.proc.pid)
        print(f"servefleet up ready at {up.base}: {len(tree.processes())} processes", flush=True)
        before = tree.sample(0.0)
        samples, load_seconds = asyncio.run(_drive(up, tree, list(keys.values()), options, log))
        idle_start = time.monotonic()
        to_idle = poll(lambda: engines_idle(tree) is not None, timeout_s=options.idle_timeout_s)
        after = tree.sample(load_seconds + time.monotonic() - idle_start)
        samples.append(after)
        kv_at_idle = engines_idle(tree)
    finally:
        exit_code = up.stop()
    report = SoakReport(
        options=options,
        cpus=os.cpu_count(),
        load_seconds=round(load_seconds, 1),
        warmup_seconds=options.warmup_s,
        requests=len(log.records),
        outcomes=log.outcomes(),
        by_kind=log.by_kind(),
        status_codes=log.status_codes(),
        server_errors=log.server_errors(),
        tokens_delivered=sum(r.tokens for r in log.records),
        first_problems=log.first_problems(),
        processes=figures([s for s in samples if s is not after], options.warmup_s),
        fds_idle_before={label: fds for label, (_, fds) in before.processes.items()},
        fds_idle_after={label: fds for label, (_, fds) in after.processes.items()},
        seconds_to_kv_idle=to_idle,
        kv_usage_at_idle=kv_at_idle,
        up_exit_code=exit_code,
        left_running=tree.left_running(),
        judged=load_seconds - options.warmup_s >= 60 * JUDGE_MIN_MINUTES,
        violations=[],
        series=[SeriesPoint.of(s) for s in samples],
    )
    report.violations = violations(report)
    return report, samples


def violations(report: SoakReport) -> list[str]:
    """The invariants the run broke (an empty list is a pass)."""
    found = []
    for bad in (Outcome.HUNG, Outcome.FAILED, Outcome.ERROR_EVENT, Outcome.REFUSED_BARE):
        if report.outcomes[bad.value]:
            found.append(f"{report.outcomes[bad.value]} requests {bad.value}")
    if report.server_errors:
        found.append(f"{report.server_errors} answers were 5xx")
    if report.seconds_to_kv_idle is None:
        found.append(f"KV blocks still held {report.options.idle_timeout_s:g} s after the load")
    if report.up_exit_code != 0:
        found.append(f"servefleet up exited {report.up_exit_code} on Ctrl-C")
    if report.left_running:
        found.append(f"left running after servefleet up stopped: {report.left_running}")
    if report.judged:
        served = {Outcome.OK.value, Outcome.LEFT.value}
        unserved = [k for k, counts in report.by_kind.items() if not served & set(counts)]
        if unserved:
            found.append(f"never served: {unserved}")
        limit, tolerance = report.options.max_slope_mib_per_min, report.options.fd_tolerance
        for p in report.processes:
            if p.rss_slope_mib_per_min > limit:
                found.append(f"{p.label} RSS grows {p.rss_slope_mib_per_min} MiB/min")
            if p.fds_last - p.fds_first > tolerance:
                found.append(f"{p.label} fds grew {p.fds_first} -> {p.fds_last}")
    return found


def write(report: SoakReport, samples: list[Sample], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak_up.json").write_text(report.model_dump_json(indent=1))
    title = (
        f"servefleet up soak: {report.load_seconds / 60:.1f} min, {report.options.clients} "
        f"clients, {report.requests} requests, "
        f"{'ok' if not report.violations else 'VIOLATIONS'}"
    )
    plot(samples, report.warmup_seconds, report.load_seconds, title, out / "soak_up.png")


def parse_options(argv: list[str] | None) -> SoakOptions:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    defaults = SoakOptions()
    p.add_argument("--minutes", type=float, default=defaults.minutes, help="of load")
    p.add_argument("--clients", type=int, default=defaults.clients)
    p.add_argument("--replicas", type=int, default=defaults.replicas)
    p.add_argument("--engine-threads", type=int, default=defaults.engine_threads, help="per engine")
    p.add_argument("--warmup-minutes", type=float, default=None, help="min(5, minutes/3)")
    p.add_argument("--sample-s", type=float, default=defaults.sample_s)
    p.add_argument("--progress-s", type=float, default=defaults.progress_s)
    p.add_argument("--max-slope-mib-per-min", type=float, default=defaults.max_slope_mib_per_min)
    p.add_argument("--fd-tolerance", type=int, default=defaults.fd_tolerance)
    p.add_argument("--out", type=Path, default=defaults.out)
    return SoakOptions.model_validate(vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    print(
        f"soak through servefleet up: {options.minutes:g} min of load, {options.clients} "
        f"clients, {options.replicas} engine(s), {len(MIX)} kinds of request",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="servefleet-soak-up-") as workdir:
        report, samples = run_soak(options, Path(workdir))
    write(report, samples, options.out)
    slopes = {p.label: p.rss_slope_mib_per_min for p in report.processes}
    print(f"requests {report.requests}: {report.outcomes}")
    print(f"RSS slope MiB/min after {report.warmup_seconds:g} s of warm-up: {slopes}")
    print(f"fds idle before/after: {report.fds_idle_before} / {report.fds_idle_after}")
    print(f"KV back to 0 after {report.seconds_to_kv_idle} s; up exit {report.up_exit_code}")
    print("verdict:", "ok" if not report.violations else "; ".join(report.violations))
    print(f"wrote {options.out / 'soak_up.json'} and {options.out / 'soak_up.png'}")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
