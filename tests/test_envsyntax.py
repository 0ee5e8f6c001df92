"""systemd v252's syntax for the settings the gate runs with (gpuslice/envsyntax.py): each case
is what systemd itself makes of the text (src/basic/extract-word.c, escape.c, env-file.c,
src/core/load-fragment.c), so that no LD_PRELOAD= or bind hides from the checks behind a quote,
an escape or a separator read otherwise."""

from __future__ import annotations

import pytest

from gpuslice import envsyntax
from gpuslice.envsyntax import (
    Mount,
    WordError,
    assignment,
    bind_paths,
    extract_first_word,
    parse_env_file,
    simplify_path,
    temporary_file_systems,
    words,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("A=1 B=2", ["A=1", "B=2"]),
        ('"LD_PRELOAD=/a b" X=1', ["LD_PRELOAD=/a b", "X=1"]),
        ("LD_PRELOAD='/a b'", ["LD_PRELOAD=/a b"]),
        ("A=\"x\"y'z'", ["A=xyz"]),  # quotes anywhere in a word, dropped
        ("  A=1\t\tB=2  ", ["A=1", "B=2"]),  # blanks coalesced
        ("A=\\x2fhome B=\\s", ["A=/home", "B= "]),  # C escapes
        ("A=\\101\\u00e9\\U0001F600", ["A=A\u00e9\U0001f600"]),
        ('A="\\"in\\" quotes"', ['A="in" quotes']),
        ("A=\\xc3\\xa9", ["A=\u00e9"]),  # bytes of UTF-8, one character
        ("A=1 B=\\q C=3", ["A=1"]),  # a bad escape: the rest of the line is ignored
        ("A=1 B='open", ["A=1"]),  # so is an unbalanced quote
        ("A=1 B=\\", ["A=1"]),  # and a trailing backslash
        ("A=\\x00 B=1", []),  # no NUL
        ("A=\\000", []),
        ("A=\\u0000", []),
        ("A=\\U0000D800", []),  # \U takes valid code points only
        ("A=\\400", []),  # octal above 255
        ("A=\\xZZ", []),
        ("A=\\u12", []),
        ("", []),
    ],
)
def test_words_as_systemd_splits_an_environment_line(value: str, expected: list[str]) -> None:
    assert words(value) == expected


def test_a_surrogate_made_by_u_is_no_valid_assignment() -> None:
    """\\u takes a surrogate (its three bytes are no UTF-8), which the assignment's own check
    then refuses, as env_assignment_is_valid does."""
    [word] = words("A=\\ud800")
    assert assignment(word) is None
    [word] = words("A=\\xff")  # a lone byte: no UTF-8 either
    assert assignment(word) is None


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("LD_PRELOAD=/a", ("LD_PRELOAD", "/a")),
        ("A=", ("A", "")),
        ("A=b=c", ("A", "b=c")),
        ("_x1=", ("_x1", "")),
        ("1A=x", None),
        ("A-B=x", None),
        ("=x", None),
        ("A", None),
        ("\u00e9=x", None),
    ],
)
def test_assignment(word: str, expected: tuple[str, str] | None) -> None:
    assert assignment(word) == expected


def test_extract_first_word_without_coalescing_gives_empty_words() -> None:
    text = "a::b:"
    found = []
    pos: int | None = 0
    while True:
        word, pos = extract_first_word(text, pos, ":", dont_coalesce=True)
        if word is None:
            break
        found.append(word)
        if pos is None:
            break
    assert found == ["a", "", "b", ""]
    assert extract_first_word("", 0, ":", dont_coalesce=True) == ("", None)
    assert extract_first_word("x", None) == (None, None)
    assert extract_first_word("   ", 0) == (None, None)
    assert extract_first_word("a  b", 0) == ("a", 3)
    assert extract_first_word("a  ", 0) == ("a", None)
    # without EXTRACT_UNQUOTE quotes are characters, and a backslash takes the next one
    assert extract_first_word("'a\\:b'", 0, ":", dont_coalesce=True) == ("'a:b'", None)
    with pytest.raises(WordError):
        extract_first_word("a\\", 0)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/usr//local/./bin/", "/usr/local/bin"),
        ("/", "/"),
        ("//", "/"),
        ("relative", None),
        ("", None),
        ("/a/../b", None),
        ("/" + "a" * 256, None),
        ("/" + "a/" * 2048, None),
    ],
)
def test_simplify_path(path: str, expected: str | None) -> None:
    assert simplify_path(path) == expected


def keep(text: str) -> str | None:
    return text


