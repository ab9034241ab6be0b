"""What the `servefleet up` soak watches: every process of the tree (`servefleet up` and all its
children) sampled for resident memory and open file descriptors, the engines' KV use read from
their own /metrics, and the figures and PNG made of those samples.

Processes are found again at each sample (psutil, recursively), so an engine the supervisor
replaces shows up as a new series instead of hiding inside a tree total; an engine is named by
its port, which is stable while it lives and what its /metrics answers on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from pydantic import BaseModel

from servefleet.api.engines import engine_adapter
from servefleet.bench.fault_soak import slope_per_minute
from servefleet.bench.fault_stack import metric_sum, scrape

ENGINE_METRICS = engine_adapter("servefleet").metrics
UP_LABEL = "up"
ENGINE_PREFIX = "engine-"  # + its port
EXIT_GRACE_S = 10.0  # a child may outlive its parent this long (see `left_running`)


@dataclass
class Sample:
    t: float  # seconds since the load began
    processes: dict[str, tuple[float, int]]  # label -> (RSS MiB, open file descriptors)
    kv_usage: dict[str, float] = field(default_factory=dict)  # engine label -> fraction used
    running: dict[str, float] = field(default_factory=dict)  # engine label -> sequences


def _flag(cmdline: list[str], name: str) -> str | None:
    return cmdline[cmdline.index(name) + 1] if name in cmdline[:-1] else None


class ProcessTree:
    """`servefleet up` (the root) and whatever it runs now."""

    def __init__(self, root_pid: int) -> None:
        self.root = psutil.Process(root_pid)
        self.seen: dict[int, str] = {}  # pid -> label, every process ever sampled
        self._urls: dict[str, str] = {}  # engine label -> base URL

    def _label(self, proc: psutil.Process) -> str:
        if proc.pid not in self.seen:
            cmdline = proc.cmdline()
            port = _flag(cmdline, "--port")
            if proc.pid == self.root.pid:
                label = UP_LABEL
            elif "engine" in cmdline and port is not None:
                label = f"{ENGINE_PREFIX}{port}"
                self._urls[label] = f"http://{_flag(cmdline, '--host') or '127.0.0.1'}:{port}"
            else:
                label = f"{proc.name()}-{proc.pid}"
            self.seen[proc.pid] = label
        return self.seen[proc.pid]

    def processes(self) -> list[tuple[str, psutil.Process]]:
        found = []
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append((self._label(proc), proc))
            except psutil.Error:
                continue  # exited while we looked
        return found

    def engine_urls(self) -> dict[str, str]:
        """Engines alive now, by label."""
        return {label: self._urls[label] for label, _ in self.processes() if label in self._urls}

    def sample(self, t: float) -> Sample:
        sample = Sample(t=t, processes={})
        for label, proc in self.processes():
            try:
                sample.processes[label] = (proc.memory_info().rss / 2**20, proc.num_fds())
            except psutil.Error:
                continue
        for label, url in self.engine_urls().items():
            try:
                metrics = scrape(url)
            except httpx.HTTPError:
                continue  # loading, or going away
            sample.kv_usage[label] = metric_sum(metrics, ENGINE_METRICS.kv_cache_usage)
            sample.running[label] = metric_sum(metrics, ENGINE_METRICS.requests_running)
        return sample

    def left_running(self, grace_s: float = EXIT_GRACE_S) -> list[str]:
        """Processes of the tree still alive `grace_s` after `servefleet up` was stopped (none
        may be). The grace is for children that exit once their parent has: an engine's
        grammar-compiler fork server notices its engine is gone a second or two later."""
        deadline = time.monotonic() + grace_s
        while True:
            left = []
            for pid, label in self.seen.items():
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        left.append(f"{label} (pid {pid})")
                except psutil.Error:
                    continue
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.2)


def engines_idle(tree: ProcessTree) -> dict[str, float] | None:
    """Each live engine's KV use when none runs a sequence or holds a block, else None."""
    sample = tree.sample(0.0)
    engines = tree.engine_urls()
    if not engines or set(sample.kv_usage) != set(engines):
        return None
    busy = any(sample.kv_usage.values()) or any(sample.running.values())
    return None if busy else sample.kv_usage


class ProcessFigures(BaseModel):
    """One process over the measured window (after the warm-up)."""

    label: str
    samples: int
    rss_mib_first: float
    rss_mib_last: float
    rss_mib_max: float
    rss_slope_mib_per_min: float
    fds_first: int
    fds_last: int
    fds_max: int


class SeriesPoint(BaseModel):
    """One sample as the JSON keeps it (to plot or fit again without rerunning)."""

    t: float
    rss_mib: dict[str, float]
    fds: dict[str, int]
    kv_usage: dict[str, float]

    @classmethod
    def of(cls, sample: Sample) -> SeriesPoint:
        return cls(
            t=round(sample.t, 1),
            rss_mib={label: round(mib, 1) for label, (mib, _) in sample.processes.items()},
            fds={label: fds for label, (_, fds) in sample.processes.items()},
            kv_usage=sample.kv_usage,
        )


def figures(samples: list[Sample], warmup_s: float) -> list[ProcessFigures]:
    """Per process seen in the measured window: RSS first/last/max/slope, fds first/last."""
    window = [s for s in samples if s.t >= warmup_s]
    labels = sorted({label for s in window for label in s.processes})
    found = []
    for label in labels:
        points = [(s.t, *s.processes[label]) for s in window if label in s.processes]
        rss = [(t, mib) for t, mib, _ in points]
        fds = [count for _, _, count in points]
        found.append(
            ProcessFigures(
                label=label,
                samples=len(points),
                rss_mib_first=round(rss[0][1], 1),
                rss_mib_last=round(rss[-1][1], 1),
                rss_mib_max=round(max(m for _, m in rss), 1),
                rss_slope_mib_per_min=round(slope_per_minute(rss), 3),
                fds_first=fds[0],
                fds_last=fds[-1],
                fds_max=max(fds),
            )
        )
    return found


def plot(samples: list[Sample], warmup_s: float, load_s: float, title: str, path: Path) -> None:
    """RSS (and its change since the warm-up, where a slope shows) and open fds per process,
    and each engine's KV use, over the run; the last sample is at idle, after the load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    for label in sorted({label for s in samples for label in s.processes}):
        points = [(s.t / 60, *s.processes[label]) for s in samples if label in s.processes]
        measured = [mib for t, mib, _ in points if t * 60 >= warmup_s]
        base = measured[0] if measured else points[0][1]
        axes[0].plot([p[0] for p in points], [p[1] for p in points], label=label)
        axes[1].plot([p[0] for p in points], [p[1] - base for p in points], label=label)
        axes[2].plot([p[0] for p in points], [p[2] for p in points], label=label)
    for label in sorted({label for s in samples for label in s.kv_usage}):
        kv = [(s.t / 60, 100 * s.kv_usage[label]) for s in samples if label in s.kv_usage]
        axes[3].plot([p[0] for p in kv], [p[1] for p in kv], label=label)
    names = (
        "RSS (MiB)",
        "RSS change since warm-up (MiB)",
        "open file descriptors",
        "KV cache in use (%)",
    )
    for ax, name in zip(axes, names, strict=True):
        ax.axvspan(0, warmup_s / 60, color="grey", alpha=0.15, label="warm-up (not measured)")
        ax.axvline(load_s / 60, color="black", linestyle=":", label="load stops")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1].set_xlabel("minutes since the load began")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
