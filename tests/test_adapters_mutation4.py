"""Edge tests for annotations, the unit index, the unit-file reader and the config reader that
`make mutate` asked for.

Every field of every Problem (not only its printed line), the per-file cap at exactly one
dropped problem, a drop-in gone between the listing and the read, each file parsed once, the
scan's choice of instances, the errors the readers raise (their errno, their words, the flags
they open with), and YAML failures that no text produces. Each test pins a rule that the
modules' own test files left open; mutation testing found the edges.
"""

from __future__ import annotations

import errno
import inspect
import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml

import gpuslice.config as config
from gpuslice.annotations import Loader, Problem, check_file, load_spec, scan
from gpuslice.config import ConfigError, parse_config, read_config_text
from gpuslice.core.model import UnitSpec
from gpuslice.paths import GATE_DROPIN_NAME
from gpuslice.unitfiles import (
    MAX_FILE_SIZE,
    Fragment,
    UnitFile,
    UnitIndex,
    _dropin_names,
    _not_regular,
    read_unit_text,
)
from tests.test_annotations import ETC, LIB, SERVICE, X, unit, write
from tests.test_newunit import new
from tests.test_unitfiles import link

KNOWN = "Priority, Type, GPUs, Requeue, Memory, Devices, Preempt"
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def write_text(path: Path, text: str) -> Path:
    """`path`, written with `text`."""
    path.write_text(text)
    return path


