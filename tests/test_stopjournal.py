"""gpuslice/stopjournal.py: whether systemd ran a stop job on a unit, from PID 1's own journal
entries, asked of a stand-in `journalctl` on PATH (a script that answers each unit as the test
says and writes down how it was called).

README: "A unit you stop by hand (`systemctl stop`) is held [...] also when no controller ran
at that moment". What the real journalctl 252 does with the same command line (a PID 1 in its
own PID namespace, writing through a journald of its own) is in the module's docstring; the
containers of tests/integration see it end to end (test_stopped_away.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from gpuslice import stopjournal
from gpuslice.stopjournal import (
    DROPPED,
    OUTPUT_MAX,
    STARTING,
    STOPPED,
    Answer,
    ask,
    boot_command,
    command,
    read_answer,
    read_boot,
    unknown_line,
)
from gpuslice.unitfiles import printable

# The stand-in: reads its answers from ANSWERS (a JSON object: unit, or BOOT for the question
# with no unit (boot_command's) -> [exit status, stdout, stderr, seconds to sleep first]; one
# not named: no entry), writes its argv and PID to CALLS, one line each.
BOOT = "(boot)"
STAND_IN = """#!{python}
import json, os, sys, time
args = sys.argv[1:]
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "calls"), "a") as f:
    f.write(json.dumps({{"pid": os.getpid(), "args": args}}) + "\\n")
unit = next((a[5:] for a in args if a.startswith("UNIT=")), "(boot)")
with open(os.path.join(here, "answers")) as f:
    code, out, err, sleep = json.load(f).get(unit, [0, "", "", 0])
time.sleep(sleep)
sys.stdout.write(out)
sys.stderr.write(err)
sys.exit(code)
"""


def entry(message_id: str, unit: str = "a.service", **fields: str) -> str:
    """One entry as `journalctl -o json --output-fields=...` prints it."""
    found = {
        "__CURSOR": "s=1;i=2",
        "__REALTIME_TIMESTAMP": "1700000000000000",
        "__MONOTONIC_TIMESTAMP": "12345678",
        "_BOOT_ID": "0" * 32,
        "MESSAGE_ID": message_id,
        "_PID": "1",
        "UNIT": unit,
        "_TRANSPORT": "journal",
        **fields,
    }
    return json.dumps(found) + "\n"


INVOCATION = "5f0c1ab2d3e44f65a7b8c9d0e1f2a3b4"  # $INVOCATION_ID, as systemd gives it
THIS_BOOT = "0123456789abcdef0123456789abcdef"  # as journald wrote it (not /proc's, in a container)


def boot_entry(**fields: str) -> str:
    """PID 1's entry of the controller's start, as `boot_command` prints it: the fields asked
    for, and those journalctl always prints."""
    found = {
        "__CURSOR": "s=1;i=1",
        "__REALTIME_TIMESTAMP": "1700000000000000",
        "__MONOTONIC_TIMESTAMP": "1234567",
        "_BOOT_ID": THIS_BOOT,
        "_PID": "1",
        "INVOCATION_ID": INVOCATION,
        **fields,
    }
    return json.dumps(found) + "\n"


class StandIn:
    """A `journalctl` first on PATH; `answers` says what it prints for each unit."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = tmp_path / "bin"
        self.dir.mkdir()
        script = self.dir / "journalctl"
        script.write_text(STAND_IN.format(python=sys.executable))
        script.chmod(0o755)
        self.answers: dict[str, tuple[int, str, str, float]] = {}
        monkeypatch.setenv("PATH", f"{self.dir}{os.pathsep}{os.environ.get('PATH', '')}")
        monkeypatch.delenv("INVOCATION_ID", raising=False)  # not run by systemd: `-b`

    def ask(self, names: list[str], seconds: float = 10.0) -> dict[str, Answer]:
        (self.dir / "answers").write_text(json.dumps(self.answers))
        return asyncio.run(ask(names, seconds))

    def calls(self) -> list[dict[str, object]]:
        path = self.dir / "calls"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def journalctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StandIn:
    """The stand-in; a killed one is reaped however late a loaded machine runs asyncio's
    child watcher: past REAP_SECONDS (2 s) it was a zombie still, and the tests that say no
    journalctl is left behind failed (the bound itself: tests/test_stopjournal_mutation2.py)."""
    monkeypatch.setattr(stopjournal, "REAP_SECONDS", 60.0)
    return StandIn(tmp_path, monkeypatch)


