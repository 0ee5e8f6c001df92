"""gpuslice/answers.py on its own, without a Controller: the status built once per change
(the counters added at each call), each caller answered as /proc would show it the
processes, the bus daemon asked about a unique name once, STATUS= and /proc's mount said.

The scheduler is the real core (pure); the rest are stand-ins: a sample, a scan, the
waiters' times, the suspensions, the adapters' counts and the bus daemon's word."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from gpuslice import __version__, procmount
from gpuslice.annotations import Problem, Scan
from gpuslice.answers import StatusAnswers
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Scheduler
from gpuslice.counters import Counters
from gpuslice.inventory import GpuUse, Sample, _with_foreign
from gpuslice.owners import Owner
from gpuslice.procmount import ProcHiding, proc_hiding_of

GIB = 1 << 30
HIDEPID = ProcHiding(True, 27, "hidepid=2,gid=27")


class Host:
    """What a StatusAnswers reads, with a count of each build and of each lookup."""

    def __init__(
        self, hiding: ProcHiding = HIDEPID, scan: Scan | None = None, sees_all: bool = True
    ) -> None:
        uses = [GpuUse(4242, 0, 2 * GIB, None, "secret", Owner("user", "1000"))]
        gpus = [_with_foreign(Gpu(0, "GPU-0", "Fake 24GB", 24 * GIB), uses, {})]
        self.sample = Sample(gpus, uses)
        self.scheduler = Scheduler(gpus, {})
        self.scheduler.request(UnitSpec("w.service", 10, memory=30 * GIB))
        self.samples_read = 0  # one per build: each reads the sample once
        self.counters = Counters()
        self.dropped = 0
        self.hiding = hiding
        self.sees_all = sees_all
        self.credentials: dict[str, tuple[int | None, frozenset[int]]] = {
            ":1.1": (1000, frozenset({1000})),
            ":1.2": (0, frozenset()),
            ":1.3": (1001, frozenset({1001, 27})),
            ":1.5": (1002, frozenset({1002})),
        }
        self.asked: list[str] = []
        self.answers = StatusAnswers(
            self.scheduler,
            scan=lambda: scan or Scan(),
            sample=self._sample,
            waiting_since=lambda: {"w.service": 1234.5},
            suspensions=dict,
            counters=self.counters,
            adapter_counts=lambda: [("dbus_signals_dropped", self.dropped)],
            started=lambda: 1000.0,
            credentials=self._ask,
            read_hiding=lambda: self.hiding,
            sees_all=lambda: self.sees_all,
        )
        self.answers.read_proc_mount()

    def _sample(self) -> Sample:
        self.samples_read += 1
        return self.sample

    async def _ask(self, sender: str) -> tuple[int | None, frozenset[int]]:
        self.asked.append(sender)
        if sender not in self.credentials:
            raise LookupError(f"{sender} has no owner")
        return self.credentials[sender]

    def answer(self, sender: str) -> dict[str, Any]:
        """The parsed answer for `sender`, awaited if it had to be asked about."""
        answer = self.answers.status_for(sender)
        if not isinstance(answer, str):
            answer = asyncio.run(_awaited(answer))
        data: dict[str, Any] = json.loads(answer)
        return data


async def _awaited(answer: Coroutine[Any, Any, str]) -> str:
    return await answer


def _state(text: str) -> dict[str, Any]:
    """An answer without the time it was given (now, for a state unchanged since)."""
    data: dict[str, Any] = json.loads(text)
    del data["controller"]["status_time"]
    return data


def _foreign(data: dict[str, Any]) -> tuple[Any, Any, Any]:
    [process] = data["gpus"][0]["foreign"]
    return process["pid"], process["command"], process["owner"]["id"]


def test_the_answer_is_built_once_per_change() -> None:
    host = Host(ProcHiding())
    first = _state(host.answers.status_json())
    assert _state(host.answers.status_json()) == first
    assert host.samples_read == 1
    host.answers.changed()
    assert host.samples_read == 1  # built when asked for, not at the change
    host.answers.status_json()
    host.answers.status_json()
    assert host.samples_read == 2


def test_the_counters_are_added_at_each_call_without_a_build() -> None:
    """They move without a change of state: the next answer says them, from the same
    cached text, after its keys."""
    host = Host(ProcHiding())
    data = json.loads(host.answers.status_json())
    assert data["controller"]["version"] == __version__
    assert data["controller"]["start_time"] == 1000.0
    assert data["counters"]["dbus_signals_dropped"] == 0
    assert data["waiting"][0]["since"] == 1234.5
    host.dropped = 3
    host.counters.error("state_save_errors")
    host.counters.admission_wait.observe(0.5)
    text = host.answers.status_json()
    data = json.loads(text)
    assert host.samples_read == 1
    assert data["counters"]["dbus_signals_dropped"] == 3
    assert data["counters"]["state_save_errors"] == 1
    assert data["admission_wait_seconds"]["count"] == 1
    keys = list(json.loads(text, object_pairs_hook=lambda pairs: [k for k, _ in pairs]))
    assert keys[-3:] == ["admission_wait_seconds", "controller", "counters"]
    assert keys[:-3] == sorted(keys[:-3])


def test_without_hidepid_everyone_gets_the_full_answer_at_once() -> None:
    host = Host(ProcHiding())
    answer = host.answers.status_for(":1.5")
    assert isinstance(answer, str)
    assert "redacted" not in json.loads(answer)
    assert _foreign(json.loads(answer)) == (4242, "secret", "1000")
    assert host.asked == []


@pytest.mark.parametrize(
    ("sender", "seen"),
    [
        (":1.2", (4242, "secret", "1000")),  # root
        (":1.3", (4242, "secret", "1000")),  # of gid=27
        (":1.1", (4242, "secret", "1000")),  # its own, in a redacted answer
        (":1.5", (None, None, None)),  # another user
        (":1.9", (None, None, None)),  # the bus daemon did not say who: fail closed
    ],
)
def test_each_caller_sees_what_proc_would_show_it(sender: str, seen: tuple[Any, ...]) -> None:
    host = Host()
    data = host.answer(sender)
    assert _foreign(data) == seen
    assert data.get("redacted", False) is (sender not in (":1.2", ":1.3"))
    assert "counters" in data and "controller" in data
    assert host.asked == [sender]


def test_under_hidepid_ptraceable_the_mounts_group_sees_no_more_than_anyone() -> None:
    """/proc mounted `hidepid=ptraceable,gid=27` shows a member of group 27 only the
    processes it may ptrace (its own): the group is exempt from hidepid=2, not from this.
    Status gave it every foreign process's PID, command and owner."""
    line = "22 21 0:21 / /proc rw,relatime - proc proc rw,gid=27,hidepid=ptraceable"
    host = Host(proc_hiding_of(line + "\n") or ProcHiding())
    assert host.answer(":1.3")["redacted"] is True  # UID 1001, of group 27
    assert _foreign(host.answer(":1.3")) == (None, None, None)
    assert _foreign(host.answer(":1.1")) == (4242, "secret", "1000")  # its own, as /proc does
    assert "redacted" not in host.answer(":1.2")  # root


