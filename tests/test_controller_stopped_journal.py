"""A unit stopped by hand while no controller ran, told by the journal (Controller.ask_journal,
gpuslice/stopjournal.py: PID 1's "Stopped" after a stop job, or its "Starting" with none
after): a unit systemd unloaded once down, and one that trapped SIGTERM and exited 0, are
held; a main process someone killed is an end by itself, as while a controller runs; where
the journal cannot tell, systemd's record of the main process decides as before. On the fakes
of tests/test_controller.py, the journal a stand-in that answers as the test says.

README: "A unit you stop by hand (`systemctl stop`) is held [...] also when no controller ran
at that moment". Taken for finished, such a unit was started again by the first refill after
the next reboot (finished is forgotten at a reboot, held is not).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from signal import SIGTERM

import pytest

from gpuslice import stopjournal
from gpuslice.core.scheduler import SavedState
from gpuslice.state import StateStore
from gpuslice.stopjournal import Answer
from gpuslice.tracker import CLD_EXITED, CLD_KILLED, MainExit, UnitState
from tests.test_controller import (
    BOOT,
    Bed,
    bed_config,
    frozen_beside_voice,
    messages,
    run,
    settle,
    state,
)

BG = {"bg.service": "Priority=50\nType=background\n"}
KILLED = MainExit(CLD_KILLED, SIGTERM, "success")
EXITED = MainExit(CLD_EXITED, 0, "success")
STOPPED = Answer(True)
BY_ITSELF = Answer(False)
NO_WORD = Answer(None, "the journal holds no word of its start or stop this boot")
NOT_FOUND = Answer(None, "journalctl not found", failed=True)


class Journal:
    """Controller.ask_journal's stand-in: each unit's answer (NO_WORD where the test names
    none); the names asked, call by call; `meanwhile` runs before it answers."""

    def __init__(self, answers: Mapping[str, Answer]) -> None:
        self.answers = dict(answers)
        self.asked: list[list[str]] = []
        self.meanwhile: Callable[[], None] = lambda: None

    async def __call__(self, names: Sequence[str]) -> dict[str, Answer]:
        self.asked.append(list(names))
        self.meanwhile()
        await asyncio.sleep(0)
        return {n: self.answers.get(n, NO_WORD) for n in names}


def _bed(
    tmp_path: Path, shown: list[UnitState] | None, answer: Answer, main: MainExit = EXITED
) -> tuple[Bed, Journal]:
    """bg.service held GPU 0, running, when the last controller of this boot saved; systemd
    shows it down with no job (`shown` None), or `shown`; the journal answers `answer` of
    it, and systemd's record of its main process says `main`."""
    config = bed_config(tmp_path)
    StateStore(Path(config.state_dir)).save(
        SavedState(holders={"bg.service": ((0,), "running", 1, "")}, seq=1), BOOT
    )
    down = [state("bg.service", "inactive", "dead")] if shown is None else shown
    bed = Bed(tmp_path, BG, down, config=config)
    journal = Journal({"bg.service": answer})
    bed.controller.ask_journal = journal
    bed.systemd.main_exits["bg.service"] = main
    return bed, journal


def _started(bed: Bed) -> list[str]:
    return [unit for what, unit in bed.systemd.calls if what == "start"]


async def _rebooted(tmp_path: Path, bed: Bed) -> Bed:
    """The host reboots: the state file the controller of `bed` saved is of the last boot,
    systemd shows bg.service down, and a controller starts (its journal asked of nothing)."""
    bed.controller.save_now()
    store = StateStore(Path(bed.config.state_dir))
    kept, _ = store.load()
    store.save(kept, "boot-0")
    again = Bed(tmp_path, BG, [state("bg.service", "inactive", "dead")], config=bed.config)
    journal = Journal({})
    again.controller.ask_journal = journal
    await again.controller.start()
    await settle()
    assert journal.asked == []  # the last boot's holders are not asked of
    return again


