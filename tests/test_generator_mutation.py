"""Edges of the systemd generator that mutation testing found open: error paths, the order of
drop-ins around the gate's, re-runs, encodings, the retry's bounds and `main`'s arguments.

Each test pins observable behaviour (files written, exact stderr lines, return codes); a test
that replaces a function does so only to make a failure happen that a real system rarely shows.
"""

from __future__ import annotations

import errno
import locale
import math
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice import generator, unitfiles
from gpuslice.annotations import Loader, Scan, scan
from gpuslice.config import SETTINGS_BY_NAME, Config
from gpuslice.core.model import UnitSpec
from gpuslice.unitfiles import UnitIndex
from tests.test_generator import ANNOTATION, ETC, LIB, LIBEXEC, gate, run, write, written

PLAIN = "[Service]\nExecStart=/bin/x\n"


def empty_plan(tmp_path: Path, result: Scan) -> generator.Plan:
    """`plan` over a hand-made scan, with no unit files at all (every ExecStartPre= list empty)."""
    return generator.plan(Loader(UnitIndex(tmp_path)), result, LIBEXEC, "/run/gpuslice")


# ---------------------------------------------------------------------------------------------
# ExecStartPre= lines applied before the gate


def test_a_drop_in_named_like_the_gate_is_not_copied_into_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A drop-in named gpuslice-gate.conf itself (`>=`, not `>`) is not applied before the gate:
    its lines are not copied."""
    write(tmp_path, f"{ETC}/a.service", "[Service]\nExecStartPre=/bin/frag\n" + ANNOTATION)
    write(tmp_path, f"{ETC}/a.service.d/10-pre.conf", "[Service]\nExecStartPre=/bin/pre\n")
    write(tmp_path, f"{ETC}/a.service.d/gpuslice-gate.conf", "[Service]\nExecStartPre=/bin/own\n")
    assert written(run(tmp_path)) == {
        "a.service.d/gpuslice-gate.conf": gate("/bin/frag", "/bin/pre")
    }
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: warning: {ETC}/a.service.d/gpuslice-gate.conf:0: [Service] this "
        "file hides the GPU gate's gpuslice-gate.conf: a.service starts without waiting for "
        "its GPUs; give it another name"
    ]


def test_a_drop_in_gone_since_it_was_listed_is_skipped_and_later_ones_still_count(
    tmp_path: Path,
) -> None:
    """A file that cannot be read is skipped (`continue`, not `break`): the lines of the files
    after it, still before the gate, are kept."""
    write(tmp_path, f"{ETC}/a.service", "[Service]\nExecStartPre=/bin/frag\n" + ANNOTATION)
    write(tmp_path, f"{ETC}/a.service.d/10-gone.conf", "[Service]\nExecStartPre=/bin/gone\n")
    write(tmp_path, f"{ETC}/a.service.d/20-more.conf", "[Service]\nExecStartPre=/bin/more\n")
    loader = Loader(UnitIndex(tmp_path))
    files = loader.files("a.service")
    assert files is not None and len(files) == 3  # listed, then one goes away
    (tmp_path / ETC.lstrip("/") / "a.service.d/10-gone.conf").unlink()
    assert generator.exec_start_pre_before_gate(loader, "a.service") == ["/bin/frag", "/bin/more"]


# ---------------------------------------------------------------------------------------------
# the drop-in's text


def test_a_del_character_is_refused_like_other_control_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DEL (0x7f) is a control character: a line holding it is refused, the other units gated."""
    write(tmp_path, f"{ETC}/del.service", "[Service]\nExecStartPre=/bin/a\x7fb\n" + ANNOTATION)
    write(tmp_path, f"{ETC}/good.service", ANNOTATION)
    assert written(run(tmp_path)) == {"good.service.d/gpuslice-gate.conf": gate()}
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: error: {ETC}/del.service:2: [Service] ExecStartPre: /bin/a\\x7fb: "
        "a control character in a line the gate's drop-in would copy, which gpuslice-generator "
        "does not write (left unmanaged, ungated) (unit not managed)"
    ]
    with pytest.raises(ValueError, match="control character"):
        generator.gate_dropin("/l", "/run/g", ["/bin/a\x7fb"])


