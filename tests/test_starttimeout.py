"""The start timeout the gate's `TimeoutStartSec=infinity` takes from a unit: warned at the
unit's own (`gpuslice check`, the generator and the controller's journal all print the scan's
problems), or at the Type= whose default it replaces; systemd's time spans."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuslice.annotations import Problem, load_spec, scan
from gpuslice.cli import main
from gpuslice.starttimeout import REMEDY, seconds_usec
from tests.test_annotations import ETC, X
from tests.test_unitfiles import write

INFINITY = 2**64 - 1
ANNOTATION = "\n[X-GPUSlice]\nPriority=1\n"
GATE = (
    "the gate's TimeoutStartSec=infinity (gpuslice-gate.conf: a start may wait hours at its gate)"
)
# what a start timeout bounded, by Type= (the types whose main process has one)
BOUNDED = [
    ("notify", "its start until READY=1"),
    ("notify-reload", "its start until READY=1"),
    ("dbus", "its start until its bus name appears"),
    ("forking", "its ExecStart= until it returns"),
    ("oneshot", "its ExecStart="),
]
# those systemd bounds with no timeout of the unit's own: a oneshot's default is infinity
BOUNDED_BY_DEFAULT = [(kind, what) for kind, what in BOUNDED if kind != "oneshot"]


def overridden(value: str, what: str) -> str:
    return (
        f"{value}: overridden by {GATE}: nothing bounds {what} any more, and one that hangs "
        f"holds its GPUs until someone stops it; {REMEDY}"
    )


def defaulted(value: str, what: str, said: str = "") -> str:
    return (
        f"{value}: {said}no TimeoutStartSec= of its own, and {GATE} replaces systemd's default "
        "start timeout (DefaultTimeoutStartSec=, 90 s unless system.conf says otherwise): "
        f"nothing bounds {what} any more, and one that hangs holds its GPUs until someone "
        f"stops it; {REMEDY}"
    )


def service(lines: str) -> str:
    """A unit whose [Service] lines start on line 2."""
    return "[Service]\n" + lines + "ExecStart=/bin/true\n" + ANNOTATION


def problems(tmp_path: Path, name: str = "x.service") -> list[Problem]:
    spec, found = load_spec(name, tmp_path)
    assert spec is not None  # a warning: still managed
    return found


def warning(path: str, line: int, key: str, message: str) -> Problem:
    return Problem(path, line, key, message, "warning", "x.service", "Service")


@pytest.mark.parametrize(
    ("text", "usec"),
    [
        ("90", 90_000_000),
        ("1min 30s", 90_000_000),
        ("5min20s", 320_000_000),
        ("1.5h", 5_400_000_000),
        ("10 ms", 10_000),
        ("250msec", 250_000),
        ("1µs", 1),
        ("1μs", 1),
        (".5", 500_000),
        ("+5", 5_000_000),
        ("5 5", 10_000_000),
        ("12.34 .56", 12_900_000),  # systemd's own example of what it takes
        ("1M", 2_629_800_000_000),
        ("2w", 1_209_600_000_000),
        ("1y", 31_557_600_000_000),
        ("1d 2hr", 93_600_000_000),
        ("0", INFINITY),  # parse_sec_fix_0: no timeout
        ("0s", INFINITY),
        ("0.0", INFINITY),
        ("infinity", INFINITY),
        (" infinity ", INFINITY),
        ("\vinfinity", None),  # systemd's blanks are " \t\n\r" alone
        ("infinity\v", None),
        ("infinity\f", None),
        ("", None),  # systemd refuses and ignores these
        ("-1", None),
        ("+.5", None),
        ("3.", None),
        ("3.s", None),
        ("12.34.56", None),
        ("5 x", None),
        ("5x", None),
        ("infinity s", None),
        ("²", None),
        ("99999999999y", None),
        ("9223372036854775807us", 9_223_372_036_854_775_807),  # strtoll's last
        ("18446744073709551615us", None),  # ERANGE
        ("0" * 30 + "5", 5_000_000),
        ("0." + "0" * 12 + "9y", 27),  # each digit a tenth of the last, rounded down
        ("1.5us", 1),  # a tenth of a microsecond is 0
        ("1.9999ms", 1_999),
        ("9223372036854775808us", None),  # strtoll's ERANGE
        ("9223372036854775807us 9223372036854775807us", INFINITY - 1),
        ("9223372036854775807us 9223372036854775807us 1us", None),  # ERANGE: infinity reached
        ("18446744073709550ms", 18_446_744_073_709_550_000),
        ("18446744073709551ms", None),  # parse_time's ERANGE: past USEC_INFINITY / 1000
        ("1s" * 128, 128_000_000),
        ("1s" * 128 + " ", None),  # past SPAN_MAX: as one systemd refuses
    ],
)
def test_time_spans_read_as_systemd_reads_them(text: str, usec: int | None) -> None:
    assert seconds_usec(text) == usec


@pytest.mark.parametrize(
    ("kind", "what"),
    BOUNDED,
)
@pytest.mark.parametrize("key", ["TimeoutStartSec", "TimeoutSec"])
def test_a_timeout_of_the_units_own_that_the_gate_overrides_is_warned_at(
    tmp_path: Path, kind: str, what: str, key: str
) -> None:
    """A worker that hangs loading its model was failed at its own TimeoutStartSec=; gated,
    it holds its GPUs until someone stops it, every other job waiting. Managed still, with a
    warning at the line in force."""
    write(tmp_path, X, service(f"Type={kind}\n{key}=5min\n"))
    assert problems(tmp_path) == [warning(X, 3, key, overridden("5min", what))]


@pytest.mark.parametrize(
    ("kind", "what"),
    BOUNDED_BY_DEFAULT,
)
def test_a_type_bounded_by_default_without_a_timeout_is_warned_at_its_type(
    tmp_path: Path, kind: str, what: str
) -> None:
    """systemd's DefaultTimeoutStartSec= (90 s) bounded its start; the gate's replaces it."""
    write(tmp_path, X, service(f"Type={kind}\n"))
    assert problems(tmp_path) == [warning(X, 2, "Type", defaulted(kind, what))]


def test_a_bus_name_without_a_type_is_a_dbus_unit(tmp_path: Path) -> None:
    """systemd's service_fix_output: Type=dbus by a BusName= when no Type= says another."""
    write(tmp_path, X, service("BusName=org.example.Job\n"))
    message = defaulted(
        "org.example.Job", "its start until its bus name appears", "Type=dbus by this BusName=, "
    )
    assert problems(tmp_path) == [warning(X, 2, "BusName", message)]
    write(tmp_path, X, service("BusName=org.example.Job\nBusName=\n"))
    assert problems(tmp_path) == []
    write(tmp_path, X, service("BusName=org.example.Job\nType=simple\n"))
    assert problems(tmp_path) == []


