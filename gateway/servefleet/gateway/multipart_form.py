"""A `multipart/form-data` body read from ASGI into fields and one uploaded file, with a size
limit enforced while it streams in (python-multipart parses; this only collects)."""

from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParser, parse_options_header

from servefleet.api.openai_errors import OpenAIError
from servefleet.gateway.asgi import Receive, Scope, header


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # name -> (filename, data)


@dataclass
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)


def _refused(message: str, param: str | None = None, status: int = 400) -> OpenAIError:
    return OpenAIError(status=status, message=message, param=param)


async def read_form(scope: Scope, receive: Receive, max_bytes: int) -> Form:
    """The form, or a 400 (not multipart, malformed) / 413 (over `max_bytes`)."""
    kind, options = parse_options_header(header(scope, b"content-type") or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise _refused("send the file as multipart/form-data (fields purpose and file)")
    parts: list[_Part] = []
    name = bytearray()
    value = bytearray()

    def header_end() -> None:
        parts[-1].headers[bytes(name).lower()] = bytes(value)
        name.clear()
        value.clear()

    callbacks = {
        "on_part_begin": lambda: parts.append(_Part()),
        "on_header_field": lambda d, s, e: name.extend(d[s:e]),
        "on_header_value": lambda d, s, e: value.extend(d[s:e]),
        "on_header_end": header_end,
        "on_part_data": lambda d, s, e: parts[-1].data.extend(d[s:e]),
    }
    try:
        parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    except Exception as exc:  # e.g. a boundary longer than RFC 2046 allows
        raise _refused(f"malformed multipart body: {exc}") from None
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _refused("the upload ended early")
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _refused(f"the upload is over {max_bytes} bytes", "file", status=413)
        try:
            parser.write(chunk)
        except Exception as exc:  # python-multipart's errors carry no stable type
            raise _refused(f"malformed multipart body: {exc}") from None
        more = bool(message.get("more_body"))
    try:
        parser.finalize()
    except Exception as exc:
        raise _refused(f"malformed multipart body: {exc}") from None
    return _collect(parts)


def _collect(parts: list[_Part]) -> Form:
    form = Form()
    for part in parts:
        disposition = part.headers.get(b"content-disposition", b"")
        _, params = parse_options_header(disposition)
        field_name = params.get(b"name", b"").decode(errors="replace")
        if not field_name:
            raise _refused("a form part has no name")
        if field_name in form.fields or field_name in form.files:
            raise _refused(f"form field {field_name} is sent twice", field_name)
        if b"filename" in params:
            filename = params[b"filename"].decode(errors="replace")
            form.files[field_name] = (filename, bytes(part.data))
        else:
            form.fields[field_name] = part.data.decode(errors="replace")
    return form