def spy_open(monkeypatch: pytest.MonkeyPatch, path: Path) -> list[int]:
    """The flags of every os.open of `path`."""
    opened: list[int] = []
    real_open = os.open

    def spy(name: os.PathLike[str] | str, flags: int, *args: int, **kwargs: int) -> int:
        if os.fspath(name) == os.fspath(path):
            opened.append(flags)
        return real_open(name, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    return opened


# ---- annotations: what a Problem holds ----------------------------------------------------------


def test_a_bad_line_in_the_section_is_a_keyless_warning_on_the_unit(tmp_path: Path) -> None:
    """A line that systemd ignores inside `[X-GPUSlice]` is a warning with no key, on the unit
    being loaded."""
    write(tmp_path, X, unit("Priority=1\nbogus\n"))
    assert load_spec("x.service", tmp_path) == (
        UnitSpec("x.service", 1, source=X),
        [Problem(X, 9, "", "missing '=', line ignored", "warning", "x.service")],
    )


def test_an_unknown_key_is_quoted_briefly_on_the_unit(tmp_path: Path) -> None:
    """An unknown key is a warning on the unit, its name quoted to 100 characters."""
    write(tmp_path, X, unit("Priority=1\n" + "k" * 150 + "=1\n"))
    assert load_spec("x.service", tmp_path) == (
        UnitSpec("x.service", 1, source=X),
        [
            Problem(
                X,
                9,
                "k" * 100 + "...",
                f"unknown key, ignored (known keys: {KNOWN})",
                "warning",
                "x.service",
            )
        ],
    )


def test_an_overridden_bad_value_is_a_warning_on_the_unit(tmp_path: Path) -> None:
    """A bad value that a later line overrides is a warning on the unit, not an error."""
    write(tmp_path, X, unit("Priority=high\nPriority=5\n"))
    assert load_spec("x.service", tmp_path) == (
        UnitSpec("x.service", 5, source=X),
        [
            Problem(
                X,
                8,
                "Priority",
                f'expected an integer 0-999, got "high" (overridden at {X}:9)',
                "warning",
                "x.service",
            )
        ],
    )


def test_an_empty_assignment_of_a_key_never_set_is_the_default(tmp_path: Path) -> None:
    """`GPUs=` before any `GPUs=value` resets nothing and is no problem."""
    write(tmp_path, X, unit("Priority=5\nGPUs=\n"))
    assert load_spec("x.service", tmp_path) == (UnitSpec("x.service", 5, source=X), [])


def test_one_problem_past_the_cap_is_summed_up_as_a_warning(tmp_path: Path) -> None:
    """51 warnings in one file: 50 shown, then one line for the last, a warning on the unit
    (no error among those left out), and the unit stays managed."""
    write(tmp_path, X, unit("Priority=1\n" + "Colour=red\n" * 51))
    spec, problems = load_spec("x.service", tmp_path)
    assert spec == UnitSpec("x.service", 1, source=X)
    assert len(problems) == 51
    assert problems[-1] == Problem(
        X, 0, "", "1 more problems in this file not shown", "warning", "x.service"
    )


def test_an_index_that_fails_is_an_error_on_the_unit(tmp_path: Path) -> None:
    """Whatever the index raises is one keyless error, named after the unit."""

    class Broken(UnitIndex):
        def fragment(self, name: str) -> None:
            raise RecursionError("deep")

    write(tmp_path, X, unit("Priority=1\n"))
    assert Loader(Broken(tmp_path)).load("x.service") == (
        None,
        [Problem("x.service", 0, "", "cannot be read: deep", "error", "x.service")],
    )


def test_files_systemd_ignores_are_warnings_on_no_unit_and_no_section(tmp_path: Path) -> None:
    """A file name that is no unit name is a warning of the whole scan: no key, no unit, no
    section (systemd never reads it)."""
    write(tmp_path, f"{ETC}/bad name.service", unit("Priority=1\n"))
    assert scan(tmp_path).problems == [
        Problem(
            f"{ETC}/bad name.service",
            0,
            "",
            "not a valid unit name, ignored (as by systemd)",
            "warning",
            "",
            section="",
        )
    ]


# ---- annotations: files that fail ---------------------------------------------------------------


@dataclass(frozen=True)
class Failing(UnitFile):
    """A unit file whose reading raises `error`."""

    error: BaseException

    def read(self) -> tuple[str, bool]:
        raise self.error


@pytest.mark.parametrize(
    ("error", "message"),
    [
        pytest.param(OSError(errno.EIO, "e" * 250), "e" * 200 + "...", id="long-strerror"),
        pytest.param(OSError("o" * 250), "o" * 200 + "...", id="long-text"),
        pytest.param(OSError(), "OSError", id="no-text"),
        pytest.param(RecursionError("deep"), "cannot be parsed (RecursionError)", id="not-os"),
    ],
)
def test_why_a_file_cannot_be_read_is_said_in_200_characters(
    tmp_path: Path, error: BaseException, message: str
) -> None:
    """The reason is the error's strerror, else its text, else its type, cut at 200
    characters; an error that is no OSError is "cannot be parsed" with its type."""
    loader = Loader(UnitIndex(tmp_path))
    assert loader.load_files("x.service", [Failing(X, str(tmp_path / "x"), error)]) == (
        None,
        [Problem(X, 0, "", f"cannot read: {message}", "error", "x.service")],
    )


def test_a_file_that_cannot_be_parsed_is_an_io_error(tmp_path: Path) -> None:
    """`Loader.parsed` raises OSError(EIO, "cannot be parsed (TYPE)") for whatever else reading
    raised (the errno is not in the message, so only `parsed` itself shows it)."""
    loader = Loader(UnitIndex(tmp_path))
    with pytest.raises(OSError) as raised:
        loader.parsed(Failing(X, str(tmp_path / "x"), UnicodeError("bad")))
    assert (raised.value.errno, raised.value.strerror) == (
        errno.EIO,
        "cannot be parsed (UnicodeError)",
    )


def test_each_file_is_parsed_once_per_loader(tmp_path: Path) -> None:
    """A loader reads a file once: a change after its first read is not seen."""
    write(tmp_path, X, unit("Priority=1\n"))
    loader = Loader(UnitIndex(tmp_path))
    first = loader.load("x.service")
    write(tmp_path, X, unit("Priority=2\n"))
    assert loader.load("x.service") == first == (UnitSpec("x.service", 1, source=X), [])


def test_files_of_a_unit_not_found_or_masked_are_none(tmp_path: Path) -> None:
    """`Loader.files` says None (not an empty list) when there is no unit, also when asked
    again."""
    link(tmp_path, f"{ETC}/masked.service", "/dev/null")
    loader = Loader(UnitIndex(tmp_path))
    for _ in range(2):
        assert loader.files("absent.service") is None
        assert loader.files("masked.service") is None


def _loader_with_a_dropin_gone(tmp_path: Path, later: str) -> Loader:
    """x.service with drop-ins zz-a.conf (removed after the listing) and zz-b.conf (`later`)."""
    write(tmp_path, f"{LIB}/x.service", unit("Priority=1\n"))
    write(tmp_path, f"{ETC}/x.service.d/zz-a.conf", "[Service]\n")
    write(tmp_path, f"{ETC}/x.service.d/zz-b.conf", later)
    loader = Loader(UnitIndex(tmp_path))
    assert loader.files("x.service") is not None  # listed now, read later
    (tmp_path / ETC.lstrip("/") / "x.service.d" / "zz-a.conf").unlink()
    return loader


GONE = Problem(
    f"{ETC}/x.service.d/zz-a.conf",
    0,
    "",
    "cannot read: No such file or directory",
    "warning",
    "x.service",
)


def test_a_dropin_gone_before_its_read_is_a_warning_and_the_rest_still_count(
    tmp_path: Path,
) -> None:
    """A drop-in removed between the listing and the read is a keyless warning on the unit;
    the drop-ins after it still apply."""
    loader = _loader_with_a_dropin_gone(tmp_path, "[X-GPUSlice]\nGPUs=2\n")
    assert loader.load("x.service") == (
        UnitSpec("x.service", 1, gpus=2, source=f"{LIB}/x.service"),
        [GONE],
    )


def test_a_gate_reset_after_a_dropin_gone_is_still_reported(tmp_path: Path) -> None:
    """The gate check skips a drop-in it cannot read and goes on with the next."""
    loader = _loader_with_a_dropin_gone(tmp_path, "[Service]\nExecStartPre=\n")
    result = scan(loader=loader)
    assert set(result.specs) == {"x.service"}
    assert result.problems == [
        GONE,
        Problem(
            f"{ETC}/x.service.d/zz-b.conf",
            2,
            "ExecStartPre",
            f"an empty ExecStartPre= after {GATE_DROPIN_NAME} removes the GPU gate: x.service "
            "starts without waiting for its GPUs; put your ExecStartPre= lines in a drop-in "
            f"named before {GATE_DROPIN_NAME}",
            "warning",
            "x.service",
            section="Service",
        ),
    ]


def test_a_dropin_hiding_the_gate_is_a_keyless_warning_on_the_unit(tmp_path: Path) -> None:
    """The warning for a drop-in named like the gate's: no line, no key, [Service], the unit."""
    write(tmp_path, f"{LIB}/x.service", unit("Priority=1\n"))
    write(tmp_path, f"{ETC}/x.service.d/{GATE_DROPIN_NAME}", "[Service]\n")
    assert scan(tmp_path).problems == [
        Problem(
            f"{ETC}/x.service.d/{GATE_DROPIN_NAME}",
            0,
            "",
            f"this file hides the GPU gate's {GATE_DROPIN_NAME}: x.service starts without "
            "waiting for its GPUs; give it another name",
            "warning",
            "x.service",
            section="Service",
        )
    ]


# ---- annotations: scan --------------------------------------------------------------------------


def test_scan_reads_the_host_by_default_and_names_its_root(tmp_path: Path) -> None:
    """Without a root, `scan` looks at the host's own unit directories; `Scan.root` is the
    root that was read."""
    assert inspect.signature(scan).parameters["root"].default == "/"
    assert scan(tmp_path).root == str(tmp_path)


def test_a_template_finding_is_reported_once_for_its_instances(tmp_path: Path) -> None:
    """An instance re-reads its template's files: their findings are reported once."""
    write(tmp_path, f"{LIB}/t@.service", unit("Priority=1\nColour=red\n"))
    write(tmp_path, f"{ETC}/t@a.service.d/x.conf", "[X-GPUSlice]\nGPUs=2\n")
    result = scan(tmp_path)
    assert set(result.specs) == {"t@.service", "t@a.service"}
    assert result.problems == [
        Problem(
            f"{LIB}/t@.service",
            9,
            "Colour",
            f"unknown key, ignored (known keys: {KNOWN})",
            "warning",
            "t@.service",
        )
    ]


def test_an_instance_file_keeps_its_spec_even_when_it_equals_the_templates(
    tmp_path: Path,
) -> None:
    """An instance with a file of its own, annotated only through its template's drop-in, is a
    managed unit of its own: only instances found by their drop-in directories are folded
    into the template."""
    source = f"{ETC}/t@.service.d/p.conf"
    write(tmp_path, f"{LIB}/t@.service", SERVICE)
    write(tmp_path, source, "[X-GPUSlice]\nPriority=5\n")
    write(tmp_path, f"{ETC}/t@a.service", SERVICE)
    result = scan(tmp_path)
    assert result.specs == {
        "t@.service": UnitSpec("t@.service", 5, source=source),
        "t@a.service": UnitSpec("t@a.service", 5, source=source),
    }
    assert result.unannotated_instances == set()
    assert result.spec_for("t@a.service") == UnitSpec("t@a.service", 5, source=source)


def test_instance_dropins_of_an_aliased_template_are_its_units(tmp_path: Path) -> None:
    """systemd reads the drop-ins of every name of a unit: `alias@a.service.d` applies to
    `real@a.service` when `alias@.service -> real@.service`, so that instance is scanned under
    the name systemd loads it by, with the alias's drop-in."""
    write(tmp_path, f"{LIB}/real@.service", unit("Priority=1\n"))
    link(tmp_path, f"{ETC}/alias@.service", f"{LIB}/real@.service")
    source = f"{ETC}/alias@a.service.d/x.conf"
    write(tmp_path, source, "[X-GPUSlice]\nGPUs=2\n")
    result = scan(tmp_path)
    assert set(result.specs) == {"real@.service", "real@a.service"}
    assert result.specs["real@a.service"].gpus == 2
    assert result.problems == []


def test_instance_dropins_of_a_template_not_listed_are_not_scanned(tmp_path: Path) -> None:
    """An instance drop-in directory counts only when its template is a listed unit: a
    template that is a dangling link is no unit, and its instance's drop-ins are not read."""
    link(tmp_path, f"{ETC}/t@.service", "/nowhere/t@.service")
    write(tmp_path, f"{ETC}/t@a.service.d/x.conf", "[X-GPUSlice]\nPriority=1\n")
    result = scan(tmp_path)
    assert result.specs == {}
    assert [p.path for p in result.problems] == [f"{ETC}/t@.service"]


# ---- unit index ---------------------------------------------------------------------------------


def test_hidden_files_are_no_units(tmp_path: Path) -> None:
    """A name starting with "." is left out without an issue, as systemd leaves it out."""
    write(tmp_path, f"{ETC}/.hidden.service", unit("Priority=1\n"))
    index = UnitIndex(tmp_path)
    assert (index.unit_names(), index.issues) == ([], [])


def test_a_plain_file_is_listed_from_the_directory_listing_alone(tmp_path: Path) -> None:
    """Only symlinks are followed when names are listed: a plain file is listed as the
    directory listing found it, even if it is gone since."""
    write(tmp_path, X, unit("Priority=1\n"))
    index = UnitIndex(tmp_path)
    (tmp_path / X.lstrip("/")).unlink()
    assert (index.unit_names(), index.issues) == (["x.service"], [])


def test_a_symlink_to_a_file_of_the_same_name_is_no_alias(tmp_path: Path) -> None:
    """`x.service -> /opt/x.service` is the unit x.service itself, listed."""
    write(tmp_path, "/opt/x.service", unit("Priority=1\n"))
    link(tmp_path, X, "/opt/x.service")
    assert UnitIndex(tmp_path).unit_names() == ["x.service"]


def test_a_file_named_like_an_instance_dropin_directory_is_none(tmp_path: Path) -> None:
    """Only a directory (or a symlink) named `foo@a.service.d` gives foo@a.service drop-ins."""
    write(tmp_path, f"{ETC}/foo@a.service.d", "[X-GPUSlice]\nPriority=1\n")
    assert UnitIndex(tmp_path).instance_dropin_names() == []


# ---- the unit-file reader -----------------------------------------------------------------------


def test_a_path_with_a_nul_is_an_invalid_argument() -> None:
    """A NUL in the path is OSError(EINVAL) with Python's words, like any other failure."""
    with pytest.raises(OSError) as raised:
        read_unit_text("/etc/systemd/system/a\0b.service")
    assert (raised.value.errno, raised.value.strerror) == (errno.EINVAL, "embedded null byte")


def test_a_directory_is_an_invalid_argument(tmp_path: Path) -> None:
    """What is not a regular file is OSError(EINVAL) saying what it is."""
    with pytest.raises(OSError) as raised:
        read_unit_text(tmp_path)
    assert (raised.value.errno, raised.value.strerror) == (
        errno.EINVAL,
        "a directory, not a regular file",
    )


def test_a_file_of_another_type_is_not_a_regular_file() -> None:
    """A mode of none of the named types is "not a regular file" (private: os.stat and
    os.fstat follow symlinks, so no file that `read_unit_text` meets has such a mode)."""
    assert _not_regular(stat.S_IFLNK | 0o777) == "not a regular file"
    assert _not_regular(stat.S_IFREG | 0o644) is None


def test_a_unit_file_is_opened_without_side_effects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is opened read-only, without blocking on a FIFO swapped in, taking it as
    controlling terminal, or leaking the descriptor into children."""
    path = write_text(tmp_path / "x.service", "[Unit]\n")
    opened = spy_open(monkeypatch, path)
    assert read_unit_text(path) == "[Unit]\n"
    assert opened == [OPEN_FLAGS]


# ---- config -------------------------------------------------------------------------------------


def test_the_config_file_is_opened_without_side_effects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is opened read-only, without blocking on a FIFO swapped in, taking it as
    controlling terminal, or leaking the descriptor into children."""
    path = write_text(tmp_path / "config.yaml", "gpus: 2\n")
    opened = spy_open(monkeypatch, path)
    assert read_config_text(path) == "gpus: 2\n"
    assert opened == [OPEN_FLAGS]


class FailingComposer:
    """Stands in for the YAML loader: composing raises `error`."""

    error: BaseException = yaml.YAMLError()

    def __init__(self, text: str) -> None:
        self.text = text

    def get_single_node(self) -> None:
        raise self.error

    def dispose(self) -> None:
        pass


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param(yaml.YAMLError("odd"), "/c: not valid YAML: odd", id="no-mark"),
        pytest.param(RecursionError(), "/c: not valid YAML: nested too deeply", id="recursion"),
    ],
)
def test_yaml_failures_without_a_place_are_errors_on_the_file(
    monkeypatch: pytest.MonkeyPatch, error: BaseException, expected: str
) -> None:
    """A YAML error with neither a mark nor a position is reported on the file with its own
    text, and a RecursionError as nesting. (The loader is replaced, a private name: no text
    makes PyYAML raise either, as every error has a mark and MAX_DEPTH keeps the composer
    shallow.)"""
    monkeypatch.setattr(FailingComposer, "error", error)
    monkeypatch.setattr(config, "_loader_class", lambda: FailingComposer)
    with pytest.raises(ConfigError) as caught:
        parse_config("gpus: 2\n", "/c")
    assert caught.value.problems == [expected]


