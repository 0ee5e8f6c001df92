"""Each C escape as systemd v252's cunescape_one (src/basic/escape.c) decodes it in an
`Environment=` word: the byte or code point it makes, or the -EINVAL that makes systemd drop the
rest of the line (the words before it kept), and never a crash of the root daemon."""

from __future__ import annotations

import pytest

from gpuslice.envsyntax import words


@pytest.mark.parametrize(
    ("escape", "decoded"),
    [
        (r"\a", "\x07"),
        (r"\b", "\x08"),
        (r"\f", "\x0c"),
        (r"\n", "\n"),
        (r"\r", "\r"),
        (r"\t", "\t"),
        (r"\v", "\x0b"),
        (r"\s", " "),
        (r"\\", "\\"),
        (r"\"", '"'),
        (r"\'", "'"),
        (r"\x41", "A"),
        (r"\012", "\n"),
        (r"\017", "\x0f"),
        (r"\177", "\x7f"),
        (r"\377", "\udcff"),  # the byte 0xff as it is, no UTF-8
        (r"\u00e9", "é"),
        (r"\U0000FDCF", "\ufdcf"),  # just below the noncharacters U+FDD0..U+FDEF
        (r"\U0000FDF0", "\ufdf0"),  # just above them
        (r"\U00000002", "\x02"),
        (r"\U0000FFFD", "\ufffd"),
        (r"\U0010FFFD", "\U0010fffd"),  # the last valid code point but the two of its plane
    ],
)
def test_escape_decodes_as_systemd(escape: str, decoded: str) -> None:
    assert words(f"X=1 A=<{escape}> B=2") == ["X=1", f"A=<{decoded}>", "B=2"]


@pytest.mark.parametrize(
    "escape",
    [
        r"\A",
        r"\X",
        r"\X00000041",  # no escape of systemd's, whatever follows
        r"\8",
        r"\x00",
        r"\000",
        r"\400",  # over 255
        r"\777",
        r"\18",
        r"\189",  # not octal
        r"\1_2",
        r"\u0000",
        r"\U00000000",
        r"\U00110000",  # past the last code point
        r"\U0000D800",
        r"\U0000D801",
        r"\U0000DFFF",  # surrogates
        r"\U0000FDD0",
        r"\U0000FDEF",  # noncharacters
        r"\U0000FFFE",
        r"\U0000FFFF",
        r"\U0001FFFF",
        r"\U0010FFFE",
    ],
)
def test_bad_escape_drops_the_rest_of_the_line(escape: str) -> None:
    assert words(f"X=1 A=<{escape}> B=2") == ["X=1"]
