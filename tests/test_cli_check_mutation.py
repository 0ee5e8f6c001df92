"""`gpuslice check` line by line: which files are read as configuration, what each error says,
in what order, on which stream, with which exit code; the NVIDIA device check's question to
systemd; and the /proc mount table reader that Status's privacy rests on (gpuslice/procmount.py):
what its fields are, and what it logs when it fails closed."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from gpuslice import cli as cli_module
from gpuslice import generator, procmount
from gpuslice.annotations import Loader, Problem, Scan
from gpuslice.cli import main
from gpuslice.procmount import ProcHiding, proc_hiding_of, read_proc_hiding
from tests.test_generator import ANNOTATION, LIB, LIBEXEC, instance, write
from tests.test_status_privacy import ROOT_LINE, mountinfo, proc_line

UNIT = "[Unit]\nDescription=x\n[Service]\nExecStart=/bin/true\n[X-GPUSlice]\nPriority=10\n"
GPUS_0 = 'gpus: invalid value "0" (allowed: an integer 1-1024)'


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(main, ["check", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result


def check(*args: str) -> tuple[int, list[str]]:
    result = invoke(*args)
    return result.exit_code, result.output.splitlines()


# ---------------------------------------------------------------------------------------------
# FILES: .yaml and .yml are configurations, the rest unit files


def test_yaml_and_yml_files_are_configurations_each_read_in_turn(tmp_path: Path) -> None:
    """A .yaml that is not there is an error naming it, and the next file is still read; a
    .yml is a configuration too (its warnings are warnings); every message is kept, in the
    order found, and one error makes the exit code 1 whatever follows."""
    absent = tmp_path / "absent.yaml"
    warned = tmp_path / "warned.yml"
    warned.write_text("colour: blue\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: 0\n")
    code, lines = check(str(absent), str(warned), str(bad))
    assert code == 1
    assert len(lines) == 3, lines
    assert lines[0] == f"error: {absent}: cannot read: No such file or directory"
    assert lines[1].startswith(f"warning: {warned}:1: colour: unknown setting, ignored (known: ")
    assert lines[2] == f"error: {bad}:1: {GPUS_0}"


def test_a_yml_file_alone_is_checked_as_a_configuration(tmp_path: Path) -> None:
    config = tmp_path / "config.yml"
    config.write_text("gpus: 0\n")
    assert check(str(config)) == (1, [f"error: {config}:1: {GPUS_0}"])


def test_unit_files_alone_do_not_check_the_configuration(tmp_path: Path) -> None:
    """`gpuslice check a.service b.service` checks those; --config is read only when no FILES
    are given (or .yaml FILES replace it)."""
    config = tmp_path / "config.yaml"
    config.write_text("gpus: 0\n")
    units = []
    for name in ("a.service", "b.service"):
        (tmp_path / name).write_text(UNIT)
        units.append(str(tmp_path / name))
    assert check(*units, "--config", str(config)) == (
        0,
        ["ok: 2 annotated unit(s) checked, 0 warning(s)"],
    )


def test_a_device_node_is_not_read_as_a_unit_file() -> None:
    """Only stat: /dev/null (a character device) is never opened."""
    assert check("/dev/null") == (1, ["error: /dev/null: cannot read: not a regular file"])


def test_a_unit_file_too_large_to_read_is_an_error(tmp_path: Path) -> None:
    big = tmp_path / "big.service"
    big.write_bytes(UNIT.encode() + b"#" * (1 << 21))
    assert check(str(big)) == (
        1,
        [f"error: {big}: cannot read: larger than 1 MiB, which no unit file needs"],
    )


def test_config_only_with_files_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["check", "--config-only", str(tmp_path / "x.service")])
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == "Error: --config-only takes no FILES"


# ---------------------------------------------------------------------------------------------
# what cannot be checked at all: one located error line, never a traceback


def test_a_config_loader_failure_is_one_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.py raises only ConfigError; anything else is still one line, not a traceback."""

    def broken(path: Path) -> Any:
        raise RuntimeError("the parser broke")

    monkeypatch.setattr(cli_module, "load_config_with_warnings", broken)
    config = tmp_path / "config.yaml"
    config.write_text("gpus: 2\n")
    assert check(str(config)) == (1, [f"error: {config}: cannot check: the parser broke"])


