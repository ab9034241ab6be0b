"""The Batch API's store the gateway config names (`BatchConfig`): its bucket, else its folder."""

from __future__ import annotations

from pathlib import Path

from servefleet.api.batches import BatchConfig
from servefleet.gateway.batch_store import BatchStore
from servefleet.gateway.batch_store_folder import FolderBatchStore


def open_store(config: BatchConfig) -> BatchStore:
    if config.s3 is not None:
        from servefleet.gateway.batch_store_s3 import S3BatchStore  # boto3 only where used

        return S3BatchStore(config.s3)
    assert config.store_dir is not None  # BatchConfig holds exactly one
    return FolderBatchStore(Path(config.store_dir))
