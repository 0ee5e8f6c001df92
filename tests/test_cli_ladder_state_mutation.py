"""What mutation testing of release-jobs' resume, `gpuslice check`, `gpuslice new`, the state
file's checkpointed entries and the ladder's restore showed no test held.

- release-jobs resumes the PIDs the state file kept for the unit, not every process of it
  (`_resume_left` hands them to the Ladder);
- `gpuslice check` reads each unit file once: its annotations and the gates it plans are of
  one reading (`scan` is given the loader that `gate_errors` reads through);
- `gpuslice new` with an option among the command's words is a usage error with click's usage
  line and hint, in its exact words;
- a bad checkpointed entry of the state file is said in its exact words;
- a resume stops the cuda-checkpoint runs an earlier controller left only for PIDs that one
  checkpointed (recalled), and only when the tool runs as transient services; the warning
  when that fails names the unit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuslice import checkpoint
from gpuslice import cli as cli_module
from gpuslice.checkpoint import CheckpointSettings, Resumed
from gpuslice.cli import main
from gpuslice.config import Config
from gpuslice.ladder import Ladder
from gpuslice.unitfiles import UnitFile
from tests.test_generator import ANNOTATION, LIB, write
from tests.test_release_jobs_resume import TOOL, _tool_and_systemd
from tests.test_session_mutation3 import UNIT, Stubbed
from tests.test_session_mutation3 import stubbed as stubbed  # a fixture
from tests.test_state import LADDER, load

GIB = 1 << 30

# ---- release-jobs: the PIDs the state file kept --------------------------------------------


def test_release_jobs_resumes_the_pids_the_state_file_kept_not_every_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given the PIDs its suspend checkpointed, the resume restores those (still the unit's)
    and asks systemd for no list of the unit's processes: asking the state of each of more
    than MAX_RECOVERED_PIDS failed the resume and left the unit suspended."""
    calls, made = _tool_and_systemd(monkeypatch)
    asked: list[list[int]] = []

    def still_its_own(self: Ladder, unit: str, pids: Sequence[int]) -> list[int]:
        asked.append(list(pids))
        return list(pids)

    monkeypatch.setattr(Ladder, "_still_its_own", still_its_own)
    settings = CheckpointSettings.from_config(Config())
    done = cli_module._resume_left("train.service", settings, [12])
    assert done == Resumed(0.5, (12,))
    assert asked == [[12]]
    assert calls == [("ThawUnit", "train.service"), ("restore", TOOL, "12")]
    assert made[0].bus.disconnected


# ---- gpuslice check: one reading of each unit file -----------------------------------------


def test_check_reads_each_unit_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gates it plans (`gate_errors`: each managed unit's own ExecStartPre= lines) are of
    the files the scan read, through the same loader: a file edited meanwhile is never half
    of each, and 10,000 units are read once, not twice."""
    write(tmp_path, f"{LIB}/train.service", "[Service]\nExecStartPre=/bin/own\n" + ANNOTATION)
    write(tmp_path, f"{LIB}/infer.service", ANNOTATION)
    read: list[str] = []
    real_read = UnitFile.read

    def counted(self: UnitFile) -> tuple[str, bool]:
        read.append(self.path)
        return real_read(self)

    monkeypatch.setattr(UnitFile, "read", counted)
    result = CliRunner().invoke(
        main, ["check", "--config", str(tmp_path / "absent.yaml"), "--root", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == "ok: 2 annotated unit(s) checked, 0 warning(s)\n"
    assert sorted(read) == [f"{LIB}/infer.service", f"{LIB}/train.service"]


# ---- gpuslice new: an option among the command's words -------------------------------------


def test_new_with_an_option_among_the_command_is_a_usage_error_in_its_words(
    tmp_path: Path,
) -> None:
    """As click's own usage errors: the usage line and the hint to --help, then why."""
    words = ["job", "--priority", "5", "/bin/echo", "--now", "--no-reload"]
    result = CliRunner().invoke(main, ["new", *words, "--root", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("Usage: main new [OPTIONS] ")
    assert "Try 'main new --help' for help." in lines
    assert lines[-1] == (
        "Error: give the command after --, e.g. -- /usr/bin/python3 job.py (an option of "
        "the command before it is taken for gpuslice's own)"
    )


# ---- the state file: a bad checkpointed entry, in its words --------------------------------


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ([[1], 0], "expected [PIDs, bytes, time]"),
        ([[5, 5], 0, 0.0], "no PID, or a PID listed twice"),
    ],
)
def test_a_bad_checkpointed_entry_is_said_in_its_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, entry: object, why: str
) -> None:
    content = json.dumps({**LADDER, "checkpointed": {"ocr.service": entry}}).encode()
    saved, _, records = load(tmp_path, content, caplog)
    [message] = [r.getMessage() for r in records]
    assert f'invalid entries (checkpointed: dropped "ocr.service": {why});' in message
    assert saved.checkpointed == {}


