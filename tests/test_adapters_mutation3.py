"""Boundary tests for config, state, annotations and cgroups that `make mutate` asked for.

The config's directory and GPU checks at their odd edges (a huge negative sexagesimal index, a
name ending in `X`), where a list error is located, how the state file is opened and how much
of it is read, the default root of `load_spec`, and the cgroup file at its size limit, PIDs
that are no PIDs, and the hierarchy systemd's units live in. Each test pins a rule that the
modules' own test files left open; mutation testing found the edges.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import yaml

from gpuslice.annotations import load_spec
from gpuslice.cgroups import CGROUP_FILE_MAX, _root_of, _systemd_path, unit_of_pid
from gpuslice.config import Config, Setting, _check, _gpu_id, parse_config
from gpuslice.core.scheduler import SavedState
from gpuslice.state import STATE_FILE_MAX, StateStore
from gpuslice.unitfiles import Entry, TextIssue, parse_sections
from tests.test_adapters_mutation4 import spy_on_os_reads
from tests.test_cgroups import write_cgroup
from tests.test_config import ALLOWED, fill, problems_of
from tests.test_state import GOOD_STATE, good

# ---- config ----------------------------------------------------------------------------------


def test_a_directory_ending_in_x_is_judged_by_its_own_name() -> None:
    """Only trailing `/` are dropped before the checks: `.X` is a plain component (valid), and
    `gpusliceX` is no directory below /var/lib/gpuslice (refused)."""
    config, warnings = parse_config("state_dir: /var/lib/gpuslice/.X\n", "/c")
    assert (config.state_dir, warnings) == ("/var/lib/gpuslice/.X", [])
    config, _ = parse_config("runtime_dir: /run/gpuslice/X/\n", "/c")
    assert config.runtime_dir == "/run/gpuslice/X"
    assert problems_of("state_dir: /var/lib/gpusliceX\n", "/c") == [
        f'/c:1: state_dir: invalid value "/var/lib/gpusliceX" (allowed: {ALLOWED["STATE"]})'
    ]


HUGE_NEGATIVE = "-1" + ":0" * 2500  # YAML 1.1 base 60: -60**2500, over 4300 decimal digits


@pytest.mark.timeout(10)
def test_a_huge_negative_gpu_index_is_a_located_error() -> None:
    """A negative index is refused without being turned into text: `str()` of an integer of
    over 4300 digits raises ValueError, and parse_config raises nothing but ConfigError."""
    assert problems_of(f"manage_gpus:\n  - 0\n  - {HUGE_NEGATIVE}\n", "/c") == [
        fill(
            f'/c:3: manage_gpus: invalid value "{HUGE_NEGATIVE[:60]}..." (allowed: {{MANAGE}})',
            Path("/c"),
        )
    ]
    assert _gpu_id(-1) is False


@pytest.mark.timeout(10)
def test_every_node_of_a_value_is_looked_at_once() -> None:
    """The walk over a value's nodes ends: a nested value is parsed, not looped over."""
    config, _ = parse_config("gpus: 2\nmanage_gpus: [0, GPU-a1]\nreserve: {'*': 1G}\n", "/c")
    assert config == Config(gpus=2, manage_gpus=("0", "GPU-a1"), reserve=(("*", 1 << 30),))


def _distinct(v: object) -> bool:
    return isinstance(v, list) and all(_gpu_id(x) for x in v) and len(set(v)) == len(v)


DISTINCT = Setting("ids", (), _distinct, "distinct GPU ids", "test", item_valid=_gpu_id)


def _value_node(text: str) -> yaml.Node:
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    assert isinstance(root, yaml.MappingNode)
    node: yaml.Node = root.value[0][1]
    return node


def test_a_list_refused_as_a_whole_is_reported_at_the_list() -> None:
    """When every entry passes `item_valid` but the list does not (a rule over the whole
    list), the error names the list at its own line, not an entry."""
    node = _value_node("# ids\nids:\n  - 0\n  - 0\n")
    assert _check(DISTINCT, node, "/c") == (
        None,
        "/c:3: ids: invalid value a list (allowed: distinct GPU ids)",
    )
    node = _value_node("ids:\n  - 0\n  - MIG-1\n")
    assert _check(DISTINCT, node, "/c") == (
        None,
        '/c:3: ids: invalid value "MIG-1" (allowed: distinct GPU ids)',
    )
    assert _check(DISTINCT, _value_node("ids: [0, 1]\n"), "/c") == ([0, 1], None)


