"""KV transfer's wire format and the store's pin/stage/commit, without a model.

Blocks move as bytes (float32 and int8 caches alike), verify themselves (chain hash, crc32,
fingerprint), and a stream cut at any byte commits whole verified blocks and nothing else.
"""

from __future__ import annotations

import pytest
import torch

from servefleet.api.kv_blocks import chain, root_hash
from servefleet.engine.kv_cache import KVCacheManager
from servefleet.engine.kv_quant import quantize_rows
from servefleet.engine.kv_store import KVStore, VerifiedBlock
from servefleet.engine.kv_warm import hot_chains
from servefleet.engine.kv_wire import END, WireError, WireReader, encode_frame, encode_header

BS, LAYERS, HEADS, HEAD_DIM, BLOCKS = 4, 2, 1, 8, 40
TOKENS = list(range(100, 100 + 3 * BS + 2))  # three full blocks and a partial one


def _store(dtype: torch.dtype, fingerprint: str = "fp", seed: int = 0) -> KVStore:
    torch.manual_seed(seed)
    x = torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, HEAD_DIM)
    storage = quantize_rows(x) if dtype == torch.int8 else x.to(dtype)
    kv = KVCacheManager(BLOCKS, BS)
    return KVStore(storage.contiguous(), kv, fingerprint, {"kv_cache_dtype": str(dtype)})


def _fill(store: KVStore, hashes: list[int], root: int | None = None) -> None:
    """Cache `hashes` (TOKENS' blocks) as a sequence would: allocated, published, freed."""
    blocks = store.kv.pool.allocate(len(hashes))
    parent = root_hash(None) if root is None else root
    for i, (block, block_hash) in enumerate(zip(blocks, hashes, strict=True)):
        tokens = tuple(TOKENS[i * BS : (i + 1) * BS])
        store.kv.pool.cache_block(block, block_hash, parent, tokens, first=i == 0)
        parent = block_hash
    store.kv.pool.free(reversed(blocks))


def _stream(store: KVStore, hashes: list[int]) -> bytes:
    held, _ = store.pin(hashes)
    data = store.read([b.block_id for b in held])
    store.unpin(held)
    header = {"fingerprint": store.fingerprint, "bytes_per_block": store.bytes_per_block}
    frames = [
        encode_frame(b.block_hash, b.parent_hash, b.token_ids, None, d)
        for b, d in zip(held, data, strict=True)
    ]
    return encode_header({**header, "adapter_identity": None}) + b"".join(frames) + END


def _receive(store: KVStore, stream: bytes, expected: list[int] | None) -> list[VerifiedBlock]:
    reader = WireReader(store.fingerprint, BS, store.bytes_per_block, expected)
    return reader.feed(stream)