@pytest.mark.parametrize("kind", ["", "Type=simple\n", "Type=exec\n", "Type=idle\n"])
def test_a_simple_units_timeout_bounded_only_its_own_start_commands(
    tmp_path: Path, kind: str
) -> None:
    """Its main process never had a start timeout: without ExecCondition=, ExecStartPre= or
    ExecStartPost= lines of its own the override takes nothing (and a oneshot's default is
    infinity); with them, it is warned naming them."""
    write(tmp_path, X, service(kind + "TimeoutStartSec=30\n"))
    assert problems(tmp_path) == []
    write(tmp_path, X, service("Type=oneshot\n"))
    assert problems(tmp_path) == []
    lines = kind + "TimeoutStartSec=30\nExecStartPre=/bin/a\nExecStartPost=/bin/b\n"
    write(tmp_path, X, service(lines))
    line = 2 + kind.count("\n")
    what = "its ExecStartPre= and ExecStartPost= lines"
    assert problems(tmp_path) == [warning(X, line, "TimeoutStartSec", overridden("30", what))]
    # an empty assignment resets its list, as systemd's
    write(tmp_path, X, service(lines + "ExecStartPre=\nExecStartPost=\nExecCondition=/bin/c\n"))
    what = "its ExecCondition= lines"
    assert problems(tmp_path) == [warning(X, line, "TimeoutStartSec", overridden("30", what))]


