"""The controller's start-up, its wiring and what it re-reads: rules no test held.

Mutation testing of gpuslice/controller.py showed these kept by nothing: how the daemon
builds the controller (the host's root, its own Inventory, the bus service routing every
method to the controller), the policy switches of config.yaml at start and at a reload, the
callbacks it hands the systemd adapter, the rebuild after a restart (each end, lost stop
and adoption it finds said once, and the stops and starts still under way left alone),
which units' signals are matched, the read of a start job queued, a stop job cancelled,
rescans and their problems, reloads and their words. Each is what an admin reads in
`journalctl -u gpuslice`, a call sent to systemd, or what the state file and status say.

And one fault found on the way (the last tests): a unit annotated while it ran was never
read, so never adopted, while one rule matched every unit's signals (beyond
MAX_UNIT_RULES units, or once the bus daemon refused a rule per unit): its GPU was granted
beside it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, cast

import pytest
from dbus_next import Message
from dbus_next.constants import MessageType, NameFlag, RequestNameReply

from gpuslice import checkpoint, envfiles
from gpuslice import controller as controller_module
from gpuslice import rereads as rereads_module
from gpuslice.annotations import Scan, scan
from gpuslice.checkpoint import Resumed
from gpuslice.config import Config
from gpuslice.controller import Controller
from gpuslice.core.scheduler import Phase, SavedState
from gpuslice.inventory import Inventory
from gpuslice.journal import Journal
from gpuslice.nvml import GpuProcess
from gpuslice.paths import env_file
from gpuslice.service import BUS_NAME, INTERFACE, OBJECT_PATH, STARTING
from gpuslice.state import StateStore, read_recorded_boot
from gpuslice.systemd import Systemd, SystemdError
from gpuslice.tracker import UnitState
from tests.test_controller import (
    BOOT,
    SESSION,
    START,
    Bed,
    FakeSystemd,
    StubNvml,
    at_gate,
    bed_config,
    bg_running_on_gpu_1,
    goes_down,
    held_listing,
    past_queued_delay,
    queued,
    read_pipe,
    run,
    settle,
    state,
    unannotate,
    until,
    write_unit,
)
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller_gates import skipped_by_its_condition

JOB1 = "/org/freedesktop/systemd1/job/1"
DOWN = {"ActiveState": "inactive", "SubState": "dead", "Job": (0, "/")}


def lines(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    """The controller's journal lines at `level` or above, as `journalctl -u gpuslice`."""
    return [r.getMessage() for r in caplog.records if r.name == "gpuslice" and r.levelno >= level]


def low_holds_gpu_0_patiently(tmp_path: Path, cgroup_of: dict[int, str]) -> Bed:
    """low.service (90) runs on the one GPU; urgent.service (10) asks from PID 4242; a stop
    is overdue after the default 90 s (no overdue line in a busy test run)."""
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n", "urgent.service": "Priority=10\n"},
        [state("low.service", "active", "running")],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
    )
    cgroup_of[4242] = "urgent.service"
    return bed


def rebuilt(bed: Bed, tmp_path: Path, **kwargs: Any) -> Controller:
    """The bed's controller, built again as the daemon would with `kwargs` (a journal)."""
    bed.controller = Controller(
        bed.config,
        tmp_path / "config.yaml",
        cast(Systemd, bed.systemd),
        root=str(tmp_path / "root"),
        inventory=bed.controller.watch.inventory,
        service=bed.controller.service,
        **kwargs,
    )
    return bed.controller


# ---- how the daemon builds it: the host's root, its own inventory, the bus service ----


class FakeBus:
    """dbus-next's MessageBus as SchedulerService uses it: one handler, messages sent."""

    def __init__(self) -> None:
        self.handlers: list[Any] = []
        self.sent: list[Message] = []
        self.names: list[str] = []

    def add_message_handler(self, handler: Any) -> None:
        self.handlers.append(handler)

    def send(self, msg: Message) -> asyncio.Future[None]:
        self.sent.append(msg)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def request_name(self, name: str, flags: NameFlag) -> RequestNameReply:
        self.names.append(name)
        return RequestNameReply.PRIMARY_OWNER

    def call(self, member: str, *body: str, serial: int = 1) -> Any:
        """A method call on the controller's object, from PID 4242's connection."""
        [handler] = self.handlers
        msg = Message(
            destination=BUS_NAME,
            path=OBJECT_PATH,
            interface=INTERFACE,
            member=member,
            signature="s" * len(body),
            body=list(body),
            sender=":1.9",
            serial=serial,
        )
        return handler(msg)

    def answer_to(self, serial: int) -> Message:
        [answer] = [m for m in self.sent if m.reply_serial == serial]
        return answer


def test_the_daemons_controller_reads_the_hosts_units_and_answers_every_method_on_the_bus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cgroup_of: dict[int, str]
) -> None:
    """`gpuslice controller` builds the controller with no root, inventory or service: it
    reads the unit files under / (at start and at each rescan), samples with an Inventory
    of the config it was given, and its bus service routes Acquire, Status, Plan and Reload
    to it. Every test bed passes its own, so none held what the daemon itself runs on."""
    write_unit(tmp_path, "a.service", "Priority=50\n")
    roots: list[str] = []

    def scanned(root: str) -> Scan:
        roots.append(root)
        return scan(str(tmp_path / "root"))

    configs: list[Config] = []

    def inventory(config: Config) -> Inventory:
        configs.append(config)
        nvml = StubNvml(available=False)
        return Inventory(config, nvml=nvml, proc=tmp_path / "proc", driver_root=tmp_path / "no")

    monkeypatch.setattr(controller_module, "scan", scanned)
    monkeypatch.setattr(controller_module, "Inventory", inventory)
    config = bed_config(tmp_path, gpus=2)
    systemd = FakeSystemd([])
    systemd.pids[":1.9"] = 4242
    cgroup_of[4242] = "a.service"
    bus = FakeBus()
    systemd.bus = bus  # type: ignore[attr-defined]
    before = time.time()
    ctl = Controller(config, tmp_path / "config.yaml", cast(Systemd, systemd))
    after = time.time()
    assert roots == [] and configs == [config]  # the unit files: read once subscribed

    async def test() -> None:
        # refused until start-up is done (the name is claimed first): an empty core would
        # say "idle" of GPUs that jobs hold
        early = bus.call("Status", serial=5)
        assert early.message_type is MessageType.ERROR
        assert early.error_name == STARTING
        assert early.body == ["gpuslice is starting: ask again in a moment"]
        await ctl.start()
        assert roots == ["/"]
        assert bus.call("Status", serial=6) is True
        started = json.loads(bus.answer_to(6).body[0])
        assert [g["index"] for g in started["gpus"]] == [0, 1]  # config.yaml's, by index
        assert before <= started["controller"]["start_time"] <= after
        assert bus.names == [BUS_NAME]
        assert ctl.status_line() == "2 GPUs: idle; 0 waiting"
        assert bus.call("Acquire", "a.service", serial=1) is True
        await settle()
        assert bus.answer_to(1).body == ["0"]
        assert bus.call("Status", serial=2) is True
        status = json.loads(bus.answer_to(2).body[0])
        assert status["gpus"][0]["holders"][0]["unit"] == "a.service"
        plan = bus.call("Plan", "a.service", serial=3)
        assert plan.message_type is MessageType.METHOD_RETURN
        assert json.loads(plan.body[0])["unit"] == "a.service"
        reload = bus.call("Reload", serial=4)
        assert reload.message_type is MessageType.METHOD_RETURN
        await until(lambda: len(roots) == 2 and ctl.rescans.task is None)
        assert roots == ["/", "/"]

    run(test)


def test_a_gates_call_while_starting_up_waits_for_the_saved_state(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """The controller claims its bus name before it loads the state (so that a second one,
    refused the name, has written nothing: test_controller_run), and gates call it by name
    from then on. b.service's gate asks while start-up waits for systemd's list of units:
    served then, on a core that did not yet know a.service holds GPU 0 (saved), it was
    granted GPU 0 beside it. It waits for start-up, then for a.service (equal priority
    preempts nothing). A Plan meanwhile is refused for now, not answered from that core."""
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n", "b.service": "Priority=50\n"},
        [state("a.service", "active", "running")],
        SavedState(holders={"a.service": ((0,), "running", 1, "")}, seq=1),
    )
    bus = FakeBus()
    bed.systemd.bus = bus  # type: ignore[attr-defined]
    bed.systemd.pids[":1.9"] = 4242
    cgroup_of[4242] = "b.service"
    ctl = Controller(
        bed.config,
        tmp_path / "config.yaml",
        cast(Systemd, bed.systemd),
        root=str(tmp_path / "root"),
        inventory=bed.controller.watch.inventory,
    )
    listing, listed = held_listing(bed)

    def answered(serial: int) -> list[Message]:
        return [m for m in bus.sent if m.reply_serial == serial]

    async def test() -> None:
        starting = asyncio.get_running_loop().create_task(ctl.start())
        await listing.wait()
        assert bus.names == [BUS_NAME]  # ours already
        assert bus.call("Acquire", "b.service", serial=1) is True
        plan = bus.call("Plan", "b.service", serial=2)
        assert (plan.error_name, plan.body) == (
            STARTING,
            ["gpuslice is starting: ask again in a moment"],
        )
        await settle()
        assert answered(1) == []
        listed.set()
        await starting
        await settle()
        assert answered(1) == []  # a.service holds GPU 0
        assert ctl.scheduler.grants() == {"a.service": {0}}
        assert ctl.scheduler.is_waiting("b.service")
        bed.systemd.units["a.service"] = state("a.service", "inactive", "dead")
        ctl.on_unit_changed("a.service", {"ActiveState": "inactive", "SubState": "dead"})
        await settle()
        assert [m.body for m in answered(1)] == [["0"]]

    run(test)


