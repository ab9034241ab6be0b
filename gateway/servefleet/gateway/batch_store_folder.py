"""The Batch API's folder store (`BatchStore`): local mode's state folder, or a
PersistentVolumeClaim mounted into the gateway.

Layout, one folder per tenant so no lookup can cross tenants:
    tenants/<tenant>/files/<file id>.json      the file object
    tenants/<tenant>/files/<file id>.data      its bytes
    tenants/<tenant>/batches/<batch id>.json   the batch object
    tenants/<tenant>/batches/<batch id>.jsonl  the journal: one record per finished line
Objects are written to a temporary name, flushed and renamed, so a reader (or a gateway
restarted mid-write) sees the old object or the new one, never half of one. Journal records
are appended and flushed one by one; a torn last record (a crash mid-append) is ignored.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from servefleet.api.batches import TERMINAL, Batch, FileObject, FilePurpose
from servefleet.gateway.batch_store import check_tenant, is_id, new_file, newest_first


class FolderBatchStore:
    """Files and batches of every tenant under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # -- files ----------------------------------------------------------------------------
    def put_file(self, tenant: str, filename: str, purpose: FilePurpose, data: bytes) -> FileObject:
        file = new_file(filename, purpose, len(data))
        folder = self._folder(tenant, "files")
        _write_atomically(folder / f"{file.id}.data", data)
        _write_atomically(folder / f"{file.id}.json", file.model_dump_json().encode())
        return file

    def file(self, tenant: str, file_id: str) -> FileObject | None:
        path = self._path(tenant, "files", file_id, ".json")
        if path is None or not path.exists():
            return None
        return FileObject.model_validate_json(path.read_bytes())

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        if self.file(tenant, file_id) is None:
            return None
        path = self._path(tenant, "files", file_id, ".data")
        return path.read_bytes() if path is not None else None

    def files(self, tenant: str) -> list[FileObject]:
        """Newest first."""
        found = [
            FileObject.model_validate_json(p.read_bytes())
            for p in self._listing(tenant, "files", ".json")
        ]
        return newest_first(found)

    def delete_file(self, tenant: str, file_id: str) -> bool:
        meta = self._path(tenant, "files", file_id, ".json")
        data = self._path(tenant, "files", file_id, ".data")
        if meta is None or data is None or not meta.exists():
            return False
        meta.unlink()  # the object first: a crash in between leaves bytes nobody can name
        data.unlink(missing_ok=True)
        return True

    # -- batches --------------------------------------------------------------------------
    def save_batch(self, batch: Batch) -> None:
        record = batch.model_dump(mode="json") | {"tenant": batch.tenant}
        path = self._folder(batch.tenant, "batches") / f"{batch.id}.json"
        _write_atomically(path, json.dumps(record).encode())

    def batch(self, tenant: str, batch_id: str) -> Batch | None:
        path = self._path(tenant, "batches", batch_id, ".json")
        if path is None or not path.exists():
            return None
        return Batch.model_validate_json(path.read_bytes())

    def batches(self, tenant: str) -> list[Batch]:
        """Newest first."""
        found = [
            Batch.model_validate_json(p.read_bytes())
            for p in self._listing(tenant, "batches", ".json")
        ]
        return newest_first(found)

    def open_batches(self) -> list[Batch]:
        """Every tenant's batches that are not finished (the runner's work), oldest first."""
        tenants = self.root / "tenants"
        names = sorted(p.name for p in tenants.iterdir()) if tenants.is_dir() else []
        found = [b for t in names for b in self.batches(t) if b.status not in TERMINAL]
        return sorted(found, key=lambda b: (b.created_at, b.id))

    # -- a batch's journal ----------------------------------------------------------------
    def append_result(self, batch: Batch, record: dict[str, Any]) -> None:
        path = self._folder(batch.tenant, "batches") / f"{batch.id}.jsonl"
        line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        with path.open("a+b") as journal:
            end = journal.seek(0, os.SEEK_END)
            if end:  # after a torn record (a crash mid-append), start a line of our own
                journal.seek(end - 1)
                if journal.read(1) != b"\n":
                    line = b"\n" + line
            journal.write(line)
            journal.flush()
            os.fsync(journal.fileno())

    def results(self, batch: Batch) -> list[dict[str, Any]]:
        path = self._path(batch.tenant, "batches", batch.id, ".jsonl")
        if path is None or not path.exists():
            return []
        records = []
        for raw in path.read_bytes().splitlines():
            try:
                records.append(json.loads(raw))
            except ValueError:  # a torn last append
                continue
        return records

    # -- paths ----------------------------------------------------------------------------
    def _folder(self, tenant: str, kind: str) -> Path:
        folder = self.root / "tenants" / check_tenant(tenant) / kind
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _path(self, tenant: str, kind: str, object_id: str, suffix: str) -> Path | None:
        """The object's path, or None for an id that is not one (never a path outside)."""
        if not is_id(object_id):
            return None
        return self._folder(tenant, kind) / f"{object_id}{suffix}"

    def _listing(self, tenant: str, kind: str, suffix: str) -> Iterator[Path]:
        folder = self._folder(tenant, kind)
        return (p for p in folder.iterdir() if p.name.endswith(suffix))


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with temporary.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