@pytest.mark.parametrize("retry", [0.0, -1.0, math.inf, -math.inf, math.nan])
def test_the_retry_must_be_a_finite_number_above_zero(retry: float) -> None:
    """gate_retry_seconds: finite `and` > 0 (0 itself refused), with a message naming it."""
    with pytest.raises(ValueError) as raised:
        generator.gate_dropin("/l", "/run/g", [], retry=retry)
    assert str(raised.value) == f"gate_retry_seconds must be a number > 0, got {retry!r}"


@pytest.fixture
def ascii_locale() -> Iterator[None]:
    """LC_CTYPE=C for the test: the locale's encoding is ASCII (outside UTF-8 mode)."""
    old = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, old)


@pytest.mark.skipif(sys.flags.utf8_mode == 1, reason="UTF-8 mode ignores the locale")
def test_a_non_ascii_line_is_written_as_utf8_whatever_the_locale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ascii_locale: None
) -> None:
    """Nothing stops non-ASCII text (`é`) in an ExecStartPre= line: the drop-in is written as
    UTF-8, as systemd reads it, not in the locale's encoding."""
    unit = tmp_path / ETC.lstrip("/") / "a.service"
    unit.parent.mkdir(parents=True)
    unit.write_bytes(("[Service]\nExecStartPre=/bin/echo caf\u00e9\n" + ANNOTATION).encode())
    out = tmp_path / "out"
    assert generator.generate(out, root=tmp_path, libexec_dir=LIBEXEC) == 1
    assert capsys.readouterr().err == ""
    dropin = out / "a.service.d/gpuslice-gate.conf"
    assert dropin.read_bytes() == gate("/bin/echo caf\u00e9").encode("utf-8")


# ---------------------------------------------------------------------------------------------
# plan: every unit on its own


def test_an_instance_sorted_before_other_units_does_not_stop_their_planning(
    tmp_path: Path,
) -> None:
    """An instance whose template is managed is skipped in the first pass (`continue`): the
    units sorted after it still get their gate."""
    write(tmp_path, f"{LIB}/a@.service", ANNOTATION)
    write(tmp_path, f"{LIB}/a@x.service", "[Service]\nExecStartPre=/bin/own\n" + ANNOTATION)
    write(tmp_path, f"{ETC}/b.service", ANNOTATION)
    assert written(run(tmp_path)) == {
        "a@.service.d/gpuslice-gate.conf": gate(),
        "a@x.service.d/gpuslice-gate.conf": gate("/bin/own"),
        "b.service.d/gpuslice-gate.conf": gate(),
    }


def test_a_unit_with_an_invalid_name_is_not_gated(tmp_path: Path) -> None:
    """A managed unit whose name is not a valid unit name gets no drop-in and one error naming
    it (escaped); the others are planned. (A scan never yields one; `plan` checks anyway.)"""
    result = Scan(
        specs={
            "bad\x1bname.service": UnitSpec("bad\x1bname.service", 1),
            "good.service": UnitSpec("good.service", 1),
        }
    )
    planned = empty_plan(tmp_path, result)
    assert planned.dropins == {"good.service": gate()}
    assert planned.errors == ["bad\\x1bname.service: not a valid unit name (unit not gated)"]


def test_an_instance_with_an_invalid_name_is_not_gated_correctly(tmp_path: Path) -> None:
    """An unmanaged instance of a managed template whose name is not valid cannot have the
    file that hides the template's gate: one error each, the template still gated."""
    result = Scan(
        specs={"train@.service": UnitSpec("train@.service", 1)},
        invalid={"train@a\x1bb.service"},
        unannotated_instances={"train@c d.service"},
    )
    planned = empty_plan(tmp_path, result)
    assert planned.dropins == {"train@.service": gate()}
    assert planned.errors == [
        "train@a\\x1bb.service: not a valid unit name (unit not gated correctly)",
        "train@c d.service: not a valid unit name (unit not gated correctly)",
    ]