# ---- the question -----------------------------------------------------------------------------


def test_the_ids_are_systemds_and_the_question_is_pid_1s_word_of_this_boot() -> None:
    """sd-messages.h's SD_MESSAGE_UNIT_STARTING, _UNIT_STOPPED and _JOURNAL_DROPPED; three
    groups joined by `+` (or), each of fields all required: PID 1's start of the unit, PID
    1's end of a stop job that did its work on it, journald's own word that it dropped PID
    1's messages; this boot, the latest one, as JSON of the fields read."""
    assert (STARTING, STOPPED, DROPPED) == (
        "7d4958e842da4a758f6c1cdc7b36dcc5",
        "9d1aaa27d60140bd96365438aad20286",
        "a596d6fe7bfa4994828e72309e95d61e",
    )
    assert command("a@b-c.service") == [
        "journalctl",
        "-b",
        "-q",
        "--no-pager",
        "-o",
        "json",
        "-n",
        "1",
        "--output-fields=MESSAGE_ID,JOB_RESULT,UNIT,_PID,_TRANSPORT,OBJECT_PID",
        "_PID=1",
        "UNIT=a@b-c.service",
        f"MESSAGE_ID={STARTING}",
        "+",
        "_PID=1",
        "UNIT=a@b-c.service",
        f"MESSAGE_ID={STOPPED}",
        "JOB_RESULT=done",
        "+",
        "_TRANSPORT=driver",
        f"MESSAGE_ID={DROPPED}",
        "OBJECT_PID=1",
    ]


def test_under_systemd_this_boot_is_journalds_id_in_each_group_and_not_dash_b() -> None:
    """`-b` is the boot /proc/sys/kernel/random/boot_id names, and in a container that file,
    under ProtectKernelTunables= or ProtectControlGroups=, names the host's boot: no entry
    matched. The boot journald wrote (`boot_command`'s entry) is named in each group: a
    match before the first `+` alone would leave the other groups of any boot."""
    assert command("a.service", THIS_BOOT) == [
        "journalctl",
        "-q",
        "--no-pager",
        "-o",
        "json",
        "-n",
        "1",
        "--output-fields=MESSAGE_ID,JOB_RESULT,UNIT,_PID,_TRANSPORT,OBJECT_PID",
        f"_BOOT_ID={THIS_BOOT}",
        "_PID=1",
        "UNIT=a.service",
        f"MESSAGE_ID={STARTING}",
        "+",
        f"_BOOT_ID={THIS_BOOT}",
        "_PID=1",
        "UNIT=a.service",
        f"MESSAGE_ID={STOPPED}",
        "JOB_RESULT=done",
        "+",
        f"_BOOT_ID={THIS_BOOT}",
        "_TRANSPORT=driver",
        f"MESSAGE_ID={DROPPED}",
        "OBJECT_PID=1",
    ]
    assert boot_command(INVOCATION) == [
        "journalctl",
        "-q",
        "--no-pager",
        "-o",
        "json",
        "-n",
        "1",
        "--output-fields=_PID,INVOCATION_ID",
        "_PID=1",
        f"INVOCATION_ID={INVOCATION}",
    ]


# ---- this boot --------------------------------------------------------------------------------


def test_the_boot_is_that_of_pid_1s_entry_of_this_start() -> None:
    assert read_boot(INVOCATION, boot_entry().encode()) == THIS_BOOT


def test_no_entry_of_this_start_is_no_boot_and_no_failure() -> None:
    """Storage=none, the controller's own LogLevelMax= below info: no word of its start."""
    assert read_boot(INVOCATION, b"\n") == Answer(
        None,
        f"the journal holds no word of this controller's start (INVOCATION_ID={INVOCATION}), "
        "so not which boot is this one",
    )