def test_a_known_caller_is_answered_without_a_lookup() -> None:
    """Named once, answered at once from then on; one not named is asked about each time,
    and not kept."""
    host = Host()
    first = host.answer(":1.1")
    del first["controller"]["status_time"]
    for _ in range(3):
        answer = host.answers.status_for(":1.1")
        assert isinstance(answer, str)
        assert _state(answer) == first
    assert host.asked == [":1.1"]
    for _ in range(2):
        answer = host.answers.status_for(":1.9")
        assert not isinstance(answer, str)
        assert json.loads(asyncio.run(_awaited(answer)))["redacted"] is True
    assert host.asked == [":1.1", ":1.9", ":1.9"]
    assert len(host.answers.callers) == 1


def test_the_full_and_the_redacted_answer_are_each_built_once_per_change() -> None:
    host = Host()
    for sender in (":1.1", ":1.5", ":1.5", ":1.1"):
        host.answer(sender)
    assert host.samples_read == 1  # the redacted one alone: nobody asked for the full one
    host.answer(":1.2")
    host.answer(":1.2")
    assert host.samples_read == 2
    host.answers.changed()
    host.answer(":1.2")
    host.answer(":1.5")
    assert host.samples_read == 4


def test_a_caller_is_judged_by_proc_as_mounted_now() -> None:
    """Its credentials are kept, not its answer: /proc remounted with another gid= (read
    again at a reload), the same connection is redacted, and not asked about again."""
    host = Host()
    assert "redacted" not in host.answer(":1.3")
    host.hiding = ProcHiding(True, 5, "hidepid=2,gid=5")
    host.answers.read_proc_mount()
    assert host.answer(":1.3")["redacted"] is True
    assert host.asked == [":1.3"]


# a problem that quotes root's environment file (gpuslice/envsafety.py), and one that does not
SECRET = Problem(
    "/etc/systemd/system/w.service",
    5,
    "EnvironmentFile",
    "LD_PRELOAD=/opt/x.so TOKEN=s3cret (set in /etc/job/x.env): ...",
    unit="w.service",
    section="Service",
    public_message="LD_PRELOAD=... (set in /etc/job/x.env; its value is shown to root alone)",
)
PLAIN = Problem("/etc/systemd/system/v.service", 7, "Priority", 'expected 0-999, got "x"')