def test_an_invalid_instance_file_hides_its_templates_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An instance left unmanaged by its own unit file (`result.invalid`, no drop-in directory
    of its own) gets the file that hides its template's gate."""
    write(tmp_path, f"{LIB}/train@.service", ANNOTATION)
    write(tmp_path, f"{LIB}/train@bad.service", "[X-GPUSlice]\nPriority=high\n")
    assert written(run(tmp_path)) == {
        "train@.service.d/gpuslice-gate.conf": gate(),
        "train@bad.service.d/gpuslice-gate.conf": generator.MASK_TEXT,
    }
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: error: {LIB}/train@bad.service:2: [X-GPUSlice] Priority: expected "
        'an integer 0-999, got "high" (unit not managed)'
    ]


def test_listing_the_instances_drop_in_directories_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the instances' drop-in directories cannot be listed: one error with the reason, and
    every other drop-in still planned."""
    write(tmp_path, f"{LIB}/train@.service", ANNOTATION)
    write(tmp_path, f"{LIB}/train@x.service", "[Service]\nExecStartPre=/bin/own\n" + ANNOTATION)
    write(tmp_path, f"{ETC}/a.service", ANNOTATION)
    loader = Loader(UnitIndex(tmp_path))
    result = scan(tmp_path, loader)

    def broken() -> list[str]:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(loader.index, "instance_dropin_names", broken)
    planned = generator.plan(loader, result, LIBEXEC, "/run/gpuslice")
    assert planned.dropins == {
        "a.service": gate(),
        "train@.service": gate(),
        "train@x.service": gate("/bin/own"),
    }
    assert planned.errors == ["cannot list the instances' drop-in directories: Input/output error"]


def test_an_exception_planning_an_instance_is_reported_and_the_others_are_gated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance whose gate cannot be planned: one error naming it and the reason (`not gated
    correctly`: its template's gate applies), every other unit gated."""
    write(tmp_path, f"{LIB}/train@.service", ANNOTATION)
    write(tmp_path, f"{LIB}/train@x.service", "[Service]\nExecStartPre=/bin/own\n" + ANNOTATION)
    write(tmp_path, f"{ETC}/z.service", ANNOTATION)
    real = generator.exec_start_pre_before_gate

    def broken(loader: Loader, unit: str) -> list[str]:
        if unit == "train@x.service":
            raise RuntimeError("boom")
        return real(loader, unit)

    monkeypatch.setattr(generator, "exec_start_pre_before_gate", broken)
    assert written(run(tmp_path)) == {
        "train@.service.d/gpuslice-gate.conf": gate(),
        "z.service.d/gpuslice-gate.conf": gate(),
    }
    assert capsys.readouterr().err.splitlines() == [
        "gpuslice-generator: error: train@x.service: cannot plan its gate: boom "
        "(unit not gated correctly)"
    ]


def test_an_exception_without_a_message_is_named_by_its_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception with an empty message is reported by its class name."""
    write(tmp_path, f"{ETC}/a.service", ANNOTATION)

    def broken(loader: Loader, unit: str) -> list[str]:
        raise RuntimeError()

    monkeypatch.setattr(generator, "exec_start_pre_before_gate", broken)
    assert written(run(tmp_path)) == {}
    assert capsys.readouterr().err.splitlines() == [
        "gpuslice-generator: error: a.service: cannot plan its gate: RuntimeError (unit not gated)"
    ]


# ---------------------------------------------------------------------------------------------
# config.yaml


def test_config_warnings_are_printed_and_the_config_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config that loads with warnings (an unknown setting): each warning on stderr, and the
    settings it does give are used."""
    write(tmp_path, "/etc/gpuslice/config.yaml", "colour: red\nruntime_dir: /run/gpuslice/x\n")
    write(tmp_path, f"{ETC}/a.service", ANNOTATION)
    assert written(run(tmp_path)) == {
        "a.service.d/gpuslice-gate.conf": gate(runtime="/run/gpuslice/x")
    }
    config = tmp_path / "etc/gpuslice/config.yaml"
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: warning: {config}:1: colour: unknown setting, ignored "
        f"(known: {', '.join(SETTINGS_BY_NAME)})"
    ]


