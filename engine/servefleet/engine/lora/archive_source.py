"""An adapter from a URL: a `.tar`, `.tar.gz` or `.tgz` archive of its PEFT folder.

The archive is downloaded (resumably, as a model file) into the partial cache entry, so the
fetcher's progress lines count it, then unpacked (`lora.unpack`) and removed; a crash
resumes the download and unpacks again from the start.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from servefleet.api.lora import MAX_ADAPTER_BYTES
from servefleet.api.model_source import url_filename
from servefleet.engine.fetch.http_source import HttpDownload, download_resumable
from servefleet.engine.lora.unpack import clear_folder, publish_unpacked, unpack_tar

ARCHIVE_DIR = ".archive"
UNPACK_DIR = ".unpack"


class ArchiveDownload:
    """One archive URL into a PEFT folder."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._head = HttpDownload(url)

    def total_bytes(self) -> int | None:
        return self._head.total_bytes()

    def run(self, folder: Path) -> None:
        archive = folder / ARCHIVE_DIR / url_filename(self.url)
        archive.parent.mkdir(parents=True, exist_ok=True)
        clear_folder(folder, keep=ARCHIVE_DIR)
        download_resumable(self.url, archive, max_bytes=MAX_ADAPTER_BYTES)
        unpacked = folder / UNPACK_DIR
        unpack_tar(archive, unpacked, self.url)
        shutil.rmtree(archive.parent)
        publish_unpacked(unpacked, folder)
        shutil.rmtree(unpacked)