def test_a_unit_directory_that_cannot_be_scanned_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(root: str, loader: Loader) -> Scan:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cli_module, "scan", broken)
    code, lines = check("--config", str(tmp_path / "absent.yaml"), "--root", str(tmp_path))
    assert (code, lines) == (
        1,
        [f"error: cannot read the unit files below {tmp_path}: Input/output error"],
    )


# ---------------------------------------------------------------------------------------------
# streams and length


def test_problems_go_to_stderr_the_verdict_to_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script reads the verdict on stdout; warnings and errors are on stderr."""
    warning = Problem("/etc/systemd/system/a.service", 2, "", "a warning", "warning", "a")
    monkeypatch.setattr(cli_module, "scan", lambda root, loader: Scan(problems=[warning]))
    result = invoke("--config", str(tmp_path / "absent.yaml"), "--root", str(tmp_path))
    assert result.exit_code == 0
    assert result.stderr == f"warning: {warning}\n"
    assert result.stdout == "ok: 0 annotated unit(s) checked, 1 warning(s)\n"


def test_a_problem_line_is_cut_at_2000_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flood = Problem("/etc/systemd/system/a.service", 2, "", "x" * 5000, "warning", "a")
    monkeypatch.setattr(cli_module, "scan", lambda root, loader: Scan(problems=[flood]))
    code, lines = check("--config", str(tmp_path / "absent.yaml"), "--root", str(tmp_path))
    assert code == 0
    assert lines[0] == f"warning: {flood}"[:2000] + "..."


# ---------------------------------------------------------------------------------------------
# NVIDIA device nodes against gpuslice.service's DeviceAllow=, as systemd shows it

ALLOW_ALL = "/dev/nvidiactl rw /dev/nvidia0 rw /dev/nvidia-uvm rw"
SHOW = "['systemctl', 'show', '-P', 'DeviceAllow', 'gpuslice.service']"
REFUSED = "is not in gpuslice.service's DeviceAllow=: NVML would be refused"


def _driver_host(
    root: Path, nodes: tuple[str, ...] = ("nvidiactl", "nvidia0", "nvidia-uvm")
) -> None:
    """A host whose nvidia module is loaded (its version unknown: no version file), with
    `nodes` in its /dev (plain files: major 0, allowed by path)."""
    (root / "sys/module/nvidia").mkdir(parents=True)
    (root / "dev").mkdir()
    for node in nodes:
        (root / "dev" / node).write_text("")


def _systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """A stand-in systemctl on PATH that answers only `show -P DeviceAllow gpuslice.service`
    (any other question: exit 1, as a real one asked something else would not print the
    bare list) and then runs `body`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "systemctl"
    script.write_text(
        "#!/bin/sh\n"
        '[ "$*" = "show -P DeviceAllow gpuslice.service" ] || { echo "asked: $*" >&2; exit 1; }\n'
        f"{body}\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def _check_host(root: Path) -> tuple[int, list[str]]:
    return check("--config", str(root / "absent.yaml"), "--root", str(root))


@pytest.mark.parametrize(
    "shown",
    [
        ALLOW_ALL,  # one line, as recent systemd prints it
        ALLOW_ALL.replace(" rw ", " rw\n"),  # one pair a line
        "/dev/nvidia0 rw\n/dev/nvidiactl rw\n/dev/nvidia-uvm rw\n",
    ],
)
def test_every_node_allowed_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shown: str
) -> None:
    """Every NODE RIGHTS pair of systemd's answer counts, the first and the last included;
    the module counts as loaded though its version cannot be read."""
    _driver_host(tmp_path)
    (tmp_path / "allow").write_text(shown)
    _systemctl(tmp_path, monkeypatch, f"cat '{tmp_path / 'allow'}'")
    assert _check_host(tmp_path) == (0, ["ok: 0 annotated unit(s) checked, 0 warning(s)"])


def test_a_node_left_out_of_device_allow_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _driver_host(tmp_path)
    _systemctl(tmp_path, monkeypatch, "echo '/dev/nvidiactl rw /dev/nvidia0 rw'")
    assert _check_host(tmp_path) == (1, [f"error: /dev/nvidia-uvm (char-0) {REFUSED}"])