def test_an_unexpected_exception_loading_the_config_means_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anything but ConfigError from loading config.yaml: one warning naming the file and the
    reason, and the defaults."""

    def broken(path: Path) -> tuple[Config, list[str]]:
        raise RuntimeError("boom")

    monkeypatch.setattr(generator, "load_config_with_warnings", broken)
    write(tmp_path, f"{ETC}/a.service", ANNOTATION)
    assert written(run(tmp_path)) == {"a.service.d/gpuslice-gate.conf": gate()}
    config = tmp_path / "etc/gpuslice/config.yaml"
    assert capsys.readouterr().err.splitlines() == [
        f"gpuslice-generator: warning: {config}: boom "
        "(using the defaults runtime_dir /run/gpuslice, gate_retry_seconds 0.5)"
    ]


# ---------------------------------------------------------------------------------------------
# generate


def test_a_long_message_is_cut_at_2000_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message on stderr is cut after exactly 2000 characters, then `...`."""

    def broken(*args: object) -> None:
        raise RuntimeError("x" * 3000)

    monkeypatch.setattr(generator, "scan", broken)
    run(tmp_path)
    message = ("cannot read the unit files: " + "x" * 3000)[:2000]
    assert capsys.readouterr().err.splitlines() == [f"gpuslice-generator: error: {message}..."]


def test_generate_writes_nothing_and_returns_0_when_the_unit_files_cannot_be_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """generate returns how many files it wrote: 0 when the unit files cannot be read."""

    def broken(*args: object) -> None:
        raise RuntimeError("scan failed")

    monkeypatch.setattr(generator, "scan", broken)
    write(tmp_path, f"{ETC}/a.service", ANNOTATION)
    out = tmp_path / "out"
    assert generator.generate(out, root=tmp_path, libexec_dir=LIBEXEC) == 0
    assert not out.exists()
    assert capsys.readouterr().err.splitlines() == [
        "gpuslice-generator: error: cannot read the unit files: scan failed (no unit gated)"
    ]