# ---- the key table, as `gpuslice new` shows it --------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--priority", "x1", "Priority=x1 (allowed: an integer 0-999)"),
        ("--priority", "1000", "Priority=1000 (allowed: an integer 0-999)"),  # too many digits
        ("--gpus", "65", "GPUs=65 (allowed: an integer 1-64)"),  # out of range
        ("--gpus", "0", "GPUs=0 (allowed: an integer 1-64)"),
    ],
)
def test_a_bad_integer_adds_nothing_to_the_options_message(
    tmp_path: Path, option: str, value: str, expected: str
) -> None:
    """An integer key's ValueError carries the value itself, so that `gpuslice new` says
    `KEY=VALUE (allowed: ...)` and no more."""
    args = ["--priority", "5"] if option != "--priority" else []
    code, out = new(tmp_path, "job", *args, option, value, "--", "/bin/true")
    assert code == 2
    assert out.splitlines()[-1] == f"Error: Invalid value for '{option}': {expected}"


def test_check_file_names_the_unit_after_the_file(tmp_path: Path) -> None:
    """`gpuslice check FILE` before installing it: each problem is about the unit the file's
    name makes, on its own line and key."""
    path = tmp_path / "x.service"
    path.write_text("[Service]\nExecStart=/bin/true\n[X-GPUSlice]\nPriority=abc\n")
    # whether others may read it is pytest's directories' say (0700): test_status_privacy.py
    assert [replace(p, private=False) for p in check_file(path)] == [
        Problem(
            str(path), 4, "Priority", 'expected an integer 0-999, got "abc"', "error", "x.service"
        )
    ]