def unknown_h(text: str) -> str | None:
    """Specifiers as `envsafety.expand` does them: %h is not known there."""
    return None if "%h" in text else text.replace("%t", "/run")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/data/models:/models", [Mount("/models", False)]),
        ("/a:/b:norbind /c", [Mount("/b", False), Mount("/c", True)]),
        ("-/a:/b:rbind", [Mount("/b", False)]),
        ("/a:/a", [Mount("/a", True)]),  # onto itself
        ("/a:/a:norbind", [Mount("/a", False)]),  # its submounts hidden
        ("/a/:/a", [Mount("/a", True)]),
        ('"/a b":"/c d"', [Mount("/c d", False)]),
        ("/a:/b:bogus /c:/d", [Mount("/d", False)]),  # a bad option skips that bind
        # a source systemd cannot take is skipped alone: its destination is the next source
        ("relative:/usr/bin", [Mount("/usr/bin", True)]),
        ("/a:relative", []),
        ("/a:", []),
        ("/a:/b x:/y", [Mount("/b", False), Mount("/y", True)]),  # `x` skipped, /y a source
        ("/a:/b:rbind:/c", []),  # the options are the rest up to a blank: bad, bind skipped
        ("/a:'/b", []),  # a syntax error ignores the rest of the line
        ("/a:%t/x", [Mount("/run/x", False)]),
        ("/a:%h/x", [Mount(None, False)]),  # not known here
        ("%h/x:/b", [Mount("/b", False)]),
        ("%h/x", [Mount(None, True)]),  # onto itself, whatever it is
        ("", []),
    ],
)
def test_bind_paths(value: str, expected: list[Mount]) -> None:
    assert bind_paths(value, unknown_h) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/run", [Mount("/run", False)]),
        ("/run:mode=0755 /var/x:ro", [Mount("/run", False), Mount("/var/x", False)]),
        ("'/a b':ro", [Mount("/a b", False)]),
        ("/a/../b /c", [Mount("/c", False)]),
        ("relative /c", [Mount("/c", False)]),
        ("%h/x", [Mount(None, False)]),
        ("/a\\", []),  # a trailing backslash: that word skipped
        ("/x '/a", [Mount("/x", False)]),  # an unbalanced quote: the rest of the line ignored
    ],
)
def test_temporary_file_systems(value: str, expected: list[Mount]) -> None:
    assert temporary_file_systems(value, unknown_h) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A=1\nB=2\n", [("A", "1"), ("B", "2")]),
        ("A=1", [("A", "1")]),
        ("  A  =  1  \n", [("A", "1")]),  # blanks around the key, before and after the value
        ("# c\n; c\nA=1\n", [("A", "1")]),
        ("# c \\\nA=1\nB=2", [("B", "2")]),  # a comment's backslash takes the newline
        ("A='x y'\n", [("A", "x y")]),
        ('A="x \\"y\\" \\$z \\n"\n', [("A", 'x "y" $z \\n')]),
        ('A="a\\\nb"', [("A", "ab")]),
        ("A=x\\\ny\n", [("A", "xy")]),  # an escaped newline is eaten
        ("A=x\\ \n", [("A", "x ")]),  # an escaped blank is kept
        ("A='x'y \"z\"\n", [("A", 'xy "z"')]),  # past the first word, quotes are characters
        ('A=x"y"\n', [("A", 'x"y"')]),  # quotes only count at the value's start
        ("A=\n", [("A", "")]),
        ("A\nB=1\n", [("B", "1")]),  # a key without `=` is dropped
        ("export A=1\n", [("export A", "1")]),  # not a valid name: systemd drops it later
        ("A=1\rB=2", [("A", "1"), ("B", "2")]),
        ("A='open\nB=2\n", [("A", "open\nB=2\n")]),
        ("A=1\nA=2\n", [("A", "1"), ("A", "2")]),
        ("", []),
    ],
)
def test_parse_env_file(text: str, expected: list[tuple[str, str]]) -> None:
    assert parse_env_file(text) == expected


def test_an_env_file_with_a_key_or_value_that_is_not_utf8_is_refused_whole() -> None:
    bad = b"\xff".decode("utf-8", "surrogateescape")
    assert parse_env_file(f"A=1\nB={bad}\n") is None
    assert parse_env_file(f"{bad}=1\n") is None
    assert parse_env_file(f"# {bad}\nA=1\n") == [("A", "1")]  # a comment is not looked at


@pytest.mark.parametrize("nonchar", ["\ufffe", "\uffff", "\ufdd0", "\U0010ffff"])
def test_an_env_file_with_a_noncharacter_is_refused_whole(nonchar: str) -> None:
    """Python decodes a noncharacter; systemd's utf8_is_valid (unichar_is_valid) refuses it."""
    assert parse_env_file(f"A=1\nB=x{nonchar}\n") is None
    assert parse_env_file("A=\ufffd\n") == [("A", "\ufffd")]  # U+FFFD is a character


def test_an_env_file_with_a_nul_is_refused_whole() -> None:
    """systemd's read_full_stream_full answers EBADMSG for a NUL anywhere, a comment's
    included: none of the file's assignments apply (they did here, up to the NUL)."""
    assert parse_env_file("A=1\0B=2\n") is None
    assert parse_env_file("A=1\n# \0\n") is None
    assert parse_env_file("A=1\n") == [("A", "1")]


def test_names_are_checked_as_systemd_does() -> None:
    assert envsyntax.is_env_name("LD_PRELOAD")
    assert not envsyntax.is_env_name("")
    assert not envsyntax.is_env_name("9A")
    assert not envsyntax.is_env_name("A B")