@pytest.mark.parametrize(
    ("shown", "main"),
    [
        ([], EXITED),  # not enabled, nothing wants it: systemd unloaded it once down
        (None, EXITED),  # it trapped SIGTERM and exited 0: its record says exited
        (None, KILLED),
    ],
    ids=["unloaded", "trapped-sigterm", "killed"],
)
def test_a_holder_the_journal_shows_a_stop_job_ending_is_held_after_a_reboot_too(
    tmp_path: Path, shown: list[UnitState] | None, main: MainExit
) -> None:
    """PID 1 wrote "Stopped" after its stop job, and no "Starting" since: held, not started
    at this start nor by the refill after the next boot. Its main process's record is not
    read (the journal told); an unloaded unit's never is (a Get would load it anew)."""
    bed, journal = _bed(tmp_path, shown, STOPPED, main)

    async def test() -> None:
        await bed.controller.start()
        await settle()
        snap = bed.controller.scheduler.snapshot()
        assert (snap.held, snap.finished) == (["bg.service"], [])
        assert journal.asked == [["bg.service"]]
        assert bed.systemd.exit_reads == []
        assert _started(bed) == []
        again = await _rebooted(tmp_path, bed)
        assert again.controller.scheduler.snapshot().held == ["bg.service"]
        assert _started(again) == []

    run(test)


@pytest.mark.parametrize("shown", [[], None], ids=["unloaded", "loaded"])
def test_a_holder_whose_last_start_has_no_stop_after_it_is_finished_even_if_killed(
    tmp_path: Path, shown: list[UnitState] | None
) -> None:
    """Its main process was killed by SIGTERM (someone's `kill`: Result=success for
    systemd) with no stop job: the journal shows its start and no stop job's end after it.
    Finished, as a controller that ran at that moment takes it (no job but ours is a stop),
    where systemd's record alone would have held it; the refill after the next boot starts
    it again."""
    bed, journal = _bed(tmp_path, shown, BY_ITSELF, KILLED)

    async def test() -> None:
        await bed.controller.start()
        await settle()
        snap = bed.controller.scheduler.snapshot()
        assert (snap.held, snap.finished) == ([], ["bg.service"])
        assert journal.asked == [["bg.service"]]
        assert bed.systemd.exit_reads == []
        again = await _rebooted(tmp_path, bed)
        assert _started(again) == ["bg.service"]

    run(test)


@pytest.mark.parametrize(
    ("answer", "level"),
    [(NO_WORD, logging.INFO), (NOT_FOUND, logging.WARNING)],
    ids=["no-word", "failed"],
)
@pytest.mark.parametrize(
    ("main", "held"), [(KILLED, ["bg.service"]), (EXITED, [])], ids=["killed", "exited"]
)
def test_where_the_journal_cannot_tell_the_main_process_record_decides_as_before(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    answer: Answer,
    level: int,
    main: MainExit,
    held: list[str],
) -> None:
    """Storage=none, a journal that dropped systemd's messages, no journalctl: systemd's
    record of its main process, read for it alone, decides (killed by a signal with
    Result=success: held). One line says so, a warning where asking failed."""
    bed, _ = _bed(tmp_path, None, answer, main)

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.controller.start()
            await settle()
        assert bed.controller.scheduler.snapshot().held == held
        assert bed.systemd.exit_reads == ["bg.service"]

    run(test)
    said = [r for r in caplog.records if "the journal cannot tell" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (
            level,
            f"the journal cannot tell whether systemd stopped bg.service: {answer.why}: "
            "judged by how systemd recorded the main process ending (a unit it no longer "
            "loads: ended by itself)",
        )
    ]


def test_an_unloaded_holder_the_journal_cannot_tell_of_is_finished_as_before(
    tmp_path: Path,
) -> None:
    """No word in the journal, and systemd keeps no record of it: finished, as before."""
    bed, journal = _bed(tmp_path, [], NO_WORD, KILLED)

    async def test() -> None:
        await bed.controller.start()
        await settle()
        snap = bed.controller.scheduler.snapshot()
        assert (snap.held, snap.finished) == ([], ["bg.service"])
        assert journal.asked == [["bg.service"]]
        assert bed.systemd.exit_reads == []

    run(test)


def test_an_answer_a_signal_of_the_unit_overtook_is_not_taken(tmp_path: Path) -> None:
    """A signal of the unit came while the journal was asked (it was started and ended
    again, say): the answer may be of another run than the state judged, and the unit is
    taken as before."""
    bed, journal = _bed(tmp_path, None, STOPPED)
    ctl = bed.controller
    journal.meanwhile = lambda: ctl.on_unit_changed(
        "bg.service", {"ActiveState": "inactive", "SubState": "dead"}
    )

    async def test() -> None:
        await ctl.start()
        await settle()
        snap = ctl.scheduler.snapshot()
        assert (snap.held, snap.finished) == ([], ["bg.service"])

    run(test)


