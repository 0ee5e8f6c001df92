"""gpuslice/envsafety.py's glob patterns and Environment= words at their exact words and edges:
which directory of a pattern may be `..` as glibc's glob(3) itself reads it (bracket
expressions, escapes, a `\\` that ends a directory), where a pattern leads out from (`/`),
refusals cut at 200 characters, a template run as another user whose file its instance
names, and the Environment= words of a unit run as root whose name or value is not worked
out."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest

from gpuslice import envsafety
from gpuslice.envsafety import FIX_INSTANCE, FIX_PATH, FIX_SKIPS
from tests.test_envsafety import ASR, ETC, GATE, errors, install, put
from tests.test_envsafety import reaches_up as reaches_up  # a fixture
from tests.test_envsafety import root as root  # a fixture
from tests.test_envsafety_mutation import fresh_covered as fresh_covered  # autouse

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

NAME_UNKNOWN = (
    "and may be one with which the gate's programs exit 0 at once (LD_TRACE_LOADED_OBJECTS, "
    "LD_TRACE_PRELINKING, LD_DEBUG, SHELLOPTS)"
)
LEADS_OUT = (
    "cannot be checked: systemd reads it as a wildcard pattern, and a directory of it may be "
    "`..` as glob(3) reads it (`.*` matches `..`), so it leads out of"
)


def _may_be_up(part: str) -> bool:
    """`envsafety._may_be_up(part)`, which must answer within a second (a bracket's end
    found before its `[` would walk it again forever: a scan that never ends)."""

    def hung(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(part)

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(1)
    try:
        return envsafety._may_be_up(part)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_bracket_expressions_make_dot_dot_as_glibcs_glob_reads_them(
    reaches_up: Callable[[str], bool],
) -> None:
    """A bracket's `]` first (or after `!` or `^`) is one of its characters, it ends at the
    first `]` after that (not the last), one with no `]` is a `[`, and two brackets are two
    characters: each as glibc's glob(3) reads it. `\\..` is `..`."""
    parts = [
        ".[!]x]",  # not `]` nor `x`: a dot
        ".[^]x]",
        ".[!x]",
        ".[].]",  # `]` or a dot
        ".[]].]",  # `]`, then `.]`
        ".[.]]",  # a dot, then `]`
        ".[.]x",
        ".[.",  # no `]`: `[` itself
        "..[",
        ".[a][.]",  # three characters
        ".[.][.]",
        "\\..",
        ".\\.",
        "\\.\\.",
    ]
    for part in parts:
        assert _as_glibc_reads(part, reaches_up), part


def _as_glibc_reads(part: str, reaches_up: Callable[[str], bool]) -> bool:
    """`_may_be_up` says what glibc's glob(3) says of `part`, but that a bracket may be taken
    for `..` where glibc reads it otherwise (each `]` after it may end it: README)."""
    maybe = _may_be_up(part)
    return maybe == reaches_up(part) or ("[" in part and maybe)


def test_a_directory_glob3_reads_as_dot_dot_by_an_escape_or_a_class_leads_out(
    root: Path, reaches_up: Callable[[str], bool]
) -> None:
    """`..\\` (a `\\` that ends a directory escapes the `/` after it), `.*\\`, `.[\\].]` (an
    escaped `]` is one of the bracket's) and `.[[:punct:]]` (a class's `]` ends nothing) are
    `..` to glibc's glob(3): a unit run as root with EnvironmentFile=/etc/job/..\\/asr/x.env
    read /etc/asr/x.env, unsaid (gpuslice read `..\\` as `..` and a `\\`, `.[\\]` as a
    bracket, then `.]`). A bracket that holds an instance's name may be anything: the name
    may end with a `\\` that escapes its `]`."""
    ups = [
        "..\\",
        ".*\\",
        ".?\\",
        ".[\\].]",
        ".[!\\]]",
        ".[\\.]",
        ".[[:punct:]]",
        ".[[=.=]]",
        ".[![:alpha:]]",
    ]
    for part in [*ups, ".[[:punct:]", ".[[.].]", ".[.\\]", ".d\\", ".*\\\\"]:
        assert _as_glibc_reads(part, reaches_up), part
    assert _may_be_up(".[\0]x]")
    put(root, "/etc/job/a/job.env")
    for i, value in enumerate(("/etc/job/..\\/asr/x.env", "/etc/job/.[[:punct:]]/asr/x.env")):
        install(root, f"bad{i}.service", f"EnvironmentFile={value}")
        assert errors(root, f"bad{i}.service") == [
            f"{ETC}/bad{i}.service:4: [Service] EnvironmentFile: {value} {LEADS_OUT} /etc/job; "
            f"{GATE} bad{i}.service {FIX_PATH}"
        ], value


def test_a_pattern_whose_first_directory_is_a_wildcard_leads_out_of_slash(root: Path) -> None:
    """/.*/etc/x.env: the directory before its first wildcard is / itself."""
    install(root, "top.service", "EnvironmentFile=/.*/etc/x.env")
    assert errors(root, "top.service") == [
        f"{ETC}/top.service:4: [Service] EnvironmentFile: /.*/etc/x.env {LEADS_OUT} /; "
        f"{GATE} top.service {FIX_PATH}"
    ]


