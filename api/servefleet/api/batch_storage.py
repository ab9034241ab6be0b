"""Where the Batch API keeps its files: `BatchConfig.s3`, an S3-compatible bucket, beside the
folder (`BatchConfig.store_dir`).

No credentials here: the gateway finds them the way boto3 does (AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, which the chart sets from a Secret, or the pod's own identity), so a
config file or a ConfigMap never holds a key.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# Object keys the store writes under `prefix` (the bucket's other keys are never read).
S3_PREFIX_PATTERN = r"^([A-Za-z0-9._-]+/)*$"


class BatchS3Store(BaseModel):
    """An S3-compatible bucket (AWS, MinIO, Ceph) the Batch API's objects live in."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    bucket: str = Field(
        min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]+[a-z0-9]$", description="Bucket."
    )
    endpoint: str | None = Field(
        default=None,
        pattern=r"^https?://[^@/]+/?$",
        description="Endpoint URL of an S3-compatible server (MinIO, Ceph); unset: AWS. No "
        "credentials in the URL.",
    )
    region: str | None = Field(default=None, min_length=1, description="Region; unset: boto3's.")
    prefix: str = Field(
        default="",
        max_length=200,
        pattern=S3_PREFIX_PATTERN,
        description="Key prefix of every object, ending in '/' (a bucket shared with other "
        "uses); empty: the bucket's root.",
    )
