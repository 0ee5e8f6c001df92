"""Corners of systemd v252's word splitting and env-file parsing (gpuslice/envsyntax.py) that
the main cases leave out: bytes that are not UTF-8, separators that systemd does not coalesce,
quoted options and a comment's first character. Each expectation is what systemd itself makes of
the text (src/basic/extract-word.c, env-file.c, src/core/load-fragment.c)."""

from __future__ import annotations

import pytest

from gpuslice.envsyntax import (
    NAME_MAX,
    Mount,
    bind_paths,
    parse_env_file,
    simplify_path,
    temporary_file_systems,
)


def keep(text: str) -> str | None:
    return text


# a byte that is not UTF-8, as unitfiles keeps it (surrogateescape)
BYTE = b"\xff".decode("utf-8", "surrogateescape")


@pytest.mark.parametrize(
    "value",
    [
        f"/a{BYTE}",  # unquoted
        f"'/a{BYTE}'",  # quoted
        f"/a\\{BYTE}",  # escaped by a backslash
    ],
)
def test_a_path_with_a_byte_that_is_not_utf8_is_read_as_that_byte(value: str) -> None:
    assert temporary_file_systems(value, keep) == [Mount(f"/a{BYTE}", False)]
    assert bind_paths(value, keep) == [Mount(f"/a{BYTE}", True)]


def test_a_component_of_name_max_bytes_is_valid_one_more_is_not() -> None:
    longest = "/" + "a" * NAME_MAX
    assert simplify_path(longest) == longest
    assert simplify_path(longest + "a") is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # separators are not coalesced: the `:` after a blank starts an empty (skipped) source,
        # so /b is a source of its own, not /a's destination
        ("/a :/b", [Mount("/a", True), Mount("/b", True)]),
        ("/a: /b", [Mount("/b", True)]),  # an empty destination: that bind skipped
        ("/a::/b", [Mount("/b", True)]),
        ("/X:/Y", [Mount("/Y", False)]),  # letters are no separators
        ('/a:/a:"norbind"', [Mount("/a", False)]),  # the options are unquoted
        ("/a:/a:''", [Mount("/a", True)]),  # empty options: rbind
    ],
)
def test_bind_paths_corners(value: str, expected: list[Mount]) -> None:
    assert bind_paths(value, keep) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (":/a /b", [Mount("/b", False)]),  # an empty path before the `:`: that entry skipped
        ("/X:ro", [Mount("/X", False)]),  # letters are no separators
        # a trailing backslash left after unquoting: that entry skipped, the next one kept
        ("/a\\\\ /b", [Mount("/b", False)]),
    ],
)
def test_temporary_file_systems_corners(value: str, expected: list[Mount]) -> None:
    assert temporary_file_systems(value, keep) == expected


def test_a_comment_ends_at_the_newline_right_after_its_mark() -> None:
    assert parse_env_file("#\nA=1\n;\nB=2\n") == [("A", "1"), ("B", "2")]
