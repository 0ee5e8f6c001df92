"""systemd's own syntax for the settings that decide what gpuslice's root gate runs with.

`Environment=`, `UnsetEnvironment=`, `BindPaths=`, `BindReadOnlyPaths=` and
`TemporaryFileSystem=` are split into words by systemd's extract_first_word, and an
`EnvironmentFile=` is read by its parse_env_file: a word read otherwise than systemd reads it
would let a `LD_PRELOAD=` or a bind over /usr/local/bin through unchecked (`envsafety`). Ported
from systemd v252.31 (src/basic/extract-word.c, escape.c's cunescape_one, env-file.c,
path-util.c's path_simplify_and_warn, and the config_parse_* callers in
src/core/load-fragment.c); each function names what it stands for. Pure stdlib.

Words are `str`; a byte that systemd's escapes (`\\xNN`, `\\ooo`) make and that is not UTF-8
is kept as a lone surrogate (Python's surrogateescape), as `unitfiles` keeps such bytes, so
that a path with it reaches the file system as that byte.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

WHITESPACE = " \t\n\r"  # systemd's WHITESPACE: what it strips around keys and values
_NEWLINE = "\n\r"
_COMMENTS = "#;"
_SHELL_NEED_ESCAPE = '"\\`$'
_HEX = "0123456789abcdefABCDEF"
PATH_MAX = 4096  # Linux's, with the NUL
NAME_MAX = 255  # Linux's: the bytes of one path component


class WordError(ValueError):
    """extract_first_word's -EINVAL (an unbalanced quote, a bad escape, a trailing backslash):
    systemd ignores the rest of the setting's line."""


def _unichar_is_valid(c: int) -> bool:
    """utf8.c's unichar_is_valid."""
    return (
        c < 0x110000
        and (c & 0xFFFFF800) != 0xD800
        and not 0xFDD0 <= c <= 0xFDEF
        and (c & 0xFFFE) != 0xFFFE
    )


def _hex(text: str, start: int, count: int) -> int:
    digits = text[start : start + count]
    if len(digits) != count or any(d not in _HEX for d in digits):
        raise WordError("bad escape")
    return int(digits, 16)


def _cunescape_one(text: str, i: int) -> tuple[bytes, int]:
    """The bytes one C escape at `text[i]` (after its backslash) stands for, and how many
    characters it takes (escape.c's cunescape_one, NUL refused)."""
    c = text[i]
    simple = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "s": 32}
    if c in simple:
        return bytes([simple[c]]), 1
    if c in "\\\"'":
        return c.encode(), 1
    if c == "x":
        byte = _hex(text, i + 1, 2)
        if byte == 0:
            raise WordError("NUL")
        return bytes([byte]), 3  # a byte as it is, UTF-8 or not
    if c in "uU":
        width = 4 if c == "u" else 8
        code = _hex(text, i + 1, width)
        # \u takes any code point but NUL (a surrogate makes bytes that are no UTF-8, which
        # the assignment's check then refuses); \U only a valid one
        if code == 0 or (c == "U" and not _unichar_is_valid(code)):
            raise WordError("bad code point")
        return chr(code).encode("utf-8", "surrogatepass"), width + 1
    if "0" <= c <= "7":
        digits = text[i : i + 3]
        if len(digits) != 3 or any(not "0" <= d <= "7" for d in digits):
            raise WordError("bad octal escape")
        byte = int(digits, 8)
        if byte == 0 or byte > 255:
            raise WordError("bad octal escape")
        return bytes([byte]), 3
    raise WordError("unknown escape")


def extract_first_word(
    text: str,
    pos: int | None,
    separators: str = WHITESPACE,
    *,
    unquote: bool = False,
    cunescape: bool = False,
    dont_coalesce: bool = False,
) -> tuple[str | None, int | None]:
    """(word, where the rest starts) from `text[pos:]`, as extract_first_word with the flags
    EXTRACT_UNQUOTE, EXTRACT_CUNESCAPE and EXTRACT_DONT_COALESCE_SEPARATORS; (None, None) when
    there is no word; the rest is None at the end of `text`. A backslash outside quotes (and
    inside them) escapes the next character: C-unescaped with `cunescape`, else taken as it is.
    Raises WordError where systemd fails."""
    if pos is None:
        return None, None
    out: bytearray | None = bytearray() if dont_coalesce else None
    n = len(text)
    i = pos
    while True:  # leading separators
        if i == n:
            return (None, None) if out is None else (_decode(out), None)
        if text[i] in separators:
            if dont_coalesce:
                return _decode(out or bytearray()), i + 1
            i += 1
            continue
        break
    word = out if out is not None else bytearray()
    quote = ""
    backslash = False
    while True:
        if backslash:
            if i == n:
                raise WordError("trailing backslash")
            if cunescape:
                raw, length = _cunescape_one(text, i)
                word += raw
                i += length - 1
            else:
                word += text[i].encode("utf-8", "surrogateescape")
            backslash = False
        elif quote:
            while True:
                if i == n:
                    raise WordError("unbalanced quote")
                c = text[i]
                if c == quote:
                    quote = ""
                    break  # EXTRACT_UNQUOTE: the quote is dropped
                if c == "\\":
                    backslash = True
                    break
                word += c.encode("utf-8", "surrogateescape")
                i += 1
        else:
            while True:
                if i == n:
                    return _decode(word), None
                c = text[i]
                if c in "'\"" and unquote:
                    quote = c
                    break
                if c == "\\":
                    backslash = True
                    break
                if c in separators:
                    if dont_coalesce:
                        return _decode(word), i + 1
                    while True:  # coalesced separators skipped
                        i += 1
                        if i == n:
                            return _decode(word), None
                        if text[i] not in separators:
                            return _decode(word), i
                word += c.encode("utf-8", "surrogateescape")
                i += 1
        i += 1


