"""Where /proc hides each user's processes from the others (`hidepid=`), Status shows a
caller its own, as /proc does (gpuslice/status.py: RedactedStatus), and asks the bus daemon
who a caller is once per unique bus name (gpuslice/callers.py).

Before: a user saw the PID and command of no process of theirs on a GPU (their own were
redacted like everyone else's), and each Status call asked the bus daemon again who called
(one of the controller's calls in flight, MAX_STATUS_ASKING of them, then refused), however
often that connection had asked before.

Unit tests, the controller on fakes (tests/test_status_privacy.py's bed), and one on a
private dbus-daemon (tests/test_dbus_adapter.py's)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from dbus_next import Message, MessageType

from gpuslice import callers as callers_module
from gpuslice import procmount, status
from gpuslice import service as service_module
from gpuslice.annotations import Scan
from gpuslice.callers import CALLERS_KEPT, KnownCallers
from gpuslice.core.decisions import LISTED_MAX
from gpuslice.core.model import Gpu
from gpuslice.inventory import GpuUse, Sample
from gpuslice.owners import Owner
from gpuslice.service import SchedulerService
from gpuslice.status import OWN_KEPT, RedactedStatus, render, snapshot_to_json
from gpuslice.systemd import Systemd
from tests.service_bus import ServiceBus
from tests.test_controller import run
from tests.test_dbus_adapter import bus_address as bus_address
from tests.test_dbus_adapter import bus_daemon as bus_daemon
from tests.test_dbus_adapter import call, connect
from tests.test_dbus_adapter import run as run_on_bus
from tests.test_status import snapshot
from tests.test_status_privacy import (
    Asked,
    Credentials,
    _answer,
    _foreign_bed,
    _foreign_host,
    _service,
    _turns,
    mountinfo,
    proc_line,
    status_call,
)

GIB = 1 << 30
MIB = 1 << 20


def _redacted(sample: Sample, gpus: int = 2) -> RedactedStatus:
    data = snapshot_to_json(
        snapshot(gpus={i: [] for i in range(gpus)}), Scan(), sample, redact=True
    )
    return RedactedStatus(data, sample)


def _hidden(memory: int | None, kind: str) -> dict[str, Any]:
    return {
        "pid": None,
        "command": None,
        "memory": memory,
        "owner": {"kind": kind, "id": None},
        "compute": True,
    }


# ---------------------------------------------------------------------------------------------
# the redacted answer, for each caller


def test_a_redacted_answer_shows_a_user_their_own_processes_and_only_theirs() -> None:
    """GPU 0: a Slurm job's process, UID 1000's and UID 1001's. UID 1000 sees its own whole
    and the others redacted; UID 1001 likewise; anyone else, or a caller of no known UID,
    the answer with none. All the rest (the waiter's reason, its parts counted by kind) is
    the same for each."""
    sample, scheduler = _foreign_host()
    data = snapshot_to_json(scheduler.snapshot(), Scan(), sample, redact=True)
    redacted = RedactedStatus(json.loads(json.dumps(data)), sample)
    assert redacted.owners == {1000, 1001}
    assert json.loads(redacted.text) == data
    mine = json.loads(redacted.text_for(1000))
    assert mine["gpus"][0]["foreign"] == [
        _hidden(10 * GIB, "slurm"),
        {
            "pid": 4242,
            "command": "secret-name",
            "memory": 2 * GIB,
            "owner": {"kind": "user", "id": "1000"},
            "compute": True,
        },
        _hidden(None, "user"),
    ]
    assert mine["redacted"] is True
    for text in ("881", "4343", "1001", "nvtop", "python3"):
        assert text not in redacted.text_for(1000), text
    theirs = json.loads(redacted.text_for(1001))["gpus"][0]["foreign"]
    assert [(p["pid"], p["command"], p["owner"]["id"]) for p in theirs] == [
        (None, None, None),
        (None, None, None),
        (4343, "nvtop", "1001"),
    ]
    for uid in (None, 0, 1002, 881):
        assert redacted.text_for(uid) is redacted.text, uid
    # everything but that entry is the answer anyone else gets
    mine["gpus"][0]["foreign"][1] = _hidden(2 * GIB, "user")
    assert mine == data
    table = render(json.loads(redacted.text_for(1000)))
    assert table.split("\n")[0] == status.REDACTED_SAID
    assert "foreign: PID 4242 secret-name" in table
    assert "(1 Slurm job, 2 users)" in table  # the waiter's reason: counted, as for anyone


@pytest.mark.parametrize(
    "owner",
    [
        None,
        Owner("other"),
        Owner("unit", "train.service"),  # even one run with User=1000: its UID is not known
        Owner("slurm", "1000"),
        Owner("machine", "1000"),
        Owner("kubernetes", "1000"),
        Owner("user", ""),
        Owner("user", "x1000"),
        Owner("user", "\u0661\u0660\u0660\u0660"),  # digits, not ASCII ones
    ],
)
def test_a_process_whose_uid_is_not_known_stays_redacted(owner: Owner | None) -> None:
    """Only a process in a user's slice (owner "user", its UID) is known to be someone's."""
    sample = Sample([Gpu(0, "GPU-0", "Fake 24GB", 24 * GIB)], [GpuUse(7, 0, GIB, None, "x", owner)])
    redacted = _redacted(sample, gpus=1)
    assert redacted.owners == frozenset()
    [entry] = json.loads(redacted.text_for(1000))["gpus"][0]["foreign"]
    assert (entry["pid"], entry["command"], entry["owner"]["id"]) == (None, None, None)


def test_only_the_processes_listed_make_a_callers_own_answer() -> None:
    """A GPU lists LISTED_MAX processes: a caller whose only process is left out (counted)
    gets the answer everyone gets, and nothing is kept for it."""
    uses = [GpuUse(100 + i, 0, GIB, None, "big", Owner("user", "5000")) for i in range(LISTED_MAX)]
    uses.append(GpuUse(999, 0, MIB, None, "small", Owner("user", "6000")))
    redacted = _redacted(Sample([Gpu(0, "GPU-0", "Fake 80GB", 80 * GIB)], uses), gpus=1)
    assert redacted.owners == {5000}
    assert redacted.text_for(6000) is redacted.text
    assert redacted._own == {}
    pids = [p["pid"] for p in json.loads(redacted.text_for(5000))["gpus"][0]["foreign"]]
    assert pids == list(range(100, 100 + LISTED_MAX))


def test_the_callers_own_answers_kept_are_bounded_the_last_asked_for_first() -> None:
    """Two GPUs of LISTED_MAX users' processes each: 16 UIDs with an answer of their own. At
    most OWN_KEPT are kept, those asked for last; one pushed out is made again, the same."""
    uses = [
        GpuUse(100 + i, i % 2, GIB, None, "w", Owner("user", str(2000 + i)))
        for i in range(2 * LISTED_MAX)
    ]
    sample = Sample([Gpu(i, f"GPU-{i}", "Fake 80GB", 80 * GIB) for i in (0, 1)], uses)
    redacted = _redacted(sample)
    uids = [2000 + i for i in range(2 * LISTED_MAX)]
    assert redacted.owners == set(uids)
    first = {uid: redacted.text_for(uid) for uid in uids}
    assert list(redacted._own) == uids[-OWN_KEPT:]
    redacted.text_for(uids[-OWN_KEPT])  # used again: last to go
    assert list(redacted._own) == [*uids[-OWN_KEPT + 1 :], uids[-OWN_KEPT]]
    for _ in range(3):
        assert redacted.text_for(uids[-1]) is redacted._own[uids[-1]]
    assert len(redacted._own) == OWN_KEPT
    again = redacted.text_for(uids[0])
    assert again == first[uids[0]] and len(redacted._own) == OWN_KEPT
    for uid, text in first.items():  # each shows its own process, on its GPU, only
        gpus = json.loads(text)["gpus"]
        shown = [(g["index"], p["pid"]) for g in gpus for p in g["foreign"] if p["pid"]]
        assert shown == [((uid - 2000) % 2, 100 + uid - 2000)], uid


# ---------------------------------------------------------------------------------------------
# the controller


def test_with_hidepid_a_user_sees_their_own_process_and_no_one_elses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PID 200 on GPU 1 runs in UID 1000's session: the caller of UID 1000 sees it whole,
    as `ps` would show it to them; the caller of UID 1002 does not."""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=invisible")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        mine = await _answer(ctl, ":1.1")
        assert mine["redacted"] is True
        assert mine["gpus"][1]["foreign"] == [
            {
                "pid": 200,
                "command": "secret",
                "memory": GIB,
                "owner": {"kind": "user", "id": "1000"},
                "compute": True,
            }
        ]
        assert "counters" in mine and "controller" in mine
        other = await _answer(ctl, ":1.5")
        assert other["redacted"] is True
        assert other["gpus"][1]["foreign"] == [_hidden(GIB, "user")]
        del mine["gpus"][1]["foreign"], other["gpus"][1]["foreign"]
        assert mine["gpus"] == other["gpus"]

    run(test)


def test_a_callers_own_answer_is_made_once_per_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Callers of one UID share its answer; a change makes the redacted answer anew, and
    what it kept for each UID goes with the old one."""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=2")
    bed.systemd.caller_credentials.of.update(  # type: ignore[attr-defined]
        {f":2.{n}": (1000, frozenset({1000})) for n in range(5)}
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.answers.changed()
        answers = [await _answer(ctl, f":2.{n}") for n in range(5)]
        built = ctl.answers._redacted.text()
        assert list(built._own) == [1000]
        assert all(a["gpus"][1]["foreign"][0]["pid"] == 200 for a in answers)
        await _answer(ctl, ":1.5")
        assert list(built._own) == [1000]
        ctl.answers.changed()
        assert (await _answer(ctl, ":2.0"))["gpus"][1]["foreign"][0]["pid"] == 200
        assert ctl.answers._redacted.text() is not built
        assert list(ctl.answers._redacted.text()._own) == [1000]

    run(test)


def test_a_caller_is_asked_about_once_per_unique_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the bus daemon named a caller, its next calls are answered at once, asking
    nothing: the same answer. A caller it did not name, or named without a UID, is asked
    about again at each call (fail closed), redacted each time."""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=2")
    credentials: Credentials = bed.systemd.caller_credentials  # type: ignore[attr-defined]

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        first = await _answer(ctl, ":1.1")
        for _ in range(3):
            answer = ctl.status_for(":1.1")
            assert isinstance(answer, str)  # answered now, no question in flight
            data = json.loads(answer)
            assert data["gpus"] == first["gpus"] and data["redacted"] is True
        assert credentials.asked == [":1.1"]
        for sender in (":1.9", ":1.4"):  # unnamed; named without a UID
            for _ in range(2):
                answer = ctl.status_for(sender)
                assert not isinstance(answer, str), sender
                data = json.loads(await answer)
                assert data["redacted"] is True
                assert data["gpus"][1]["foreign"] == [_hidden(GIB, "user")]
        assert credentials.asked == [":1.1", ":1.9", ":1.9", ":1.4", ":1.4"]
        assert len(ctl.answers.callers) == 1

    run(test)


def test_a_callers_credentials_are_kept_not_what_they_were_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member of gid=27 sees everything; /proc remounted with gid=5 (a reload), the same
    connection, asked about no more, is answered redacted."""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=2,gid=27")
    credentials: Credentials = bed.systemd.caller_credentials  # type: ignore[attr-defined]

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert "redacted" not in await _answer(ctl, ":1.3")
        procmount.MOUNTINFO.write_text(mountinfo(proc_line("rw,hidepid=2,gid=5")))
        ctl.reload_config()
        assert (await _answer(ctl, ":1.3"))["redacted"] is True
        assert credentials.asked == [":1.3"]

    run(test)


def test_a_user_connecting_again_and_again_keeps_a_bounded_number_of_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One user, a new connection for each call: CALLERS_KEPT names are kept, the last
    ones; the first, pushed out, is asked about again; one answer kept for the UID."""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=2")
    credentials: Credentials = bed.systemd.caller_credentials  # type: ignore[attr-defined]
    senders = [f":3.{n}" for n in range(CALLERS_KEPT + 40)]
    credentials.of.update({s: (1000, frozenset({1000})) for s in senders})

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        for sender in senders:
            assert (await _answer(ctl, sender))["gpus"][1]["foreign"][0]["pid"] == 200
        assert len(ctl.answers.callers) == CALLERS_KEPT
        assert isinstance(ctl.status_for(senders[-1]), str)
        assert len(credentials.asked) == len(senders)
        assert (await _answer(ctl, senders[0]))["gpus"][1]["foreign"][0]["pid"] == 200
        assert credentials.asked[-1] == senders[0]
        assert len(ctl.answers.callers) == CALLERS_KEPT
        assert list(ctl.answers._redacted.text()._own) == [1000]

    run(test)


def test_the_callers_kept_are_bounded_and_only_unique_names_that_said_a_uid() -> None:
    """10,000 connections: CALLERS_KEPT kept, the last used; a well-known name (never a
    sender the bus daemon stamps) and an answer without a UID are not kept."""
    known = KnownCallers()
    for n in range(10_000):
        known.put(f":1.{n}", (1000, frozenset({1000})))
    assert len(known) == CALLERS_KEPT
    assert known.get(":1.0") is None
    oldest = f":1.{10_000 - CALLERS_KEPT}"
    assert known.get(oldest) == (1000, frozenset({1000}))  # used: the last to go now
    known.put(":9.9", (1, frozenset()))
    assert known.get(oldest) is not None
    assert known.get(f":1.{10_000 - CALLERS_KEPT + 1}") is None
    known.put("org.example.Name", (0, frozenset()))
    known.put(":1.77777", (None, frozenset({27})))
    known.put("", (0, frozenset()))
    assert known.get("org.example.Name") is known.get(":1.77777") is known.get("") is None
    assert len(known) == CALLERS_KEPT


# ---------------------------------------------------------------------------------------------
# the service


def test_a_known_caller_is_answered_while_the_questions_in_wait_are_at_their_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MAX_STATUS_ASKING callers wait for the bus daemon's word (a user opening connection
    after connection): a caller already known is answered, asking nothing; a new one is
    refused, its question not begun."""
    monkeypatch.setattr(service_module, "MAX_STATUS_ASKING", 2)

    async def scenario() -> None:
        bus, asked = ServiceBus(), Asked()

        def for_caller(sender: str) -> str | Coroutine[Any, Any, str]:
            return '{"known": 1}' if sender == ":1.7" else asked(sender)

        service = _service(bus, for_caller)
        assert service._handle(status_call(2)) is True
        assert service._handle(status_call(3)) is True
        refused = service._handle(status_call(4))
        assert isinstance(refused, Message)
        assert refused.error_name == "org.freedesktop.DBus.Error.LimitsExceeded"
        assert service._handle(status_call(7)) is True
        assert [(m.reply_serial, m.body) for m in bus.sent] == [(7, ['{"known": 1}'])]
        await _turns()
        assert asked.asked == [":1.2", ":1.3"]
        asked.go.set()
        await _turns()
        assert sorted(m.reply_serial for m in bus.sent) == [2, 3, 7]

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------
# on a real bus daemon


def test_over_the_bus_each_connection_is_asked_about_once_by_the_name_the_bus_stamped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bus_address: str
) -> None:
    """The controller's Status on a private dbus-daemon. A connection calling three times
    is asked about once; a second connection once more. A third that sets the first one's
    name as its sender is asked about under its own (the bus daemon stamps it). A caller
    that leaves while it is being asked about: the answer goes nowhere, nothing is kept,
    and the next caller is answered."""
    monkeypatch.setattr(callers_module, "CALLERS_KEPT", 4)
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=2")

    async def scenario() -> None:
        ctl = bed.controller
        await ctl.start()
        systemd = Systemd(await connect(bus_address))
        asked: list[str] = []
        hold: dict[str, asyncio.Event] = {}

        async def credentials(sender: str) -> tuple[int | None, frozenset[int]]:
            asked.append(sender)
            if sender in hold:
                await hold[sender].wait()
            return await systemd.caller_credentials(sender)

        bed.systemd.caller_credentials = credentials  # type: ignore[attr-defined]
        service = SchedulerService(
            systemd.bus, lambda u, s: None, lambda: "{}", lambda: None, None, ctl.status_for
        )
        await service.claim_name()
        one, two, three = [await connect(bus_address) for _ in range(3)]
        for _ in range(3):
            reply = await call(one, "Status")
            assert reply.message_type is MessageType.METHOD_RETURN, reply.body
        await call(two, "Status")
        assert asked == [one.unique_name, two.unique_name]
        forged = Message(
            destination=service_module.BUS_NAME,
            path=service_module.OBJECT_PATH,
            interface=service_module.INTERFACE,
            member="Status",
            sender=one.unique_name,
        )
        reply = await three.call(forged)
        assert reply is not None and reply.message_type is MessageType.METHOD_RETURN
        assert asked[-1] == three.unique_name
        # a caller that leaves mid-question
        leaving = await connect(bus_address)
        gone = asyncio.get_running_loop().create_future()

        def left(msg: Message) -> None:
            said = msg.member == "NameOwnerChanged" and msg.body[0] == leaving.unique_name
            if said and not gone.done():
                gone.set_result(None)

        watcher = await connect(bus_address)
        watcher.add_message_handler(left)
        await watcher.call(
            Message(
                destination="org.freedesktop.DBus",
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
                member="AddMatch",
                signature="s",
                body=[f"type='signal',member='NameOwnerChanged',arg0='{leaving.unique_name}'"],
            )
        )
        hold[leaving.unique_name] = asyncio.Event()
        leaving.send(
            Message(
                destination=service_module.BUS_NAME,
                path=service_module.OBJECT_PATH,
                interface=service_module.INTERFACE,
                member="Status",
            )
        )
        while leaving.unique_name not in asked:
            await asyncio.sleep(0.01)
        leaving.disconnect()
        await asyncio.wait_for(gone, 15)  # the bus daemon's word (a loaded machine: not 5 s)
        hold[leaving.unique_name].set()
        while service._asking:
            await asyncio.sleep(0.01)
        assert ctl.answers.callers.get(leaving.unique_name) is None
        reply = await call(two, "Status")
        assert reply.message_type is MessageType.METHOD_RETURN
        assert asked.count(two.unique_name) == 1

    async def closing() -> None:
        try:
            await scenario()
        finally:  # the controller's timers go with the test (tests/test_controller.run)
            for handle in getattr(asyncio.get_running_loop(), "_scheduled", ()):
                handle.cancel()

    run_on_bus(closing)


def test_the_bus_daemon_never_gives_a_unique_name_twice(bus_address: str) -> None:
    """What the credentials kept rest on: connections that come and go each get a name
    never given before (a name kept can only be of the connection it was asked about)."""

    async def scenario() -> None:
        seen: set[str] = set()
        for _ in range(30):
            bus = await connect(bus_address)
            assert bus.unique_name not in seen
            seen.add(bus.unique_name)
            bus.disconnect()
            await bus.wait_for_disconnect()

    run_on_bus(scenario)