@pytest.mark.parametrize(
    "out",
    [
        boot_entry(_PID="4242"),  # not PID 1's
        boot_entry(INVOCATION_ID="f" * 32),  # another start's
        boot_entry(_BOOT_ID="0123456789ABCDEF0123456789ABCDEF"),  # not journalctl's form
        boot_entry(_BOOT_ID="0" * 31),
        boot_entry(_BOOT_ID="0" * 32 + "\n"),
        boot_entry(_BOOT_ID=["0" * 32]),  # type: ignore[arg-type]
        json.dumps({"_PID": "1", "INVOCATION_ID": INVOCATION}),  # no _BOOT_ID
        boot_entry() + boot_entry(),  # two entries: -n 1 gives one
        '["a list"]\n',
        "-- No entries --\n",
        "[" * 2000 + "]" * 2000,
    ],
    ids=[
        "not-pid-1",
        "other-start",
        "upper-case",
        "short",
        "newline",
        "list-id",
        "no-boot",
        "two",
        "list",
        "words",
        "deep",
    ],
)
def test_any_other_answer_to_the_boot_is_no_boot_and_a_failure(out: str) -> None:
    answer = read_boot(INVOCATION, out.encode())
    assert isinstance(answer, Answer)
    assert answer.stopped is None and answer.failed
    assert answer.why.startswith("journalctl ")


# ---- the answer -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("out", "stopped"),
    [
        (entry(STOPPED, JOB_RESULT="done"), True),  # a stop job ended its last run
        (entry(STARTING), False),  # its last start, and no stop job's end after it
    ],
    ids=["stopped", "started"],
)
def test_pid_1s_latest_word_of_the_unit_tells(out: str, stopped: bool) -> None:
    assert read_answer("a.service", out.encode()) == Answer(stopped)


def test_no_entry_is_a_journal_that_cannot_tell_and_no_failure() -> None:
    """Storage=none, a vacuumed journal, a unit's LogLevelMax= below info: no word of it."""
    for out in (b"", b"\n", b"  \n"):
        assert read_answer("a.service", out) == Answer(
            None, "the journal holds no word of its start or stop this boot"
        )


def test_journald_dropping_pid_1s_messages_since_cannot_tell_and_is_no_failure() -> None:
    """Its "Suppressed N messages from init.scope" came after PID 1's latest word of the
    unit: a "Stopped" or "Starting" after that word may be among those dropped."""
    out = entry(DROPPED, unit="", _PID="42", _TRANSPORT="driver", OBJECT_PID="1")
    assert read_answer("a.service", out.encode()) == Answer(
        None, "journald dropped messages of systemd's since its last word of it"
    )


@pytest.mark.parametrize(
    "out",
    [
        entry(STOPPED, _PID="4242", JOB_RESULT="done"),  # not PID 1's
        entry(STARTING, _PID="4242"),
        entry(STOPPED, unit="b.service", JOB_RESULT="done"),  # another unit's
        entry(STARTING, unit="b.service"),
        entry(STOPPED, JOB_RESULT="timeout"),  # not asked for: the stop did not end it
        entry(STOPPED),  # no JOB_RESULT
        entry(STOPPED, JOB_RESULT=["d", "o"]),  # type: ignore[arg-type]
        entry(DROPPED, _TRANSPORT="journal", OBJECT_PID="1"),  # anyone's entry with that id
        entry("39f53479d3a045ac8e11786248231fbf"),  # "Started": not asked for
        entry(STARTING) + entry(STOPPED, JOB_RESULT="done"),  # two entries: -n 1 gives one
        '["a list"]\n',
        "-- No entries --\n",
        '{"MESSAGE_ID": ',
        "\xff\xfe{}",
        "[" * 2000 + "]" * 2000,  # deeper than json's parser goes
    ],
    ids=[
        "stopped-not-pid-1",
        "starting-not-pid-1",
        "stopped-other-unit",
        "starting-other-unit",
        "stopped-timeout",
        "stopped-no-result",
        "stopped-result-list",
        "dropped-not-driver",
        "other-id",
        "two",
        "list",
        "words",
        "cut",
        "not-utf8",
        "deep",
    ],
)
def test_anything_but_what_was_asked_for_is_no_answer_and_a_failure(out: str) -> None:
    answer = read_answer("a.service", out.encode("utf-8", "surrogateescape"))
    assert answer.stopped is None
    assert answer.failed
    assert answer.why.startswith("journalctl ")


