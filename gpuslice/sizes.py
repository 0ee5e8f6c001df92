"""Memory sizes as people write them in unit files and config.yaml, and as we print them.

Binary units throughout, as systemd does (`MemoryMax=1G` is 1 GiB): `512M`, `20G` and `20GiB`
are all powers of 1024. Plain digits are bytes.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?$", re.IGNORECASE)
SIZE_ALLOWED = "a size such as 512M, 20G or 20GiB (binary units)"


def parse_size(text: str) -> int:
    """Bytes in `text`; ValueError for anything that is not a positive size."""
    match = _SIZE.match(text.strip())
    if match is None:
        raise ValueError(text)
    number, unit = match.groups()
    if unit == "" and "." in number:
        raise ValueError(text)
    value = int(float(number) * _UNITS[unit.upper()])
    if value <= 0:
        raise ValueError(text)
    return value


def format_size(value: int) -> str:
    """`14.2 GiB`, `512 MiB`: one decimal where it helps a person compare."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= factor:
            amount = value / factor
            return f"{amount:.0f} {unit}" if amount == int(amount) else f"{amount:.1f} {unit}"
    return f"{value} B"