# Holders of every kind the question must tell apart, one GPU each, every one stopped by a
# stop job as the journal would say: name -> (saved phase, what systemd shows).
MIXED: dict[str, tuple[str, UnitState | None]] = {
    "down-running.service": ("running", state("down-running.service", "inactive", "dead")),
    "down-starting.service": ("starting", state("down-starting.service", "inactive", "dead")),
    "down-frozen.service": ("frozen", state("down-frozen.service", "inactive", "dead")),
    "ours-stopping.service": ("stopping", state("ours-stopping.service", "inactive", "dead")),
    "was-failed.service": ("running", state("was-failed.service", "failed", "failed")),
    "job-queued.service": ("running", state("job-queued.service", "inactive", "dead", 4, "start")),
    "still-running.service": ("running", state("still-running.service", "active", "running")),
    "unloaded.service": ("running", None),  # systemd does not list it
}
ASKED = ["down-frozen.service", "down-running.service", "down-starting.service", "unloaded.service"]


def test_only_holders_down_with_no_job_or_unloaded_and_not_being_stopped_are_asked_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One start-up, eight holders, one question for all: those the last controller saw
    running, starting or frozen that systemd lists inactive with no job, or no longer
    lists, are asked of, and held. The one gpuslice was stopping is preempted and brought
    back; the failed one is failed; the one with a start job and the running one are not
    asked of. Every one told: no line, and no record read."""
    names = sorted(MIXED)
    config = bed_config(tmp_path, gpus=len(names))
    saved = SavedState(
        holders={n: ((i,), MIXED[n][0], i + 1, "") for i, n in enumerate(names)}, seq=len(names)
    )
    StateStore(Path(config.state_dir)).save(saved, BOOT)
    shown = [s for _, s in MIXED.values() if s is not None]
    bed = Bed(tmp_path, dict.fromkeys(names, "Priority=50\n"), shown, config=config)
    journal = Journal(dict.fromkeys(names, STOPPED))
    bed.controller.ask_journal = journal

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await ctl.start()
            await settle()
        assert journal.asked == [ASKED]
        assert bed.systemd.exit_reads == []
        snap = ctl.scheduler.snapshot()
        assert snap.held == ASKED
        assert snap.failed == ["was-failed.service"]
        assert "ours-stopping.service" in _started(bed)  # preempted, then brought back

    run(test)
    assert not [m for m in messages(caplog) if "journal" in m]


def test_each_unit_the_journal_cannot_tell_of_alone_has_its_record_read(tmp_path: Path) -> None:
    """Three holders down: a.service told stopped, b.service told ended by itself, c.service
    not told: only c.service's record is read (killed: held)."""
    units = {n: "Priority=50\nType=background\n" for n in ("a.service", "b.service", "c.service")}
    config = bed_config(tmp_path, gpus=3)
    saved = SavedState(
        holders={n: ((i,), "running", i + 1, "") for i, n in enumerate(units)}, seq=3
    )
    StateStore(Path(config.state_dir)).save(saved, BOOT)
    bed = Bed(tmp_path, units, [state(n, "inactive", "dead") for n in units], config=config)
    bed.controller.ask_journal = Journal({"a.service": STOPPED, "b.service": BY_ITSELF})
    for name in units:
        bed.systemd.main_exits[name] = KILLED

    async def test() -> None:
        await bed.controller.start()
        await settle()
        assert bed.systemd.exit_reads == ["c.service"]
        snap = bed.controller.scheduler.snapshot()
        assert (snap.held, snap.finished) == (["a.service", "c.service"], ["b.service"])

    run(test)


def test_the_debug_line_says_the_journal_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bed, _ = _bed(tmp_path, [], STOPPED)

    async def test() -> None:
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            await bed.controller.start()
            await settle()

    run(test)
    assert [m for m in messages(caplog) if "while no controller ran" in m] == [
        "bg.service was stopped while no controller ran (the journal shows systemd's stop job "
        "ending it)"
    ]


