"""Resident memory of a process tree, sampled on a background thread.

A server's footprint is its whole tree (vLLM and some wrappers fork workers), and its peak
comes during load, so it is sampled while the benchmark runs rather than read once. Read
from /proc (Linux): a sample costs one small file read per process. RSS counts a page shared
by several processes of the tree (a library, a forked child's copy-on-write pages) once in
each, so the tree's RSS overstates what it holds; PSS shares each such page out between its
processes (`smaps_rollup`), so the tree's PSS is what the tree costs the machine, and both
are sampled.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import TracebackType

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _parent_of(stat_text: str) -> int:
    """The ppid field of /proc/<pid>/stat (after the command name, which may hold spaces)."""
    return int(stat_text.rsplit(")", 1)[1].split()[1])


def tree_pids(root: int, proc: Path = Path("/proc")) -> list[int]:
    """`root` and all its descendants alive now."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = _parent_of((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def process_rss_bytes(pid: int, proc: Path = Path("/proc")) -> int:
    """Resident bytes of one process (0 once it has exited)."""
    try:
        resident_pages = int((proc / str(pid) / "statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return resident_pages * PAGE_BYTES


def process_pss_bytes(pid: int, proc: Path = Path("/proc")) -> int:
    """Proportional set size of one process (its RSS where the kernel has no
    `smaps_rollup`; 0 once it has exited)."""
    try:
        with (proc / str(pid) / "smaps_rollup").open() as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return process_rss_bytes(pid, proc)


def tree_rss_bytes(root: int, proc: Path = Path("/proc")) -> int:
    return sum(process_rss_bytes(pid, proc) for pid in tree_pids(root, proc))


def tree_pss_bytes(root: int, proc: Path = Path("/proc")) -> int:
    return sum(process_pss_bytes(pid, proc) for pid in tree_pids(root, proc))


class RssSampler:
    """Samples a process tree's RSS and PSS every `interval_s` while in its `with` block."""

    def __init__(self, root_pid: int, interval_s: float = 0.2) -> None:
        self.root_pid = root_pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []  # (monotonic seconds, RSS bytes)
        self.pss_samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def peak_bytes(self) -> int:
        return max((rss for _, rss in self.samples), default=0)

    @property
    def peak_pss_bytes(self) -> int:
        return max(self.pss_samples, default=0)

    def sample(self) -> int:
        """The tree's RSS now (its PSS is recorded beside it)."""
        rss = tree_rss_bytes(self.root_pid)
        self.samples.append((time.monotonic(), rss))
        self.pss_samples.append(tree_pss_bytes(self.root_pid))
        return rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()