def test_missing_nodes_are_named_where_the_module_version_is_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/sys/module/nvidia without a version file: the module is loaded all the same."""
    _driver_host(tmp_path, nodes=())
    _systemctl(tmp_path, monkeypatch, f"echo '{ALLOW_ALL}'")
    missing = "is missing: NVML cannot start (run nvidia-modprobe, or check udev)"
    assert _check_host(tmp_path) == (
        1,
        [f"error: /dev/nvidiactl {missing}", f"error: /dev/nvidia[0-9]* {missing}"],
    )


def test_systemctl_failing_is_one_error_not_every_node_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No systemd to ask (a container, a chroot): systemctl fails, printing nothing on
    stdout; that is said, not taken as an empty DeviceAllow=."""
    _driver_host(tmp_path)
    _systemctl(tmp_path, monkeypatch, "echo 'Failed to connect to bus' >&2; exit 1")
    assert _check_host(tmp_path) == (
        1,
        [
            "error: cannot read gpuslice.service's DeviceAllow= to check NVIDIA devices: "
            f"Command '{SHOW}' returned non-zero exit status 1."
        ],
    )


def test_a_hung_systemctl_is_given_up_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemctl waits on a hung systemd; check gives up after its deadline (here scaled down
    60 times) instead of hanging with it."""
    _driver_host(tmp_path)
    _systemctl(tmp_path, monkeypatch, "exec sleep 60")
    real_run = subprocess.run

    def scaled(*args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        if timeout is None:
            pytest.fail("systemctl run without a deadline: a hung systemd hangs check")
        return real_run(*args, timeout=timeout / 60, **kwargs)

    monkeypatch.setattr(subprocess, "run", scaled)
    assert _check_host(tmp_path) == (
        1,
        [
            "error: cannot read gpuslice.service's DeviceAllow= to check NVIDIA devices: "
            f"Command '{SHOW}' timed out after 0.5 seconds"
        ],
    )


# ---------------------------------------------------------------------------------------------
# the /proc mount table


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # a value with "=" in it is still hidepid's, unknown: taken to hide
        ("rw,hidepid=0=2", ProcHiding(True, None, "hidepid=0=2")),
        # and the group exempt from no value it does not know
        ("rw,hidepid=invisible=1,gid=27", ProcHiding(True, None, "hidepid=invisible=1,gid=27")),
        # a 10-digit group (systemd's container ranges start at 0x7ffe0000)
        ("rw,hidepid=2,gid=2147352576", ProcHiding(True, 2147352576, "hidepid=2,gid=2147352576")),
    ],
)
def test_option_values(options: str, expected: ProcHiding) -> None:
    assert proc_hiding_of(mountinfo(proc_line(options))) == expected


def test_proc_mounted_with_any_source_counts() -> None:
    """`mount -t proc none /proc -o hidepid=2`: the type says proc, the source is anything;
    a tmpfs whose source is named "proc" is no proc."""
    line = "22 21 0:21 / /proc rw,nosuid - proc none rw,hidepid=2"
    assert proc_hiding_of(mountinfo(line)) == ProcHiding(True, None, "hidepid=2")
    assert proc_hiding_of(mountinfo("30 21 0:40 / /proc rw - tmpfs proc rw")) is None


def test_fields_are_split_at_single_spaces_as_the_kernel_writes_them() -> None:
    """The kernel escapes space, tab, newline and backslash only: another whitespace
    character (a vertical tab) is part of the mount point, and a proc mounted on `/proc\\v`
    over /proc does not cover it."""
    lower = proc_line("rw,hidepid=2", 22, 21)
    other = "40 22 0:41 / /proc\x0b rw,relatime - proc proc rw"
    assert proc_hiding_of(mountinfo(lower, other)) == ProcHiding(True, None, "hidepid=2")
    assert proc_hiding_of(mountinfo(other)) is None


def test_the_separator_is_looked_for_after_the_mount_options() -> None:
    """Optional fields start at the seventh; a lone "-" before it is no separator."""
    line = "22 21 0:21 / /proc - shared:12 - proc proc rw,hidepid=2"
    assert proc_hiding_of(mountinfo(line)) == ProcHiding(True, None, "hidepid=2")


@pytest.mark.parametrize(
    "junk",
    [
        "22 21 0:21 / /proc rw a b c -",  # the separator last
        "22 21 0:21 / /proc rw a b - proc",  # a type, no source nor options
        "22 21 0:21 / /proc rw a b - proc proc",  # no options
    ],
)
def test_lines_cut_after_the_separator_are_skipped(junk: str) -> None:
    assert proc_hiding_of(mountinfo(junk)) is None
    assert proc_hiding_of(mountinfo(junk, proc_line("rw"))) == ProcHiding()


def test_two_proc_mounts_neither_on_top_and_neither_hiding_hide_nothing() -> None:
    twins = mountinfo(proc_line("rw", 22, 21), proc_line("rw,hidepid=0", 40, 21))
    assert proc_hiding_of(twins) == ProcHiding()


def test_a_table_past_the_bound_is_read_to_its_last_whole_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The /proc line is the last whole line before the bound: read whole (its gid to the
    last digit), the lines before it too."""
    monkeypatch.setattr(procmount, "MOUNTINFO_MAX", 4096)
    filler = [f"{100 + i} 21 0:{i} / /mnt/m{i:04d} rw - tmpfs tmpfs rw" for i in range(20)]
    head = "\n".join((ROOT_LINE, *filler, proc_line("rw,hidepid=2,gid=27"))) + "\n"
    assert len(head) < 4096
    path = tmp_path / "mountinfo"
    path.write_text(head + "x" * 8192 + "\n")
    assert read_proc_hiding(path) == ProcHiding(True, 27, "hidepid=2,gid=27")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "gpuslice.procmount" and r.levelno == logging.WARNING
    ]