def test_decisions_go_to_the_journal_the_daemon_built_the_controller_with(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under systemd the daemon hands the controller a Journal: each decision is an entry
    that its unit's own journal shows too (`journalctl -u a.service`), not a plain line, and
    status counts the entries journald did not take."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    entries: list[dict[str, str]] = []

    class Recorder:
        failures = 3

        def send(self, fields: list[tuple[str, str]]) -> bool:
            entries.append(dict(fields))
            return True

    ctl = rebuilt(bed, tmp_path, journal=cast(Journal, Recorder()))

    async def test() -> None:
        await ctl.start()
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            ctl.on_unit_changed("a.service", at_gate())
            await settle()
        assert [(e["MESSAGE"], e["GPUSLICE_DECISION"]) for e in entries] == [
            ("starting a.service (priority 50) on GPU 0", "grant")
        ]
        assert not [m for m in lines(caplog) if "a.service" in m]
        counters = json.loads(ctl.status_json())["counters"]
        assert counters["journal_write_errors"] == 3

    run(test)


# ---- config.yaml's policy switches, at start and at a reload ----


class UsersProcessOnGpu1(StubNvml):
    """The two GPUs, with a user's process (PID 200, in a login session) on GPU 1 while
    `present`."""

    present = True

    def processes(self, index: int) -> list[GpuProcess]:
        return [GpuProcess(200, 1, 1 << 30, compute=True)] if index == 1 and self.present else []


def bg_beside_a_users_process(tmp_path: Path, foreign_processes: str) -> Bed:
    """bg.service (background) runs on GPU 1 as saved; a user's CUDA process runs there."""
    return bg_running_on_gpu_1(
        tmp_path, UsersProcessOnGpu1(), SESSION, foreign_processes=foreign_processes
    )


YIELDED = (
    "yielding GPU 1: stopping background bg.service (priority 90) while a process gpuslice "
    "does not manage uses it (PID 200; UID 1000)"
)


@pytest.mark.parametrize("policy", ["yield", "ignore"])
def test_foreign_processes_in_config_decides_whether_a_background_unit_yields_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    """README, foreign_processes: `yield` stops a background unit on a GPU that a process no
    managed unit owns uses; `ignore` only counts that process's memory. The controller
    starts with the policy its config.yaml says, not the core's default (yield)."""
    bed = bg_beside_a_users_process(tmp_path, policy)

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.controller.start()
            await settle()
        stopped = ("stop", "bg.service") in bed.systemd.calls
        assert stopped is (policy == "yield")
        assert (YIELDED in lines(caplog)) is (policy == "yield"), lines(caplog)

    run(test)


@pytest.mark.parametrize(("before", "after"), [("ignore", "yield"), ("yield", "ignore")])
def test_a_reload_applies_the_foreign_processes_policy_it_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, before: str, after: str
) -> None:
    """`systemctl reload gpuslice` after foreign_processes was changed, as a user's process
    starts on bg.service's GPU: the reload's sample decides on the new policy (the
    background unit yields to it, or no longer does), without a restart."""
    bed = bg_beside_a_users_process(tmp_path, before)
    cast(UsersProcessOnGpu1, bed.nvml).present = False
    (tmp_path / "config.yaml").write_text(f"gpus: 2\nforeign_processes: {after}\n")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert bed.systemd.calls == [("subscribe", "")]
        cast(UsersProcessOnGpu1, bed.nvml).present = True
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            ctl.reload_config()
            await until(lambda: ctl.rescans.task is None)
            await settle()
        stopped = ("stop", "bg.service") in bed.systemd.calls
        assert stopped is (after == "yield")
        assert (YIELDED in lines(caplog)) is (after == "yield"), lines(caplog)

    run(test)


def p_preempted_by_urgent(tmp_path: Path, requeue_at_gate: bool) -> Bed:
    """p.service (50) was preempted for urgent.service (10), which runs on the one GPU."""
    return Bed(
        tmp_path,
        {"p.service": "Priority=50\n", "urgent.service": "Priority=10\n"},
        [state("urgent.service", "active", "running")],
        SavedState(
            holders={"urgent.service": ((0,), "running", 2, "")}, preempted={"p.service": 1}, seq=2
        ),
        config=bed_config(tmp_path, requeue_at_gate=requeue_at_gate),
    )


QUEUED_AT_GATE = (
    "restarting preempted p.service (priority 50): it waits at its gate for more urgent units"
)


@pytest.mark.parametrize("requeue_at_gate", [True, False])
def test_requeue_at_gate_in_config_restarts_a_preempted_unit_to_wait_at_its_gate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, requeue_at_gate: bool
) -> None:
    """README, requeue_at_gate: true restarts a preempted unit whose GPUs are taken at once,
    to wait at its gate (systemctl list-jobs shows it); false (the default) restarts it once
    they are free. The controller starts with what config.yaml says."""
    bed = p_preempted_by_urgent(tmp_path, requeue_at_gate)

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.controller.start()
            await settle()
        assert (("start", "p.service") in bed.systemd.calls) is requeue_at_gate
        assert (QUEUED_AT_GATE in lines(caplog)) is requeue_at_gate, lines(caplog)

    run(test)


def test_a_reload_that_turns_requeue_at_gate_on_restarts_a_preempted_unit_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """requeue_at_gate: true written and the config reloaded: p.service, preempted and its
    GPU still taken, is restarted to wait at its gate by the reload's rescan."""
    bed = p_preempted_by_urgent(tmp_path, False)
    (tmp_path / "config.yaml").write_text("requeue_at_gate: true\n")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert bed.systemd.calls == [("subscribe", "")]
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            ctl.reload_config()
            await until(lambda: ctl.rescans.task is None)
            await settle()
        assert bed.systemd.calls == [("subscribe", ""), ("start", "p.service")]
        assert QUEUED_AT_GATE in lines(caplog)

    run(test)