def test_the_timeout_in_force_is_read_as_systemd_merges_it(tmp_path: Path) -> None:
    """The last value systemd takes wins over the fragment and the drop-ins named before the
    gate's; one it refuses is ignored; 0 and infinity are no timeout, which the gate takes
    nothing from."""
    write(tmp_path, X, service("Type=notify\nTimeoutStartSec=2min\n"))
    dropin = f"{ETC}/x.service.d/10-t.conf"
    write(tmp_path, dropin, "[Service]\nTimeoutSec=10\nTimeoutStartSec=soon\nTimeoutSec=\n")
    what = "its start until READY=1"
    assert problems(tmp_path) == [warning(dropin, 2, "TimeoutSec", overridden("10", what))]
    for value in ("infinity", "0"):
        write(tmp_path, dropin, f"[Service]\nTimeoutStartSec={value}\n")
        assert problems(tmp_path) == []
    write(tmp_path, dropin, "[Service]\nType=nonsense\n[Unit]\nTimeoutStartSec=1\n")
    assert problems(tmp_path) == [warning(X, 3, "TimeoutStartSec", overridden("2min", what))]


@pytest.mark.parametrize("name", ["zz-timeout.conf", "timeout.conf", "gpuslice-gate.conf.conf"])
def test_a_timeout_in_a_dropin_named_after_the_gates_wins_unwarned(
    tmp_path: Path, name: str
) -> None:
    """It overrides the gate's infinity (README): nothing is taken, so nothing is said, of
    the unit's own value or of its type's default; it bounds the wait at the gate too."""
    write(tmp_path, X, service("Type=notify\nTimeoutStartSec=2min\n"))
    write(tmp_path, f"{ETC}/x.service.d/{name}", "[Service]\nTimeoutStartSec=10min\n")
    assert problems(tmp_path) == []
    write(tmp_path, X, service("Type=forking\n"))
    assert problems(tmp_path) == []


def test_a_templates_timeout_is_warned_once_and_reaches_check(tmp_path: Path) -> None:
    """Every instance re-reads its template's files: the scan says each finding once, and
    `gpuslice check` prints it as a warning (exit 0), as the generator and the controller's
    journal print the scan's problems."""
    template = f"{ETC}/w@.service"
    write(tmp_path, template, service("Type=notify\nTimeoutStartSec=90\n"))
    write(tmp_path, f"{ETC}/w@a.service.d/10-x.conf", "[Service]\nEnvironment=A=1\n")
    found = warning(template, 3, "TimeoutStartSec", overridden("90", "its start until READY=1"))
    result = scan(tmp_path)
    assert "w@.service" in result.specs
    assert result.problems == [replace(found, unit="w@.service")]
    outcome = CliRunner().invoke(
        main, ["check", "--config", str(tmp_path / "absent.yaml"), "--root", str(tmp_path)]
    )
    assert (outcome.exit_code, outcome.output.splitlines()) == (
        0,
        [f"warning: {found}", "ok: 1 annotated unit(s) checked, 1 warning(s)"],
    )


def test_the_warning_names_every_step_the_timeout_bounded(tmp_path: Path) -> None:
    """A notify unit's timeout bounded its start until READY=1 and its own ExecStartPre=
    lines: both are said, the way systemd runs them."""
    write(tmp_path, X, service("Type=notify\nTimeoutStartSec=5min\nExecStartPre=/bin/a\n"))
    what = "its start until READY=1 and its ExecStartPre= lines"
    assert problems(tmp_path) == [warning(X, 3, "TimeoutStartSec", overridden("5min", what))]


def test_a_long_value_is_quoted_cut(tmp_path: Path) -> None:
    """The value quoted at the head of the warning is cut at 100 characters, a timeout's as
    a bus name's: the rest of the line is what to do."""
    value = "1s" * 60
    write(tmp_path, X, service(f"Type=notify\nTimeoutStartSec={value}\n"))
    what = "its start until READY=1"
    quoted = value[:100] + "..."
    assert problems(tmp_path) == [warning(X, 3, "TimeoutStartSec", overridden(quoted, what))]
    name = "org.example." + "a" * 140
    write(tmp_path, X, service(f"BusName={name}\n"))
    said = "Type=dbus by this BusName=, "
    message = defaulted(name[:100] + "...", "its start until its bus name appears", said)
    assert problems(tmp_path) == [warning(X, 2, "BusName", message)]