# ---- asking -----------------------------------------------------------------------------------


def test_each_unit_is_asked_once_and_answered_by_its_own_entry(journalctl: StandIn) -> None:
    journalctl.answers = {
        "a.service": (0, entry(STOPPED, "a.service", JOB_RESULT="done"), "", 0),
        "b.service": (0, entry(STARTING, "b.service"), "", 0),
    }
    answers = journalctl.ask(["a.service", "b.service", "c.service", "a.service"])
    assert answers == {
        "a.service": Answer(True),
        "b.service": Answer(False),
        "c.service": Answer(None, "the journal holds no word of its start or stop this boot"),
    }
    calls = journalctl.calls()
    assert sorted(str(c["args"]) for c in calls) == sorted(
        str(command(n)[1:]) for n in ("a.service", "b.service", "c.service")
    )


def test_without_invocation_id_each_unit_is_asked_of_dash_b_and_no_boot_asked(
    journalctl: StandIn,
) -> None:
    """Not run by systemd (a developer's shell, tests): no start of ours to find, and `-b`
    is right where /proc is not a container's sandboxed one."""
    journalctl.answers = {"a.service": (0, entry(STARTING), "", 0)}
    assert journalctl.ask(["a.service"]) == {"a.service": Answer(False)}
    [call] = journalctl.calls()
    assert call["args"] == command("a.service")[1:]
    assert "-b" in command("a.service") and "_BOOT_ID" not in str(call["args"])