# ---- state -----------------------------------------------------------------------------------


def test_the_state_file_is_opened_without_side_effects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is opened read-only, without following a symlink, blocking on a FIFO swapped
    in, taking it as controlling terminal, or leaking the descriptor into children."""
    store = StateStore(tmp_path)
    store.path.write_bytes(good())
    opened: list[int] = []
    real_open = os.open

    def spy(path: os.PathLike[str] | str, flags: int, *args: int, **kwargs: int) -> int:
        if os.fspath(path) == os.fspath(store.path):
            opened.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    assert store.load() == (GOOD_STATE, "0f6c/1234")
    expected = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    assert opened == [expected]


def test_no_more_than_one_byte_past_the_limit_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file over STATE_FILE_MAX is known to be too big after STATE_FILE_MAX + 1 bytes: that
    one read is all the memory a huge file costs."""
    store = StateStore(tmp_path)
    with open(store.path, "wb") as f:
        f.truncate(STATE_FILE_MAX + 10)  # sparse: instant
    reads = spy_on_os_reads(monkeypatch)
    assert store.load() == (SavedState(), "")
    assert reads == [STATE_FILE_MAX + 1]
    assert store.bad_path.stat().st_size == STATE_FILE_MAX + 10


# ---- annotations -----------------------------------------------------------------------------


def test_load_spec_reads_the_host_by_default() -> None:
    """Without a root, `load_spec` looks at the host's own unit directories."""
    assert inspect.signature(load_spec).parameters["root"].default == "/"


# ---- cgroups ---------------------------------------------------------------------------------


def test_an_unused_unified_path_of_x_is_still_a_path() -> None:
    """Only a unified path of slashes means "cgroup2 unused": `/X` is a real cgroup and wins
    over the v1 systemd line (and names no unit)."""
    text = "1:name=systemd:/system.slice/x.service\n0::/X\n"
    assert _systemd_path(text) == "/X"
    assert _systemd_path("1:name=systemd:/system.slice/x.service\n0::/\n") == (
        "/system.slice/x.service"
    )


def test_an_unused_unified_path_without_a_v1_line_is_the_root() -> None:
    """With no v1 systemd line, an unused unified hierarchy still gives its path, `/`."""
    assert _systemd_path("0::/\n") == "/"
    assert _systemd_path("4:memory:/x\n0::/ (deleted)\n") == "/"
    assert _systemd_path("4:memory:/x\n") is None


def test_pid_1s_root_is_empty_when_its_file_cannot_be_read(tmp_path: Path) -> None:
    """No readable cgroup file for PID 1 (or no systemd hierarchy in it): the root is ``,
    as on a host, and nothing is shifted."""
    assert _root_of(tmp_path) == ""
    write_cgroup(tmp_path, 1, "4:memory:/machine.slice/m.scope\n")
    assert _root_of(tmp_path) == ""