@pytest.mark.parametrize("hiding", [ProcHiding(), HIDEPID])
def test_a_value_of_roots_environment_file_is_shown_to_root_alone(hiding: ProcHiding) -> None:
    """Where /proc hides nothing too: the value is root's secret whoever else may see every
    process (the mount's gid= group, everyone without hidepid=), and the bus daemon is asked
    who calls while a problem withholds one. The problems are as many for everyone."""
    host = Host(hiding, Scan(problems=[PLAIN, SECRET]))
    root = host.answer(":1.2")["problems"]
    assert root == [str(PLAIN), str(SECRET)]
    assert "s3cret" in root[1]
    for sender in (":1.1", ":1.3", ":1.5", ":1.9"):
        data = host.answer(sender)
        assert data["problems"] == [str(PLAIN), SECRET.public()], sender
        assert "s3cret" not in json.dumps(data)
    assert host.asked == [":1.2", ":1.1", ":1.3", ":1.5", ":1.9"]
    assert "s3cret" in host.answers.status_json()  # the controller's own: `gpuslice check`


def test_without_a_secret_no_caller_is_asked_about_without_hidepid() -> None:
    host = Host(ProcHiding(), Scan(problems=[PLAIN]))
    answer = host.answers.status_for(":1.5")
    assert isinstance(answer, str)
    assert json.loads(answer)["problems"] == [str(PLAIN)]
    assert host.asked == []
    assert host.samples_read == 1


def test_procs_mount_is_said_when_it_changes(caplog: pytest.LogCaptureFixture) -> None:
    host = Host(ProcHiding())
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        host.answers.read_proc_mount()
        host.hiding = HIDEPID
        host.answers.read_proc_mount()
        host.answers.read_proc_mount()
        host.hiding = ProcHiding()
        host.answers.read_proc_mount()
    assert [r.getMessage() for r in caplog.records] == [
        "/proc hides other users' processes (hidepid=2,gid=27): Status shows them only to "
        "callers that are root, or of group 27",
        "/proc no longer hides other users' processes: Status shows them all",
    ]


@pytest.mark.parametrize(
    ("hiding", "remedy"),
    [
        (
            HIDEPID,
            "give it the mount's group: `systemctl edit gpuslice`, [Service] "
            "SupplementaryGroups=27, then restart it",
        ),
        (
            ProcHiding(True, None, "hidepid=ptraceable,gid=27"),
            "mount /proc with hidepid=invisible,gid=GROUP and give it that group "
            "(SupplementaryGroups=)",
        ),
    ],
)
def test_a_proc_mount_that_hides_processes_from_the_controller_too_is_an_error(
    caplog: pytest.LogCaptureFixture, hiding: ProcHiding, remedy: str
) -> None:
    """hidepid= hides from root too what it may not ptrace, and the controller has no
    CAP_SYS_PTRACE: with gid= (or ptraceable) it saw no GPU process of another user nor of a
    root job (taken for gone: not counted, not attributed) and never said so. Said at start,
    and again only once it was seen fixed (`sees_every_process`: PID 1 shown)."""
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        host = Host(hiding, sees_all=False)
        host.answers.read_proc_mount()
        host.sees_all = True
        host.answers.read_proc_mount()
        host.sees_all = False
        host.answers.read_proc_mount()
        Host(hiding, sees_all=True)
        Host(ProcHiding(), sees_all=False)  # nothing hidden: its PID 1 is not looked for
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0] == said[1]
    assert said[0] == (
        f"/proc hides other users' processes from the controller too ({hiding.said}): it "
        "cannot see the processes on the GPUs, whose unit or owner they are, nor their "
        f"memory; {remedy}"
    )


def test_pid_1_tells_whether_proc_shows_every_process(tmp_path: Path) -> None:
    """Its cgroup, readable: `hidepid=noaccess` shows the directory, not what is in it."""
    assert procmount.sees_every_process() is True  # this host's /proc
    (tmp_path / "1").mkdir()
    assert procmount.sees_every_process(tmp_path) is False
    (tmp_path / "1" / "cgroup").write_text("0::/init.scope\n")
    assert procmount.sees_every_process(tmp_path) is True


def test_the_status_line_says_the_holders_and_the_waiters() -> None:
    host = Host(ProcHiding())
    assert host.answers.status_line() == "1 GPU: idle; 1 waiting"
    host.scheduler.set_gpus([Gpu(0, "GPU-0", "Fake 80GB", 80 * GIB)])
    assert host.answers.status_line() == "1 GPU: w.service running; 0 waiting"