def _commit(store: KVStore, blocks: list[VerifiedBlock], first: int | None = None) -> None:
    ids = store.stage(len(blocks) + 1)  # one more than needed: the spare must go back
    store.write(ids[: len(blocks)], [b.data for b in blocks])
    store.commit(ids, blocks, first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_blocks_round_trip_bit_exact(dtype: torch.dtype) -> None:
    hashes = chain(root_hash(None), TOKENS, BS)
    sender, receiver = _store(dtype), _store(dtype, seed=1)
    _fill(sender, hashes)
    blocks = _receive(receiver, _stream(sender, hashes), hashes)
    assert [b.block_hash for b in blocks] == hashes
    _commit(receiver, blocks)
    for block_hash in hashes:
        src, dst = sender.kv.pool.lookup(block_hash), receiver.kv.pool.lookup(block_hash)
        assert src is not None and dst is not None
        a, b = sender.storage[:, :, src.block_id], receiver.storage[:, :, dst.block_id]
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert receiver.held_run(hashes) == 3 and receiver.staged == 0
    receiver.kv.check_all_free()
    sender.kv.check_all_free()


def test_a_stream_cut_at_any_byte_commits_only_whole_verified_blocks() -> None:
    hashes = chain(root_hash(None), TOKENS, BS)
    sender = _store(torch.float32)
    _fill(sender, hashes)
    stream = _stream(sender, hashes)
    before = _store(torch.float32, seed=1).storage
    for cut in range(len(stream) + 1):
        receiver = KVStore(before.clone(), KVCacheManager(BLOCKS, BS), "fp", {})
        blocks = _receive(receiver, stream[:cut], hashes)
        _commit(receiver, blocks)
        assert receiver.held_run(hashes) == len(blocks)
        assert sum(1 for b in receiver.kv.pool.blocks if b.block_hash is not None) == len(blocks)
        cached = {receiver.kv.pool.lookup(h).block_id for h in hashes[: len(blocks)]}  # type: ignore[union-attr]
        untouched = [i for i in range(BLOCKS) if i not in cached]
        assert torch.equal(receiver.storage[:, :, untouched], before[:, :, untouched])
        receiver.kv.check_all_free()
    assert len(_receive(_store(torch.float32), stream, hashes)) == 3


def _tampered(stream: bytes, old: bytes, new: bytes) -> bytes:
    assert old in stream
    return stream.replace(old, new, 1)


def test_mismatches_are_refused() -> None:
    hashes = chain(root_hash(None), TOKENS, BS)
    sender = _store(torch.float32)
    _fill(sender, hashes)
    stream = _stream(sender, hashes)
    with pytest.raises(WireError) as caught:
        _receive(_store(torch.float32, fingerprint="other"), stream, hashes)
    assert caught.value.code == "kv_fingerprint_mismatch"
    with pytest.raises(WireError) as caught:
        _receive(_store(torch.int8), stream, hashes)  # other bytes per block
    assert caught.value.code == "kv_fingerprint_mismatch"
    flipped = bytearray(stream)
    flipped[-len(END) - 3] ^= 0xFF  # a byte of the last block's KV
    with pytest.raises(WireError) as caught:
        _receive(_store(torch.float32), bytes(flipped), hashes)
    assert caught.value.code == "crc_mismatch"
    assert [b.block_hash for b in caught.value.blocks] == hashes[:2]  # those before it hold
    forged = _tampered(stream, b'"tokens":[100,', b'"tokens":[999,')
    with pytest.raises(WireError) as caught:
        _receive(_store(torch.float32), forged, hashes)
    assert caught.value.code == "chain_mismatch"
    other_chain = chain(root_hash(7), TOKENS, BS)  # another adapter's names for the tokens
    with pytest.raises(WireError) as caught:
        _receive(_store(torch.float32), stream, other_chain)
    assert caught.value.code == "chain_mismatch"


def test_frames_must_continue_the_chain_without_expected_hashes() -> None:
    hashes = chain(root_hash(None), TOKENS, BS)
    sender = _store(torch.float32)
    _fill(sender, hashes)
    held, _ = sender.pin(hashes)
    data = sender.read([b.block_id for b in held])
    sender.unpin(held)
    header = encode_header(
        {"fingerprint": "fp", "bytes_per_block": sender.bytes_per_block, "adapter_identity": None}
    )
    skip = [
        encode_frame(b.block_hash, b.parent_hash, b.token_ids, None, d)
        for b, d in zip(held, data, strict=True)
    ]
    with pytest.raises(WireError) as caught:
        _receive(_store(torch.float32), header + skip[0] + skip[2], None)
    assert caught.value.code == "chain_mismatch"


def test_caps_bound_pins_and_stages() -> None:
    store = _store(torch.float32)
    assert store.cap == 4  # 10% of 40 blocks
    ids = store.stage(10)
    assert len(ids) == 4 and store.stage(1) == []
    store.commit(ids, [])
    assert store.staged == 0
    store.kv.check_all_free()


def _firsts(store: KVStore, hashes: list[int]) -> list[bool]:
    return [b.first for h in hashes if (b := store.kv.pool.lookup(h)) is not None]


def test_an_imported_chain_start_is_marked_first_and_offered_on() -> None:
    """A salted chain cannot be walked back to the unsalted root: only its first block's
    mark lets the hot list offer it. An import marks the block the importer names, never
    one whose parent is cached here (that is no chain's start, whatever a peer says)."""
    salted = chain(root_hash(None, "tenant-salt"), TOKENS, BS)
    sender = _store(torch.float32)
    _fill(sender, salted, root_hash(None, "tenant-salt"))
    assert hot_chains(sender.kv.pool, 100, 10) == [salted]
    blocks = _receive(sender, _stream(sender, salted), salted)
    unnamed, named, claimed = (_store(torch.float32, seed=i) for i in (1, 2, 3))
    _commit(unnamed, blocks)
    assert hot_chains(unnamed.kv.pool, 100, 10) == []  # held, but not offered on
    _commit(named, blocks, first=salted[0])
    assert hot_chains(named.kv.pool, 100, 10) == [salted]
    assert _firsts(named, salted) == [True, False, False]
    _commit(claimed, blocks[:1], first=salted[0])
    _commit(claimed, blocks[1:], first=salted[1])  # a mid-chain block named as a start
    assert _firsts(claimed, salted) == [True, False, False]
    assert hot_chains(claimed.kv.pool, 100, 10) == [salted]
