"""Memory sizes: the one grammar behind `engine.kvCacheMemory` and the engine's
`--kv-cache-memory`, so a value the API accepts is a value the engine reads the same way.

A size is bytes or a fraction of free accelerator (or host) memory:

- an integer (YAML int) is bytes: `4294967296`;
- a number with a unit is bytes: `4Gi`, `4GiB`, `512M`, `512MB`, `1.5G`, `100B` (units are
  case-insensitive; `K M G T` are powers of 1000, `Ki Mi Gi Ti` powers of 1024, a trailing `B`
  changes nothing);
- a bare number up to 1 is a fraction: `0.9`, `.5`, `1`, `1.0`; a bare whole number above 1
  is bytes: `1073741824`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE = re.compile(
    r"^\s*(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[kmgt]i?b?|b)?\s*$", re.IGNORECASE
)
_POWERS = "kmgt"


@dataclass(frozen=True)
class MemorySize:
    """A parsed size: exactly one of `bytes` or `fraction` (0 < fraction <= 1) is set."""

    bytes: int | None = None
    fraction: float | None = None

    def flag_value(self) -> str:
        """The canonical spelling engines read: whole bytes, or the fraction as a decimal."""
        if self.bytes == 1:
            return "1B"  # a bare "1" is the whole of free memory
        return str(self.bytes) if self.bytes is not None else str(self.fraction)

    def resolve(self, free_bytes: int) -> int:
        """Bytes this size stands for when `free_bytes` are free."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return int(free_bytes * self.fraction)


def _unit_factor(unit: str) -> int:
    unit = unit.lower()
    if unit == "b":
        return 1
    power = _POWERS.index(unit[0]) + 1
    return 1024**power if "i" in unit else 1000**power


def parse_memory_size(value: int | str) -> MemorySize:
    """Read a size (see the module docstring); ValueError says what is accepted."""
    if isinstance(value, bool):
        raise ValueError(f"memory size {value!r}: expected bytes, a fraction or a size")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"memory size {value}: bytes must be positive")
        return MemorySize(bytes=value)
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(
            f"memory size {value!r}: use bytes (1073741824), a size (4Gi, 512MB) "
            "or a fraction of free memory (0.9)"
        )
    text, unit = match.group("number"), match.group("unit")
    number = float(text)
    if number <= 0:
        raise ValueError(f"memory size {value!r} must be positive")
    if unit is not None:
        size = int(number * _unit_factor(unit))
        if size <= 0:
            raise ValueError(f"memory size {value!r} is less than one byte")
        return MemorySize(bytes=size)
    if number <= 1:
        return MemorySize(fraction=number)
    if not text.isdigit():
        raise ValueError(f"memory size {value!r}: a fraction is at most 1, bytes are whole")
    return MemorySize(bytes=int(text))