# ---- drop-in directories of a dashed name -------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "present", "expected"),
    [
        pytest.param("a.b-c.service", ["a.b-"], ["a.b-"], id="dot-in-prefix"),
        pytest.param("a-b@c-d@e.service", ["a-b@c-", "a-"], ["a-"], id="prefix-before-first-at"),
        pytest.param("a@x-y.service", ["a@x-"], [], id="no-dash-before-at"),
        pytest.param("a-b-@x.service", ["a-b-", "a-"], ["a-"], id="trailing-dash-before-at"),
        pytest.param("a-b--.service", ["a-b-", "a-"], ["a-b-", "a-"], id="one-dash-chopped"),
        pytest.param("-a.service", ["-"], [], id="leading-dash"),
        pytest.param("a-b.service", ["a-"], ["a-"], id="one-letter-component"),
    ],
)
def test_dash_prefix_dropin_dirs_follow_systemd(
    tmp_path: Path, name: str, present: list[str], expected: list[str]
) -> None:
    """Prefix drop-ins (`foo-.service.d` for `foo-bar.service`) come from the name before the
    unit suffix, or before the first `@` of an instance; a trailing dash is chopped once, and a
    leading dash gives no prefix. Directories of other prefixes do not apply."""
    for prefix in present:
        (tmp_path / ETC.lstrip("/") / f"{prefix}.service.d").mkdir(parents=True)
    assert [path for path, _real in UnitIndex(tmp_path).dropin_dirs(name)] == [
        f"{ETC}/{prefix}.service.d" for prefix in expected
    ]