def test_a_root_units_file_that_is_no_pattern_is_not_looked_under(root: Path) -> None:
    """EnvironmentFile=/etc/asr, a directory (systemd cannot read it: the start fails) of a
    unit run as root, is its own business: what is under it (a user's file) is not
    looked at as under a pattern's directory."""
    put(root, "/etc/asr/sub/x.env", uid=ASR)
    install(root, "dir.service", "EnvironmentFile=/etc/asr")
    assert errors(root, "dir.service") == []


def test_refusals_of_long_patterns_and_words_are_cut_at_200_characters(root: Path) -> None:
    """A pattern that leads out, and an Environment= word that may skip the gate, are shown
    to their 200th character."""
    pattern = "/etc/job/.*/" + "a/" * 120 + "x.env"
    install(root, "long.service", f"EnvironmentFile={pattern}")
    assert errors(root, "long.service") == [
        f"{ETC}/long.service:4: [Service] EnvironmentFile: {pattern[:200]}... {LEADS_OUT} "
        f"/etc/job; {GATE} long.service {FIX_PATH}"
    ]
    word = "LD_DEBUG=" + "a" * 250 + "%i"
    install(root, "word@.service", f"Environment={word}")
    assert errors(root, "word@.service") == [
        f"{ETC}/word@.service:4: [Service] Environment: {word[:200]}... cannot be checked: %i "
        "is the instance's name, or holds it, which whoever starts an instance of "
        "word@.service chooses, and glibc's loader prints LD_DEBUG's options and exits 0 "
        f"instead of running the program where one of its words is help; {GATE} "
        f"word@.service {FIX_SKIPS}"
    ]


def test_a_template_run_as_another_user_whose_file_its_instance_names_is_refused_as_such(
    root: Path,
) -> None:
    """/etc/job/%I.env of a template run as asr: refused for the specifier, as every unit run
    as another user whose file is not worked out (not as a root template's instance)."""
    install(root, "tu@.service", "User=asr", "EnvironmentFile=/etc/job/%I.env")
    assert errors(root, "tu@.service") == [
        f"{ETC}/tu@.service:5: [Service] EnvironmentFile: /etc/job/%I.env cannot be checked: "
        "%I depends on the instance's name, which whoever starts an instance of tu@.service "
        f"chooses, so the file cannot be checked for every instance; {GATE} tu@.service "
        f"{FIX_PATH}"
    ]
    assert FIX_INSTANCE not in errors(root, "tu@.service")[0]


def test_environment_words_of_a_root_unit_whose_value_may_skip_the_gate(root: Path) -> None:
    """LD_TRACE_LOADED_OBJECTS=%i skips whatever the instance: said with why %i is not worked
    out for this template; SHELLOPTS=%i with the words that skip, `noexec or onecmd`."""
    install(root, "tr@.service", "Environment=LD_TRACE_LOADED_OBJECTS=%i")
    assert errors(root, "tr@.service") == [
        f"{ETC}/tr@.service:4: [Service] Environment: LD_TRACE_LOADED_OBJECTS=%i cannot be "
        "checked: glibc's loader lists a program's libraries and exits 0 instead of running "
        "it, whatever the value, and its value is not worked out (%i depends on the "
        "instance's name, which whoever starts an instance of tr@.service chooses, so the "
        f"file cannot be checked for every instance); {GATE} tr@.service {FIX_SKIPS}"
    ]
    install(root, "sh@.service", "Environment=SHELLOPTS=%i")
    assert errors(root, "sh@.service") == [
        f"{ETC}/sh@.service:4: [Service] Environment: SHELLOPTS=%i cannot be checked: %i is "
        "the instance's name, or holds it, which whoever starts an instance of sh@.service "
        "chooses, and a /bin/sh that is bash reads the gate without running it (noexec), or "
        "runs its first command alone (onecmd), and exits 0 where one of its words is "
        f"noexec or onecmd; {GATE} sh@.service {FIX_SKIPS}"
    ]


def test_environment_words_whose_name_is_read_as_expand_reads_it(root: Path) -> None:
    """The name of a word ends at its first `=` that is no specifier's: %I alone (no `=`:
    b@LD_DEBUG\\x3dhelp.service makes it LD_DEBUG=help) and `%==1` (`%=`, not known) are
    names not worked out; `%%=%i` is `%`, and `%n=%h` the unit's name, neither of which
    skips the gate."""
    install(root, "cap@.service", "Environment=%I")
    assert errors(root, "cap@.service") == [
        f"{ETC}/cap@.service:4: [Service] Environment: %I cannot be checked: its name is not "
        "worked out (%I depends on the instance's name, which whoever starts an instance of "
        "cap@.service chooses, so the file cannot be checked for every instance), "
        f"{NAME_UNKNOWN}; {GATE} cap@.service {FIX_SKIPS}"
    ]
    install(root, "eq.service", "Environment=%==1")
    assert errors(root, "eq.service") == [
        f"{ETC}/eq.service:4: [Service] Environment: %==1 cannot be checked: its name is not "
        "worked out (the specifier %= has a value gpuslice does not work out (it knows %n %N "
        f"%p %P %i %I %j %J %t %S %C %L %E %T %V %%)), {NAME_UNKNOWN}; {GATE} eq.service "
        f"{FIX_SKIPS}"
    ]
    install(root, "pp@.service", "Environment=%%=%i")
    install(root, "n.service", "Environment=%n=%h")
    assert errors(root, "pp@.service") == []
    assert errors(root, "n.service") == []
