"""The tenant-facing Files and Batch API (`/v1/files`, `/v1/batches`), OpenAI's shapes.

Every call needs the tenant's key and sees only that tenant's files and batches: another
tenant's id answers 404, exactly as an id that does not exist. Query parameters other than
the ones listed per path are refused with a 400 that names them. The store is read and
written off the event loop (a bucket is a network call), so interactive requests never wait
on it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl

from servefleet.api.batches import (
    COMPLETION_WINDOW_S,
    TERMINAL,
    Batch,
    BatchCreateRequest,
    BatchErrors,
    BatchLine,
    RequestCounts,
    parse_lines,
)
from servefleet.api.openai_errors import OpenAIError
from servefleet.api.openai_wire import parse_request
from servefleet.gateway.asgi import Receive, Scope, Send, header, read_body, respond
from servefleet.gateway.batch_runner import BatchRunner
from servefleet.gateway.batch_store import BatchStore, StoreUnavailable, new_batch_id
from servefleet.gateway.multipart_form import read_form
from servefleet.gateway.route_table import RouteTable

FILES = "/v1/files"
BATCHES = "/v1/batches"
_FILE = re.compile(r"^/v1/files/(?P<id>[^/]+)(?P<content>/content)?$")
_BATCH = re.compile(r"^/v1/batches/(?P<id>[^/]+)(?P<cancel>/cancel)?$")
LIST_LIMIT = (1, 100, 20)  # least, most, default


def is_batch_path(path: str) -> bool:
    return path in (FILES, BATCHES) or path.startswith((FILES + "/", BATCHES + "/"))


def _not_found(what: str, object_id: str) -> OpenAIError:
    return OpenAIError(status=404, message=f"No {what} with id {object_id!r}.", param="id")


def _query(scope: Scope, allowed: Sequence[str]) -> dict[str, str]:
    pairs = parse_qsl(scope.get("query_string", b"").decode(errors="replace"))
    for name, _ in pairs:
        if name not in allowed:
            raise OpenAIError(status=400, message=f"Unknown query parameter {name}.", param=name)
    return dict(pairs)


def _page(items: list[Any], query: dict[str, str]) -> bytes:
    """OpenAI's list envelope over newest-first `items`, after the id `after`, `limit` long."""
    least, most, default = LIST_LIMIT
    try:
        limit = int(query.get("limit", default))
    except ValueError:
        limit = -1
    if not least <= limit <= most:
        raise OpenAIError(
            status=400, message=f"limit must be an integer from {least} to {most}.", param="limit"
        )
    after = query.get("after")
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise OpenAIError(status=400, message=f"No object with id {after!r}.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    data = [item.public() if isinstance(item, Batch) else item.model_dump() for item in page]
    body = {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }
    return json.dumps(body).encode()


class BatchApi:
    def __init__(
        self,
        store: BatchStore,
        runner: BatchRunner,
        max_file_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.runner = runner
        self.max_file_bytes = max_file_bytes
        self._clock = clock

    async def handle(self, table: RouteTable, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = table.keys.require_tenant(header(scope, b"authorization"))
        try:
            await self._route(tenant, scope, receive, send)
        except StoreUnavailable as exc:
            raise OpenAIError(
                status=503,
                message="The batch store is unavailable; try again shortly.",
                type="server_error",
                code="store_unavailable",
                headers={"retry-after": "5"},
            ) from exc

    async def _route(self, tenant: str, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if path == FILES:
            await self._files(tenant, method, scope, receive, send)
        elif path == BATCHES:
            await self._batches(tenant, method, scope, receive, send)
        elif (match := _FILE.match(path)) is not None:
            await self._file(tenant, method, match["id"], bool(match["content"]), scope, send)
        elif (match := _BATCH.match(path)) is not None:
            await self._batch(tenant, method, match["id"], bool(match["cancel"]), scope, send)
        else:
            raise OpenAIError(
                status=404, message=f"Unknown path {method} {path}", code="unknown_url"
            )

    # -- /v1/files --------------------------------------------------------------------------
    async def _files(
        self, tenant: str, method: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if method == "GET":
            query = _query(scope, ("purpose", "limit", "after", "order"))
            files = await asyncio.to_thread(self.store.files, tenant)
            if "purpose" in query:
                files = [f for f in files if f.purpose == query["purpose"]]
            if query.get("order", "desc") not in ("asc", "desc"):
                raise OpenAIError(status=400, message="order is asc or desc.", param="order")
            if query.get("order") == "asc":
                files.reverse()
            await respond(send, 200, _page(files, query))
            return
        _allow(method, "POST", FILES)
        _query(scope, ())
        form = await read_form(scope, receive, self.max_file_bytes)
        unknown = sorted(set(form.fields) - {"purpose"} | set(form.files) - {"file"})
        if unknown:
            raise OpenAIError(
                status=400, message=f"Unknown form field {unknown[0]}.", param=unknown[0]
            )
        if form.fields.get("purpose") != "batch":
            raise OpenAIError(
                status=400,
                message="purpose must be 'batch' (the only one served).",
                param="purpose",
            )
        if "file" not in form.files:
            raise OpenAIError(status=400, message="file is required.", param="file")
        filename, data = form.files["file"]
        file = await asyncio.to_thread(self.store.put_file, tenant, filename, "batch", data)
        await respond(send, 200, file.model_dump_json().encode())

    async def _file(
        self, tenant: str, method: str, file_id: str, content: bool, scope: Scope, send: Send
    ) -> None:
        _query(scope, ())
        if method == "DELETE" and not content:
            reading = [
                b.id
                for b in await asyncio.to_thread(self.store.batches, tenant)
                if b.input_file_id == file_id and b.status not in TERMINAL
            ]
            if reading:  # the runner reads it until the batch closes
                raise OpenAIError(
                    status=409,
                    message=f"File {file_id} is the input of open batch {reading[0]}; cancel "
                    "the batch or wait for it to finish.",
                )
            if not await asyncio.to_thread(self.store.delete_file, tenant, file_id):
                raise _not_found("file", file_id)
            body = {"id": file_id, "object": "file", "deleted": True}
            await respond(send, 200, json.dumps(body).encode())
            return
        _allow(method, "GET", scope["path"])
        file = await asyncio.to_thread(self.store.file, tenant, file_id)
        if file is None:
            raise _not_found("file", file_id)
        if not content:
            await respond(send, 200, file.model_dump_json().encode())
            return
        data = await asyncio.to_thread(self.store.file_content, tenant, file_id) or b""
        await respond(send, 200, data, content_type=b"application/octet-stream")

    # -- /v1/batches ------------------------------------------------------------------------
    async def _batches(
        self, tenant: str, method: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        if method == "GET":
            query = _query(scope, ("limit", "after"))
            batches = await asyncio.to_thread(self.store.batches, tenant)
            await respond(send, 200, _page(batches, query))
            return
        _allow(method, "POST", BATCHES)
        _query(scope, ())
        _, request = parse_request(BatchCreateRequest, await read_body(receive))
        batch, lines = await asyncio.to_thread(self._new_batch, tenant, request)
        self._started(batch, lines)
        await respond(send, 200, json.dumps(batch.public()).encode())

    def create(self, tenant: str, request: BatchCreateRequest) -> Batch:
        """Validate the input file's lines now: a bad file fails the batch with every bad line
        listed (OpenAI's `failed` batch with `errors`); a good one starts in_progress."""
        batch, lines = self._new_batch(tenant, request)
        self._started(batch, lines)
        return batch

    def _started(self, batch: Batch, lines: list[BatchLine]) -> None:
        """On the event loop: the runner's own state."""
        if batch.status == "in_progress":
            self.runner.note(batch, lines)  # in the batch signal at once, before its turn
        self.runner.wake()

    def _new_batch(self, tenant: str, request: BatchCreateRequest) -> tuple[Batch, list[BatchLine]]:
        """The batch, saved, and its lines: store calls only (run off the event loop)."""
        file = self.store.file(tenant, request.input_file_id)
        if file is None or file.purpose != "batch":
            raise OpenAIError(
                status=400,
                message=f"input_file_id {request.input_file_id!r} is not one of your batch files.",
                param="input_file_id",
            )
        now = int(self._clock())
        data = self.store.file_content(tenant, file.id) or b""
        lines, errors = parse_lines(data, request.endpoint)
        batch = Batch(
            id=new_batch_id(),
            endpoint=request.endpoint,
            input_file_id=file.id,
            created_at=now,
            expires_at=now + COMPLETION_WINDOW_S[request.completion_window],
            metadata=request.metadata,
            tenant=tenant,
            request_counts=RequestCounts(total=len(lines)),
        )
        if errors:
            batch.status, batch.failed_at = "failed", now
            batch.errors = BatchErrors(data=errors)
        else:
            batch.status, batch.in_progress_at = "in_progress", now
        self.store.save_batch(batch)
        return batch, lines

    async def _batch(
        self, tenant: str, method: str, batch_id: str, cancel: bool, scope: Scope, send: Send
    ) -> None:
        _query(scope, ())
        _allow(method, "POST" if cancel else "GET", scope["path"])
        batch = await asyncio.to_thread(self.store.batch, tenant, batch_id)
        if batch is None:
            raise _not_found("batch", batch_id)
        if cancel:
            if batch.status in TERMINAL:
                raise OpenAIError(
                    status=409,
                    message=f"Batch {batch_id} is {batch.status}; only an open batch can be "
                    "cancelled.",
                )
            if batch.status != "cancelling":
                batch.status, batch.cancelling_at = "cancelling", int(self._clock())
                await asyncio.to_thread(self.store.save_batch, batch)
                self.runner.wake()
        await respond(send, 200, json.dumps(batch.public()).encode())


def _allow(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise OpenAIError(
            status=405,
            message=f"Method {method} is not allowed on {path}; use {allowed}.",
            headers={"Allow": allowed},
        )