def test_a_units_own_name_is_not_among_its_dash_prefixes() -> None:
    """`a-b-.service` is itself a prefix name: its dash is chopped once and it is not its own
    prefix (private: `dropin_dirs` lists a directory once, so the public API cannot tell)."""
    assert _dropin_names("a-b-.service") == ["a-b-.service", "a-.service"]
    assert _dropin_names("a-.service") == ["a-.service"]


# ---- the unit-file reader: what changes after the stat ------------------------------------------


def test_a_fifo_swapped_in_after_the_stat_is_not_a_regular_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The type is checked again on the open file: a FIFO that replaced a regular file after
    the stat is OSError(EINVAL) saying what it is, and is not read."""
    regular = write_text(tmp_path / "regular.service", "[Unit]\n")
    fifo = tmp_path / "fifo.service"
    os.mkfifo(fifo)
    real_stat = os.stat

    def fake_stat(path: os.PathLike[str] | str, *args: object, **kwargs: bool) -> os.stat_result:
        return real_stat(regular if os.fspath(path) == os.fspath(fifo) else path)

    monkeypatch.setattr(os, "stat", fake_stat)
    with pytest.raises(OSError) as raised:
        read_unit_text(fifo)
    assert (raised.value.errno, raised.value.strerror) == (
        errno.EINVAL,
        "a FIFO, not a regular file",
    )


def test_a_file_one_byte_over_the_limit_is_too_big_after_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of MAX_FILE_SIZE + 1 bytes is OSError(EFBIG), known from one read of
    MAX_FILE_SIZE + 1 bytes: that read is all the memory a huge file costs."""
    path = tmp_path / "big.service"
    with open(path, "wb") as f:
        f.truncate(MAX_FILE_SIZE + 1)  # sparse: instant
    reads = spy_on_os_reads(monkeypatch)
    with pytest.raises(OSError) as raised:
        read_unit_text(path)
    assert (raised.value.errno, raised.value.strerror) == (
        errno.EFBIG,
        "larger than 1 MiB, which no unit file needs",
    )
    assert reads == [MAX_FILE_SIZE + 1]