# ---- the ladder: runs an earlier controller left ---------------------------------------------


def _stopped(monkeypatch: pytest.MonkeyPatch, problem: str = "") -> list[list[int]]:
    """checkpoint.stop_earlier_runs stood in for: the PIDs of each call, answering
    `problem`."""
    stopped: list[list[int]] = []

    async def stop_earlier_runs(pids: Sequence[int]) -> str:
        stopped.append(list(pids))
        return problem

    monkeypatch.setattr(checkpoint, "stop_earlier_runs", stop_earlier_runs)
    return stopped


def _via_systemd(ladder: Stubbed, via_systemd: bool) -> None:
    ladder.settings = dataclasses.replace(ladder.settings, via_systemd=via_systemd)


def test_a_resume_of_its_own_suspend_stops_no_earlier_runs(
    stubbed: Stubbed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller that suspended the unit knows its own runs ended: only a controller
    restarted since (the PIDs recalled) stops what the last one may have left running."""
    stopped = _stopped(monkeypatch)
    _via_systemd(stubbed, True)
    stubbed.job(11, UNIT, 2)
    stubbed.go.set()
    asyncio.run(stubbed.ladder.suspend(UNIT))
    asyncio.run(stubbed.ladder.resume(UNIT))
    assert [e for e, _, _ in stubbed.events.said] == ["suspended", "resumed"]
    assert stubbed.restored == [[11]]
    assert stopped == []


def test_recalled_pids_stop_no_runs_when_the_tool_runs_in_no_service(
    stubbed: Stubbed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without via_systemd the last controller's runs died with it: no transient service is
    left to stop, and no `systemctl stop` is sent."""
    stopped = _stopped(monkeypatch)
    _via_systemd(stubbed, False)
    stubbed.owners[11] = UNIT
    stubbed.ladder.recall({UNIT: ((11,), 2 * GIB, time.time())})
    asyncio.run(stubbed.ladder.resume(UNIT))
    assert [e for e, _, _ in stubbed.events.said] == ["resumed"]
    assert stubbed.restored == [[11]]
    assert stopped == []


def test_earlier_runs_that_cannot_be_stopped_are_a_warning_naming_the_unit(
    stubbed: Stubbed, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stopped = _stopped(monkeypatch, "was not down 0.2 s after a stop")
    _via_systemd(stubbed, True)
    stubbed.owners[11] = UNIT
    stubbed.ladder.recall({UNIT: ((11,), 2 * GIB, time.time())})
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        asyncio.run(stubbed.ladder.resume(UNIT))
    assert stopped == [[11]]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"resuming {UNIT}: cuda-checkpoint runs an earlier controller left on its processes "
        "was not down 0.2 s after a stop (systemd ends them at their RuntimeMaxSec=)"
    ]
    assert stubbed.restored == [[11]]
