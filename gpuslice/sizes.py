"""Memory sizes as people write them in unit files and config.yaml, and as we print them.

Binary units throughout, as systemd does (`MemoryMax=1G` is 1 GiB): `512M`, `20G` and `20GiB`
are all powers of 1024. Plain digits are bytes. Sizes are read exactly (no floating point) and
bounded: at least 1 byte, at most `SIZE_MAX` (1 PiB, far above any GPU's memory).
"""

from __future__ import annotations

import re
from fractions import Fraction

from gpuslice.envsyntax import WHITESPACE

_UNITS = {
    "": 1,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
    "T": 1 << 40,
    "P": 1 << 50,
    "E": 1 << 60,
}
SIZE_MAX = 1 << 50  # 1 PiB
# ASCII digits only (`\d` would take "٣"), an optional fraction, optional blanks, then an
# optional unit letter with an optional `B`/`iB`, or a lone `B` (bytes).
_SIZE = re.compile(
    r"([0-9]+)(?:\.([0-9]+))?[ \t]*(?:([KMGTPE])(?:i?B)?|B)?", re.IGNORECASE | re.ASCII
)
_MAX_DIGITS = 32  # far more than 1 PiB needs, so that a huge number is not even converted
SIZE_ALLOWED = "a size such as 512M, 20G or 20GiB (binary units, at most 1P)"


def parse_size(text: str) -> int:
    """Bytes in `text`; ValueError for anything that is not a size of 1 byte to 1 PiB.

    A fraction is allowed with a unit (`1.5G`) and the result is rounded down to whole bytes,
    as systemd's parse_size does; a size that is not at least 1 byte (`0`, `0.0001K`), a
    fraction of a byte (`1.5`) and anything over `SIZE_MAX` are rejected.
    """
    # systemd strips its WHITESPACE around a value; other white space is an error
    match = _SIZE.fullmatch(text.strip(WHITESPACE))
    if match is None:
        raise ValueError(text)
    whole, fraction, unit = match.groups()
    if len(whole.lstrip("0")) + len(fraction or "") > _MAX_DIGITS:
        raise ValueError(text)
    if unit is None and fraction is not None:
        raise ValueError(text)  # bytes are whole
    exact = Fraction(int(whole.lstrip("0") or "0")) + (
        Fraction(int(fraction), 10 ** len(fraction)) if fraction else 0
    )
    value = int(exact * _UNITS[(unit or "").upper()])  # rounds down, like systemd
    if not 0 < value <= SIZE_MAX:
        raise ValueError(text)
    return value


def format_size(value: int) -> str:
    """`14.2 GiB`, `512 MiB`: one decimal where it helps a person compare."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= factor:
            amount = value / factor
            return f"{amount:.0f} {unit}" if amount == int(amount) else f"{amount:.1f} {unit}"
    return f"{value} B"
