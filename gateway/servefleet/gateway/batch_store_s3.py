"""The Batch API's S3-compatible store (`BatchStore`): a bucket on AWS, MinIO or Ceph, shared
by the gateway replicas and kept outside the cluster's volumes.

Layout under the configured prefix, the tenant always from the gateway's key check and every
id checked against `ID_PATTERN` first, so no client string becomes part of a key:
    tenants/<tenant>/files/<file id>.json           the file object
    tenants/<tenant>/files/<file id>.data           its bytes
    tenants/<tenant>/batches/<batch id>.json        the batch object
    tenants/<tenant>/batches/<batch id>.journal/<line index>.json   one finished line
    tenants/<tenant>/batches/<batch id>.journal/<first>-<last>-<rand>.jsonl   folded lines
    open/<tenant>/<batch id>                        a marker while the batch is open
A PUT is atomic in S3 (an object appears whole when its upload completes, and the body is
checked against its MD5), so no reader sees part of an object, and a crash mid-write leaves
the old object or none. S3 has no append: each journal record is an object of its own, named
by its line, so a record is durable once its PUT returns and a line run twice (a restart)
is journaled once. Reading such a journal would take a GET a line, so every
`SEGMENT_RECORDS` records this store journaled are folded into one segment object (one PUT)
and their own objects deleted (one DeleteObjects): a batch of n lines reads back in about
n / SEGMENT_RECORDS GETs. A crash between the two leaves a line twice, read back once. The open
markers spare the runner's poll a read of every batch ever made.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from servefleet.api.batch_storage import BatchS3Store
from servefleet.api.batches import TERMINAL, Batch, FileObject, FilePurpose
from servefleet.gateway.batch_store import (
    StoreUnavailable,
    check_tenant,
    is_id,
    new_file,
    newest_first,
)

_MISSING = frozenset({"404", "NoSuchKey", "NotFound"})
_READERS = 8  # journal objects fetched at once
SEGMENT_RECORDS = 256  # journal records folded into one object (DeleteObjects takes 1,000)
_T = TypeVar("_T")
log = logging.getLogger("servefleet.gateway.batch")


def _reached(call: Callable[[], _T]) -> _T:
    """`call`'s answer; a bucket that cannot be reached, or answers with an error other than
    a missing key, is `StoreUnavailable` (a 503 to the tenant, never a 500)."""
    try:
        return call()
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING:
            raise
        raise StoreUnavailable(f"the batch bucket answered {exc}") from exc
    except BotoCoreError as exc:
        raise StoreUnavailable(f"the batch bucket cannot be reached: {exc}") from exc


class S3BatchStore:
    """Files and batches of every tenant in one bucket, under one prefix."""

    def __init__(self, config: BatchS3Store) -> None:
        session = boto3.Session()
        if session.get_credentials() is None:  # never unsigned: the store holds tenants' data
            raise ValueError(
                "batch.s3 needs credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(the chart sets them from gateway.batch.s3.credentialsSecret) or the pod's "
                "own identity"
            )
        timeouts = Config(
            connect_timeout=5, read_timeout=30, retries={"mode": "standard", "max_attempts": 3}
        )
        self._client: Any = session.client(
            "s3", endpoint_url=config.endpoint, region_name=config.region, config=timeouts
        )
        self.bucket = config.bucket
        self.prefix = config.prefix
        self._unfolded: dict[str, dict[int, bytes]] = {}  # journal -> line index -> record
        self._folding = threading.Lock()  # records are appended from worker threads

    # -- files ----------------------------------------------------------------------------
    def put_file(self, tenant: str, filename: str, purpose: FilePurpose, data: bytes) -> FileObject:
        file = new_file(filename, purpose, len(data))
        base = self._tenant(tenant) + "files/" + file.id
        self._put(base + ".data", data)  # the bytes first: a listed file can be read
        self._put(base + ".json", file.model_dump_json().encode())
        return file

    def file(self, tenant: str, file_id: str) -> FileObject | None:
        raw = self._get_object(tenant, "files", file_id, ".json")
        return FileObject.model_validate_json(raw) if raw is not None else None

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        if self.file(tenant, file_id) is None:
            return None
        return self._get_object(tenant, "files", file_id, ".data")

    def files(self, tenant: str) -> list[FileObject]:
        keys = self._keys(self._tenant(tenant) + "files/", ".json")
        return newest_first(
            [FileObject.model_validate_json(raw) for raw in self._read(keys) if raw]
        )

    def delete_file(self, tenant: str, file_id: str) -> bool:
        if self.file(tenant, file_id) is None:
            return False
        base = self._tenant(tenant) + "files/" + file_id
        self._delete(base + ".json")  # the object first: a crash leaves bytes nobody can name
        self._delete(base + ".data")
        return True

    # -- batches --------------------------------------------------------------------------
    def save_batch(self, batch: Batch) -> None:
        record = batch.model_dump(mode="json") | {"tenant": batch.tenant}
        key = self._tenant(batch.tenant) + f"batches/{batch.id}.json"
        marker = self.prefix + f"open/{batch.tenant}/{batch.id}"
        if batch.status in TERMINAL:
            self._put(key, json.dumps(record).encode())
            self._delete(marker)  # after: a crash leaves a marker of a closed batch, skipped
        else:
            self._put(marker, b"")  # before: an open batch always has its marker
            self._put(key, json.dumps(record).encode())

    def batch(self, tenant: str, batch_id: str) -> Batch | None:
        raw = self._get_object(tenant, "batches", batch_id, ".json")
        return Batch.model_validate_json(raw) if raw is not None else None

    def batches(self, tenant: str) -> list[Batch]:
        keys = self._keys(self._tenant(tenant) + "batches/", ".json")
        return newest_first([Batch.model_validate_json(raw) for raw in self._read(keys) if raw])

    def open_batches(self) -> list[Batch]:
        found = []
        for key in self._keys(self.prefix + "open/", "", delimiter=""):
            tenant, _, batch_id = key[len(self.prefix) + len("open/") :].partition("/")
            batch = self.batch(tenant, batch_id) if is_id(batch_id) else None
            if batch is not None and batch.status not in TERMINAL:
                found.append(batch)
            elif batch is not None:  # closed, its marker left by a crash
                self._delete(key)
        return sorted(found, key=lambda b: (b.created_at, b.id))

    # -- a batch's journal ----------------------------------------------------------------
    def append_result(self, batch: Batch, record: dict[str, Any]) -> None:
        index = record.get("index")
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"a journal record names its line: index={index!r}")
        line = json.dumps(record, separators=(",", ":")).encode()
        journal = self._journal(batch)
        self._put(journal + f"{index:09d}.json", line)
        with self._folding:
            unfolded = self._unfolded.setdefault(journal, {})
            unfolded[index] = line
            if len(unfolded) < SEGMENT_RECORDS:
                return
            del self._unfolded[journal]
        self._fold(journal, unfolded)

    def _fold(self, journal: str, records: dict[int, bytes]) -> None:
        """`records` (each already an object of its own) as one segment, then their objects
        deleted. Best effort: a failure leaves them where they are, still read back."""
        lines = sorted(records)
        name = f"{lines[0]:09d}-{lines[-1]:09d}-{secrets.token_hex(4)}.jsonl"
        gone = [{"Key": journal + f"{i:09d}.json"} for i in lines]
        try:
            self._put(journal + name, b"".join(records[i] + b"\n" for i in lines))
            _reached(
                lambda: self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": gone, "Quiet": True}
                )
            )
        except StoreUnavailable as exc:
            log.warning("batch_journal_not_folded journal=%s error=%s", journal, exc)

    def results(self, batch: Batch) -> list[dict[str, Any]]:
        """One record per line, from line objects and segments alike. A listed line object
        folded away meanwhile (its segment not listed) means reading the listing again."""
        for _ in range(3):
            keys = list(self._keys(self._journal(batch), ""))
            found = self._read(iter(k for k in keys if k.endswith((".json", ".jsonl"))))
            if None not in found:
                break
        records: dict[int, dict[str, Any]] = {}
        for raw in found:
            for line in (raw or b"").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # not one of ours; a PUT is never torn
                    continue
                if isinstance(record, dict) and isinstance(record.get("index"), int):
                    records.setdefault(record["index"], record)
        return list(records.values())

    # -- keys and requests ----------------------------------------------------------------
    def _tenant(self, tenant: str) -> str:
        return f"{self.prefix}tenants/{check_tenant(tenant)}/"

    def _journal(self, batch: Batch) -> str:
        return self._tenant(batch.tenant) + f"batches/{batch.id}.journal/"

    def _get_object(self, tenant: str, kind: str, object_id: str, suffix: str) -> bytes | None:
        """The object's bytes; None for one that is missing or an id that is not one."""
        if not is_id(object_id):
            return None
        return self._get(self._tenant(tenant) + f"{kind}/{object_id}{suffix}")

    def _put(self, key: str, data: bytes) -> None:
        digest = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        _reached(
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=key, Body=data, ContentMD5=digest
            )
        )

    def _get(self, key: str) -> bytes | None:
        try:
            answer = _reached(lambda: self._client.get_object(Bucket=self.bucket, Key=key))
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING:
                return None
            raise
        body: bytes = _reached(answer["Body"].read)
        return body

    def _delete(self, key: str) -> None:
        _reached(lambda: self._client.delete_object(Bucket=self.bucket, Key=key))

    def _keys(self, prefix: str, suffix: str, delimiter: str = "/") -> Iterator[str]:
        """Keys right under `prefix` (every key below it without a delimiter)."""
        listing = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            listing["Delimiter"] = delimiter
        pages = iter(self._client.get_paginator("list_objects_v2").paginate(**listing))
        while (page := _reached(lambda: next(pages, None))) is not None:
            for item in page.get("Contents", []):
                if item["Key"].endswith(suffix):
                    yield item["Key"]

    def _read(self, keys: Iterator[str]) -> list[bytes | None]:
        """The objects at `keys`, several at once; None for one deleted meanwhile."""
        with ThreadPoolExecutor(_READERS) as pool:
            return list(pool.map(self._get, list(keys)))
