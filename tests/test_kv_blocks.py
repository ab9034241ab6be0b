"""The block hash chain: stable across processes, one chain per adapter."""

from __future__ import annotations

import subprocess
import sys

from servefleet.api.kv_blocks import HASH_LIMIT, chain, chain_hash, root_hash

_SCRIPT = (
    "from servefleet.api.kv_blocks import chain, root_hash;"
    "print(chain(root_hash(None), list(range(64)), 16), chain(root_hash(-5), [1] * 32, 16))"
)


def _in_subprocess(seed: str) -> str:
    env = {"PYTHONHASHSEED": seed, "PATH": ""}
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, check=True, capture_output=True, text=True
    ).stdout


def test_hashes_do_not_depend_on_the_hash_seed() -> None:
    first, second = _in_subprocess("0"), _in_subprocess("1")
    assert first == second
    assert first.strip() == f"{chain(root_hash(None), list(range(64)), 16)} " + str(
        chain(root_hash(-5), [1] * 32, 16)
    )


def test_adapters_never_share_a_chain() -> None:
    tokens = list(range(48))
    base = chain(root_hash(None), tokens, 16)
    one = chain(root_hash(1), tokens, 16)
    other = chain(root_hash(2), tokens, 16)
    assert not set(base) & set(one) and not set(one) & set(other)
    assert root_hash(0) != root_hash(None)


def test_chain_is_128_bit_and_order_sensitive() -> None:
    parent = root_hash(None)
    h = chain_hash(parent, [1, 2, 3])
    assert 0 <= h < HASH_LIMIT
    assert h != chain_hash(parent, [1, 2, 3, 0])
    assert chain_hash(parent, [1, 2, 3]) != chain_hash(parent, [3, 2, 1])
    assert chain_hash(parent, [1, 2, 3]) == h
    assert chain(parent, [5] * 40, 16) == [
        chain_hash(parent, [5] * 16),
        chain_hash(chain_hash(parent, [5] * 16), [5] * 16),
    ]
