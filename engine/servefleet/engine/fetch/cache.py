"""One entry of the download cache: a lock, a partial folder, and an atomic rename.

Pods sharing the cache (a PVC, or a node's folder) may fetch the same model at once: the
first takes an exclusive `flock` and downloads into `.partial/<entry>`, the others wait on
the lock. A finished download is renamed to `<entry>` in one step, so a folder at its
final name is always complete, and a crash leaves only the partial folder, which the next
fetch resumes instead of starting over.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL_DIR = ".partial"
LOCK_DIR = ".locks"


class CacheEntry:
    """The folders of one cache entry under a cache root."""

    def __init__(self, root: Path, entry: str) -> None:
        self.final = root / entry
        self.partial = root / PARTIAL_DIR / entry
        self._lock_file = root / LOCK_DIR / f"{entry}.lock"

    def ready(self) -> bool:
        """Complete: only a finished download is ever at the final name."""
        return self.final.is_dir()

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the entry's lock (waiting for another holder, in this pod or another)."""
        self._lock_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_file, "a") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def commit(self) -> None:
        """Publish the partial folder under the final name (call with the lock held)."""
        _fsync_tree(self.partial)
        os.rename(self.partial, self.final)


def _fsync_tree(folder: Path) -> None:
    """Flush the files before the rename makes them visible: a node crash right after
    must not leave a complete-looking entry with missing bytes."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under a folder (0 when it does not exist yet)."""
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue  # renamed or removed while we walked
    return total
