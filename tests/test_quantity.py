"""The one memory-size grammar: engine.kvCacheMemory and the engine's --kv-cache-memory."""

from __future__ import annotations

import pytest

from servefleet.api.quantity import MemorySize, parse_memory_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # The CRD's forms.
        (1024, MemorySize(bytes=1024)),
        (1 << 30, MemorySize(bytes=1 << 30)),
        ("0.9", MemorySize(fraction=0.9)),
        (".5", MemorySize(fraction=0.5)),
        ("1", MemorySize(fraction=1.0)),
        ("1.0", MemorySize(fraction=1.0)),
        ("4Gi", MemorySize(bytes=4 << 30)),
        ("2G", MemorySize(bytes=2 * 10**9)),
        ("512M", MemorySize(bytes=512 * 10**6)),
        ("3Ti", MemorySize(bytes=3 << 40)),
        ("8Ki", MemorySize(bytes=8 << 10)),
        ("1073741824", MemorySize(bytes=1 << 30)),
        # The engine flag's forms.
        ("1GiB", MemorySize(bytes=1 << 30)),
        ("256MiB", MemorySize(bytes=256 << 20)),
        ("512MB", MemorySize(bytes=512 * 10**6)),
        ("2gib", MemorySize(bytes=2 << 30)),
        ("1.5GiB", MemorySize(bytes=3 << 29)),
        (" 2 GiB ", MemorySize(bytes=2 << 30)),
        ("100B", MemorySize(bytes=100)),
    ],
)
def test_accepted_forms(value: int | str, expected: MemorySize) -> None:
    assert parse_memory_size(value) == expected


@pytest.mark.parametrize(
    "value", [0, -1, True, "0", "0.0", "0GiB", "lots", "", "1.5", "4Xi", "-1Gi", "4 Gi B"]
)
def test_rejected_forms(value: int | str) -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_memory_size(value)


@pytest.mark.parametrize("value", [1 << 30, 1, "0.9", "1", "4Gi", "512MB", ".25"])
def test_the_flag_value_reads_back_as_the_same_size(value: int | str) -> None:
    size = parse_memory_size(value)
    assert parse_memory_size(size.flag_value()) == size


def test_resolve_turns_a_fraction_of_free_memory_into_bytes() -> None:
    assert parse_memory_size("0.5").resolve(free_bytes=1000) == 500
    assert parse_memory_size("4Ki").resolve(free_bytes=10) == 4096