def _decode(raw: bytearray) -> str:
    return raw.decode("utf-8", "surrogateescape")


# what systemd's utf8_is_valid refuses beyond undecodable bytes (kept as lone surrogates):
# unichar_is_valid's noncharacters, U+FDD0..U+FDEF and the last two of every plane
_NOT_UTF8 = re.compile(
    "[\ud800-\udfff\ufdd0-\ufdef"
    + "".join(chr(plane << 16 | 0xFFFE) + chr(plane << 16 | 0xFFFF) for plane in range(17))
    + "]"
)
_ENV_NAME = re.compile("[A-Za-z_][A-Za-z0-9_]*")


def is_valid_utf8(text: str) -> bool:
    """Whether `text` came from UTF-8 that systemd's utf8_is_valid takes: no byte kept as a
    surrogate, no noncharacter (U+FFFE, U+FDD0, ...), which Python decodes and systemd refuses."""
    return text.isascii() or _NOT_UTF8.search(text) is None  # isascii: O(1), the usual case


def words(value: str) -> list[str]:
    """The words of one `Environment=` or `UnsetEnvironment=` (config_parse_environ,
    config_parse_unset_environ): unquoted and C-unescaped, split at whitespace. At a syntax
    error systemd ignores the rest of the line but keeps the words before it."""
    found: list[str] = []
    pos: int | None = 0
    while True:
        try:
            word, pos = extract_first_word(value, pos, unquote=True, cunescape=True)
        except WordError:
            return found
        if word is None:
            return found
        found.append(word)


def is_env_name(name: str) -> bool:
    """env-util.c's env_name_is_valid: letters, digits and `_`, not first a digit."""
    return _ENV_NAME.fullmatch(name) is not None


def assignment(word: str) -> tuple[str, str] | None:
    """(name, value) of a valid `NAME=VALUE` (env_assignment_is_valid), else None."""
    name, eq, value = word.partition("=")
    if not eq or not is_env_name(name) or not is_valid_utf8(value):
        return None
    return name, value


def simplify_path(path: str) -> str | None:
    """`path` as path_simplify_and_warn(PATH_CHECK_ABSOLUTE) leaves it (`//` and `.` gone, no
    trailing `/`), or None where systemd ignores the entry: not absolute, a `..`, too long."""
    if not path.startswith("/"):
        return None
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts or any(len(p.encode("utf-8", "surrogateescape")) > NAME_MAX for p in parts):
        return None
    simple = "/" + "/".join(parts)
    if len(simple.encode("utf-8", "surrogateescape")) >= PATH_MAX:
        return None
    return simple


# what a specifier-expanding function gives back: the text, or None when it cannot be told
Resolve = Callable[[str], "str | None"]


class Mount(NamedTuple):
    """One bind mount or temporary file system: `destination` is None when it cannot be told
    here (a specifier); `same` when it is a recursive bind of a path onto itself (no
    destination given, or the source's), which shows what was there already."""

    destination: str | None
    same: bool


