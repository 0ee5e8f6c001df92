"""`gpuslice check`, `gpuslice enroll` and the status table, without a running systemd."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from gpuslice import cli as cli_module
from gpuslice.annotations import Problem, Scan
from gpuslice.checkpoint import CheckpointError
from gpuslice.cli import main
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import SavedState, Scheduler
from gpuslice.inventory import GpuUse, Sample
from gpuslice.state import StateStore
from gpuslice.status import render, snapshot_to_json
from tests.hostpaths import REAL
from tests.release_jobs_standins import show
from tests.test_decisions import held_wait_json
from tests.test_release_jobs_resume import _systemd_started, _this_boot

GIB = 1 << 30
UNIT = "[Unit]\nDescription=x\n[Service]\nExecStart=/bin/true\n[X-GPUSlice]\n"


def test_check_files_reports_file_line_key_and_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.service"
    bad.write_text(UNIT + "Priority=high\nType=sometimes\n")
    config = tmp_path / "config.yaml"
    config.write_text("gpus: 0\n")
    assert check(str(bad), str(config)) == (
        1,
        [
            f'error: {config}:1: gpus: invalid value "0" (allowed: an integer 1-1024)',
            f'error: {bad}:6: [X-GPUSlice] Priority: expected an integer 0-999, got "high"',
            f"error: {bad}:7: [X-GPUSlice] Type: expected one of on-demand, background, "
            'got "sometimes"',
        ],
    )


def test_check_good_file(tmp_path: Path) -> None:
    good = tmp_path / "good.service"
    good.write_text(UNIT + "Priority=10\nMemory=20G\n")
    result = CliRunner().invoke(main, ["check", str(good)])
    assert (result.exit_code, result.output) == (
        0,
        "ok: 1 annotated unit(s) checked, 0 warning(s)\n",
    )


def test_check_refuses_a_user_unit_whose_environment_file_a_user_can_change(
    tmp_path: Path,
) -> None:
    """`gpuslice check FILE` reads the real file system: tmp_path is under /tmp (sticky,
    anyone makes files there), a tree of users' files (gpuslice/envsafety.py). A unit run as
    root is refused too: a user could set what lets its start through ungated."""
    env = tmp_path / "asr.env"
    env.write_text("A=1\n")
    bad = tmp_path / "asr.service"
    bad.write_text(f"[Service]\nUser=asr\nEnvironmentFile={env}\n[X-GPUSlice]\nPriority=10\n")
    root_unit = tmp_path / "root.service"
    root_unit.write_text(f"[Service]\nEnvironmentFile={env}\n[X-GPUSlice]\nPriority=10\n")
    result = CliRunner().invoke(main, ["check", str(root_unit)])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: {root_unit}:2: [Service] EnvironmentFile: {env}")
    result = CliRunner().invoke(main, ["check", str(bad)])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: {bad}:3: [Service] EnvironmentFile: {env}")
    assert "gpuslice's gate runs as root with this unit's environment" in result.output


def test_enroll_writes_a_validated_dropin(tmp_path: Path) -> None:
    unit_dir = tmp_path / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    (unit_dir / "plain.service").write_text("[Service]\nExecStart=/bin/true\n")
    args = ["enroll", "plain", "--priority", "5", "--type", "background", "--no-reload"]
    result = CliRunner().invoke(main, [*args, "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    dropin = unit_dir / "plain.service.d/gpuslice.conf"
    assert "Priority=5\nType=background\nGPUs=1\nRequeue=yes\n" in dropin.read_text()
    assert f"enrolled plain.service (priority 5) via {tmp_path}" in result.output


def test_status_table_shows_memory_foreign_processes_and_reasons() -> None:
    voice = UnitSpec("voice.service", 10, memory=10 * GIB)
    big = UnitSpec("big.service", 20, memory=20 * GIB)
    gpu = Gpu(0, "GPU-0", "Fake 24GB", 24 * GIB, 0, 2 * GIB, (77,), used=13 * GIB)
    sched = Scheduler([gpu], {})
    sched.request(voice)
    sched.request(big)
    sample = Sample(
        [gpu],
        [GpuUse(10, 0, 11 * GIB, "voice.service", "python3"), GpuUse(77, 0, 2 * GIB, None, "Xorg")],
    )
    scan = Scan(specs={s.name: s for s in (voice, big)})
    data = snapshot_to_json(sched.snapshot(), scan, sample)
    assert data["gpus"][0]["holders"] == [
        {
            "unit": "voice.service",
            "priority": 10,
            "state": "running",
            "memory_declared": 10 * GIB,
            "memory_used": 11 * GIB,
            "reason": None,
            "since": None,
        }
    ]
    text = render(data)
    assert "GPU 0: Fake 24GB, 13 GiB / 24 GiB used" in text
    assert "10 GiB declared, 11 GiB used (MORE THAN DECLARED)" in text
    assert "foreign: PID 77 Xorg" in text
    assert (
        "big.service (priority 20): waiting: needs 20 GiB on one GPU; GPU 0 has 12 GiB free "
        "after the reserve, held by voice.service, priority 10"
    ) in text


# ---------------------------------------------------------------------------------------------
# check: never a traceback, never blocked; exit 1 with located lines


def check(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["check", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output.splitlines()


def test_check_files_that_are_not_regular_files(tmp_path: Path) -> None:
    for name in ("dir.yaml", "dir.service"):
        (tmp_path / name).mkdir()
    for name in ("fifo.yaml", "fifo.service"):
        os.mkfifo(tmp_path / name)  # opening one for reading would block
    names = ["dir.yaml", "fifo.yaml", "dir.service", "fifo.service", "absent.service"]
    assert check(*(str(tmp_path / n) for n in names)) == (
        1,
        [
            f"error: {tmp_path}/dir.yaml: cannot read: a directory, not a regular file",
            f"error: {tmp_path}/fifo.yaml: cannot read: a FIFO, not a regular file",
            f"error: {tmp_path}/dir.service: cannot read: a directory, not a regular file",
            f"error: {tmp_path}/fifo.service: cannot read: a FIFO, not a regular file",
            f"error: {tmp_path}/absent.service: cannot read: No such file or directory",
        ],
    )


def test_check_config_option_that_is_a_directory(tmp_path: Path) -> None:
    assert check("--config", str(tmp_path), "--root", str(tmp_path)) == (
        1,
        [f"error: {tmp_path}: cannot read: a directory, not a regular file"],
    )


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"gpus: \xff\n", "{C}:1: not UTF-8 text (byte 0xff at offset 6)"),
        (b"#" * (1 << 21), "{C}: larger than 262144 bytes (256 KiB), not read"),
        (
            b"gpus: " + b"[" * 5000 + b"]" * 5000 + b"\n",
            "{C}:1: not valid YAML: nested deeper than 16 levels",
        ),
        (
            b"a: &a [x, x, x, x, x, x, x, x, x]\nb: [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n",
            "{C}:2: not valid YAML: aliases (*name) are not allowed in config.yaml",
        ),
        (b"gpus: !!int abc\n", '{C}:1: gpus: invalid value "abc" (allowed: an integer 1-1024)'),
    ],
)
def test_check_hostile_config(tmp_path: Path, data: bytes, expected: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_bytes(data)
    assert check(str(config)) == (1, ["error: " + expected.replace("{C}", str(config))])


def test_check_prints_one_line_per_config_problem(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("gpus: 0\nstop_timeout: 0\n")
    assert check(str(config)) == (
        1,
        [
            f'error: {config}:1: gpus: invalid value "0" (allowed: an integer 1-1024)',
            f'error: {config}:2: stop_timeout: invalid value "0" (allowed: a number of seconds '
            "1-86400)",
        ],
    )


def test_check_escapes_control_characters_from_unit_files(tmp_path: Path) -> None:
    unit = tmp_path / "x.service"
    unit.write_text(UNIT + "Priority=\x1b[2J\n")
    code, lines = check(str(unit))
    assert code == 1
    assert "\x1b" not in "".join(lines)
    assert any("\\x1b[2J" in line for line in lines)


def test_check_prints_the_scans_warnings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    warning = Problem("/etc/systemd/system/a.service.d/z.conf", 2, "", "a warning", "warning", "a")
    monkeypatch.setattr("gpuslice.cli.scan", lambda root, loader: Scan(problems=[warning]))
    assert check("--config", str(tmp_path / "absent.yaml"), "--root", str(tmp_path)) == (
        0,
        [f"warning: {warning}", "ok: 0 annotated unit(s) checked, 1 warning(s)"],
    )


def test_check_config_only_reads_no_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ExecReload= runs: a unit's problem must not fail `systemctl reload gpuslice`."""
    broken = Problem("/etc/systemd/system/a.service", 2, "", "an error", "error", "a")
    monkeypatch.setattr("gpuslice.cli.scan", lambda root, loader: Scan(problems=[broken]))
    config = tmp_path / "config.yaml"
    config.write_text("gpus: 2\n")
    assert check("--config-only", "--config", str(config), "--root", str(tmp_path)) == (
        0,
        [f"ok: {config}, 0 warning(s)"],
    )
    config.write_text("gpus: banana\n")
    assert check("--config-only", "--config", str(config)) == (
        1,
        [f'error: {config}:1: gpus: invalid value "banana" (allowed: an integer 1-1024)'],
    )