def test_nothing_is_decided_while_the_journal_is_asked(tmp_path: Path) -> None:
    """A sample taken while the journal is asked (the sampler's timer) starts nothing: GPU 1
    is free and back.service is owed a comeback, but start-up decides once, after the
    answers. Then back.service is brought back and bg.service, stopped, is held."""
    config = bed_config(tmp_path, gpus=2)
    saved = SavedState(
        holders={"bg.service": ((0,), "running", 1, "")}, preempted={"back.service": 2}, seq=2
    )
    StateStore(Path(config.state_dir)).save(saved, BOOT)
    units = {"bg.service": "Priority=50\nType=background\n", "back.service": "Priority=50\n"}
    bed = Bed(tmp_path, units, [], config=config)  # both unloaded
    ctl = bed.controller
    journal = Journal({"bg.service": STOPPED})
    ctl.ask_journal = journal
    during: list[list[str]] = []

    async def ask(names: Sequence[str]) -> dict[str, Answer]:
        ctl.watch.refresh()  # as the sampler's timer does: decide on what NVML shows
        await settle()
        during.append(_started(bed))
        return await journal(names)

    ctl.ask_journal = ask

    async def test() -> None:
        await ctl.start()
        await settle()
        assert during == [[]]
        assert _started(bed) == ["back.service"]
        assert ctl.scheduler.snapshot().held == ["bg.service"]

    run(test)


def test_the_journal_is_asked_through_journalctl_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stopjournal.ask itself, with a journalctl on PATH that answers PID 1's "Stopped" of
    bg.service (unloaded): held."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    said = json.dumps(
        {
            "MESSAGE_ID": stopjournal.STOPPED,
            "JOB_RESULT": "done",
            "UNIT": "bg.service",
            "_PID": "1",
            "_TRANSPORT": "journal",
        }
    )
    script = bin_dir / "journalctl"
    script.write_text(f"#!{sys.executable}\nprint({said!r})\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("INVOCATION_ID", raising=False)  # not run by systemd: no boot asked
    bed, _ = _bed(tmp_path, [], NO_WORD)
    bed.controller.ask_journal = stopjournal.ask

    async def test() -> None:
        await bed.controller.start()
        await settle()
        assert bed.controller.scheduler.snapshot().held == ["bg.service"]

    run(test)


@pytest.mark.parametrize("phase", ["suspended", "frozen"])
@pytest.mark.parametrize(
    ("answer", "held"), [(STOPPED, True), (BY_ITSELF, False)], ids=["stop-job", "no-stop-job"]
)
def test_a_frozen_or_suspended_unit_that_exited_143_on_a_stop_while_away_is_held(
    tmp_path: Path, phase: str, answer: Answer, held: bool
) -> None:
    """emb.service, frozen beside voice.service or suspended for it, was stopped by hand
    while no controller ran, and its main process exited 143 on the SIGTERM: systemd shows
    it failed. Asked of the journal as a holder found down is: a stop job ended it, held
    (as while a controller runs), not failed (a new boot cleared that, and refill started
    it again); with no stop job (its processes killed) it failed. Its main process's record
    is not read: it tells no failed unit stopped."""
    bed = frozen_beside_voice(
        tmp_path,
        phase=phase,
        shown=("failed", "failed"),
        section="Type=background\n",
        freezer=False,
    )
    journal = Journal({"emb.service": answer})
    bed.controller.ask_journal = journal

    async def test() -> None:
        await bed.controller.start()
        await settle()
        assert journal.asked == [["emb.service"]]
        assert bed.systemd.exit_reads == []
        snap = bed.controller.scheduler.snapshot()
        assert (snap.held, snap.failed) == (
            (["emb.service"], []) if held else ([], ["emb.service"])
        )
        assert "emb.service" not in _started(bed)

    run(test)


def test_a_frozen_instance_stopped_while_no_controller_ran_is_forgotten(
    tmp_path: Path,
) -> None:
    """emb@1.service (on-demand) was frozen beside voice.service; someone stopped it while no
    controller ran (the journal says so): held, owed nothing, and forgotten as any instance
    held that is owed nothing. Its hold, booked at start-up, awaits no SystemState read (one
    now says nothing of when it was stopped): kept for one, it stayed held for ever."""
    bed = frozen_beside_voice(tmp_path, "emb@1.service", shown=("inactive", "dead"), freezer=False)
    bed.controller.ask_journal = Journal({"emb@1.service": STOPPED})

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert "emb@1.service" not in ctl.scheduler.annotated()
        assert ctl.scheduler.save().held == []
        assert ctl.scheduler.unconfirmed_holds == {}

    run(test)
