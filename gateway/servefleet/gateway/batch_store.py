"""Where the Batch API keeps files, batches and each batch's journal: one interface
(`BatchStore`), two stores picked by the gateway config (`BatchConfig`): a folder
(`batch_store_folder`: local mode's state folder, or a PersistentVolumeClaim) or an
S3-compatible bucket (`batch_store_s3`).

What every store guarantees, and the runner and the API rely on:
- Tenants are apart: every object lives under its tenant's name, and an id that is not one
  (`ID_PATTERN`) names nothing, so no id reaches another tenant's object or leaves the store.
- An object (a file, its bytes, a batch) is written whole or not at all: a reader, or a
  gateway restarted mid-write, sees the old object or the new one, never part of one.
- A file's bytes are written before its object and deleted after it, so a listed file can
  always be read.
- A journal record, once `append_result` returns, survives a crash; a record torn by one is
  never returned. The journal is the truth a restarted runner resumes from.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any, Protocol

from servefleet.api.batches import (
    BATCH_ID_PREFIX,
    FILE_ID_PREFIX,
    ID_PATTERN,
    Batch,
    FileObject,
    FilePurpose,
)

_ID = re.compile(ID_PATTERN)
_TENANT = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS label, as tenants are


class StoreUnavailable(RuntimeError):
    """The store could not be reached, or failed, for now: the API answers 503 and the runner
    tries again on its next poll; nothing already stored is touched."""


class BatchStore(Protocol):
    """Files and batches of every tenant."""

    def put_file(
        self, tenant: str, filename: str, purpose: FilePurpose, data: bytes
    ) -> FileObject: ...
    def file(self, tenant: str, file_id: str) -> FileObject | None: ...
    def file_content(self, tenant: str, file_id: str) -> bytes | None: ...
    def files(self, tenant: str) -> list[FileObject]:
        """Newest first."""
        ...

    def delete_file(self, tenant: str, file_id: str) -> bool: ...
    def save_batch(self, batch: Batch) -> None: ...
    def batch(self, tenant: str, batch_id: str) -> Batch | None: ...
    def batches(self, tenant: str) -> list[Batch]:
        """Newest first."""
        ...

    def open_batches(self) -> list[Batch]:
        """Every tenant's batches that are not finished (the runner's work), oldest first."""
        ...

    def append_result(self, batch: Batch, record: dict[str, Any]) -> None: ...
    def results(self, batch: Batch) -> list[dict[str, Any]]: ...


def new_batch_id() -> str:
    return BATCH_ID_PREFIX + secrets.token_hex(12)


def new_file(filename: str, purpose: FilePurpose, size: int) -> FileObject:
    return FileObject(
        id=FILE_ID_PREFIX + secrets.token_hex(12),
        bytes=size,
        created_at=int(time.time()),
        filename=filename,
        purpose=purpose,
    )


def check_tenant(tenant: str) -> str:
    """`tenant`, or a ValueError: a tenant name is a DNS label, never a path."""
    if not _TENANT.match(tenant):
        raise ValueError(f"not a tenant name: {tenant!r}")
    return tenant


def is_id(object_id: str) -> bool:
    """An id the store may have made; anything else (a path, a key) names nothing."""
    return _ID.match(object_id) is not None


def newest_first(found: list[Any]) -> list[Any]:
    return sorted(found, key=lambda o: (o.created_at, o.id), reverse=True)