def test_a_requeue_waiting_at_its_gate_whose_annotation_went_is_stopped_not_let_through(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """gpuslice restarted the preempted p.service to wait at its gate (requeue_at_gate), and
    its gate asks, when a daemon-reload takes p.service's annotation out. The start is
    gpuslice's own: it is stopped, as gpuslice starts no unannotated unit. Let through, its
    gate passed with no GPU of gpuslice's and p.service ran ungated, beside urgent.service."""
    bed = p_preempted_by_urgent(tmp_path, True)
    cgroup_of[4242] = "p.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert bed.systemd.calls[-1] == ("start", "p.service")
        bed.systemd.units["p.service"] = state("p.service", "activating", "start-pre", 3)
        await bed.acquire("p.service")
        assert ctl.scheduler.is_waiting("p.service")
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await unannotate(ctl, tmp_path, "p.service")
            await settle()
        assert bed.systemd.calls[-1] == ("stop", "p.service")
        assert bed.service.granted == []
        assert ctl.scheduler.phase("p.service") is Phase.STOPPING
        assert not [m for m in lines(caplog) if "passed the gate" in m], lines(caplog)

    run(test)


def test_a_requeue_whose_wait_failed_while_no_controller_ran_is_still_owed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """p.service, restarted to wait at its gate (requeue_at_gate), asked there; the
    controller went away and p.service's wait ended (its TimeoutStartSec=): failed. Its
    comeback is owed as before, once its GPU is free, not forgotten with its start."""
    bed = Bed(
        tmp_path,
        {"p.service": "Priority=50\n", "urgent.service": "Priority=10\n"},
        [state("urgent.service", "active", "running"), state("p.service", "failed", "failed")],
        SavedState(
            holders={"urgent.service": ((0,), "running", 2, "")},
            requeued=["p.service"],
            seq=2,
        ),
        config=bed_config(tmp_path, requeue_at_gate=True),
    )

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.controller.start()
            await settle()
        snap = bed.controller.scheduler.snapshot()
        assert [p[0] for p in snap.preempted] == ["p.service"]
        assert snap.failed == []
        assert ("start", "p.service") not in bed.systemd.calls  # not to its gate again

    run(test)


def test_a_requeue_whose_wait_fails_as_the_controller_starts_is_still_owed(
    tmp_path: Path,
) -> None:
    """As above, but the controller starts while p.service's wait is ending (its gate killed
    at its TimeoutStartSec=, not yet failed): neither down nor at its gate then, it fails
    once the controller is ready. Nobody's holder or waiter, its down was ignored: its
    comeback was lost, its start kept as ours for good."""
    bed = Bed(
        tmp_path,
        {"p.service": "Priority=50\n", "urgent.service": "Priority=10\n"},
        [
            state("urgent.service", "active", "running"),
            state("p.service", "deactivating", "stop-sigterm", 5, "start"),
        ],
        SavedState(
            holders={"urgent.service": ((0,), "running", 2, "")},
            requeued=["p.service"],
            seq=2,
        ),
        config=bed_config(tmp_path, requeue_at_gate=True),
    )

    async def test() -> None:
        await bed.controller.start()
        await settle()
        bed.systemd.units["p.service"] = state("p.service", "failed", "failed")
        failed = {"ActiveState": "failed", "SubState": "failed", "Job": (0, "/")}
        bed.controller.on_unit_changed("p.service", failed)
        await settle()
        core = bed.controller.scheduler
        assert [p[0] for p in core.snapshot().preempted] == ["p.service"]
        assert (core.requeued, core.started) == (set(), set())
        assert ("start", "p.service") not in bed.systemd.calls  # not to its gate again

    run(test)


# ---- the rebuild after a restart: what it finds is said once, what is under way stays ----


def test_start_up_says_each_end_and_lost_stop_it_finds_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While the controller was away a.service and b.service ended, c.service (frozen) was
    stopped and started again, d.service's stop for g.service was lost, e.service (suspended)
    was stopped by hand, and f.service started unknown to it. Start-up takes each in, and the
    journal says each once, in that order: none of the lines of one unit may be lost to the
    next unit's."""
    units = {f"{c}.service": "Priority=50\nMemory=1G\n" for c in "abcdfg"}
    units["e.service"] = "Priority=90\nMemory=1G\nPreempt=suspend stop\n"
    bed = Bed(
        tmp_path,
        units,
        [
            state("a.service", "inactive", "dead"),
            state("b.service", "inactive", "dead"),
            state("c.service", "activating", "start-pre", 5, "start"),
            state("d.service", "active", "running"),
            state("f.service", "active", "running"),
        ],
        SavedState(
            holders={
                "a.service": ((0,), "running", 1, ""),
                "b.service": ((0,), "running", 2, ""),
                "c.service": ((0,), "frozen", 3, ""),
                "d.service": ((0,), "stopping", 4, "g.service"),
            },
            suspended={"e.service": ((0,), 5)},
            frozen_for={"c.service": ["b.service"]},
            seq=6,
        ),
    )

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.controller.start()
        assert bed.systemd.calls == [("subscribe", "")]
        snap = bed.controller.scheduler.snapshot()
        assert snap.finished == ["a.service", "b.service"]
        assert snap.held == ["e.service"]
        assert bed.controller.scheduler.phase("d.service") is Phase.RUNNING
        assert bed.controller.scheduler.is_waiting("c.service")

    run(test)
    assert lines(caplog, logging.INFO)[1:] == [
        "a.service finished: released GPU 0",
        "b.service finished: released GPU 0",
        "c.service finished: released GPU 0",
        "d.service (priority 50) did not stop: its stop was lost while the controller was away;"
        " it keeps GPU 0",
        "e.service was stopped outside gpuslice: held until started again",
        "f.service (priority 50) is running without enough free GPUs to account for it; "
        "counting it on none",
        "c.service waiting: needs 1 GiB on one GPU; GPU 0 held by d.service, priority 50",
        "gpuslice ready: 1 GPU: d.service running; 1 waiting",
    ]


def test_start_up_leaves_stops_under_way_to_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """h.service and i.service were stopping for u.service, which waits at its gate: h.service
    is on its way down by itself (no job), i.service's stop job is queued. Neither stop was
    lost: both stay stopping (preempted once down), nothing is sent again, and u.service
    waits for both, the journal says."""
    bed = Bed(
        tmp_path,
        {"h.service": "Priority=90\n", "i.service": "Priority=90\n", "u.service": "Priority=10\n"},
        [
            state("h.service", "deactivating", "stop-sigterm"),
            state("i.service", "active", "running", 7, "stop"),
            state("u.service", "activating", "start-pre", 3, "start"),
        ],
        SavedState(
            holders={
                "h.service": ((0,), "stopping", 1, "u.service"),
                "i.service": ((1,), "stopping", 2, "u.service"),
            },
            seq=2,
        ),
        config=bed_config(tmp_path, gpus=2),
    )

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await ctl.start()
            await settle()
        assert bed.systemd.calls == [("subscribe", "")]
        assert ctl.scheduler.phase("h.service") is Phase.STOPPING
        assert ctl.scheduler.phase("i.service") is Phase.STOPPING

    run(test)
    assert lines(caplog, logging.INFO)[1:] == [
        "u.service waiting for h.service (priority 90) to stop on GPU 0, i.service "
        "(priority 90) to stop on GPU 1",
        "gpuslice ready: 2 GPUs: h.service, i.service stopping; 1 waiting",
    ]


def test_start_up_leaves_starts_of_ours_that_systemd_runs_to_their_gates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """gpuslice had started j.service and k.service (refills). systemd shows j.service
    failed and waiting to restart (its restart job queued), k.service's start job queued:
    both starts reached systemd, so neither is sent again (a second StartUnit would be a
    second run, or merge into someone's job). k.service keeps GPU 1 for its gate, which is
    granted when it asks, not before (nothing of it runs yet)."""
    bed = Bed(
        tmp_path,
        {
            "j.service": "Priority=80\nType=background\n",
            "k.service": "Priority=80\nType=background\n",
        },
        [
            state("j.service", "activating", "auto-restart", 8, "restart"),
            state("k.service", "inactive", "dead", 9, "start"),
        ],
        SavedState(
            holders={
                "j.service": ((0,), "starting", 1, ""),
                "k.service": ((1,), "starting", 2, ""),
            },
            seq=2,
            started=["j.service", "k.service"],
        ),
        config=bed_config(tmp_path, gpus=2),
    )

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await ctl.start()
            await settle()
        # read: what their queued jobs wait for (no GPU unit's start: k keeps its place)
        reads = [("jobs_waited_for", "8"), ("jobs_waited_for", "9")]
        assert bed.systemd.calls == [("subscribe", ""), *reads]
        assert ctl.scheduler.phase("k.service") is Phase.STARTING
        assert ctl.scheduler.grants()["k.service"] == frozenset({1})
        assert not env_file(bed.config.runtime_dir, "k.service").exists()

    run(test)
    assert lines(caplog, logging.INFO)[1:] == [
        "j.service failed: gpuslice will not start it by itself (its own Restart= policy applies)",
        "starting j.service (priority 80) on GPU 0",
        "gpuslice ready: 2 GPUs: j.service running; k.service starting; 0 waiting",
    ]


def test_a_running_unit_booked_from_its_env_file_is_said_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The state file lost: a.service, running, is booked on GPU 1 that its env file names,
    and the journal says where that came from (an admin comparing the books with nvidia-smi
    needs to know they are a guess from the file, not a saved grant)."""
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n"},
        [state("a.service", "active", "running")],
        config=bed_config(tmp_path, gpus=2),
    )
    path = env_file(bed.config.runtime_dir, "a.service")
    path.parent.mkdir(parents=True)
    path.write_text("CUDA_VISIBLE_DEVICES=1\nGPUSLICE_GPUS=1\n")

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.controller.start()
        assert bed.controller.scheduler.grants() == {"a.service": frozenset({1})}

    run(test)
    assert "a.service runs without a saved grant: GPUs [1] from its env file" in lines(caplog)


def test_what_start_up_decided_is_saved_before_it_is_ready(tmp_path: Path) -> None:
    """gone.service ended while the controller was away: start-up records it finished and
    saves that at once. The save was left to a scheduling pass that nothing was due to run:
    a controller killed then, or stopped, left the state file naming gone.service a holder
    of GPU 0 (a restart adopted the GPU of a unit long gone)."""
    bed = Bed(
        tmp_path,
        {"gone.service": "Priority=50\n"},
        [state("gone.service", "inactive", "dead")],
        SavedState(holders={"gone.service": ((0,), "running", 1, "")}, seq=1),
    )
    store = StateStore(Path(bed.config.state_dir))

    async def test() -> None:
        await bed.controller.start()
        saved, boot = store.load()
        assert (saved.holders, saved.finished, boot) == ({}, ["gone.service"], BOOT)

    run(test)


def test_a_controller_that_decided_nothing_writes_no_state(tmp_path: Path) -> None:
    """Nothing to take in at start-up, no event since: stopping (`save_now`) or a pass
    writes nothing; a save costs a rename and an fsync on the state directory's disk."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    state_file = Path(bed.config.state_dir) / "state.json"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("a.service", DOWN)  # a signal that changes nothing: one pass
        await settle()
        ctl.save_now()
        assert not state_file.exists()

    run(test)


def test_start_up_records_the_boot_it_saves_the_state_with(tmp_path: Path) -> None:
    """This boot as the controller tells it (Systemd.boot_id) is recorded where `gpuslice
    release-jobs` reads it (paths.BOOT_RECORD), the boot its state is saved with: in a
    container release-jobs reads another kernel boot id than this sandbox, and asked
    itself, no state was ever this boot's."""
    bed = Bed(
        tmp_path,
        {"gone.service": "Priority=50\n"},
        [state("gone.service", "inactive", "dead")],
        SavedState(holders={"gone.service": ((0,), "running", 1, "")}, seq=1),
    )
    record = tmp_path / "run" / "gpuslice" / "runtime-dir.boot"
    record.parent.mkdir(parents=True)  # RuntimeDirectory=
    bed.controller.boot_record = record

    async def test() -> None:
        await bed.controller.start()
        _, boot = StateStore(Path(bed.config.state_dir)).load()
        assert read_recorded_boot(record) == boot == BOOT

    run(test)


def test_a_boot_that_cannot_be_recorded_is_said_and_start_up_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    record = tmp_path / "runtime-dir.boot"
    record.mkdir()  # what no file replaces
    bed.controller.boot_record = record

    async def test() -> None:
        await bed.controller.start()
        assert bed.controller.ready

    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        run(test)
    [said] = lines(caplog, logging.ERROR)
    assert said.startswith(f"cannot record this boot in {record} (")
    assert said.endswith(
        "): in a container, `gpuslice release-jobs` (apt remove) takes this boot's state for "
        "an earlier boot's and leaves its frozen and suspended units as they are"
    )


def test_status_in_systemctl_follows_each_change_after_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`systemctl status gpuslice` shows STATUS=: READY=1 carries the first, and each change
    since is sent STATUS_DELAY later (a grant here). The first change's was never sent,
    nor any after it: the line stayed "idle" while jobs ran."""
    monkeypatch.setattr(controller_module, "STATUS_DELAY", 0.01)
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    said: list[str] = []

    class Told:
        def ready(self, status: str) -> None:
            said.append(f"READY=1 {status}")

        def status(self, status: str) -> None:
            said.append(status)

    async def test() -> None:
        ctl = bed.controller
        ctl.notifier = cast(Any, Told())
        await ctl.start()
        ctl.on_unit_changed("a.service", at_gate())
        await until(lambda: len(said) == 2)
        assert said == [
            "READY=1 1 GPU: idle; 0 waiting",
            "1 GPU: a.service running; 0 waiting",
        ]

    run(test)


# ---- what systemd says reaches the controller; which units' signals are matched ----


def test_systemds_signals_reach_the_controller_through_the_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up hands the systemd adapter the controller's handlers for each signal: a
    unit's change, JobNew, JobRemoved, Reloading and systemd's re-execution. Left with the
    adapter's own (which drop them), the controller heard nothing after start-up."""
    monkeypatch.setattr(rereads_module, "REFRESH_DELAY", 0.01)
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n", "b.service": "Priority=50\n"},
        [state("a.service", "active", "running")],
        config=bed_config(tmp_path, gpus=2),
    )
    pipe = Path(bed.config.runtime_dir) / "gate" / "b.service"

    async def test() -> None:
        ctl = bed.controller
        adapter = bed.systemd
        await ctl.start()
        await settle()
        adapter.on_job_new(1, JOB1, "b.service")
        assert pipe.exists()  # made for its gate
        adapter.on_unit_changed("b.service", at_gate())
        await settle()
        assert bed.controller.scheduler.grants()["b.service"] == frozenset({1})
        adapter.units["b.service"] = state("b.service", "active", "running")
        adapter.on_unit_changed("b.service", {"ActiveState": "active", "SubState": "running"})
        adapter.on_job_removed(1, JOB1, "b.service", "done")
        await until(lambda: adapter.reads == ["b.service"])  # nothing said since: read
        adapter.on_systemd_restarted()
        await until(lambda: sorted(adapter.reads) == ["a.service", "b.service", "b.service"])
        write_unit(tmp_path, "c.service", "Priority=50\n")
        adapter.on_reloading(True)
        adapter.on_reloading(False)
        await until(lambda: ctl.spec_for("c.service") is not None)

    run(test)