def spy_on_os_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes asked of every `os.read` from now on."""
    sizes: list[int] = []
    real_read = os.read

    def spy(fd: int, size: int) -> bytes:
        sizes.append(size)
        return real_read(fd, size)

    monkeypatch.setattr(os, "read", spy)
    return sizes


def fstat_says_size(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """Every `os.fstat` from now on gives `size` as the file's size (a file that grew since)."""
    real_fstat = os.fstat

    def fstat(fd: int) -> os.stat_result:
        values = list(real_fstat(fd))
        values[stat.ST_SIZE] = size
        return os.stat_result(values)

    monkeypatch.setattr(os, "fstat", fstat)


def test_a_small_file_is_read_in_one_read_and_one_to_meet_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No buffered read of MAX_FILE_SIZE bytes (a megabyte allocated per file): a unit file
    costs a read of its size and the one that meets its end."""
    path = write_text(tmp_path / "a.service", "[Unit]\n")
    reads = spy_on_os_reads(monkeypatch)
    assert read_unit_text(path) == "[Unit]\n"
    assert reads == [4096, 4096]


def test_a_file_larger_than_its_fstat_said_is_read_no_further_than_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads of the size fstat() gave go on while the file does, but they ask for no more
    than MAX_FILE_SIZE + 1 bytes in all: a file that grows while it is read costs no more
    memory than one that was large from the start."""
    path = tmp_path / "big.service"
    with open(path, "wb") as f:
        f.truncate(MAX_FILE_SIZE + 5000)
    fstat_says_size(monkeypatch, 10)
    reads = spy_on_os_reads(monkeypatch)
    with pytest.raises(OSError) as raised:
        read_unit_text(path)
    assert raised.value.errno == errno.EFBIG
    assert sum(reads) == MAX_FILE_SIZE + 1
    assert set(reads) == {4096, (MAX_FILE_SIZE + 1) % 4096}


