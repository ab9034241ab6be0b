"""Fetch one model source into the cache: cache hit, lock, download, publish, report.

A failure is a `FetchError`; `fetch_until_done` keeps trying in the same process (soon
for a network blip, slowly for "not found" or "access denied") and logs the cause each
time, so the init container neither exits into a crash loop nor hides why it waits.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from servefleet.api.fetch_progress import FetchProgress, human_bytes
from servefleet.api.model_source import ModelSource
from servefleet.engine.fetch.cache import CacheEntry, folder_bytes
from servefleet.engine.fetch.errors import FetchError
from servefleet.engine.fetch.progress import Emit, ProgressLog


class Download(Protocol):
    """What each source implements."""

    def total_bytes(self) -> int | None: ...

    def run(self, folder: Path) -> None: ...


@dataclass(frozen=True)
class FetchResult:
    """Where the engine finds the model, and whether this call downloaded it."""

    path: Path
    downloaded: bool
    size_bytes: int


def _print(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


def download_for_source(source: ModelSource) -> Download:
    # Imported per source: boto3 and huggingface_hub are heavy and each fetch needs one.
    if source.huggingface is not None:
        from servefleet.engine.fetch.huggingface_source import HuggingFaceDownload

        return HuggingFaceDownload(source.huggingface)
    if source.s3 is not None:
        from servefleet.engine.fetch.s3_source import S3Download

        return S3Download(source.s3)
    if source.url is not None:
        from servefleet.engine.fetch.http_source import HttpDownload

        return HttpDownload(source.url)
    raise FetchError(f"model.source.{source.kind} is not downloaded", permanent=True)


def fetch_model(
    source: ModelSource,
    cache_root: Path,
    *,
    emit: Emit = _print,
    progress_interval: float = 5.0,
    download_for: Callable[[ModelSource], Download] = download_for_source,
    fetched_path: str | None = None,
) -> FetchResult:
    """Make `cache_root/source.fetched_path()` complete, downloading only what is missing.
    An adapter fetch passes its own `download_for` (archives, OCI artifacts) and the
    `fetched_path` that gives (the cache entry: an adapter is a folder)."""
    entry = CacheEntry(cache_root, source.cache_entry())
    path = cache_root / (fetched_path or source.fetched_path())
    if entry.ready():
        return _done(entry, path, emit, downloaded=False)
    download = download_for(source)
    total = download.total_bytes()
    with ProgressLog(entry.partial, total, emit, progress_interval) as progress, entry.locked():
        if entry.ready():  # another pod finished it while we waited for the lock
            return _done(entry, path, emit, downloaded=False)
        entry.partial.mkdir(parents=True, exist_ok=True)
        download.run(entry.partial)
        progress.report()
        entry.commit()
    return _done(entry, path, emit, downloaded=True)


def _done(entry: CacheEntry, path: Path, emit: Emit, *, downloaded: bool) -> FetchResult:
    size = folder_bytes(entry.final)
    how = "downloaded" if downloaded else "already in the cache"
    emit(
        FetchProgress(
            state="done",
            done_bytes=size,
            total_bytes=size,
            message=f"{human_bytes(size)} {how} at {path}",
        ).line()
    )
    return FetchResult(path=path, downloaded=downloaded, size_bytes=size)


@dataclass(frozen=True)
class RetryPolicy:
    """How long to wait between tries: transient errors back off from `first` up to
    `permanent`; permanent ones wait `permanent` (a fixed Secret or upstream is then
    picked up without a restart). `attempts` 0 = forever (in a pod)."""

    first: float = 5.0
    permanent: float = 300.0
    attempts: int = 0


def fetch_until_done(
    source: ModelSource,
    cache_root: Path,
    policy: RetryPolicy,
    *,
    emit: Emit = _print,
    progress_interval: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> FetchResult:
    """`fetch_model`, tried again after each failure; raises the last error when
    `policy.attempts` are used up."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return fetch_model(source, cache_root, emit=emit, progress_interval=progress_interval)
        except FetchError as exc:
            last = policy.attempts and attempt >= policy.attempts
            delay = (
                policy.permanent
                if exc.permanent
                else min(policy.permanent, policy.first * 2 ** (attempt - 1))
            )
            then = "giving up" if last else f"next try in {delay:.0f}s"
            emit(FetchProgress(state="failed", message=f"{exc.message}; {then}").line())
            if last:
                raise
            sleep(delay)