def bind_paths(value: str, resolve: Resolve) -> list[Mount]:
    """The mounts of one `BindPaths=`/`BindReadOnlyPaths=` (config_parse_bind_paths):
    `[-]SOURCE[:DESTINATION[:OPTIONS]]`, space-separated, each path's specifiers expanded by
    `resolve`. As in systemd, a source that is no absolute normalized path is skipped alone,
    and what follows its `:` is read as the next source."""
    found: list[Mount] = []
    seps = ":" + WHITESPACE
    pos: int | None = 0
    while True:
        try:
            raw, pos = extract_first_word(value, pos, seps, unquote=True, dont_coalesce=True)
        except WordError:
            return found
        if raw is None:
            return found
        source = resolve(raw)
        if source is not None:
            source = simplify_path(source[1:] if source.startswith("-") else source)
            if source is None:
                continue
        if pos is None or value[pos - 1] != ":":
            found.append(Mount(source, True))  # onto itself
            continue
        try:
            raw, pos = extract_first_word(value, pos, seps, unquote=True, dont_coalesce=True)
        except WordError:
            return found
        if raw is None:
            continue
        destination = resolve(raw)
        if destination is not None:
            destination = simplify_path(destination)
            if destination is None:
                continue
        recursive = True
        if pos is not None and value[pos - 1] == ":":
            try:
                options, pos = extract_first_word(value, pos, unquote=True)
            except WordError:
                return found
            if options not in (None, "", "rbind", "norbind"):
                continue
            recursive = options != "norbind"
        same = recursive and source is not None and destination == source
        found.append(Mount(destination, same))


def temporary_file_systems(value: str, resolve: Resolve) -> list[Mount]:
    """The mounts of one `TemporaryFileSystem=` (config_parse_temporary_filesystems):
    `PATH[:OPTIONS]`, space-separated."""
    found: list[Mount] = []
    pos: int | None = 0
    while True:
        try:
            word, pos = extract_first_word(value, pos, unquote=True)
        except WordError:
            return found
        if word is None:
            return found
        try:
            raw, _ = extract_first_word(word, 0, ":", dont_coalesce=True)
        except WordError:
            continue
        if raw is None:
            continue
        path = resolve(raw)
        if path is not None:
            path = simplify_path(path)
            if path is None:
                continue
        found.append(Mount(path, False))


def parse_env_file(text: str) -> list[tuple[str, str]] | None:
    """The assignments of an `EnvironmentFile=`'s text, in order (env-file.c's
    parse_env_file_internal: shell-like quotes and backslashes, `#`/`;` comments, a key's
    trailing blanks dropped), or None where systemd refuses the whole file: a key or value
    that is not UTF-8, or a NUL anywhere (fileio.c's read_full_stream_full, asked for no
    size, answers EBADMSG rather than let C stop at it). The unit's start then fails, or,
    for a `-` file, goes on without any of its assignments: an earlier `LD_PRELOAD=` stands."""
    if "\0" in text:
        return None
    found: list[tuple[str, str]] = []
    state = "pre_key"
    key: list[str] = []
    value: list[str] = []
    key_ws: int | None = None  # where the key's trailing blanks begin
    value_ws: int | None = None  # where the value's trailing blanks begin (unquoted only)

    def push() -> None:
        k = "".join(key[:key_ws] if key_ws is not None else key)
        found.append((k, "".join(value)))

    for c in text:
        if state == "pre_key":
            if c in _COMMENTS:
                state = "comment"
            elif c not in WHITESPACE:
                state = "key"
                key_ws = None
                key.append(c)
        elif state == "key":
            if c in _NEWLINE:
                state = "pre_key"
                key = []
            elif c == "=":
                state = "pre_value"
                value_ws = None
            else:
                if c not in WHITESPACE:
                    key_ws = None
                elif key_ws is None:
                    key_ws = len(key)
                key.append(c)
        elif state in ("pre_value", "value"):
            if c in _NEWLINE:
                if state == "value" and value_ws is not None:
                    del value[value_ws:]
                push()
                state = "pre_key"
                key, value = [], []
            elif c == "\\":
                state = "value_escape"
                value_ws = None
            elif state == "pre_value" and c == "'":
                state = "single"
            elif state == "pre_value" and c == '"':
                state = "double"
            elif state == "pre_value":
                if c not in WHITESPACE:
                    state = "value"
                    value.append(c)
            else:
                if c not in WHITESPACE:
                    value_ws = None
                elif value_ws is None:
                    value_ws = len(value)
                value.append(c)
        elif state == "value_escape":
            state = "value"
            if c not in _NEWLINE:  # an escaped newline is eaten up entirely
                value.append(c)
        elif state == "single":
            if c == "'":
                state = "pre_value"
            else:
                value.append(c)
        elif state == "double":
            if c == '"':
                state = "pre_value"
            elif c == "\\":
                state = "double_escape"
            else:
                value.append(c)
        elif state == "double_escape":
            state = "double"
            if c in _SHELL_NEED_ESCAPE:
                value.append(c)
            elif c != "\n":
                value += ["\\", c]
        elif state == "comment":
            if c == "\\":
                state = "comment_escape"
            elif c in _NEWLINE:
                state = "pre_key"
        else:  # comment_escape
            state = "comment"
    if state in ("pre_value", "value", "value_escape", "single", "double", "double_escape"):
        if state == "value" and value_ws is not None:
            del value[value_ws:]
        push()
    if not all(is_valid_utf8(k) and is_valid_utf8(v) for k, v in found):
        return None
    return found