def test_failing_closed_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Both ways of not knowing say why at warning level: an admin whose Status lost its
    process details reads why in the journal."""
    caplog.set_level(logging.WARNING, logger="gpuslice.procmount")
    missing = tmp_path / "missing"
    assert read_proc_hiding(missing) == procmount.UNKNOWN
    assert _warnings(caplog) == [
        f"cannot read the mount table ([Errno 2] No such file or directory: '{missing}'): "
        "Status hides other users' processes"
    ]
    caplog.clear()
    table = tmp_path / "mountinfo"
    table.write_text(ROOT_LINE + "\n")
    assert read_proc_hiding(table) == procmount.UNKNOWN
    assert _warnings(caplog) == ["no /proc in the mount table: Status hides other users' processes"]


# ---------------------------------------------------------------------------------------------
# what the generator will do


@pytest.mark.parametrize("length", [253, 254, 255])
def test_an_instance_the_generator_cannot_gate_as_it_must_is_an_error_as_the_generator_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], length: int
) -> None:
    """A managed template's instance whose name leaves no room for a drop-in directory of its
    own (254, 255 characters) while it needs one (its own ExecStartPre= lines, or no
    annotation: the template's gate is wrong for it): `check` says what gpuslice-generator
    says, line for line (it said ok). At 253 characters it gets its own: ok."""
    own = instance(length)
    unmanaged = instance(length).replace("train@x", "train@z")
    write(tmp_path, f"{LIB}/train@.service", ANNOTATION)
    write(tmp_path, f"{LIB}/{own}", "[Service]\nExecStartPre=/bin/own\n" + ANNOTATION)
    write(tmp_path, f"{LIB}/{instance(length).replace('train@x', 'train@y')}", ANNOTATION)
    write(tmp_path, f"{LIB}/{unmanaged}", "[Service]\nExecStart=/bin/x\n")
    generator.generate(tmp_path / "out", root=str(tmp_path), libexec_dir=LIBEXEC)
    said = capsys.readouterr().err.splitlines()
    code, lines = check("--config", str(tmp_path / "absent.yaml"), "--root", str(tmp_path))
    prefix = "gpuslice-generator: "
    assert [line for line in lines if not line.startswith("ok: ")] == [
        line.removeprefix(prefix) for line in said
    ]
    if length == 253:
        assert (code, lines) == (0, ["ok: 3 annotated unit(s) checked, 0 warning(s)"])
    else:
        assert code == 1 and len(lines) == 2
        assert all("name too long for a drop-in directory of its own" in line for line in lines)