def test_check_config_only_takes_no_files(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["check", "--config-only", str(tmp_path / "x.service")])
    assert result.exit_code == 2
    assert "--config-only takes no FILES" in result.output


def test_check_names_nvidia_nodes_the_sandbox_would_refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a host whose nvidia module is loaded, `gpuslice check` compares /dev/nvidia* with
    the DeviceAllow= systemd shows for gpuslice.service (here: a stand-in systemctl)."""
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024\n"
    )
    (tmp_path / "proc/devices").write_text("Character devices:\n195 nvidia-frontend\n")
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidiactl").write_text("")  # no GPU node: reported as missing
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    systemctl = bin_dir / "systemctl"
    systemctl.write_text("#!/bin/sh\necho 'char-nvidia-uvm rw'\n")
    systemctl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    code, lines = check("--config", "/nonexistent/config.yaml", "--root", str(tmp_path))
    assert code == 1
    assert "error: /dev/nvidia[0-9]* is missing: NVML cannot start" in "\n".join(lines)
    assert any(
        line.startswith("error: /dev/nvidiactl (char-") and "not in gpuslice.service's" in line
        for line in lines
    ), lines


# ---------------------------------------------------------------------------------------------
# status JSON: each waiter's place in the queue, since when it waits, its reason as data


def test_status_json_waiters_position_since_and_decision() -> None:
    sched = Scheduler([0], {})
    sched.request(UnitSpec("a.service", 20))
    sched.request(UnitSpec("late.service", 30))
    sched.request(UnitSpec("b.service", 20))
    scan = Scan(specs={})
    since = {"b.service": 1700000000.5}
    data = snapshot_to_json(sched.snapshot(), scan, Sample([Gpu(0)]), since)
    waiting = data["waiting"]
    assert [(w["unit"], w["position"], w["since"]) for w in waiting] == [
        ("b.service", 1, 1700000000.5),
        ("late.service", 2, None),
    ]
    assert waiting[0]["reason"] == "waiting: GPU 0 held by a.service, priority 20"
    assert waiting[0]["decision"] == held_wait_json("b.service", 20, [], 20)
    # the v1 keys are unchanged; the table numbers waiters and says how long they waited
    assert set(waiting[1]) >= {"unit", "priority", "reason"}
    text = render(data, now=1700000125.0)
    assert (
        "  1. b.service (priority 20): waiting: GPU 0 held by a.service, priority 20 "
        "(for 2 min 4 s)"
    ) in text.splitlines()
    assert "  2. late.service (priority 30): waiting: GPU 0 held by a.service, priority 20" in (
        text.splitlines()
    )


def test_status_json_from_an_older_controller_still_renders() -> None:
    data = {
        "gpus": [],
        "waiting": [{"unit": "w.service", "priority": 5, "reason": "waiting: x"}],
        "preempted": [],
        "held": [],
        "finished": [],
        "failed": [],
    }
    assert "  1. w.service (priority 5): waiting: x" in render(data, now=0.0).splitlines()


def test_plan_of_a_template_names_an_instance_instead() -> None:
    """systemd starts only a template's instances, and an instance's GPUs may be its name
    (`Devices=%i`): a plan of the template itself would describe nothing that can happen."""
    result = CliRunner().invoke(main, ["plan", "worker@"])
    assert result.exit_code == 2
    assert "worker@.service is a template: name one of its instances (worker@0.service)" in (
        result.output
    )


@pytest.mark.parametrize(
    ("text", "released"),
    [
        ("runtime_dir: /run/gpuslice/x\n", ["/run/gpuslice/x/gate"]),
        # bad elsewhere: the file's runtime_dir (a controller started before the typo, and
        # the gates the generator wrote since), and the default's
        ("runtime_dir: /run/gpuslice/x\ngpus: 0\n", ["/run/gpuslice/gate", "/run/gpuslice/x/gate"]),
        ("gpus: 0\n", ["/run/gpuslice/gate"]),
    ],
)
def test_release_gates_wakes_them_wherever_the_controller_may_have_made_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, released: list[str]
) -> None:
    from gpuslice import gatepipes

    woken: list[str] = []
    monkeypatch.setattr(gatepipes, "wake_and_remove", lambda d: woken.append(str(d)))
    monkeypatch.setattr("gpuslice.paths.RUNTIME_DIR_RECORD", str(tmp_path / "no-record"))
    # the real default, whose gates are woken by the stand-in above, not on this host
    monkeypatch.setattr("gpuslice.paths.DEFAULT_RUNTIME_DIR", REAL["paths.DEFAULT_RUNTIME_DIR"])
    monkeypatch.delenv("GPUSLICE_RUNTIME_DIR", raising=False)
    (tmp_path / "config.yaml").write_text(text)
    result = CliRunner().invoke(main, ["release-gates", "--config", str(tmp_path / "config.yaml")])
    assert result.exit_code == 0, result.output
    assert woken == released


def test_release_gates_wakes_them_in_the_runtime_dir_the_controller_ran_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runtime_dir edited in config.yaml since the controller started: it made its pipes in
    the runtime_dir of this boot, which gpuslice.service is told (GPUSLICE_RUNTIME_DIR) and
    recorded (paths.RUNTIME_DIR_RECORD). Only config.yaml's was woken: a gate blocked in
    open() on its pipe waited for the next controller."""
    from gpuslice import gatepipes

    woken: list[str] = []
    monkeypatch.setattr(gatepipes, "wake_and_remove", lambda d: woken.append(str(d)))
    (tmp_path / "record").write_text("/run/gpuslice/a\n")
    monkeypatch.setattr("gpuslice.paths.RUNTIME_DIR_RECORD", str(tmp_path / "record"))
    monkeypatch.setenv("GPUSLICE_RUNTIME_DIR", "/run/gpuslice/b")
    (tmp_path / "config.yaml").write_text("runtime_dir: /run/gpuslice/c\n")
    result = CliRunner().invoke(main, ["release-gates", "--config", str(tmp_path / "config.yaml")])
    assert result.exit_code == 0, result.output
    assert woken == ["/run/gpuslice/a/gate", "/run/gpuslice/b/gate", "/run/gpuslice/c/gate"]


