"""The fault benches read the seed a gateway tells its client: seeds are signed 64-bit
integers, so a negative one must count as told, not as missing."""

from servefleet.bench.fault_load import _int_or_none


def test_signed_seed_header_is_read() -> None:
    assert _int_or_none("-9223372036854775808") == -(2**63)
    assert _int_or_none("1234") == 1234


def test_absent_or_garbled_header_is_none() -> None:
    assert _int_or_none(None) is None
    assert _int_or_none("12a") is None
