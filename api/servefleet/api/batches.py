"""OpenAI's Files and Batch API as the gateway serves it: the objects, the request bodies and
the lines of a batch's input and output files.

Shapes follow OpenAI's reference, so the official client's `files.create`, `batches.create`,
`retrieve`, `list`, `cancel` and `files.content` work unchanged. What we do not run is refused
by name: an endpoint other than the three the gateway serves, a completion window other than
`24h`, a streamed line (a batch answer is one JSON body).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from servefleet.api.batch_storage import BatchS3Store
from servefleet.api.openai_messages import StrictModel

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
FilePurpose = Literal["batch", "batch_output"]
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
MAX_METADATA_PAIRS = 16
MAX_LINE_ERRORS = 100  # a failed validation lists at most this many lines
FILE_ID_PREFIX = "file-"
BATCH_ID_PREFIX = "batch_"
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class FileObject(BaseModel):
    """OpenAI's `file` object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["processed"] = "processed"
    status_details: str | None = None


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class LineError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[LineError]


class Batch(BaseModel):
    """OpenAI's `batch` object; `tenant` is ours and never leaves the gateway."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["batch"] = "batch"
    endpoint: BatchEndpoint
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: Literal["24h"] = "24h"
    status: BatchStatus = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    tenant: str = Field(exclude=True, default="")

    def public(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class BatchCreateRequest(StrictModel):
    """`POST /v1/batches`."""

    input_file_id: str = Field(pattern=ID_PATTERN)
    endpoint: BatchEndpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_fits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} metadata pairs")
        for key, text in value.items():
            if len(key) > 64 or len(text) > 512:
                raise ValueError("metadata keys are at most 64 characters, values 512")
        return value


class BatchLine(StrictModel):
    """One line of a batch's input file."""

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: BatchEndpoint
    body: dict[str, Any]


def parse_lines(data: bytes, endpoint: str) -> tuple[list[BatchLine], list[LineError]]:
    """Every line of an input file, or the errors that fail the batch (1-based line numbers):
    invalid JSON or shape, a url other than the batch's endpoint, a streamed body, a
    custom_id seen before."""
    lines: list[BatchLine] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        problem = _line_problem(raw, endpoint, seen)
        if isinstance(problem, LineError):
            problem.line = number
            errors.append(problem)
            if len(errors) >= MAX_LINE_ERRORS:
                break
        else:
            lines.append(problem)
    if not lines and not errors:
        errors.append(LineError(code="empty_file", message="the input file has no request lines"))
    return lines, errors


def _line_problem(raw: bytes, endpoint: str, seen: set[str]) -> BatchLine | LineError:
    try:
        line = BatchLine.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        first = exc.errors()[0] if isinstance(exc, ValidationError) else None
        message = first["msg"] if first else "the line is not valid JSON"
        param = ".".join(str(p) for p in first["loc"]) if first else None
        return LineError(code="invalid_request", message=message, param=param)
    if line.url != endpoint:
        return LineError(
            code="mismatched_endpoint",
            message=f"the line's url {line.url} is not the batch's endpoint {endpoint}",
            param="url",
        )
    if line.body.get("stream"):
        return LineError(
            code="invalid_request", message="a batch line cannot stream", param="body.stream"
        )
    if line.custom_id in seen:
        return LineError(
            code="duplicate_custom_id",
            message=f"custom_id {line.custom_id!r} appears more than once",
            param="custom_id",
        )
    seen.add(line.custom_id)
    return line


def output_line(
    line_id: str, custom_id: str, status: int, request_id: str, body: Any
) -> dict[str, Any]:
    """A line of the output (2xx) or error (otherwise) file, as OpenAI writes them."""
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


class BatchConfig(BaseModel):
    """The gateway's Batch API (`GatewayConfig.batch`); unset: `/v1/files` and `/v1/batches`
    answer 404 saying the API is not enabled. Its store is a folder or a bucket, exactly one."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    store_dir: str | None = Field(
        default=None,
        min_length=1,
        description="Folder of the files, batches and journals (local mode's state folder, "
        "or a PersistentVolumeClaim mounted into the gateway).",
    )
    s3: BatchS3Store | None = Field(
        default=None, description="An S3-compatible bucket instead of a folder."
    )
    max_file_bytes: int = Field(
        default=100 * 1024 * 1024, gt=0, description="Largest upload accepted."
    )
    line_concurrency: int = Field(
        default=4,
        ge=1,
        le=256,
        description="Lines of one batch in flight at once, at least: more while the pools' "
        "ready replicas leave batch requests more slots (replicas bought for a deadline).",
    )
    retry_seconds: float = Field(
        default=2.0, gt=0, description="Wait before a line turned away for now is tried again."
    )

    @model_validator(mode="after")
    def _one_store(self) -> BatchConfig:
        if (self.store_dir is None) == (self.s3 is None):
            raise ValueError("batch needs exactly one store: store_dir (a folder) or s3")
        return self
