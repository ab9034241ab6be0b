"""S3-compatible downloads (AWS, MinIO, Ceph): one object, or every object under a prefix.

Credentials come the way boto3 finds them (the AWS_* variables the operator sets from
the deployment's Secret, or the pod's own identity); with none at all the requests go
unsigned, as for a public bucket (an engine fetching an adapter holds no credentials).
Objects already complete in the partial folder are skipped and a cut-off one continues
with a ranged GET, so a restarted fetch resumes.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from servefleet.api.model_source import S3Source
from servefleet.engine.fetch.errors import FetchError

CHUNK = 1 << 20
PERMANENT_CODES = frozenset(
    {
        "400",
        "401",
        "403",
        "404",
        "AccessDenied",
        "InvalidAccessKeyId",
        "NoSuchBucket",
        "NoSuchKey",
        "SignatureDoesNotMatch",
        "InvalidBucketName",
    }
)


@dataclass(frozen=True)
class _Object:
    key: str
    size: int
    local: str  # path relative to the download folder


class S3Download:
    """One `S3Source` into a folder."""

    def __init__(self, source: S3Source) -> None:
        self.source = source
        config = Config(retries={"mode": "standard", "max_attempts": 3})
        session = boto3.Session()  # resolves credentials once (the client reuses them)
        self.anonymous = session.get_credentials() is None
        if self.anonymous:
            config = config.merge(Config(signature_version=UNSIGNED))
        self._client: Any = session.client(
            "s3", endpoint_url=source.endpoint, region_name=source.region, config=config
        )
        self._objects: list[_Object] | None = None

    def _what(self) -> str:
        return self.source.url + (f" at {self.source.endpoint}" if self.source.endpoint else "")

    def _error(self, exc: Exception) -> FetchError:
        if isinstance(exc, NoCredentialsError):
            return FetchError(f"{self._what()}: no S3 credentials found", permanent=True)
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            detail = error.get("Message") or code
            if self.anonymous and str(status) in ("401", "403"):
                detail += " (no S3 credentials found: the request was sent unsigned)"
            return FetchError(
                f"{self._what()}: {code or status}: {detail}",
                permanent=code in PERMANENT_CODES or str(status) in PERMANENT_CODES,
            )
        return FetchError(f"{self._what()}: {exc}", permanent=False)

    def _list(self) -> list[_Object]:
        if self._objects is not None:
            return self._objects
        bucket, key = self.source.bucket, self.source.key
        try:
            if not self.source.is_folder:
                head = self._client.head_object(Bucket=bucket, Key=key)
                found = [_Object(key, int(head["ContentLength"]), posixpath.basename(key))]
            else:
                found = []
                pages = self._client.get_paginator("list_objects_v2")
                for page in pages.paginate(Bucket=bucket, Prefix=key):
                    for item in page.get("Contents", []):
                        local = item["Key"][len(key) :]
                        if local and not local.endswith("/"):
                            found.append(_Object(item["Key"], int(item["Size"]), local))
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc) from exc
        if not found:
            raise FetchError(f"{self._what()}: no objects there", permanent=True)
        self._objects = found
        return found

    def total_bytes(self) -> int | None:
        return sum(o.size for o in self._list())

    def run(self, folder: Path) -> None:
        for obj in self._list():
            target = folder / obj.local
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._download(obj, target)
            except (ClientError, BotoCoreError) as exc:
                raise self._error(exc) from exc

    def _download(self, obj: _Object, target: Path) -> None:
        have = target.stat().st_size if target.exists() else 0
        if target.exists() and have == obj.size:
            return
        if have > obj.size:
            have = 0  # changed upstream: start over
        extra = {"Range": f"bytes={have}-"} if have else {}
        body = self._client.get_object(Bucket=self.source.bucket, Key=obj.key, **extra)["Body"]
        with open(target, "ab" if have else "wb") as out:
            for chunk in body.iter_chunks(CHUNK):
                out.write(chunk)
        if target.stat().st_size != obj.size:
            raise FetchError(f"{self._what()}: {obj.key} ended early", permanent=False)