def test_under_systemd_the_boot_is_asked_first_and_each_unit_of_that_boot(
    journalctl: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INVOCATION_ID", INVOCATION)
    journalctl.answers = {
        BOOT: (0, boot_entry(), "", 0),
        "a.service": (0, entry(STOPPED, "a.service", JOB_RESULT="done"), "", 0),
        "b.service": (0, entry(STARTING, "b.service"), "", 0),
    }
    answers = journalctl.ask(["a.service", "b.service"])
    assert answers == {"a.service": Answer(True), "b.service": Answer(False)}
    first, *units = journalctl.calls()
    assert first["args"] == boot_command(INVOCATION)[1:]
    assert sorted(str(c["args"]) for c in units) == sorted(
        str(command(n, THIS_BOOT)[1:]) for n in ("a.service", "b.service")
    )
    for call in units:
        args = call["args"]
        assert isinstance(args, list)
        assert "-b" not in args
        assert args.count(f"_BOOT_ID={THIS_BOOT}") == 3


@pytest.mark.parametrize(
    ("boot", "why", "failed"),
    [
        (
            (0, "", "", 0),
            f"the journal holds no word of this controller's start (INVOCATION_ID={INVOCATION}"
            "), so not which boot is this one",
            False,
        ),
        (
            (1, "", "Failed to open journal\n", 0),
            "journalctl exited with status 1: Failed to open journal",
            True,
        ),
        (
            (0, boot_entry(_PID="4242"), "", 0),
            "journalctl gave an entry not asked for: " + printable(boot_entry(_PID="4242"), 80),
            True,
        ),
        (
            (0, "x" * (OUTPUT_MAX + 1), "", 0),
            f"journalctl wrote more than {OUTPUT_MAX} bytes",
            True,
        ),
        ((0, boot_entry(), "", 60), "journalctl did not answer within 2 s", True),
    ],
    ids=["none", "status", "not-asked-for", "over", "late"],
)
def test_a_boot_not_known_is_every_units_answer_and_no_unit_is_asked(
    journalctl: StandIn,
    monkeypatch: pytest.MonkeyPatch,
    boot: tuple[int, str, str, float],
    why: str,
    failed: bool,
) -> None:
    """Which boot is this one unknown, no unit's entries can be told this boot's (falls back
    to each main process's record); the time for all counts from the boot's question, and a
    boot's journalctl past it is killed."""
    monkeypatch.setenv("INVOCATION_ID", INVOCATION)
    journalctl.answers = {BOOT: boot, "a.service": (0, entry(STARTING), "", 0)}
    # 2 s for the one that never answers; the time a loaded machine may take to start and
    # run the stand-in (Python) for those that do
    seconds = 2 if boot[3] else 30
    began = time.monotonic()
    answers = journalctl.ask(["a.service", "b.service"], seconds=seconds)
    assert time.monotonic() - began < 10
    assert answers == dict.fromkeys(["a.service", "b.service"], Answer(None, why, failed))
    [call] = journalctl.calls()
    assert call["args"] == boot_command(INVOCATION)[1:]
    with pytest.raises(ProcessLookupError):
        os.kill(int(str(call["pid"])), 0)


def test_the_time_for_all_counts_the_boots_question_too(
    journalctl: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start-up waits `seconds` at most, not that for the boot and as long again for the
    units: a unit's journalctl still running at the end is killed."""
    monkeypatch.setenv("INVOCATION_ID", INVOCATION)
    # the boot answers well within the 2 s (1.5 s left the stand-in 0.5 s to start in,
    # short on a loaded machine); the unit's, after it, cannot
    journalctl.answers = {
        BOOT: (0, boot_entry(), "", 0.4),
        "a.service": (0, entry(STARTING), "", 1.6),
    }
    began = time.monotonic()
    answers = journalctl.ask(["a.service"], seconds=2)
    assert time.monotonic() - began < 10  # 2 s, then a kill and a reap: not a hang
    assert answers == {"a.service": Answer(None, "journalctl did not answer within 2 s", True)}
    _, unit = journalctl.calls()
    with pytest.raises(ProcessLookupError):
        os.kill(int(str(unit["pid"])), 0)


@pytest.mark.parametrize("invocation", ["", "F" * 32, "0" * 31, "0" * 32 + "\n", "-b", "../x"])
def test_an_invocation_id_not_systemds_is_no_boot_and_runs_nothing(
    journalctl: StandIn, monkeypatch: pytest.MonkeyPatch, invocation: str
) -> None:
    monkeypatch.setenv("INVOCATION_ID", invocation)
    answer = journalctl.ask(["a.service"])["a.service"]
    assert answer.stopped is None and answer.failed
    assert answer.why.startswith("INVOCATION_ID is not an id systemd gives: ")
    assert journalctl.calls() == []


def test_a_journalctl_that_fails_is_said_with_its_status_and_first_words(
    journalctl: StandIn,
) -> None:
    """journald not running and no journal files readable, a journalctl too old for a flag:
    its exit status and its message, in one escaped line."""
    journalctl.answers = {
        "a.service": (1, "", "Failed to open\n journal:\x1b[31m No such file\n", 0),
        "b.service": (3, "", "", 0),
    }
    answers = journalctl.ask(["a.service", "b.service"])
    assert answers == {
        "a.service": Answer(
            None,
            "journalctl exited with status 1: Failed to open journal:\\x1b[31m No such file",
            failed=True,
        ),
        "b.service": Answer(None, "journalctl exited with status 3: no message", failed=True),
    }


def test_no_journalctl_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert asyncio.run(ask(["a.service"])) == {
        "a.service": Answer(None, "journalctl not found", failed=True)
    }


def test_a_journalctl_that_cannot_be_run_is_said(
    journalctl: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found but not runnable (no x bit, here for root too: no x bit at all)."""
    path = journalctl.dir / "journalctl"
    path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    monkeypatch.setenv("PATH", str(journalctl.dir))
    answer = journalctl.ask(["a.service"])["a.service"]
    assert answer.stopped is None and answer.failed
    assert answer.why == "journalctl could not be run: Permission denied"


def test_an_answer_over_the_limit_is_none_and_journalctl_is_not_waited_for(
    journalctl: StandIn,
) -> None:
    """An output over OUTPUT_MAX bytes (on either stream) is no answer, and a journalctl that
    keeps writing is killed at once, not when the time for all runs out."""
    huge = "x" * (1 << 20)
    exact = entry(STARTING, "c.service")
    exact = exact[:-1] + " " * (OUTPUT_MAX - len(exact)) + "\n"
    journalctl.answers = {
        "a.service": (0, huge, "", 0),
        "b.service": (1, "", huge, 0),
        "c.service": (0, exact, "", 0),  # OUTPUT_MAX bytes exactly: read
    }
    began = time.monotonic()
    answers = journalctl.ask(["a.service", "b.service", "c.service"], seconds=30)
    assert time.monotonic() - began < 10
    over = Answer(None, f"journalctl wrote more than {OUTPUT_MAX} bytes", failed=True)
    assert answers == {"a.service": over, "b.service": over, "c.service": Answer(False)}


def test_units_not_answered_in_time_are_not_known_and_their_journalctl_is_killed(
    journalctl: StandIn,
) -> None:
    """The time is for all the units together: a journalctl stuck on a journal (a slow disk,
    a huge file) costs start-up `seconds` once; those answered by then keep their answer,
    the others are no answer, their journalctl killed and reaped."""
    journalctl.answers = {
        "a.service": (0, entry(STOPPED, "a.service", JOB_RESULT="done"), "", 0),
        "slow.service": (0, entry(STOPPED, "slow.service", JOB_RESULT="done"), "", 60),
    }
    began = time.monotonic()
    answers = journalctl.ask(["a.service", "slow.service"], seconds=3)
    assert time.monotonic() - began < 10
    assert answers == {
        "a.service": Answer(True),
        "slow.service": Answer(None, "journalctl did not answer within 3 s", failed=True),
    }
    [slow] = [c for c in journalctl.calls() if "UNIT=slow.service" in str(c["args"])]
    with pytest.raises(ProcessLookupError):
        os.kill(int(str(slow["pid"])), 0)


def test_at_most_at_once_run_together(journalctl: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two at a time here: the third starts once one of the first two is done (a start-up
    with many holders down does not start a journalctl for each at once)."""
    monkeypatch.setattr(stopjournal, "AT_ONCE", 2)
    names = ["a.service", "b.service", "c.service"]
    journalctl.answers = {n: (0, entry(STARTING, n), "", 0.5) for n in names}
    began = time.monotonic()
    answers = journalctl.ask(names)
    assert time.monotonic() - began >= 1.0
    assert answers == dict.fromkeys(names, Answer(False))


def test_nothing_to_ask_runs_nothing(journalctl: StandIn) -> None:
    assert journalctl.ask([]) == {}
    assert journalctl.calls() == []


def test_a_cancelled_ask_kills_its_journalctl(journalctl: StandIn) -> None:
    """The controller stops during start-up: no journalctl is left behind."""
    journalctl.answers = {"a.service": (0, "", "", 60)}
    (journalctl.dir / "answers").write_text(json.dumps(journalctl.answers))

    async def test() -> None:
        task = asyncio.create_task(ask(["a.service"], 30))
        while not journalctl.calls():
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(test())
    [call] = journalctl.calls()
    with pytest.raises(ProcessLookupError):
        os.kill(int(str(call["pid"])), 0)


# ---- the line ---------------------------------------------------------------------------------


def test_one_line_for_the_units_not_told_a_warning_only_for_a_failure() -> None:
    none = Answer(None, "no word")
    failed = Answer(None, "journalctl not found", failed=True)
    assert unknown_line({"a.service": Answer(True), "b.service": Answer(False)}) is None
    assert unknown_line({"b.service": none, "a.service": Answer(True)}) == (
        False,
        "b.service: no word",
    )
    answers = {f"u{i}.service": none for i in range(5)} | {"u9.service": failed}
    assert unknown_line(answers) == (
        True,
        "u0.service: no word; u1.service: no word; u2.service: no word; and 3 more",
    )
    assert unknown_line({f"u{i}.service": none for i in range(3)}) == (
        False,
        "u0.service: no word; u1.service: no word; u2.service: no word",
    )
