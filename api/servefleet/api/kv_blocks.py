"""The prefix-cache block hash chain, spelled once for every engine and the gateway.

A full block of `block_size` tokens is named by blake2b-128 over its parent's 16-byte hash
and its token ids as int32 little-endian, so equal names mean equal prefixes. Why not
Python's `hash` of a tuple: it is 64-bit, not collision-resistant (a tenant could craft two
prompts whose blocks collide) and fixed by the CPython build, so two engines or a gateway
could not be sure to agree. The chain's root mixes in the adapter's identity: KV computed
under one adapter (or the base model) is never a prefix of another's. Hashes stay Python
ints (unsigned, below 2**128) so the block pool's dict keys are unchanged.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16
HASH_LIMIT = 1 << (8 * HASH_BYTES)
_ROOT_DOMAIN = b"servefleet-kv-chain-v1"


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=HASH_BYTES).digest(), "little")


def hash_bytes(block_hash: int) -> bytes:
    """The 16 bytes a hash is chained and sent as."""
    return block_hash.to_bytes(HASH_BYTES, "little")


def root_hash(adapter_identity: int | None = None, cache_salt: str | None = None) -> int:
    """The chain's start: the base model's, or its own for each adapter identity (a signed
    64-bit int, `LoraAdapter.identity`) and each cache salt (`servefleet.api.cache_salt`):
    requests of different salts never share a prefix block. Unsalted roots are unchanged."""
    if adapter_identity is None:
        root = _ROOT_DOMAIN + b"\x00"
    else:
        root = _ROOT_DOMAIN + b"\x01" + adapter_identity.to_bytes(8, "little", signed=True)
    if cache_salt is None:
        return _digest(root)
    salt = cache_salt.encode()
    return _digest(root + b"\x02" + len(salt).to_bytes(4, "little") + salt)


def chain_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The name of a block whose tokens follow the prefix named `parent`."""
    packed = struct.pack(f"<{len(token_ids)}i", *token_ids)
    return _digest(hash_bytes(parent) + packed)


def chain(parent: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hashes of every full block of `token_ids` after `parent`."""
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out
