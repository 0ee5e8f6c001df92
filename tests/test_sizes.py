"""Sizes in (`512M`, `20GiB`), sizes out (`14.2 GiB`): exact, bounded, ASCII only."""

from __future__ import annotations

import pytest

from gpuslice.sizes import SIZE_ALLOWED, SIZE_MAX, format_size, parse_size

K, M, G, T, P = (1 << 10, 1 << 20, 1 << 30, 1 << 40, 1 << 50)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("4096", 4096),
        ("1K", K),
        ("1k", K),
        ("1KB", K),
        ("1KiB", K),
        ("512M", 512 * M),
        ("20G", 20 * G),
        ("20GiB", 20 * G),
        ("20gib", 20 * G),
        ("2T", 2 * T),
        ("1P", P),
        ("1.5G", 3 * G // 2),
        ("0.5K", 512),
        ("1.0009765625K", 1025),
        ("1.0001K", 1024),  # rounded down to whole bytes, as systemd does
        ("7B", 7),
        ("20 G", 20 * G),
        ("20\tGiB", 20 * G),
        ("  512M \n", 512 * M),
        ("0001K", K),
        ("0" * 10_000 + "1K", K),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("9" * 400, id="400-nines"),  # was OverflowError (float -> inf -> int)
        pytest.param("9" * 400 + "G", id="400-nines-G"),
        pytest.param("9" * 5000, id="5000-nines"),  # over int()'s digit limit
        pytest.param("1." + "9" * 400 + "G", id="400-decimals"),
        pytest.param("1025P", id="over-1P"),
        pytest.param(str(SIZE_MAX + 1), id="one-byte-over"),
        pytest.param("1E", id="exbibyte"),
        pytest.param("\u0663G", id="arabic-indic-digit"),  # `\d` would take it
        pytest.param("\uff11G", id="fullwidth-digit"),
        pytest.param("\u00b2G", id="superscript"),
        pytest.param("1\u212a", id="kelvin-sign"),  # IGNORECASE alone would take it as K
        pytest.param("0", id="zero"),
        pytest.param("0G", id="zero-G"),
        pytest.param("0.0001K", id="rounds-to-0"),
        pytest.param("0.5B", id="half-byte"),
        pytest.param("1.5", id="fractional-bytes"),
        pytest.param("-1G", id="negative"),
        pytest.param("+1G", id="plus"),
        pytest.param(".5G", id="no-integer-part"),
        pytest.param("5.G", id="no-fraction-digits"),
        pytest.param("1e9", id="exponent"),
        pytest.param("inf", id="inf"),
        pytest.param("nan", id="nan"),
        pytest.param("1 2G", id="inner-space"),
        pytest.param("1G G", id="two-units"),
        pytest.param("20iB", id="iB-without-unit"),
        pytest.param("1X", id="unknown-unit"),
        pytest.param("1\u00a0G", id="no-break-space"),
        pytest.param("\u20031G", id="em-space"),
        pytest.param("1_000", id="underscore"),
        pytest.param("", id="empty"),
        pytest.param(" ", id="blank"),
    ],
)
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_size_allowed_says_the_bound() -> None:
    assert "at most 1P" in SIZE_ALLOWED
    assert parse_size("1P") == SIZE_MAX


@pytest.mark.parametrize(
    ("value", "text"),
    [(0, "0 B"), (512, "512 B"), (K, "1 KiB"), (3 * G // 2, "1.5 GiB"), (P, "1024 TiB")],
)
def test_format_size(value: int, text: str) -> None:
    assert format_size(value) == text
