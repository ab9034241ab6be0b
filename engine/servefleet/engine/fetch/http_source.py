"""Plain HTTP(S) downloads of one file, resumed with a Range request after a crash."""

from __future__ import annotations

from pathlib import Path

import httpx

from servefleet.api.model_source import url_filename
from servefleet.engine.fetch.errors import FetchError, http_error

CHUNK = 1 << 20
TIMEOUT = httpx.Timeout(30.0, read=300.0)


class HttpDownload:
    """One URL into `<folder>/<its file name>`."""

    def __init__(self, url: str) -> None:
        self.url = url

    def total_bytes(self) -> int | None:
        """The size from a HEAD request, or None when the server does not say."""
        try:
            response = httpx.head(self.url, follow_redirects=True, timeout=TIMEOUT)
        except httpx.HTTPError as exc:
            raise FetchError(f"{self.url}: {exc}", permanent=False) from exc
        if response.status_code >= 400 and response.status_code != 405:
            raise http_error(response.status_code, self.url)
        length = response.headers.get("content-length")
        return int(length) if length and response.status_code < 300 else None

    def run(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        download_resumable(self.url, folder / url_filename(self.url))


def download_resumable(
    url: str,
    target: Path,
    headers: dict[str, str] | None = None,
    max_bytes: int | None = None,
) -> None:
    """GET `url` into `target`, continuing from the bytes already in it when the server
    honours Range (206); a server that answers 200 instead gets the file from the start.
    Past `max_bytes` the download stops with a permanent error (an untrusted source)."""
    have = target.stat().st_size if target.exists() else 0
    request_headers = dict(headers or {})
    if have:
        request_headers["Range"] = f"bytes={have}-"
    try:
        with httpx.stream(
            "GET", url, headers=request_headers, follow_redirects=True, timeout=TIMEOUT
        ) as response:
            if response.status_code == 416 and have:
                return  # nothing past what we have: the file is complete
            if response.status_code >= 400:
                raise http_error(response.status_code, url)
            mode = "ab" if response.status_code == 206 else "wb"
            written = have if mode == "ab" else 0
            with open(target, mode) as out:
                for chunk in response.iter_bytes(CHUNK):
                    written += len(chunk)
                    if max_bytes is not None and written > max_bytes:
                        raise FetchError(f"{url}: larger than {max_bytes} bytes", permanent=True)
                    out.write(chunk)
    except httpx.HTTPError as exc:
        raise FetchError(f"{url}: {exc}", permanent=False) from exc