def test_annotation_problems_are_said_at_start_up_and_at_each_rescan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo in an annotation (Priority=high) is an error naming the file, line and key,
    in the journal at start-up and again at each rescan (daemon-reload), where an admin who
    just edited it looks."""
    write_unit(tmp_path, "b.service", "Priority=high\n")
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    problem = (
        "/etc/systemd/system/b.service:5: [X-GPUSlice] Priority: expected an integer 0-999, "
        'got "high"'
    )

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await ctl.start()
            assert lines(caplog, logging.ERROR) == [problem]
            caplog.clear()
            ctl.rescans.request()
            await until(lambda: ctl.rescans.task is None)
            assert lines(caplog, logging.ERROR) == [problem]

    run(test)


def test_a_preempted_instance_systemd_no_longer_lists_is_heard_and_comes_back(
    tmp_path: Path,
) -> None:
    """p@1.service (an instance of an annotated template) was preempted for urgent.service;
    systemd garbage-collected it meanwhile, so only the state file names it. Start-up knows
    it by that name: its signals are matched (a start by hand must be heard), and it is
    started again once urgent.service's GPU is free."""
    bed = Bed(
        tmp_path,
        {"p@.service": "Priority=60\n", "urgent.service": "Priority=10\n"},
        [state("urgent.service", "active", "running")],
        SavedState(
            holders={"urgent.service": ((0,), "running", 2, "")},
            preempted={"p@1.service": 1},
            seq=2,
        ),
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await until(lambda: bed.systemd.watched == {"urgent.service", "p@1.service"})
        goes_down(bed, "urgent.service")
        await settle()
        assert bed.systemd.calls[-1] == ("start", "p@1.service")

    run(test)


def preempted_beside_urgent(tmp_path: Path) -> Bed:
    """urgent.service (10) runs on the one GPU; p.service (60) was preempted for it."""
    return Bed(
        tmp_path,
        {"p.service": "Priority=60\n", "urgent.service": "Priority=10\n"},
        [state("urgent.service", "active", "running")],
        SavedState(
            holders={"urgent.service": ((0,), "running", 2, "")}, preempted={"p.service": 1}, seq=2
        ),
    )


async def rebooting_once_urgent_is_down(bed: Bed) -> None:
    """The controller starts, the host's reboot is queued (job 7), and the shutdown stops
    urgent.service: its GPU is free while the host goes down."""
    await bed.controller.start()
    bed.controller.on_job_new(7, "/org/freedesktop/systemd1/job/7", "reboot.target")
    goes_down(bed, "urgent.service")
    await settle()


def test_a_reboot_target_cancel_alone_leaves_the_host_going_down(tmp_path: Path) -> None:
    """The bus lost shutdown.target's JobNew; `systemctl cancel` of reboot.target's job
    leaves shutdown.target's, and the host still reboots. Taken for a cancelled shutdown,
    p.service's comeback was started and refused by systemd. SystemState, read at that
    JobRemoved, says `stopping`: nothing started; shutdown.target's cancel brings it back."""
    bed = preempted_beside_urgent(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        await rebooting_once_urgent_is_down(bed)
        bed.systemd.system = "stopping"
        ctl.on_job_removed(7, "/org/freedesktop/systemd1/job/7", "reboot.target", "canceled")
        await settle()
        assert ("start", "p.service") not in bed.systemd.calls
        assert ctl.tracker.shutting_down
        bed.systemd.system = "running"
        ctl.on_job_removed(8, "/org/freedesktop/systemd1/job/8", "shutdown.target", "canceled")
        await settle()
        assert bed.systemd.calls[-1] == ("start", "p.service")

    run(test)


def test_a_preempted_unit_is_not_started_while_the_host_goes_down(tmp_path: Path) -> None:
    """p.service was preempted for urgent.service; the host reboots, and urgent.service is
    stopped for it (gpuslice.service stops after the units it gates). Started then, its
    start was refused (the transaction is destructive), it was taken for failed, and
    after the reboot never started again. It stays preempted, saved so; a shutdown
    cancelled brings it back."""
    bed = preempted_beside_urgent(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        await rebooting_once_urgent_is_down(bed)
        assert ("start", "p.service") not in bed.systemd.calls
        ctl.save_now()
        saved, _ = StateStore(Path(bed.config.state_dir)).load()
        assert saved.preempted == {"p.service": 1}
        ctl.on_job_removed(7, "/org/freedesktop/systemd1/job/7", "reboot.target", "canceled")
        await settle()
        assert bed.systemd.calls[-1] == ("start", "p.service")

    run(test)


def test_a_shutdown_cancelled_unheard_is_found_by_the_audit(tmp_path: Path) -> None:
    """The JobRemoved of the cancelled reboot is lost on the bus: the periodic audit asks
    systemd's SystemState, and once it is no longer `stopping` p.service comes back. Without
    it no preempted unit came back, and no background unit started, until a restart."""
    bed = preempted_beside_urgent(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        await rebooting_once_urgent_is_down(bed)
        bed.systemd.system = "stopping"
        await ctl.reads.audit()
        await settle()
        assert ("start", "p.service") not in bed.systemd.calls  # still going down
        bed.systemd.system = "running"  # cancelled; its JobRemoved never came
        await ctl.reads.audit()
        await settle()
        assert bed.systemd.calls[-1] == ("start", "p.service")
        assert ctl.counters.errors["dbus_signals_lost"] == 1

    run(test)


def test_a_running_unit_whose_annotation_went_is_still_heard_until_it_ends(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """low.service's annotation went while it runs on GPU 0, which it keeps until it ends:
    its signals stay matched, or its end was never heard and GPU 0 stayed held for good."""
    bed = low_holds_gpu_0_patiently(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await unannotate(ctl, tmp_path, "low.service")
        await until(lambda: bed.systemd.watched == {"urgent.service", "low.service"})
        assert ctl.scheduler.grants() == {"low.service": frozenset({0})}

    run(test)


def test_an_instance_on_its_way_down_at_start_up_is_heard_until_it_is_down(
    tmp_path: Path,
) -> None:
    """t@2.service is stopping (deactivating) when the controller starts: the core knows
    it as systemd lists it, and hears its end before forgetting it. Forgotten at once, as
    one already down is, its signals were unmatched and its end unheard."""
    bed = Bed(
        tmp_path,
        {"t@.service": "Priority=50\n"},
        [
            state("t@1.service", "inactive", "dead"),
            state("t@2.service", "deactivating", "stop-sigterm", 4, "stop"),
        ],
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.scheduler.annotated() == {"t@2.service"}
        await until(lambda: bed.systemd.watched == {"t@2.service"})
        bed.controller.on_unit_changed("t@2.service", DOWN)
        await settle()
        assert ctl.scheduler.annotated() == set()

    run(test)


def test_a_template_systemd_lists_is_no_unit_of_the_core(tmp_path: Path) -> None:
    """Anyone may have systemd load a template (`systemctl show t@.service`), and it is
    listed then: t@.service annotates its instances, it is no unit to schedule, save or
    match signals of."""
    bed = Bed(
        tmp_path,
        {"t@.service": "Priority=50\n", "a.service": "Priority=50\n"},
        [state("t@.service", "inactive", "dead"), state("a.service", "inactive", "dead")],
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.scheduler.annotated() == {"a.service"}
        await until(lambda: bed.systemd.watched == {"a.service"})
        ctl.rescans.request()
        await until(lambda: ctl.rescans.task is None)
        assert ctl.scheduler.annotated() == {"a.service"}

    run(test)


def test_a_plain_unit_whose_annotation_went_is_no_longer_heard_after_its_start(
    tmp_path: Path,
) -> None:
    """a.service's start job was seen (JobNew), then its annotation went: its signals are
    no longer matched. Only an instance of a template is matched for its start's sake; a
    plain unit kept so was listened to (every signal of it read) for good."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n", "b.service": "Priority=50\n"}, [])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await until(lambda: bed.systemd.watched == {"a.service", "b.service"})
        ctl.on_job_new(1, JOB1, "a.service")
        await unannotate(ctl, tmp_path, "a.service")
        await until(lambda: bed.systemd.watched == {"b.service"})

    run(test)


def test_an_instance_started_again_while_still_matched_costs_no_re_match(
    tmp_path: Path,
) -> None:
    """t@1 ran, ended and was forgotten; its rule is still matched when its next start's
    JobNew comes: no AddMatch/RemoveMatch round (the bus daemon's work grows with every
    rule) is needed to hear it."""
    bed = Bed(tmp_path, {"t@.service": "Priority=50\n"}, [])
    watch = bed.systemd.watch
    asked: list[set[str] | None] = []

    async def counted(units: Collection[str] | None) -> list[str]:
        asked.append(None if units is None else set(units))
        return await watch(units)

    bed.systemd.watch = counted  # type: ignore[method-assign]

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await until(lambda: bed.systemd.watched == set())
        ctl.on_job_new(1, JOB1, "t@1.service")
        await until(lambda: bed.systemd.watched == {"t@1.service"})
        ctl.on_unit_changed("t@1.service", at_gate(bytes(16)))
        ctl.on_unit_changed("t@1.service", {"ActiveState": "active", "SubState": "running"})
        ctl.on_unit_changed("t@1.service", DOWN)
        await settle()
        assert ctl.scheduler.annotated() == set()
        assert asked == [set(), {"t@1.service"}]
        ctl.on_job_new(2, "/org/freedesktop/systemd1/job/2", "t@1.service")
        await settle()
        assert asked == [set(), {"t@1.service"}]

    run(test)


def test_a_job_of_a_unit_that_holds_its_gpus_costs_no_read(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """`systemctl stop low.service` (or a restart) while it runs: its JobNew is no start
    the core does not know, and is not read to see whether it is one (a read per job of
    every running unit, for nothing)."""
    bed = low_holds_gpu_0_patiently(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_job_new(5, JOB1, "low.service")
        await past_queued_delay()
        assert bed.systemd.reads == []

    run(test)


def test_a_queued_start_whose_annotation_went_before_its_read_answered_is_not_announced(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """urgent.service's start job waits in systemd's queue; the read of its type is answered
    after a daemon-reload took its annotation out: nothing is announced (its start goes on
    ungated) and low.service is not stopped for it. Announced, the core was asked about a
    unit with no annotation, and the controller's task failed."""
    bed = low_holds_gpu_0_patiently(tmp_path, cgroup_of)
    read = bed.systemd.unit_state
    answer = asyncio.Event()

    async def slow(name: str) -> UnitState:
        await answer.wait()
        return await read(name)

    bed.systemd.unit_state = slow  # type: ignore[method-assign]

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            queued(bed, "urgent.service", "start")
            await past_queued_delay()
            await unannotate(ctl, tmp_path, "urgent.service")
            answer.set()
            await settle()
        assert bed.systemd.calls == [("subscribe", "")]
        assert not ctl.scheduler.is_waiting("urgent.service")
        assert lines(caplog, logging.ERROR) == []

    run(test)


def test_a_stop_job_systemd_cancelled_is_said_with_its_result(
    tmp_path: Path, cgroup_of: dict[int, str], caplog: pytest.LogCaptureFixture
) -> None:
    """low.service is stopped for urgent.service, and someone's job cancels our stop job
    (`systemctl start low.service --job-mode=replace`): low.service still runs, the journal
    says how our stop ended, in systemd's word, and it is asked to stop again."""
    bed = low_holds_gpu_0_patiently(tmp_path, cgroup_of)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("urgent.service")
        assert bed.systemd.calls[-1] == ("stop", "low.service")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            ctl.on_job_removed(1, JOB1, "low.service", "canceled")
            ctl.on_unit_changed(
                "low.service", {"ActiveState": "active", "SubState": "running", "Job": (0, "/")}
            )
            await settle()
        assert bed.systemd.calls.count(("stop", "low.service")) == 2
        assert lines(caplog, logging.WARNING) == [
            "low.service (priority 90) did not stop for urgent.service (priority 10): its stop "
            "job ended with result 'canceled'; it keeps GPU 0"
        ]

    run(test)


def test_a_rescan_that_fails_is_said_in_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug (or an exception nobody foresaw) in reading the unit files off the loop must
    show in `journalctl -u gpuslice` with its traceback, not vanish with the rescan's task;
    the next daemon-reload scans again."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    real = scan

    def broken(root: str) -> Scan:
        raise RuntimeError("the scan broke")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        monkeypatch.setattr(controller_module, "scan", broken)
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            ctl.rescans.request()
            await until(lambda: ctl.rescans.task is None)
            await settle()
        [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert (record.name, record.getMessage()) == ("gpuslice", "internal error")
        assert record.exc_info is not None and str(record.exc_info[1]) == "the scan broke"
        monkeypatch.setattr(controller_module, "scan", real)
        write_unit(tmp_path, "b.service", "Priority=50\n")
        ctl.on_reloading(False)
        await until(lambda: ctl.spec_for("b.service") is not None)

    run(test)


class Unmatchable(FakeSystemd):
    """A bus daemon that refuses our AddMatch calls (its limit on match rules reached);
    `also_every_unit`: its limit on every unit's rule too."""

    also_every_unit = False

    async def watch(self, units: Collection[str] | None) -> list[str]:
        if units is not None or self.also_every_unit:
            raise SystemdError("org.freedesktop.DBus.Error.LimitsExceeded", "too many rules")
        return await super().watch(units)


@pytest.mark.parametrize("also_every_unit", [False, True])
def test_signals_that_cannot_be_matched_unit_by_unit_are_read_for_every_unit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, also_every_unit: bool
) -> None:
    """The bus daemon refuses a match rule per unit: the controller says so and matches
    every unit's signals instead (costlier, never deaf). If that fails too, the rules in
    force stay and the next change of the set tries again: a failure here is said once,
    never a crash of the task that matches."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    systemd = Unmatchable([])
    systemd.also_every_unit = also_every_unit
    systemd.watched = {"a.service"}
    bed.systemd = systemd
    ctl = rebuilt(bed, tmp_path)

    async def test() -> None:
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await ctl.start()
            await settle()
        assert lines(caplog, logging.WARNING)[1:] == [
            "cannot match each unit's signals (too many rules): reading every unit's"
        ]
        assert systemd.watched == ({"a.service"} if also_every_unit else None)

    run(test)


# ---- reloads: their words, and the paths kept ----


def test_a_reload_says_each_warning_and_keeps_the_paths_it_started_with_in_so_many_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """config.yaml edited (a misspelt key, new state_dir and runtime_dir), then `systemctl
    reload gpuslice`: each warning is a line naming file, line and key, and the paths stay
    those the controller started with (runtime_dir: until the next boot, as the gates'
    drop-ins keep naming it; state_dir: until it restarts), which the journal says with both
    values."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(
        "gpus: 1\nstate_dir: /var/lib/gpuslice/b\nruntime_dir: /run/gpuslice/b\nbogus: 1\n"
    )
    old_state, old_runtime = bed.config.state_dir, bed.config.runtime_dir

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            ctl.reload_config()
            await until(lambda: ctl.rescans.task is None)
        assert (ctl.config.state_dir, ctl.config.runtime_dir) == (old_state, old_runtime)
        [bogus, runtime, state_dir] = lines(caplog, logging.WARNING)
        assert bogus.startswith(f"{config_path}:4: bogus: unknown setting, ignored (known: ")
        assert runtime == (
            f"{config_path}:3: runtime_dir: /run/gpuslice/b takes effect at the next boot: "
            f"the gates' drop-ins name {old_runtime}, where gpuslice writes until then"
        )
        assert state_dir == (
            f"{config_path}:2: state_dir: /var/lib/gpuslice/b takes effect when "
            f"gpuslice.service restarts (until then {old_state})"
        )

    run(test)


def test_a_reload_of_a_broken_config_keeps_the_last_good_one_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo in config.yaml, then a reload: the controller goes on with what it had, and
    the journal says so with the file's own error (file, line, key)."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    config_path = tmp_path / "config.yaml"
    config_path.write_text("gpus: many\n")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            ctl.reload_config()
            await settle()
        [said] = lines(caplog, logging.ERROR)
        assert said.startswith(f"keeping the last good configuration: {config_path}:1: gpus: ")
        assert ctl.config is bed.config

    run(test)


# ---- the Preempt= ladder asks the controller's NVML ----


def test_a_suspend_without_nvml_is_refused_for_that_reason_and_the_unit_stopped(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Preempt=suspend stop, cuda-checkpoint installed and cgroup v2, but NVML does not
    answer: the suspend needs a fresh sample of the unit's GPU processes from the
    controller's own NVML to know what to move and that it went. Without it, the journal
    says that, not a failure of gpuslice's own, and the next rung (stop) follows."""
    monkeypatch.setattr(checkpoint, "require_tool", lambda *_, **__: "/bin/true")
    marker = tmp_path / "cgroup.controllers"
    marker.write_text("cpu memory\n")
    bed = low_holds_gpu_0_patiently(tmp_path, cgroup_of)
    write_unit(tmp_path, "low.service", "Priority=90\nPreempt=suspend stop\n")
    bed.controller.scan = scan(str(tmp_path / "root"))
    bed.controller.ladder.unified_marker = marker

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            await bed.acquire("urgent.service")
            await until(lambda: ("stop", "low.service") in bed.systemd.calls)
        assert lines(caplog, logging.WARNING) == [
            "cannot suspend low.service (priority 90) for urgent.service (priority 10): NVML "
            "is not available: the memory could not be confirmed; trying stop instead"
        ]

    run(test)


# ---- a unit annotated while it runs, with every unit's signals matched ----


class Crowded(FakeSystemd):
    """As Systemd.watch beyond MAX_UNIT_RULES (here 2 units): more units than that are
    matched by one rule for every unit."""

    async def watch(self, units: Collection[str] | None) -> list[str]:
        new = None if units is None or len(units) > 2 else set(units)
        old, self.watched = self.watched, new
        if new == old or old is None:
            return []
        return sorted((set(units or ()) if new is None else new) - old)


class Limited(FakeSystemd):
    """A bus daemon that takes at most 4 match rules of ours (max_match_rules_per_connection):
    one more is refused."""

    async def watch(self, units: Collection[str] | None) -> list[str]:
        if units is not None and len(units) > 4:
            raise SystemdError("org.freedesktop.DBus.Error.LimitsExceeded", "too many rules")
        return await super().watch(units)


@pytest.mark.parametrize("systemd", [FakeSystemd, Crowded, Limited])
def test_a_unit_annotated_while_it_runs_is_adopted_when_every_units_signals_are_matched(
    tmp_path: Path, cgroup_of: dict[int, str], systemd: type[FakeSystemd]
) -> None:
    """b.service runs on the one GPU when a daemon-reload annotates it. Its signals were
    dropped while it was not annotated, so its state is read once it matters: adopted, it
    holds GPU 0 and urgent.service waits for it. With every unit's signals matched (more
    than MAX_UNIT_RULES units matter, or the bus daemon refused a rule per unit), the unit
    was matched already and never read: GPU 0 looked free and was granted beside it."""
    units = {n: "Priority=50\n" for n in ("a.service", "c.service", "d.service")}
    bed = Bed(tmp_path, {**units, "urgent.service": "Priority=10\n"}, [])
    bed.systemd = systemd([state("b.service", "active", "running")])
    ctl = rebuilt(bed, tmp_path)
    cgroup_of[4242] = "urgent.service"

    async def test() -> None:
        await ctl.start()
        await settle()
        write_unit(tmp_path, "b.service", "Priority=90\n")
        ctl.rescans.request()
        await until(lambda: ctl.scheduler.grants() == {"b.service": frozenset({0})})
        assert bed.systemd.reads == ["b.service"]  # once
        await bed.acquire("urgent.service")
        assert bed.service.granted == []
        assert bed.systemd.calls[-1] == ("stop", "b.service")

    run(test)


def test_a_unit_newly_annotated_whose_signal_came_first_is_not_read(tmp_path: Path) -> None:
    """b.service is annotated by a rescan while every unit's signals are matched, and a
    signal of it (at its gate) comes before its read would be sent: that signal told its
    state, and a read answered later could only repeat it, or be older."""
    bed = Bed(tmp_path, {n: "Priority=50\n" for n in ("a.service", "c.service", "d.service")}, [])
    bed.systemd = Crowded([])
    ctl = rebuilt(bed, tmp_path)

    async def test() -> None:
        await ctl.start()
        await settle()
        write_unit(tmp_path, "b.service", "Priority=90\n")
        ctl._apply_scan(scan(str(tmp_path / "root")))
        ctl.on_unit_changed("b.service", at_gate())
        await settle()
        assert bed.systemd.reads == []
        assert ctl.scheduler.grants() == {"b.service": frozenset({0})}

    run(test)


def test_only_units_whose_signals_were_dropped_are_read_when_annotated(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """With every unit's signals matched, a rescan reads the units it newly annotates, and
    no others: not low.service, whose annotation comes back while it still holds GPU 0
    (followed all along), nor t@.service, a template (no unit: read, it was taken for one)."""
    bed = low_holds_gpu_0_patiently(tmp_path, cgroup_of)
    write_unit(tmp_path, "x.service", "Priority=50\n")  # three units: every unit's rule
    bed.systemd = Crowded([state("low.service", "active", "running")])
    ctl = rebuilt(bed, tmp_path)

    async def test() -> None:
        await ctl.start()
        await settle()
        await unannotate(ctl, tmp_path, "low.service")
        assert ctl.scheduler.grants() == {"low.service": frozenset({0})}
        write_unit(tmp_path, "low.service", "Priority=90\n")
        write_unit(tmp_path, "t@.service", "Priority=50\n")
        ctl.rescans.request()
        await until(lambda: ctl.spec_for("low.service") is not None and ctl.rescans.task is None)
        await settle()
        assert bed.systemd.watched is None and bed.systemd.reads == []
        assert ctl.scheduler.annotated() == {"low.service", "urgent.service", "x.service"}

    run(test)


def test_a_unit_annotated_again_while_its_old_rule_still_matches_it_is_read(
    tmp_path: Path,
) -> None:
    """b.service's annotation went and came back before the re-match that would drop its
    rule: still matched, it is named by no re-match as newly matched, and its signals in
    between were dropped (not annotated then). Read by the scan that annotates it, it is
    adopted on the GPU it runs on; unread, that GPU looked free."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [state("b.service", "active", "running")])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert bed.systemd.watched == {"a.service"}
        bed.systemd.watched.add("b.service")  # its rule, not yet taken back
        write_unit(tmp_path, "b.service", "Priority=90\n")
        ctl._apply_scan(scan(str(tmp_path / "root")))
        await until(lambda: ctl.scheduler.grants() == {"b.service": frozenset({0})})
        assert bed.systemd.reads == ["b.service"]

    run(test)


def test_a_unit_heard_before_its_annotation_went_is_read_when_it_comes_back(
    tmp_path: Path,
) -> None:
    """b.service was annotated and heard (inactive), lost its annotation, started meanwhile
    (its signals dropped), and is annotated again while every unit's signals are matched.
    What was heard of it before is older than its start: it is read, and adopted."""
    units = {n: "Priority=50\n" for n in ("a.service", "c.service", "d.service")}
    bed = Bed(tmp_path, {**units, "b.service": "Priority=90\n"}, [])
    bed.systemd = Crowded([state("b.service", "inactive", "dead")])
    ctl = rebuilt(bed, tmp_path)

    async def test() -> None:
        await ctl.start()
        await settle()
        ctl.on_unit_changed("b.service", {"ActiveState": "inactive", "SubState": "dead"})
        assert ctl.tracker.heard("b.service") > 0
        await unannotate(ctl, tmp_path, "b.service")
        bed.systemd.units["b.service"] = state("b.service", "active", "running")
        ctl.on_unit_changed("b.service", {"ActiveState": "active", "SubState": "running"})
        write_unit(tmp_path, "b.service", "Priority=90\n")
        ctl._apply_scan(scan(str(tmp_path / "root")))
        await until(lambda: ctl.scheduler.grants() == {"b.service": frozenset({0})})
        assert bed.systemd.reads == ["b.service"]

    run(test)


def _told(bed: Bed, unit: str, index: int, uuid: str) -> None:
    """The unit's env file, as a grant of GPU `index` named `uuid` wrote it."""
    env = env_file(bed.config.runtime_dir, unit)
    env.parent.mkdir(parents=True, exist_ok=True)
    env.write_text(
        f"CUDA_VISIBLE_DEVICES={uuid}\nCUDA_DEVICE_ORDER=PCI_BUS_ID\n"
        f"NVIDIA_VISIBLE_DEVICES={uuid}\nGPUSLICE_GPUS={index}\n"
    )


@pytest.mark.parametrize("running", [False, True])
def test_a_restart_checks_the_gpus_of_holders_past_their_gate_only(
    tmp_path: Path, running: bool
) -> None:
    """a.service was granted GPU 0 and waits at its gate: its env file is an earlier run's
    (GPU-A, since gone), not this grant's, and names no GPU it runs on: no GPU is taken for
    renumbered for it. b.service runs, told GPU 1 when that was GPU-B, which NVML now
    numbers 0: both GPUs are lost while it holds 1, whatever a.service's file says."""
    nvml = StubNvml()
    nvml.uuids = ("GPU-B", "GPU-C")
    holders: dict[str, tuple[tuple[int, ...], str, int, str]] = {
        "a.service": ((0,), "starting", 1, "")
    }
    states = [state("a.service", "activating", "start-pre", 3, "start")]
    if running:
        holders["b.service"] = ((1,), "running", 2, "")
        states.append(state("b.service", "active", "running"))
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n", "b.service": "Priority=50\n"},
        states,
        SavedState(holders=holders, seq=2),
        config=bed_config(tmp_path, gpus=2),
        nvml=nvml,
    )
    _told(bed, "a.service", 0, "GPU-A")
    _told(bed, "b.service", 1, "GPU-B")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        lost = [g.index for g in ctl.watch.sample.gpus if g.lost]
        assert lost == ([0, 1] if running else [])

    run(test)


def test_a_restart_tells_the_core_the_gpus_its_holders_run_on(tmp_path: Path) -> None:
    """b.service runs on GPU 1, told GPU-B, which NVML numbers 0 now. The state file names
    GPU 1 only: the core learns GPU-B from its env file, so that a suspend of it takes
    GPU-B along and it comes back there, whatever NVML numbers it then (`Holder.uuids`;
    unknown, it came back by index once the renumbered indices were released)."""
    nvml = StubNvml()
    nvml.uuids = ("GPU-B", "GPU-C")
    bed = Bed(
        tmp_path,
        {"b.service": "Priority=50\nPreempt=suspend stop\n"},
        [state("b.service", "active", "running")],
        SavedState(holders={"b.service": ((1,), "running", 1, "")}, seq=1),
        config=bed_config(tmp_path, gpus=2),
        nvml=nvml,
    )
    _told(bed, "b.service", 1, "GPU-B")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.scheduler.holders["b.service"].uuids == {1: "GPU-B"}

    run(test)


def test_a_restart_resumes_a_suspended_unit_on_the_gpu_its_env_file_names_at_its_index_now(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """vlm.service was suspended from GPU 1 when that was GPU-B (its env file says so; the
    state file names GPU 1 only). GPU-A went and the controller restarted: NVML numbers
    GPU-B 0 now. By index, its room was kept on GPU 1 (GPU-C), batch.service was granted
    GPU 0 and vlm.service was resumed on GPU 1: its processes woke on GPU-B, beside
    batch.service. It comes back on GPU 0, its env file says so, and batch.service gets 1."""
    nvml = StubNvml()
    nvml.uuids = ("GPU-B", "GPU-C")
    bed = Bed(
        tmp_path,
        {
            "vlm.service": "Priority=90\nType=background\nPreempt=suspend stop\n",
            "batch.service": "Priority=95\n",
        },
        [
            state("vlm.service", "active", "running"),
            state("batch.service", "activating", "start-pre", 3, "start"),
        ],
        SavedState(suspended={"vlm.service": ((1,), 1)}, seq=1),
        config=bed_config(tmp_path, gpus=2),
        nvml=nvml,
    )
    _told(bed, "vlm.service", 1, "GPU-B")
    cgroup_of[4242] = "batch.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("batch.service", ":1.9", 4242)
        assert ctl.scheduler.grants() == {
            "vlm.service": frozenset({0}),
            "batch.service": frozenset({1}),
        }
        assert set(bed.service.granted) == {("batch.service", "1")}
        assert envfiles.told_uuids(bed.config.runtime_dir, "vlm.service") == {0: "GPU-B"}

    run(test)


def test_a_holder_adopted_at_a_restart_is_checked_against_its_env_file_before_a_grant(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """a.service was saved starting on GPU 1, granted when that was GPU-B, and the last
    controller was killed before it saved the grant: the restart finds it running and
    adopts it. Its env file was read only after the first grant of the restart, and its
    word lost to the booking the sample before had made by today's numbering (GPU 1 is
    GPU-C): b.service was granted GPU 0, GPU-B, beside it. Both wait for a.service's end."""
    nvml = StubNvml()
    nvml.uuids = ("GPU-B", "GPU-C")
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n", "b.service": "Priority=50\n"},
        [
            state("a.service", "active", "running"),
            state("b.service", "activating", "start-pre", 3, "start"),
        ],
        SavedState(holders={"a.service": ((1,), "starting", 1, "")}, seq=1),
        config=bed_config(tmp_path, gpus=2),
        nvml=nvml,
    )
    _told(bed, "a.service", 1, "GPU-B")
    cgroup_of[4242] = "b.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("b.service", ":1.9", 4242)
        assert bed.service.granted == []
        assert [(g.index, g.lost) for g in ctl.watch.sample.gpus] == [(0, True), (1, True)]
        goes_down(bed, "a.service")
        await until(lambda: bed.service.granted == [("b.service", "0")])

    run(test)


def test_a_frozen_unit_keeps_its_gpu_from_a_grant_after_nvml_numbered_the_gpus_anew(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """emb.service is frozen beside voice.service on GPU 1, GPU-B when both were granted (it
    keeps its VRAM there); the controller restarts and NVML numbers GPU-B 0. A frozen unit
    holds its GPU like a running one: both GPUs are lost while either holds GPU 1, through
    its thaw, and b.service gets GPU 0 only once both have ended."""
    nvml = StubNvml()
    nvml.uuids = ("GPU-B", "GPU-C")
    bed = Bed(
        tmp_path,
        {
            "emb.service": "Priority=90\nMemory=4G\nPreempt=freeze stop\n",
            "voice.service": "Priority=10\nMemory=4G\n",
            "b.service": "Priority=50\n",
        },
        [
            state("emb.service", "active", "running"),
            state("voice.service", "active", "running"),
            state("b.service", "activating", "start-pre", 3, "start"),
        ],
        SavedState(
            holders={
                "emb.service": ((1,), "frozen", 1, ""),
                "voice.service": ((1,), "running", 2, ""),
            },
            frozen_for={"emb.service": ["voice.service"]},
            seq=2,
        ),
        config=bed_config(tmp_path, gpus=2),
        nvml=nvml,
    )
    bed.systemd.freezer = {"emb.service": "frozen"}
    _told(bed, "emb.service", 1, "GPU-B")
    _told(bed, "voice.service", 1, "GPU-B")
    cgroup_of[4242] = "b.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await bed.acquire("b.service", ":1.9", 4242)
        assert bed.service.granted == []
        assert [(g.index, g.lost) for g in ctl.watch.sample.gpus] == [(0, True), (1, True)]
        goes_down(bed, "voice.service")
        await until(lambda: ctl.scheduler.phase("emb.service") is Phase.RUNNING)
        ctl.watch.refresh()
        assert bed.service.granted == []
        goes_down(bed, "emb.service")
        await until(lambda: bed.service.granted == [("b.service", "0")])

    run(test)


def test_a_restart_rechecks_the_gpus_when_any_holders_env_file_changed_the_books(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """Two holders adopted at a restart (saved starting, found running: the last controller
    was killed before it saved their grants): a.service's env file names GPU-B at index 1 (NVML
    numbers GPU-C 1 now), c.service's names what the books say already. That the first
    changed the books is enough to sample again before a grant, whatever the second says:
    b.service is not granted GPU 0 (GPU-B) beside a.service."""
    nvml = StubNvml()
    nvml.uuids = ("GPU-B", "GPU-C", "GPU-D")
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=50\n", "b.service": "Priority=50\n", "c.service": "Priority=50\n"},
        [
            state("a.service", "active", "running"),
            state("c.service", "active", "running"),
            state("b.service", "activating", "start-pre", 3, "start"),
        ],
        SavedState(
            holders={
                "a.service": ((1,), "starting", 1, ""),
                "c.service": ((2,), "starting", 2, ""),
            },
            seq=2,
        ),
        config=bed_config(tmp_path, gpus=3),
        nvml=nvml,
    )
    _told(bed, "a.service", 1, "GPU-B")
    _told(bed, "c.service", 2, "GPU-D")
    cgroup_of[4242] = "b.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert list(ctl.scheduler.grants()) == ["a.service", "c.service"]
        await bed.acquire("b.service", ":1.9", 4242)
        assert bed.service.granted == []
        assert [(g.index, g.lost) for g in ctl.watch.sample.gpus] == [
            (0, True),
            (1, True),
            (2, False),
        ]

    run(test)


def _moved_on_restart(tmp_path: Path, cgroup_of: dict[int, str], told: bool) -> Bed:
    """vlm.service suspended from GPU 1 (GPU-B, as its env file says when `told`); NVML
    numbers GPU-B 0 since the restart."""
    nvml = StubNvml()
    nvml.uuids = ("GPU-B", "GPU-C")
    bed = Bed(
        tmp_path,
        {"vlm.service": "Priority=90\nType=background\nPreempt=suspend stop\n"},
        [state("vlm.service", "active", "running")],
        SavedState(suspended={"vlm.service": ((1,), 1)}, seq=1),
        config=bed_config(tmp_path, gpus=2),
        nvml=nvml,
    )
    if told:
        _told(bed, "vlm.service", 1, "GPU-B")
    return bed


def test_an_env_file_that_cannot_be_written_anew_after_a_moved_resume_is_said(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The resume goes on (its processes keep the UUIDs they run on); the journal names the
    file, why, the unit and the indices the file still gives."""
    bed = _moved_on_restart(tmp_path, cgroup_of, told=True)

    def refused(runtime_dir: str, unit: str, devices: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(envfiles, "write", refused)

    async def test() -> None:
        with caplog.at_level(logging.WARNING, logger="gpuslice"):
            await bed.controller.start()
            await until(lambda: bed.controller.scheduler.grants() != {})
        assert bed.controller.scheduler.grants() == {"vlm.service": frozenset({0})}

    run(test)
    path = env_file(bed.config.runtime_dir, "vlm.service")
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (
        logging.WARNING,
        f"cannot write {path} ([Errno 30] Read-only file system): it still names the GPUs of "
        "vlm.service by the indices they had before NVML numbered them anew (GPU 1)",
    ) in said
    assert envfiles.told_uuids(bed.config.runtime_dir, "vlm.service") == {1: "GPU-B"}


def test_a_resumed_unit_without_an_env_file_gets_none_written(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """No env file (unreadable, or removed) says nothing of the GPUs it was suspended from:
    it is resumed by index, and no file is made up for it."""
    bed = _moved_on_restart(tmp_path, cgroup_of, told=False)

    async def test() -> None:
        await bed.controller.start()
        await until(lambda: bed.controller.scheduler.grants() != {})
        assert bed.controller.scheduler.grants() == {"vlm.service": frozenset({1})}

    run(test)
    assert not env_file(bed.config.runtime_dir, "vlm.service").exists()


def test_a_stop_announced_while_start_up_reads_the_unit_files_is_heard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone stops r.service (`systemctl stop`) while the controller, subscribed, reads
    the unit files: its JobNew came when no unit was annotated yet (the files are read once
    subscribed), and was not noted. r.service then left running by a job never announced:
    taken for ended by itself, finished, not held as a stop by hand is."""
    job = "/org/freedesktop/systemd1/job/7"
    bed = Bed(
        tmp_path,
        {"r.service": "Priority=50\n"},
        [state("r.service", "active", "running", 7, "stop")],
        SavedState(holders={"r.service": ((0,), "running", 1, "")}, seq=1),
    )

    async def test() -> None:
        ctl = bed.controller
        loop = asyncio.get_running_loop()
        announced = asyncio.Event()

        def reading(root: str) -> Scan:
            loop.call_soon_threadsafe(ctl.on_job_new, 7, job, "r.service")
            loop.call_soon_threadsafe(announced.set)
            time.sleep(0.05)
            return scan(root)

        monkeypatch.setattr(controller_module, "scan", reading)
        await ctl.start()
        assert announced.is_set()
        ctl.on_unit_changed(
            "r.service",
            {"ActiveState": "deactivating", "SubState": "stop-sigterm", "Job": (7, job)},
        )
        bed.systemd.units["r.service"] = state("r.service", "inactive", "dead")
        ctl.on_unit_changed("r.service", DOWN)
        ctl.on_job_removed(7, job, "r.service", "done")
        await settle()
        snap = ctl.scheduler.snapshot()
        assert (snap.held, snap.finished) == (["r.service"], [])

    run(test)


# what vlm.service's suspend checkpointed (SavedState.checkpointed): PIDs, bytes, Unix time
CHECKPOINTED: dict[str, tuple[tuple[int, ...], int, float]] = {
    "vlm.service": ((4242, 17), 1 << 30, 1.7e9)
}


def _suspended_beside_asr(tmp_path: Path, boot: str) -> Bed:
    """vlm.service suspended for asr.service, which holds the one GPU still; saved in `boot`
    with what vlm.service's suspend checkpointed."""
    bed = Bed(
        tmp_path,
        {
            "vlm.service": "Priority=90\nType=background\nPreempt=suspend stop\n",
            "asr.service": "Priority=10\n",
        },
        [state("vlm.service", "active", "running"), state("asr.service", "active", "running")],
    )
    saved = SavedState(
        holders={"asr.service": ((0,), "running", 2, "")},
        suspended={"vlm.service": ((0,), 1)},
        seq=2,
        checkpointed=CHECKPOINTED,
    )
    StateStore(Path(bed.config.state_dir)).save(saved, boot)
    return bed


def test_a_restart_of_the_boot_recalls_the_pids_a_suspend_checkpointed_and_saves_them_on(
    tmp_path: Path,
) -> None:
    """Lost at a restart, the resume asked cuda-checkpoint the state of every process of the
    unit, and failed (the unit stopped, its work lost) for one of more than
    MAX_RECOVERED_PIDS processes. The restarted controller resumes those its predecessor
    checkpointed, and its saves keep them for the next restart."""
    bed = _suspended_beside_asr(tmp_path, BOOT)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        recalled = ctl.ladder.suspensions["vlm.service"]
        assert recalled.saved() == CHECKPOINTED["vlm.service"] and recalled.recalled
        assert ctl.scheduler.suspended_units() == ["vlm.service"]
        ctl._persist()
        assert ctl.store.load()[0].checkpointed == CHECKPOINTED

    run(test)


def test_the_pids_a_suspend_of_another_boot_checkpointed_are_not_recalled(
    tmp_path: Path,
) -> None:
    """PIDs of another boot are other processes: its suspended unit counts as preempted,
    and nothing of it is kept."""
    bed = _suspended_beside_asr(tmp_path, "another-boot")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.ladder.suspensions == {}
        assert ctl.scheduler.suspended_units() == []
        ctl._persist()
        assert ctl.store.load()[0].checkpointed == {}

    run(test)


def test_a_resume_decided_at_a_restart_restores_the_recalled_pids(tmp_path: Path) -> None:
    """asr.service ended while no controller ran: the start resumes vlm.service at once, on
    the PIDs its suspend checkpointed, not on whatever the unit's processes are now."""
    bed = _suspended_beside_asr(tmp_path, BOOT)
    bed.systemd.units["asr.service"] = state("asr.service", "inactive", "dead")
    restored: list[tuple[str, object, bool]] = []

    async def restore(
        unit: str, pids: object = None, run: object = None, *, recalled: bool = False
    ) -> Resumed:
        restored.append((unit, pids, recalled))
        return Resumed(0.1, (4242, 17), ())

    async def test() -> None:
        ctl = bed.controller
        ctl.ladder.restore = restore  # type: ignore[method-assign]
        await ctl.start()
        await until(lambda: ctl.scheduler.phase("vlm.service") is Phase.RUNNING)
        assert restored == [("vlm.service", (4242, 17), True)]
        assert ctl.ladder.suspensions == {}

    run(test)


def test_the_recalled_pids_of_a_unit_stopped_while_no_controller_ran_are_dropped(
    tmp_path: Path,
) -> None:
    """Held, not suspended: nothing of its suspend is kept, in the ladder or the file."""
    bed = _suspended_beside_asr(tmp_path, BOOT)
    bed.systemd.units["vlm.service"] = state("vlm.service", "inactive", "dead")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.scheduler.suspended_units() == []
        assert ctl.ladder.suspensions == {}
        ctl._persist()
        assert ctl.store.load()[0].checkpointed == {}

    run(test)


def test_start_up_takes_a_start_in_its_exec_condition_for_none_yet(tmp_path: Path) -> None:
    """u.service (10) runs its `ExecCondition=` when the controller starts, low.service (90)
    on the GPU: the check may skip the start, so low.service is not stopped for it (its
    start-pre signal, or its gate's ask, makes it known)."""
    bed = Bed(
        tmp_path,
        {"low.service": "Priority=90\n", "u.service": "Priority=10\n"},
        [
            state("low.service", "active", "running"),
            state("u.service", "activating", "condition", 3, "start"),
        ],
        SavedState(holders={"low.service": ((0,), "running", 1, "")}, seq=1),
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert bed.systemd.calls == [("subscribe", "")]
        assert ctl.scheduler.phase("low.service") is Phase.RUNNING
        assert not ctl.scheduler.is_waiting("u.service")

    run(test)


@pytest.mark.parametrize("saved", [None, "starting"])
def test_a_start_queued_behind_a_gpu_units_start_at_start_up_keeps_nothing_from_it(
    tmp_path: Path, saved: str | None
) -> None:
    """a.service (10) Requires= and After= b.service (50), one GPU: gpuslice restarted while
    a's start waits in systemd's queue (job 5) for b's (job 6), whose gate waits. Queued at
    once, a was granted GPU 0 and b's gate waited for it while a's start waited for b's:
    neither ever ran. The jobs a's start waits for are read: known at its gate, a keeps
    nothing, and b is granted when its gate asks. So too where a's start is one of ours
    (a comeback, `saved` starting on GPU 0): no place is kept for it."""
    holders: dict[str, tuple[tuple[int, ...], str, int, str]] = {}
    if saved:
        holders["a.service"] = ((0,), saved, 1, "")
    bed = Bed(
        tmp_path,
        {"a.service": "Priority=10\n", "b.service": "Priority=50\n"},
        [
            state("a.service", "inactive", "dead", 5, "start"),
            state("b.service", "activating", "start-pre", 6, "start"),
        ],
        SavedState(holders=holders, seq=1, started=["a.service"] if saved else []),
    )
    bed.systemd.waited_for[5] = [(6, "b.service", "start")]

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert ("jobs_waited_for", "5") in bed.systemd.calls
        assert ctl.scheduler.grants().get("a.service", frozenset()) == frozenset()
        assert not ctl.scheduler.is_waiting("a.service")
        await bed.acquire("b.service")
        assert bed.service.granted == [("b.service", "0")]

    run(test)


@pytest.mark.parametrize("c_job", ["start", "stop"])
def test_a_start_kept_since_start_up_is_walked_again_when_a_gate_waits_on_its_gpus(
    tmp_path: Path, c_job: str
) -> None:
    """c.service (40) Requires= and After= b.service (50), one GPU: gpuslice restarted
    while c's start of ours (job 5, GPU 0) waits in systemd's queue for plain.service's
    start only: found free, GPU 0 stays kept for it (Restore.queued_free). Then b starts,
    and c's job waits for b's too: b's gate, waiting on GPU 0, has c's job (systemd's word:
    no walk of this controller knew it) walked again, and c keeps nothing; b is granted.
    Where c's signal shows a job of another kind now (its JobNew unheard: no walk of this
    controller knew it), no start bound for its gate, nothing is walked."""
    bed = Bed(
        tmp_path,
        {"c.service": "Priority=40\nType=background\n", "b.service": "Priority=50\n"},
        [
            state("c.service", "inactive", "dead", 5, "start"),
            state("b.service", "inactive", "dead"),
        ],
        SavedState(holders={"c.service": ((0,), "starting", 1, "")}, seq=1, started=["c.service"]),
    )
    bed.systemd.waited_for[5] = [(7, "plain.service", "start")]

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert bed.systemd.calls.count(("jobs_waited_for", "5")) == 1
        assert ctl.scheduler.grants()["c.service"] == frozenset({0})  # walked free: kept
        read = [c for c in bed.systemd.calls if c[0] == "jobs_waited_for"]
        if c_job == "stop":
            bed.systemd.units["c.service"] = state("c.service", "inactive", "dead", 9, "stop")
            down = {"ActiveState": "inactive", "SubState": "dead"}
            ctl.on_unit_changed(
                "c.service", {**down, "Job": (9, "/org/freedesktop/systemd1/job/9")}
            )
            await settle()
        bed.systemd.waited_for[5] = [(7, "plain.service", "start"), (6, "b.service", "start")]
        bed.systemd.units["b.service"] = state("b.service", "activating", "start-pre", 6)
        ctl.on_job_new(6, "/org/freedesktop/systemd1/job/6", "b.service")
        ctl.on_unit_changed("b.service", at_gate())
        await settle()
        walks = bed.systemd.calls.count(("jobs_waited_for", "5"))
        if c_job == "stop":
            assert [c for c in bed.systemd.calls if c[0] == "jobs_waited_for"] == read
            assert ctl.scheduler.grants()["c.service"] == frozenset({0})
            return
        assert walks == 2
        assert ctl.scheduler.phase("c.service") is Phase.STARTING  # its start goes on
        assert ctl.scheduler.grants()["c.service"] == frozenset()
        assert read_pipe(bed, "b.service") == START.hex() + "\n"

    run(test)


def test_a_refill_skipped_while_no_controller_ran_is_sent_again_and_said_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """gpuslice had started bg.service (a refill, GPU 0 kept) and was killed between the
    failed check systemd sent of its start and the job's end: start-up finds it down with
    no job, and sends its start again once (a StartUnit that may not have reached systemd).
    Skipped again, the first check this controller sees counts as new: said skipped, with
    the failed units, not held and not started again."""
    bed = Bed(
        tmp_path,
        {"bg.service": "Priority=90\nType=background\n"},
        [state("bg.service", "inactive", "dead")],
        SavedState(
            holders={"bg.service": ((0,), "starting", 1, "")},
            seq=1,
            started=["bg.service"],
            refills=["bg.service"],
        ),
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await settle()
        assert bed.systemd.calls.count(("start", "bg.service")) == 1
        assert ctl.scheduler.phase("bg.service") is Phase.STARTING
        skipped_by_its_condition(ctl, "bg.service", 7, 5_000_000)
        await settle()
        assert ctl.scheduler.save().failed == ["bg.service"]
        assert "bg.service" not in ctl.scheduler.held
        assert bed.systemd.calls.count(("start", "bg.service")) == 1

    run(test)
    assert any(m.startswith("bg.service skipped: ") for m in lines(caplog))
