"""The KV transfer wire format (`application/x-servefleet-kv; v=1`): encode and verify.

    b"SFKV" | u32 len | header JSON {fingerprint, kv_dtype, block_size, layers, kv_heads,
                                     row_width, bytes_per_block, adapter_identity, count}
    frames: u32 len | meta JSON {hash, parent, adapter_identity, tokens, crc32} | raw block
    end:    u32 0

Lengths are little-endian. A block's raw bytes are block-major (for each layer, K then V,
each [block_size, kv_heads, row] as stored: int8 rows carry their scale inline), so both
float and int8 caches move as bytes. Every frame verifies itself: the receiver recomputes
the chain hash from parent and tokens, checks the parent continues the chain, and the crc32
of the bytes. A stream cut at any byte therefore yields whole verified blocks and nothing
else; the reader only hands out a block once its last byte arrived and checked.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable
from typing import Any

from servefleet.api.kv_blocks import chain_hash
from servefleet.api.kv_transfer import MAGIC, MAX_META_BYTES
from servefleet.engine.kv_store import VerifiedBlock

_LEN = struct.Struct("<I")


class WireError(ValueError):
    """The stream is not one this engine may use; `code` says why (for metrics and 4xx)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.blocks: list[VerifiedBlock] = []  # verified before it, in the same chunk


def _hex(value: int) -> str:
    return f"{value:032x}"


def encode_header(fields: dict[str, Any]) -> bytes:
    body = json.dumps(fields, separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(body)) + body


def encode_frame(
    block_hash: int,
    parent_hash: int,
    token_ids: Iterable[int],
    adapter_identity: int | None,
    data: bytes,
) -> bytes:
    meta = {
        "hash": _hex(block_hash),
        "parent": _hex(parent_hash),
        "adapter_identity": adapter_identity,
        "tokens": list(token_ids),
        "crc32": zlib.crc32(data),
    }
    body = json.dumps(meta, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body + data


END = _LEN.pack(0)


class WireReader:
    """Incremental decoder: feed it chunks, get the blocks that completed and verified.

    `fingerprint`: what the header must carry (else code `kv_fingerprint_mismatch`).
    `expected`: the hashes the blocks must have, in order (a puller knows them); without it
    a frame's parent must be the previous frame's hash (the first is the caller's to check).
    """

    def __init__(
        self, fingerprint: str, block_size: int, bytes_per_block: int, expected: list[int] | None
    ) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.expected = expected
        self.header: dict[str, Any] | None = None
        self.complete = False  # the end marker arrived
        self.count = 0  # blocks verified so far
        self.last_hash: int | None = None
        self.first_parent: int | None = None
        self._buffer = bytearray()
        self._meta: dict[str, Any] | None = None
        self.leftover: list[VerifiedBlock] = []  # verified, not yet handed on (a puller's)

    def feed(self, chunk: bytes) -> list[VerifiedBlock]:
        if self.complete and chunk:
            raise WireError("trailing_bytes", "bytes after the end of the stream")
        self._buffer += chunk
        out: list[VerifiedBlock] = []
        try:
            self._drain(out)
        except WireError as exc:
            exc.blocks = out  # what verified before the bad frame is still good
            raise
        return out

    def _drain(self, out: list[VerifiedBlock]) -> None:
        while True:
            if self.header is None:
                if not self._read_header():
                    return
            elif self._meta is None:
                if not self._read_meta():
                    return
            else:
                if len(self._buffer) < self.bytes_per_block:
                    return
                data = bytes(self._buffer[: self.bytes_per_block])
                del self._buffer[: self.bytes_per_block]
                out.append(self._verify(self._meta, data))
                self._meta = None

    def _take_json(self) -> dict[str, Any] | None:
        """One length-prefixed JSON object off the buffer; None until it is all there."""
        if len(self._buffer) < _LEN.size:
            return None
        (length,) = _LEN.unpack_from(self._buffer)
        if length > MAX_META_BYTES:
            raise WireError("bad_frame", f"a header of {length} bytes (at most {MAX_META_BYTES})")
        if length == 0:
            del self._buffer[: _LEN.size]
            return {}
        if len(self._buffer) < _LEN.size + length:
            return None
        raw = bytes(self._buffer[_LEN.size : _LEN.size + length])
        del self._buffer[: _LEN.size + length]
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise WireError("bad_frame", f"frame header is not JSON: {exc}") from exc
        if not isinstance(value, dict) or not value:
            raise WireError("bad_frame", "frame header is not a JSON object")
        return value

    def _read_header(self) -> bool:
        if len(self._buffer) < len(MAGIC):
            return False
        if bytes(self._buffer[: len(MAGIC)]) != MAGIC:
            raise WireError("bad_frame", "not a servefleet KV stream")
        rest = self._buffer[len(MAGIC) :]
        saved, self._buffer = self._buffer, bytearray(rest)
        header = self._take_json()
        if header is None:
            self._buffer = saved
            return False
        if header.get("fingerprint") != self.fingerprint:
            raise WireError("kv_fingerprint_mismatch", "blocks of another model or KV layout")
        if header.get("bytes_per_block") != self.bytes_per_block:
            raise WireError("kv_fingerprint_mismatch", "blocks of another size")
        adapter = header.get("adapter_identity")
        if adapter is not None and (
            type(adapter) is not int or not -(1 << 63) <= adapter < 1 << 63
        ):
            raise WireError("bad_frame", "adapter_identity is not a 64-bit integer")
        self.header = header
        return True

    def _read_meta(self) -> bool:
        meta = self._take_json()
        if meta is None:
            return False
        if not meta:
            self.complete = True
            if self._buffer:
                raise WireError("trailing_bytes", "bytes after the end of the stream")
            return False
        self._meta = meta
        return True

    def _verify(self, meta: dict[str, Any], data: bytes) -> VerifiedBlock:
        try:
            block_hash, parent = int(meta["hash"], 16), int(meta["parent"], 16)
            tokens = tuple(int(t) for t in meta["tokens"])
            crc = int(meta["crc32"])
            adapter = meta.get("adapter_identity")
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError("bad_frame", f"frame header fields: {exc!r}") from exc
        assert self.header is not None
        if adapter != self.header.get("adapter_identity"):
            raise WireError("chain_mismatch", "a block of another adapter")
        if len(tokens) != self.block_size or chain_hash(parent, tokens) != block_hash:
            raise WireError("chain_mismatch", "a block's hash does not match its tokens")
        if self.expected is not None:
            if self.count >= len(self.expected) or self.expected[self.count] != block_hash:
                raise WireError("chain_mismatch", "a block that was not asked for")
        elif self.last_hash is not None and parent != self.last_hash:
            raise WireError("chain_mismatch", "a block that does not continue the chain")
        if zlib.crc32(data) != crc:
            raise WireError("crc_mismatch", "a block's bytes do not match their crc32")
        if self.first_parent is None:
            self.first_parent = parent
        self.last_hash = block_hash
        self.count += 1
        return VerifiedBlock(block_hash, parent, tokens, data)