def test_generate_reads_the_real_root_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without `root`, generate reads the runtime_dir record, config.yaml and the unit files
    under `/` (each a stand-in here: none of this host's is read)."""
    seen: list[str] = []

    def index(root: str | os.PathLike[str]) -> UnitIndex:
        seen.append(os.fspath(root))
        return UnitIndex(tmp_path)

    def config(path: Path) -> tuple[Config, list[str]]:
        seen.append(os.fspath(path))
        return Config(), []

    def pinned(record: Path) -> None:
        seen.append(os.fspath(record))

    monkeypatch.setattr(generator, "UnitIndex", index)
    monkeypatch.setattr(generator, "load_config_with_warnings", config)
    monkeypatch.setattr(generator, "read_pinned_runtime_dir", pinned)
    write(tmp_path, f"{ETC}/a.service", ANNOTATION)
    out = tmp_path / "out"
    assert generator.generate(out, libexec_dir=LIBEXEC) == 1
    assert seen == ["/run/gpuslice/runtime-dir", "/etc/gpuslice/config.yaml", "/"]
    assert written(out) == {"a.service.d/gpuslice-gate.conf": gate()}


def test_each_unit_file_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan and the plan share one Loader: each unit file is read once per run (and both
    see the same text)."""
    write(tmp_path, f"{ETC}/a.service", "[Service]\nExecStartPre=/bin/frag\n" + ANNOTATION)
    write(tmp_path, f"{ETC}/a.service.d/10-pre.conf", "[Service]\nExecStartPre=/bin/pre\n")
    write(tmp_path, f"{LIB}/train@.service", ANNOTATION)
    write(tmp_path, f"{LIB}/train@x.service", "[Service]\nExecStartPre=/bin/own\n" + ANNOTATION)
    reads: Counter[str] = Counter()
    real = unitfiles.read_unit

    def counting(path: str | os.PathLike[str]) -> tuple[str, bool]:
        reads[str(Path(path).relative_to(tmp_path))] += 1
        return real(path)

    monkeypatch.setattr(unitfiles, "read_unit", counting)
    assert written(run(tmp_path)) == {
        "a.service.d/gpuslice-gate.conf": gate("/bin/frag", "/bin/pre"),
        "train@.service.d/gpuslice-gate.conf": gate(),
        "train@x.service.d/gpuslice-gate.conf": gate("/bin/own"),
    }
    assert reads == {
        "etc/systemd/system/a.service": 1,
        "etc/systemd/system/a.service.d/10-pre.conf": 1,
        "usr/lib/systemd/system/train@.service": 1,
        "usr/lib/systemd/system/train@x.service": 1,
    }


def test_a_second_run_over_its_own_output_rewrites_the_same_drop_ins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run again over its own output (its directory is in the search path): the existing drop-in
    directories are reused and the gate's own file is not copied into the new gate."""
    write(tmp_path, f"{ETC}/a.service", "[Service]\nExecStartPre=/bin/frag\n" + ANNOTATION)
    write(tmp_path, f"{LIB}/train@.service", ANNOTATION)
    write(tmp_path, f"{LIB}/train@x.service", "[Service]\nExecStartPre=/bin/own\n" + ANNOTATION)
    expected = {
        "a.service.d/gpuslice-gate.conf": gate("/bin/frag"),
        "train@.service.d/gpuslice-gate.conf": gate(),
        "train@x.service.d/gpuslice-gate.conf": gate("/bin/own"),
    }
    out = tmp_path / "run/systemd/generator"
    for _ in range(2):
        assert generator.generate(out, root=tmp_path, libexec_dir=LIBEXEC) == 3
        assert written(out) == expected
    assert capsys.readouterr().err == ""


def test_a_write_error_for_an_instance_is_reported_as_not_gated_correctly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An instance whose own gate cannot be written still has its template's: the error says
    `not gated correctly`."""
    write(tmp_path, f"{LIB}/train@.service", ANNOTATION)
    write(tmp_path, f"{LIB}/train@x.service", "[Service]\nExecStartPre=/bin/own\n" + ANNOTATION)
    out = tmp_path / "run/systemd/generator"
    write(out, "train@x.service.d", "a file where the directory should be\n")
    assert generator.generate(out, root=tmp_path, libexec_dir=LIBEXEC) == 1
    assert written(out) == {"train@.service.d/gpuslice-gate.conf": gate()}
    assert capsys.readouterr().err.splitlines() == [
        "gpuslice-generator: error: train@x.service: cannot write its gate: File exists "
        "(unit not gated correctly)"
    ]


# ---------------------------------------------------------------------------------------------
# main


Call = tuple[tuple[object, ...], dict[str, object]]


def spy_generate(monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    calls: list[Call] = []

    def fake(*args: object, **kwargs: object) -> int:
        calls.append((args, kwargs))
        return 0

    monkeypatch.setattr(generator, "generate", fake)
    return calls


@pytest.mark.parametrize("argc", [1, 3])
def test_main_reads_sys_argv_and_the_real_root_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argc: int
) -> None:
    """`main()` takes NORMAL_DIR from sys.argv[1] (EARLY_DIR and LATE_DIR unused) and writes
    for the units under `/`."""
    calls = spy_generate(monkeypatch)
    dirs = [str(tmp_path / name) for name in ("normal", "early", "late")][:argc]
    monkeypatch.setattr(sys, "argv", ["gpuslice-generator", *dirs])
    assert generator.main() == 0
    assert calls == [((dirs[0],), {"root": "/"})]


def test_main_reports_an_exception_from_generate_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should generate raise after all, main prints the reason as an error and exits 0."""

    def broken(*args: object, **kwargs: object) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(generator, "generate", broken)
    assert generator.main([str(tmp_path / "out")], root=str(tmp_path)) == 0
    assert capsys.readouterr().err.splitlines() == ["gpuslice-generator: error: boom"]