def test_what_is_not_a_regular_file_is_never_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO, a directory or a device is known from stat() before any open(): opening a
    device can do things (rewind a tape, hang up a line)."""
    fifo = tmp_path / "fifo.service"
    os.mkfifo(fifo)
    opened: list[str] = []
    real_open = os.open

    def spy(path: str, *args: int) -> int:
        opened.append(os.fspath(path))
        return real_open(path, *args)

    monkeypatch.setattr(os, "open", spy)
    for path in (fifo, tmp_path, Path("/dev/null")):
        with pytest.raises(OSError):
            read_unit_text(path)
    assert opened == []


def test_a_file_that_grew_since_its_fstat_is_read_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size fstat() gave is a hint, not the end: what was written since is read too, up to
    the limit."""
    path = tmp_path / "a.service"
    path.write_text("#" * 5000)
    fstat_says_size(monkeypatch, 10)  # as if the file grew after fstat
    assert read_unit_text(path) == "#" * 5000


# ---- fragments ----------------------------------------------------------------------------------


def test_a_fragment_in_a_link_loop_gives_way_to_a_later_directory(tmp_path: Path) -> None:
    """A fragment candidate with too many links is ignored, as systemd ignores it, and the
    search goes on: the first real file in path order is the fragment."""
    link(tmp_path, X, "x.service")  # a loop
    write(tmp_path, f"{LIB}/x.service", unit("Priority=1\n"))
    real = str(tmp_path / LIB.lstrip("/") / "x.service")
    assert UnitIndex(tmp_path).fragment("x.service") == Fragment(f"{LIB}/x.service", real, False)
