"""Progress lines while a download runs: bytes done/total, at most one line per interval.

Measured from the partial folder's size on disk rather than from each downloader's
callbacks, so every source (and a pod waiting on another pod's download into a shared
cache) reports the same way, and a resumed download starts from what is already there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from servefleet.api.fetch_progress import FetchProgress
from servefleet.engine.fetch.cache import folder_bytes

Emit = Callable[[str], None]


class ProgressLog:
    """A background thread logging `FetchProgress` lines; quiet while nothing changes."""

    def __init__(self, folder: Path, total: int | None, emit: Emit, interval: float) -> None:
        self._folder = folder
        self._total = total
        self._emit = emit
        self._interval = interval
        self._stop = threading.Event()
        self._last: int | None = None
        # Measure and emit under one lock: the thread's line and the caller's final one
        # could otherwise cross, and a stale size would be the last line logged.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fetch-progress", daemon=True)

    def __enter__(self) -> ProgressLog:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.report()

    def report(self) -> None:
        """Log the bytes on disk now, unless unchanged since the last line."""
        with self._lock:
            done = folder_bytes(self._folder)
            if self._total is not None:
                done = min(done, self._total)
            if done == self._last:
                return
            self._last = done
            progress = FetchProgress(state="progress", done_bytes=done, total_bytes=self._total)
            self._emit(progress.model_copy(update={"message": progress.summary()}).line())