def test_a_file_of_exactly_the_limit_is_read_whole(tmp_path: Path) -> None:
    """CGROUP_FILE_MAX bytes are within the limit: its last line counts even without a final
    newline; one byte more and that line is cut."""
    last = "0::/system.slice/asr.service"
    filler = "5:memory:/" + "x" * 1000 + "\n"
    room = CGROUP_FILE_MAX - len(last)
    lines = filler * (room // len(filler))
    head = "5:memory:/" + "y" * (room - len(lines) - len("5:memory:/") - 1) + "\n"
    content = head + lines + last
    assert len(content) == CGROUP_FILE_MAX
    write_cgroup(tmp_path, 42, content)
    assert unit_of_pid(42, tmp_path) == "asr.service"
    write_cgroup(tmp_path, 43, "\n" + content)
    assert unit_of_pid(43, tmp_path) is None


@pytest.mark.parametrize("pid", [0, -1, True, False, "42", 4.0])
def test_what_is_no_pid_is_never_looked_up(tmp_path: Path, pid: int) -> None:
    """Only a positive int names a process: 0, a negative number, a bool or a string is
    refused before /proc is read, even where a file under its name exists."""
    for name in ("0", "-1", "True", "False", "42", "4.0", "4"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cgroup").write_text("0::/system.slice/asr.service\n")
    assert unit_of_pid(pid, tmp_path) is None
    assert unit_of_pid(42, tmp_path) == "asr.service"


# ---- unit-file text --------------------------------------------------------------------------


def test_unit_text_may_begin_with_a_continued_line() -> None:
    """A continuation can start on the very first line: the header joined with the blank line
    after it is still the header, at line 1."""
    headers: list[tuple[str, int]] = []
    assert parse_sections("[S]\\\n\nk = v\n", None, headers) == [Entry("S", "k", "v", 3)]
    assert headers == [("S", 1)]


def test_only_an_empty_last_line_is_dropped() -> None:
    """The empty string after a final line end is dropped, not an empty line inside the text:
    a last line without a line end still counts."""
    assert parse_sections("[S]\n\nk=v") == [Entry("S", "k", "v", 3)]
    assert parse_sections("[S]\n\n") == []


def test_only_systemd_whitespace_comes_before_a_comment() -> None:
    """A comment's `#`/`;` may follow spaces and tabs only: after a vertical tab or a form feed
    (no systemd WHITESPACE) the line is an assignment whose key keeps that character."""
    text = "[S]\n \t#c=1\n\x0b#k=v\n\x0c;j=w\n"
    assert parse_sections(text) == [
        Entry("S", "\x0b#k", "v", 3),
        Entry("S", "\x0c;j", "w", 4),
    ]


def test_an_odd_run_of_backslashes_continues_the_line() -> None:
    """Three trailing backslashes continue the line (the last one escapes the newline), four do
    not."""
    text = "[S]\nk=a\\\\\\\nb=c\nj=d\\\\\\\\\nm=n\n"
    assert parse_sections(text) == [
        Entry("S", "k", "a\\\\ b=c", 2),
        Entry("S", "j", "d\\\\\\\\", 4),
        Entry("S", "m", "n", 5),
    ]


def test_a_continuation_open_at_the_end_of_the_text_is_still_read() -> None:
    """A continuation the text ends in is joined from all its lines, and its header or issue is
    reported like any other line's."""
    assert parse_sections("[S]\nk=a\\\nb\\") == [Entry("S", "k", "a b", 2)]
    issues: list[TextIssue] = []
    assert parse_sections("[S]\nnoequals\\", issues) == []
    assert issues == [TextIssue("S", 2, "missing '=', line ignored")]
    headers: list[tuple[str, int]] = []
    assert parse_sections("[T]\\", None, headers) == []
    assert headers == [("T", 1)]


def test_a_comment_character_after_the_first_is_part_of_the_key() -> None:
    """Only the first character makes a comment: `k#=v` assigns key `k#`, and a one-character
    line is just a line without `=`."""
    issues: list[TextIssue] = []
    assert parse_sections("[S]\nk#=v\nx;=y\nz\n", issues) == [
        Entry("S", "k#", "v", 2),
        Entry("S", "x;", "y", 3),
    ]
    assert issues == [TextIssue("S", 4, "missing '=', line ignored")]


def test_a_bad_header_is_quoted_to_80_characters() -> None:
    """An invalid section header is quoted to its first 80 characters, then `...`."""
    issues: list[TextIssue] = []
    assert parse_sections("[" + "x" * 100 + "\n", issues) == []
    quoted = "[" + "x" * 79 + "..."
    message = f"invalid section header '{quoted}': systemd ignores the rest of the file"
    assert issues == [TextIssue(None, 1, message)]


def test_a_key_keeps_whitespace_that_is_not_systemds() -> None:
    """Keys are trimmed of spaces and tabs only: a vertical tab or form feed stays in the key."""
    assert parse_sections("[S]\n \x0bk\x0c\t= v\n") == [Entry("S", "\x0bk\x0c", "v", 2)]