def test_metrics_without_an_answer_prints_only_up_0_and_exits_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """README, "Metrics": when the controller does not answer, `gpuslice metrics` prints only
    `gpuslice_up 0` and exits 1 (a textfile collector's cron job sees the failure; the
    stale file is not taken for a healthy scrape)."""

    async def away(address: str | None) -> str:
        raise click.ClickException("the name org.gpuslice.Scheduler1 has no owner")

    monkeypatch.setattr(cli_module, "_call_status", away)
    result = CliRunner().invoke(main, ["metrics"])
    assert result.exit_code == 1, result.output
    samples = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert samples == ["gpuslice_up 0.0"]
    assert "gpuslice metrics: no status from the controller: " in result.stderr


def _left_behind(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    saved: SavedState,
    boot: str,
    shown: dict[str, tuple[str, str]],
) -> tuple[list[list[str]], str]:
    """`gpuslice release-jobs` on the saved state `saved` of boot `boot`, systemd showing
    each unit's (ActiveState, FreezerState) as `shown`, no cuda-checkpoint to resume a
    suspended unit with (tests/test_release_jobs_resume.py resumes): the systemctl commands
    it ran but `show`, and its stderr."""
    monkeypatch.setattr(StateStore, "load", lambda self: (saved, boot))
    # the state is this stand-in, in no file: nothing on the host to save over or
    # to find saved since (a /var/lib/gpuslice left by another run made it so)
    monkeypatch.setattr(StateStore, "saved_since", lambda self: None)
    _systemd_started(monkeypatch)
    monkeypatch.setattr(
        cli_module,
        "_resume_left",
        lambda unit, s, pids=None: CheckpointError(f"{unit}: no cuda-checkpoint"),
    )
    ran: list[list[str]] = []

    def systemctl(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if command[1] == "show":
            return subprocess.CompletedProcess(command, 0, show(command, shown), "")
        ran.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", systemctl)
    (tmp_path / "config.yaml").write_text("log_level: info\n")
    result = CliRunner().invoke(main, ["release-jobs", "--config", str(tmp_path / "config.yaml")])
    assert result.exit_code == 0, result.output
    return ran, result.stderr


def test_release_jobs_thaws_what_only_the_controller_would_thaw_and_names_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`apt remove` (debian/gpuslice.prerm, after the controller's stop): a unit frozen beside
    a more urgent one kept its GPU memory and was left frozen for ever; a suspended unit and
    a preempted one were never brought back, and nothing said so."""
    saved = SavedState(
        holders={
            "frozen.service": ((0,), "frozen", 1, ""),
            "runs.service": ((0,), "running", 2, ""),
            "stopping.service": ((1,), "stopping", 3, "urgent.service"),
        },
        suspended={"suspended.service": ((1,), 4)},
        preempted={"preempted.service": 5, "restarted.service": 6},
        thaw_owed=["owed.service"],
    )
    shown = {
        "frozen.service": ("active", "frozen"),
        "owed.service": ("active", "frozen"),
        "runs.service": ("active", "running"),
        "suspended.service": ("active", "frozen"),
        "restarted.service": ("active", "running"),  # started by hand since
    }
    ran, stderr = _left_behind(tmp_path, monkeypatch, saved, _this_boot(), shown)
    assert ran == [
        ["systemctl", "thaw", "--", "frozen.service"],
        ["systemctl", "thaw", "--", "owed.service"],
    ]
    lines = stderr.splitlines()  # thaws and resumes first, as the controller orders them
    assert len(lines) == 3, stderr
    assert "suspended.service is left suspended" in lines[0]
    assert "`systemctl stop suspended.service`" in lines[0]
    assert "(not resumed: suspended.service: no cuda-checkpoint)" in lines[0]
    for line, unit in zip(lines[1:], ("preempted.service", "stopping.service"), strict=True):
        assert f"{unit} was preempted and nothing will start it again" in line
        assert f"`systemctl start {unit}`" in line


def test_release_jobs_of_an_earlier_boot_thaws_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holders of an earlier boot ran no process in this one: a unit of that name frozen now
    is someone else's. A unit suspended then was preempted (its processes died)."""
    saved = SavedState(
        holders={"frozen.service": ((0,), "frozen", 1, "")},
        suspended={"suspended.service": ((1,), 4)},
        thaw_owed=["frozen.service"],
    )
    shown = {"frozen.service": ("active", "frozen")}
    ran, stderr = _left_behind(tmp_path, monkeypatch, saved, "another-boot/1", shown)
    assert ran == []
    assert stderr.splitlines() == [
        "gpuslice is being removed: suspended.service was preempted and nothing will start it "
        "again: `systemctl start suspended.service` if it is still wanted"
    ]


def test_release_jobs_leaves_a_running_controllers_units_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop the removal asked for and did not get (a policy-rc.d refused it): the
    controller still holds that unit frozen, and a thaw behind its back would fight it."""
    saved = SavedState(holders={"frozen.service": ((0,), "frozen", 1, "")})
    shown = {"gpuslice.service": ("active", "running"), "frozen.service": ("active", "frozen")}
    ran, stderr = _left_behind(tmp_path, monkeypatch, saved, _this_boot(), shown)
    assert ran == []
    assert "gpuslice.service is active: its units are left to it" in stderr
