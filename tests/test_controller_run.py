"""The daemon's main (controller.run), its logging, and the words it says, held in-process.

Mutation testing of gpuslice/controller.py found no unit test of `run()` at all (only the
containers of tests/integration start it) and none of these rules: a SIGHUP before start-up
is done is a reload once it is, never the end of the process; a bad config exits 78 saying
why; READY=1, then WATCHDOG=1 at half WatchdogSec, then on SIGTERM or SIGINT STOPPING=1 and
exit 0; a lost system bus is said and exits 1 so that Restart= brings the controller back;
a bus name held by `gpuslice release-jobs` is waited for (EXTEND_TIMEOUT_USEC=, STATUS=), no
longer than RELEASE_WAIT, and a stop meanwhile ends it at once;
the log is in journald's `<N>` form under systemd and plain otherwise, at `log_level`,
whatever logging was set up before; each decision's journal entry carries its sentence, its
level and, for a grant, how long the unit waited; an annotation problem is logged at its
severity; the status line's words and its cut at STATUS_NAMES_MAX; the status and plan
answers' keys and their order; a task's failure is said, a cancelled task's is not.

`run()` meets fakes where it would meet the host: Systemd.connect gives a FakeSystemd whose
bus is lost when a test says, the gate service is a FakeService, NVML a stub, the unit files
and the state and runtime directories are under tmp_path (the config file's own values must
be below /var/lib/gpuslice and /run/gpuslice), journald is a recorder, and NOTIFY_SOCKET is
a datagram socket the test reads. Signals are sent to this process from inside the test's
event loop, once run() has installed its handlers (its wait on the bus has begun), and the
handlers the test found are put back after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from signal import SIGHUP, SIGINT, SIGTERM
from typing import Any, cast

import pytest
from dbus_next import Message
from dbus_next.constants import NameFlag, RequestNameReply

from gpuslice import __version__, stopjournal
from gpuslice import clock as clock_module
from gpuslice import controller as controller_module
from gpuslice import reloads as reloads_module
from gpuslice import service as service_module
from gpuslice.annotations import scan
from gpuslice.config import ConfigError, load_config_with_warnings
from gpuslice.controller import Controller, JournalFormatter
from gpuslice.core.scheduler import SavedState
from gpuslice.gpuwatch import NVML_DEADLINE
from gpuslice.inventory import Inventory
from gpuslice.journal import Journal
from gpuslice.ladder import Suspension
from gpuslice.paths import env_file, gate_pipe_dir
from gpuslice.service import RELEASING, NotManaged, SchedulerService
from gpuslice.state import StateStore, read_recorded_boot
from gpuslice.systemd import Systemd
from gpuslice.tracker import UnitState
from tests.test_controller import (
    BOOT,
    HOUR,
    UNIT_DIR,
    Bed,
    FakeService,
    FakeSystemd,
    StubNvml,
    at_gate,
    bed_config,
    run,
    settle,
    state,
    until,
    vlm_suspended_for_voice,
    write_unit,
)

# How long a test waits for run() to end after its signal (a hang is a failure, not a wait;
# a pass never waits this long, a loaded machine may take more than 5 s)
ENDS_WITHIN = 30.0
RUNNING = {"ActiveState": "active", "SubState": "running"}
FAILED = {"ActiveState": "failed", "SubState": "failed"}


# ---- the host run() meets -------------------------------------------------------------------


class LosableBus:
    """The system bus connection run() waits on: lost when the test says."""

    def __init__(self) -> None:
        self.waited_on = False
        self._lost = asyncio.Event()

    async def wait_for_disconnect(self) -> None:
        self.waited_on = True
        await self._lost.wait()

    def lose(self) -> None:
        self._lost.set()


class BusSystemd(FakeSystemd):
    """FakeSystemd with the `bus` run() waits on and the gate service exports on."""

    def __init__(self, units: list[UnitState]) -> None:
        super().__init__(units)
        self.bus = LosableBus()


class KeptJournal:
    """journald's socket in-process (Journal's interface): every entry is kept."""

    def __init__(self) -> None:
        self.entries: list[dict[str, str]] = []
        self.closed = False
        self.failures = 0

    def send(self, fields: list[tuple[str, str]]) -> bool:
        self.entries.append(dict(fields))
        return True

    def close(self) -> None:
        self.closed = True


class Host:
    """What run() finds in place of the host: see the module's docstring."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp_path = tmp_path
        self.monkeypatch = monkeypatch
        self.config_path = tmp_path / "config.yaml"
        self.config_path.write_text("gpus: 1\n")
        (tmp_path / "root" / UNIT_DIR).mkdir(parents=True, exist_ok=True)
        self.systemd = BusSystemd([])
        self.service = FakeService()
        self.connected: list[str | None] = []  # the addresses run() connected to
        self.service_buses: list[object] = []
        self.controllers: list[Controller] = []
        self.journals: list[KeptJournal] = []
        self.while_connecting: Callable[[], Awaitable[None]] = settle
        self.said: list[str] = []  # the datagrams systemd was sent, in order
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        name = f"gpuslice-test-{uuid.uuid4().hex}"
        self._notify.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
        monkeypatch.delenv("GPUSLICE_DRIVER_ROOT", raising=False)
        real_load = load_config_with_warnings

        def load(path: Any) -> tuple[Any, list[str]]:
            config, warnings = real_load(path)
            kept = bed_config(tmp_path)
            return dataclasses.replace(
                config, state_dir=kept.state_dir, runtime_dir=kept.runtime_dir
            ), warnings

        async def connect(address: str | None = None) -> Systemd:
            self.connected.append(address)
            await self.while_connecting()
            return cast(Systemd, self.systemd)

        def service(bus: object, on_acquire: Any, *handlers: object) -> FakeService:
            self.service_buses.append(bus)
            self.controllers.append(on_acquire.__self__)
            return self.service

        def journal() -> KeptJournal:
            self.journals.append(KeptJournal())
            return self.journals[-1]

        monkeypatch.setattr(controller_module, "load_config_with_warnings", load)
        monkeypatch.setattr(reloads_module, "load_config_with_warnings", load)
        # written just now: read at once (config.SETTLE_SECONDS); no /run/gpuslice here
        monkeypatch.setattr(reloads_module, "CONFIG_SETTLE", 0)
        monkeypatch.setattr(controller_module, "RUNTIME_RECORD", tmp_path / "none" / "runtime-dir")
        monkeypatch.setattr(controller_module, "STATE_RECORD", tmp_path / "none" / "state-dir")
        monkeypatch.setattr(controller_module, "THIS_BOOT_RECORD", tmp_path / "none" / "boot")
        monkeypatch.delenv("GPUSLICE_RUNTIME_DIR", raising=False)
        monkeypatch.setattr(Systemd, "connect", connect)
        monkeypatch.setattr(controller_module, "SchedulerService", service)
        monkeypatch.setattr(controller_module, "Journal", journal)
        monkeypatch.setattr(controller_module, "scan", lambda root: scan(str(tmp_path / "root")))
        monkeypatch.setattr(
            controller_module,
            "Inventory",
            lambda config: Inventory(
                config,
                nvml=StubNvml(available=False),
                proc=tmp_path / "proc",
                driver_root=tmp_path / "no-nvidia",
            ),
        )

    @property
    def controller(self) -> Controller:
        [controller] = self.controllers
        return controller

    def start(self, bus_address: str | None = None) -> asyncio.Task[int]:
        return asyncio.get_running_loop().create_task(
            controller_module.run(self.config_path, bus_address)
        )

    async def waiting_on_its_bus(self, daemon: asyncio.Task[int]) -> None:
        """Until run() is started up and waits on its bus (every handler installed)."""
        await until(lambda: self.systemd.bus.waited_on or daemon.done())
        if daemon.done():
            raise AssertionError(f"run() ended before it waited on its bus: {daemon.result()}")

    def heard(self) -> list[str]:
        """Every datagram sent to NOTIFY_SOCKET so far."""
        while True:
            try:
                self.said.append(self._notify.recv(8192).decode())
            except BlockingIOError:
                return self.said

    def close(self) -> None:
        for controller in self.controllers:
            controller.notifier.close()
        self._notify.close()


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    """A Host; after the test, the signal handlers and the logging it found."""
    handlers = {sig: signal.getsignal(sig) for sig in (SIGHUP, SIGINT, SIGTERM)}
    made = Host(tmp_path, monkeypatch)
    with kept_logging():
        try:
            yield made
        finally:
            made.close()
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)


@contextlib.contextmanager
def kept_logging() -> Iterator[None]:
    """The root logger's handlers and level as they were: _journal_logging replaces them."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)


def stderr_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


# ---- run(): the daemon's life ---------------------------------------------------------------


@pytest.mark.parametrize("stop", [SIGTERM, SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_daemon_says_ready_feeds_the_watchdog_and_a_stop_signal_ends_it_cleanly(
    host: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stop: int
) -> None:
    """Under systemd (JOURNAL_STREAM set): the config's warnings are logged; a unit at its
    gate is granted, its decision written to its own journal; READY=1 comes with the status
    line; WATCHDOG=1 at half of WatchdogSec, again and again (WatchdogSec= kills a controller
    that stops feeding it); SIGTERM (systemctl stop) or SIGINT (^C by hand) ends it with
    STOPPING=1, the journal closed and exit 0. A stop that exited non-zero would have systemd
    mark gpuslice failed at each upgrade; one left waiting would be killed at
    TimeoutStopSec. Holders found down at start-up are asked of the journal
    (stopjournal.ask): without it, one stopped by hand while no controller ran and since
    unloaded by systemd was taken for finished."""
    monkeypatch.setenv("JOURNAL_STREAM", "8:4242")
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # fed every 10 ms
    host.config_path.write_text("gpus: 1\nfrobnicate: yes\n")
    [warning] = load_config_with_warnings(host.config_path)[1]
    write_unit(host.tmp_path, "a.service", "Priority=50\n")
    host.systemd.units["a.service"] = state("a.service", "activating", "start-pre", 7, "start")

    async def test() -> None:
        daemon = host.start("unix:path=/run/test-bus")
        await host.waiting_on_its_bus(daemon)
        assert host.connected == ["unix:path=/run/test-bus"]
        assert host.service_buses == [host.systemd.bus]
        assert host.service.granted == [("a.service", "0")]
        await until(lambda: host.heard().count("WATCHDOG=1") >= 2)
        # WATCHDOG=1 may come first: each NVML wait of start-up begins with one
        said = [m for m in host.heard() if m != "WATCHDOG=1"]
        assert said[0] == "READY=1\nSTATUS=1 GPU: a.service running; 0 waiting"
        assert host.controller.journal is cast(Journal, host.journals[0])
        assert host.controller.ask_journal is stopjournal.ask
        assert not host.journals[0].closed
        signal.raise_signal(stop)
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 0
        assert host.heard()[-1] == "STOPPING=1"
        assert host.journals[0].closed  # what journald had not taken yet, if it takes it now

    run(test)
    [journal] = host.journals
    [grant] = [e for e in journal.entries if e["GPUSLICE_DECISION"] == "grant"]
    assert grant["MESSAGE"] == "starting a.service (priority 50) on GPU 0"
    lines = stderr_lines(capsys)
    assert f"<4>{warning}" in lines
    assert "<6>gpuslice ready: 1 GPU: a.service running; 0 waiting" in lines
    assert lines[-1] == "<6>gpuslice stopping; running jobs are left alone"
    assert not any("starting a.service" in line for line in lines)  # the journal's, not twice


def test_under_the_watchdog_an_nvml_wait_begins_with_watchdog_and_lasts_half_of_it(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WatchdogSec=3 (WATCHDOG_USEC): an NVML call waits at most 1.5 s, not NVML_DEADLINE
    (2 s), and the wait begins with WATCHDOG=1 (OffLoop's test says why)."""
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")

    async def test() -> None:
        daemon = host.start()
        await host.waiting_on_its_bus(daemon)
        nvml = host.controller.watch.nvml
        assert (nvml.deadline, nvml.longest) == (NVML_DEADLINE, 1.5)
        fed = host.heard().count("WATCHDOG=1")
        assert nvml.call(lambda: 7) == 7
        assert host.heard().count("WATCHDOG=1") == fed + 1
        signal.raise_signal(SIGTERM)
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 0

    run(test)


def test_a_daemon_run_by_hand_logs_plain_lines_and_opens_no_journal(
    host: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without JOURNAL_STREAM (run from a shell) there is no journald to write entries to:
    decisions are plain lines, every line `LEVEL message`, and the stop still exits 0."""
    write_unit(host.tmp_path, "a.service", "Priority=50\n")
    host.systemd.units["a.service"] = state("a.service", "activating", "start-pre", 7, "start")

    async def test() -> None:
        daemon = host.start()
        await host.waiting_on_its_bus(daemon)
        assert host.connected == [None]
        assert host.controller.journal is None
        signal.raise_signal(SIGTERM)
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 0

    run(test)
    assert host.journals == []
    lines = stderr_lines(capsys)
    assert "INFO starting a.service (priority 50) on GPU 0" in lines
    assert lines[-1] == "INFO gpuslice stopping; running jobs are left alone"


def test_a_lost_system_bus_is_said_and_exits_1_so_that_systemd_restarts_the_controller(
    host: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No reconnect loop (STYLE: Restart= brings the controller back, which reads systemd's
    state anew): a lost bus is one error line and exit 1. Exit 0 would be a clean stop, not
    restarted (Restart=on-failure), every gate waiting; and no STOPPING=1 is said for it."""
    monkeypatch.setenv("JOURNAL_STREAM", "8:4242")

    async def test() -> None:
        daemon = host.start()
        await host.waiting_on_its_bus(daemon)
        host.systemd.bus.lose()
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 1

    run(test)
    assert "STOPPING=1" not in host.heard()
    assert stderr_lines(capsys)[-1] == (
        "<3>lost the system bus; exiting so that systemd restarts the controller"
    )


def test_the_daemon_records_this_boot_for_release_jobs(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run() has the controller record this boot as it tells it where `gpuslice
    release-jobs` reads it (paths.BOOT_RECORD): in a container, release-jobs reads another
    kernel boot id than the controller's sandbox does, and without the record took every
    state for an earlier boot's (its frozen units left frozen at `apt remove`)."""
    record = host.tmp_path / "run" / "gpuslice" / "runtime-dir.boot"
    record.parent.mkdir(parents=True)  # RuntimeDirectory=
    monkeypatch.setattr(controller_module, "THIS_BOOT_RECORD", record)

    async def test() -> None:
        daemon = host.start()
        await host.waiting_on_its_bus(daemon)
        assert read_recorded_boot(record) == BOOT
        signal.raise_signal(SIGTERM)
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 0

    run(test)


class NameOwned:
    """The system bus where another process owns org.gpuslice.Scheduler1 (":1.7", PID 4242):
    another controller, which answers Status; or, `releasing`, `gpuslice release-jobs`,
    which answers RELEASING and lets go of the name after `held_for` claims. From its
    `late_after`th claim on, the loop's clock reads an HOUR later (a RELEASE_WAIT of an
    HOUR has run out then, after so many claims, not after so much of a loaded machine's
    time)."""

    def __init__(
        self, releasing: bool = False, held_for: int | None = None, late_after: int = 0
    ) -> None:
        self.releasing = releasing
        self.held_for = held_for
        self.late_after = late_after
        self.claims = 0

    def add_message_handler(self, handler: object) -> None:
        pass

    async def request_name(self, name: str, flags: NameFlag) -> RequestNameReply:
        self.claims += 1
        if self.claims == self.late_after:
            loop = asyncio.get_running_loop()
            now = loop.time
            loop.time = lambda: now() + HOUR  # type: ignore[method-assign]
        if self.held_for is not None and self.claims > self.held_for:
            return RequestNameReply.PRIMARY_OWNER
        return RequestNameReply.EXISTS

    async def call(self, msg: Message) -> Message:
        msg.serial = 1  # as the bus connection numbers what it sends
        if msg.member == "GetNameOwner":
            return Message.new_method_return(msg, "s", [":1.7"])
        if msg.member == "GetConnectionUnixProcessID":
            return Message.new_method_return(msg, "u", [4242])
        if self.releasing:
            reply = Message.new_error(msg, RELEASING, "ask again once it ends")
        else:
            reply = Message.new_method_return(msg, "s", ["{}"])
        reply.sender = ":1.7"
        return reply


def tree(*roots: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every entry under `roots`: its mode, its modification time, a regular file's bytes."""
    found: dict[str, tuple[int, int, bytes | None]] = {}
    for root in roots:
        for path in [root, *sorted(root.rglob("*"))]:
            st = path.lstat()
            data = path.read_bytes() if path.is_file() and not path.is_symlink() else None
            found[str(path)] = (st.st_mode, st.st_mtime_ns, data)
    return found


def test_a_second_controller_is_refused_the_bus_name_and_has_changed_nothing(
    host: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuslice controller` run by hand while gpuslice.service runs: the bus name is the
    other's (EXISTS). Before, it claimed the name only once started up, and by then had
    recorded its runtime_dir, its boot and its state_dir over the running controller's
    records, rewritten that controller's state file (one invalid entry: copied to
    state.json.bad, rewritten with the valid ones; a stand-in is taken over the same way)
    and removed the gate pipes that controller holds (`gpuslice release-jobs` and the
    generator read those records). Now it claims the name first: one line says why it ends,
    exit 1, and not one file, name, byte or time under the state_dir, the runtime_dir (gate
    pipes, env files) or the records' directory has changed."""
    config = bed_config(host.tmp_path)
    state_dir, runtime_dir = Path(config.state_dir), Path(config.runtime_dir)
    records = host.tmp_path / "run-gpuslice"  # RuntimeDirectory=, as gpuslice.service has it
    records.mkdir()
    (records / "runtime-dir").write_text(config.runtime_dir + "\n")
    (records / "boot").write_text("the-running-controllers-boot\n")
    monkeypatch.setattr(controller_module, "RUNTIME_RECORD", records / "runtime-dir")
    monkeypatch.setattr(controller_module, "STATE_RECORD", records / "state-dir")
    monkeypatch.setattr(controller_module, "THIS_BOOT_RECORD", records / "boot")
    write_unit(host.tmp_path, "a.service", "Priority=50\n")
    saved = StateStore(state_dir)
    saved.save(SavedState(holders={"a.service": ((0,), "running", 1, "")}, seq=1), BOOT)
    text = json.loads(saved.path.read_text())
    text["holders"]["b.service"] = "not an entry"
    saved.path.write_text(json.dumps(text))
    gate_pipe_dir(config.runtime_dir).mkdir(parents=True)
    os.mkfifo(gate_pipe_dir(config.runtime_dir) / "a.service", 0o600)
    env_file(config.runtime_dir, "gone.service").parent.mkdir(parents=True)
    env_file(config.runtime_dir, "gone.service").write_text("CUDA_VISIBLE_DEVICES=0\n")
    host.systemd.units["a.service"] = state("a.service", "active", "running")
    real = SchedulerService(NameOwned(), lambda unit, sender: None, str, lambda: None)
    host.service.claim_name = real.claim_name  # type: ignore[method-assign]
    before = tree(state_dir, runtime_dir, records)

    async def test() -> None:
        assert await asyncio.wait_for(host.start(), ENDS_WITHIN) == 1

    run(test)
    assert tree(state_dir, runtime_dir, records) == before
    assert stderr_lines(capsys) == [
        "ERROR org.gpuslice.Scheduler1 is owned by another process (EXISTS): another gpuslice "
        "controller runs (systemctl status gpuslice), or `gpuslice release-jobs` releases the "
        "units of a stopped one (apt remove); this controller exits, having changed nothing"
    ]
    assert host.systemd.calls == []  # nor asked systemd for its signals
    assert not host.heard()  # nor told systemd it is ready


def test_a_controller_that_finds_release_jobs_holding_its_name_waits_then_starts(
    host: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`systemctl start gpuslice` while a `gpuslice release-jobs` run by hand holds the bus
    name: the controller asks for it again every CLAIM_RETRY s, each time telling systemd
    its start goes on (EXTEND_TIMEOUT_USEC=, or TimeoutStartSec= killed it) and, once, why
    (STATUS=, and the journal); once release-jobs lets go, it starts up as any other.
    Before, it exited 1 at once, Restart= retried it into the start limit, and
    gpuslice.service stayed failed after release-jobs ended, every gated start waiting."""
    monkeypatch.setattr(service_module, "CLAIM_RETRY", 0.01)
    bus = NameOwned(releasing=True, held_for=3)
    real = SchedulerService(bus, lambda unit, sender: None, str, lambda: None)
    host.service.claim_name = real.claim_name  # type: ignore[method-assign]

    async def test() -> None:
        daemon = host.start()
        await host.waiting_on_its_bus(daemon)
        signal.raise_signal(SIGTERM)
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 0

    run(test)
    assert bus.claims == 4
    extend = "EXTEND_TIMEOUT_USEC=90000000"
    assert host.heard()[:5] == [
        extend,
        "STATUS=waiting for gpuslice release-jobs (PID 4242) to finish",
        extend,
        extend,
        "READY=1\nSTATUS=1 GPU: idle; 0 waiting",
    ]
    lines = stderr_lines(capsys)
    assert lines[0] == (
        "INFO waiting for gpuslice release-jobs (PID 4242) to finish: "
        "org.gpuslice.Scheduler1 is held by it until then"
    )
    assert "INFO gpuslice ready: 1 GPU: idle; 0 waiting" in lines
    assert sum("release-jobs" in line for line in lines) == 1  # said once, not at each try


def test_a_controller_waits_for_release_jobs_no_longer_than_release_wait_and_exits_1(
    host: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A release-jobs that holds the name past RELEASE_WAIT (hung, or a resume that takes
    long) is not waited for longer: the controller exits 1 saying so, having changed
    nothing, and Restart= starts it again to wait once more."""
    monkeypatch.setattr(service_module, "CLAIM_RETRY", 0.01)
    monkeypatch.setattr(service_module, "RELEASE_WAIT", HOUR)  # past at the 4th claim
    bus = NameOwned(releasing=True, late_after=4)
    real = SchedulerService(bus, lambda unit, sender: None, str, lambda: None)
    host.service.claim_name = real.claim_name  # type: ignore[method-assign]

    async def test() -> None:  # the clock an HOUR on at the 4th claim: ENDS_WITHIN from then
        assert await asyncio.wait_for(host.start(), HOUR + ENDS_WITHIN) == 1

    run(test)
    assert bus.claims == 4
    assert stderr_lines(capsys)[1:] == [
        "ERROR org.gpuslice.Scheduler1 is still held by `gpuslice release-jobs` (PID 4242) "
        "after 3600 s; this controller exits, having changed nothing"
    ]
    assert host.systemd.calls == []
    assert "READY=1" not in "\n".join(host.heard())


def test_a_controller_stopped_while_it_waits_for_release_jobs_exits_0_at_once(
    host: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`systemctl stop gpuslice` (SIGTERM) while the controller waits for release-jobs to
    let go of its name: it ends at once, exit 0, having read and written nothing. Left to
    wait, the stop waited up to RELEASE_WAIT, past TimeoutStopSec=, and was killed."""
    monkeypatch.setattr(service_module, "CLAIM_RETRY", 0.01)
    bus = NameOwned(releasing=True)
    real = SchedulerService(bus, lambda unit, sender: None, str, lambda: None)
    host.service.claim_name = real.claim_name  # type: ignore[method-assign]

    async def test() -> None:
        daemon = host.start()
        await until(lambda: bus.claims >= 3)
        signal.raise_signal(SIGTERM)
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 0

    run(test)
    assert stderr_lines(capsys)[1:] == [
        "INFO stopped while waiting for its bus name; this controller exits, having changed nothing"
    ]
    assert host.systemd.calls == []
    assert "READY=1" not in "\n".join(host.heard())


def test_a_sighup_while_starting_up_is_a_reload_once_started_and_one_after_at_once(
    host: Host, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGHUP's default action ends the process: a `kill -HUP` (or `systemctl reload`) while
    the controller connects to the bus failed its start, which systemd counts against its
    start limit. Taken in from run()'s first line, it is a reload once the controller has
    started (the file may have changed since it was read); one while it runs reloads then."""
    host.config_path.write_text("gpus: 1\nlog_level: info\n")

    async def reloaded_meanwhile() -> None:
        host.config_path.write_text("gpus: 1\nlog_level: warning\n")
        signal.raise_signal(SIGHUP)
        await settle()

    host.while_connecting = reloaded_meanwhile

    async def test() -> None:
        daemon = host.start()
        await host.waiting_on_its_bus(daemon)
        assert logging.getLogger().level == logging.WARNING
        assert host.controller.config.log_level == "warning"
        host.config_path.write_text("gpus: 1\nlog_level: debug\n")
        signal.raise_signal(SIGHUP)
        await until(lambda: logging.getLogger().level == logging.DEBUG)
        assert host.controller.config.log_level == "debug"
        signal.raise_signal(SIGINT)
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 0

    run(test)
    assert stderr_lines(capsys)[-1] == "INFO gpuslice stopping; running jobs are left alone"


def test_a_config_that_cannot_be_used_is_said_and_exits_78_before_the_bus(
    host: Host, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """EX_CONFIG (78): the unit's RestartPreventExitStatus= stops restarting a controller
    that would fail the same way every second; the error, naming file, line and key, is the
    one line in the journal (at error level, before any log_level could be read)."""
    monkeypatch.setenv("JOURNAL_STREAM", "8:4242")
    host.config_path.write_text("gpus: many\n")
    with pytest.raises(ConfigError) as error:
        load_config_with_warnings(host.config_path)

    async def test() -> None:
        assert await asyncio.wait_for(host.start(), ENDS_WITHIN) == 78

    run(test)
    assert host.connected == []
    assert capsys.readouterr().err == f"<3>{error.value}\n"
    assert str(error.value).startswith(f"{host.config_path}:1: gpus: ")


# ---- the controller's log: journald's form, at log_level ------------------------------------


def test_the_log_is_journalds_form_under_systemd_plain_by_hand_at_log_level_whatever_was_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under systemd each line starts `<N>` (journald files it at that level, and a second
    line of a message cannot set its own); by hand `LEVEL message`. Logging set up before
    (by a library's first log call, which installs its own handler) is replaced, not kept
    with ours ignored: its lines would lack their level, and log_level would not apply."""
    log = logging.getLogger("gpuslice")
    with kept_logging():
        root = logging.getLogger()
        earlier = logging.StreamHandler(sys.stderr)
        root.addHandler(earlier)
        root.setLevel(logging.ERROR)
        monkeypatch.setenv("JOURNAL_STREAM", "8:4242")
        controller_module._journal_logging("debug")
        assert earlier not in root.handlers
        assert root.level == logging.DEBUG
        log.debug("first\nsecond")
        log.error("third")
        assert stderr_lines(capsys) == ["<7>first", "<7>second", "<3>third"]
        monkeypatch.delenv("JOURNAL_STREAM")
        controller_module._journal_logging("warning")
        log.info("not shown")
        log.warning("shown")
        assert stderr_lines(capsys) == ["WARNING shown"]


def test_a_line_of_a_level_journald_has_no_number_for_is_info() -> None:
    """A level of a library's own (logging.addLevelName) is neither debug nor an error."""
    record = logging.LogRecord("gpuslice", 25, __file__, 1, "odd", (), None)
    assert JournalFormatter().format(record) == "<6>odd"


# ---- a decision's journal entry, an annotation problem, a task's failure ----------------------


class Clock:
    """gpuslice.clock's `time`: the wall clock and CLOCK_BOOTTIME, moved by the test."""

    CLOCK_BOOTTIME = time.CLOCK_BOOTTIME

    def __init__(self) -> None:
        self.wall = 1_700_000_000.0
        self.mono = 100.0

    def time(self) -> float:
        return self.wall

    def clock_gettime(self, which: int) -> float:
        assert which == time.CLOCK_BOOTTIME
        return self.mono


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    made = Clock()
    monkeypatch.setattr(clock_module, "time", made)
    return made


def test_each_decisions_entry_carries_its_sentence_its_level_and_a_grants_wait(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """README, "A unit's own journal": `journalctl -u UNIT` shows each decision at its level
    (a failure is a warning: `-p warning` finds it) and a grant says how long the unit waited
    at its gate (GPUSLICE_WAITED_USEC, 0 when at once); the entry is the line, not a copy."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n", "b.service": "Priority=50\n"}, [])
    journal = KeptJournal()

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.journal = cast(Journal, journal)
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            ctl.on_unit_changed("a.service", at_gate())
            await settle()
            ctl.on_unit_changed("a.service", RUNNING)
            ctl.on_unit_changed("b.service", at_gate())
            await settle()
            clock.mono += 2.5
            ctl.on_unit_changed("a.service", FAILED)
            await settle()

    run(test)
    shown = [
        (e["GPUSLICE_DECISION"], e["PRIORITY"], e["MESSAGE"], e.get("GPUSLICE_WAITED_USEC"))
        for e in journal.entries
    ]
    assert shown == [
        ("grant", "6", "starting a.service (priority 50) on GPU 0", "0"),
        ("wait", "6", "b.service waiting: GPU 0 held by a.service, priority 50", None),
        (
            "failed",
            "4",
            "a.service failed: gpuslice will not start it by itself (its own Restart= "
            "policy applies)",
            None,
        ),
        ("grant", "6", "starting b.service (priority 50) on GPU 0", "2500000"),
    ]
    assert not [r for r in caplog.records if "a.service" in r.getMessage()]


def test_an_annotation_problem_is_logged_at_its_severity_in_its_own_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`Priority=high` makes the unit unmanaged: an error; an unknown key is ignored: a
    warning. Each is the `PATH:LINE: [X-GPUSlice] KEY: message` line `gpuslice check` gives."""
    bed = Bed(tmp_path, {"a.service": "Priority=high\n", "b.service": "Priority=5\nFrob=1\n"}, [])

    async def test() -> None:
        with caplog.at_level(logging.DEBUG, logger="gpuslice"):
            await bed.controller.start()

    run(test)
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if ".service:" in r.getMessage()]
    assert logged == [
        (
            logging.ERROR,
            "/etc/systemd/system/a.service:5: [X-GPUSlice] Priority: expected an integer 0-999, "
            'got "high"',
        ),
        (
            logging.WARNING,
            "/etc/systemd/system/b.service:6: [X-GPUSlice] Frob: unknown key, ignored (known "
            "keys: Priority, Type, GPUs, Requeue, Memory, Devices, Preempt)",
        ),
    ]


def test_a_tasks_failure_is_said_with_its_traceback_a_cancelled_tasks_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in a task the controller spawned must show in the journal (`internal error`
    and the traceback), not vanish with the task; a task cancelled (a timer's read made
    moot) ended normally and says nothing."""
    bed = Bed(tmp_path, {}, [])

    async def fails() -> None:
        raise ValueError("boom")

    async def waits() -> None:
        await asyncio.Event().wait()

    async def test() -> None:
        ctl = bed.controller
        with caplog.at_level(logging.DEBUG):
            ctl._spawn(waits())
            [waiting] = ctl._tasks
            waiting.cancel()
            ctl._spawn(fails())
            await settle()

    run(test)
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert (record.name, record.getMessage()) == ("gpuslice", "internal error")
    assert record.exc_info is not None and repr(record.exc_info[1]) == "ValueError('boom')"


# ---- status: the line, the answers ----------------------------------------------------------


def test_the_status_line_says_idle_running_and_waiting_with_the_gpus_counted(
    tmp_path: Path,
) -> None:
    """`systemctl status gpuslice` shows this line: its words are read by admins and by
    scripts grepping for them."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n", "b.service": "Priority=50\n"}, [])
    two = Bed(tmp_path / "two", {}, [], config=bed_config(tmp_path / "two", gpus=2))

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.status_line() == "1 GPU: idle; 0 waiting"
        ctl.on_unit_changed("a.service", at_gate())
        await settle()
        assert ctl.status_line() == "1 GPU: a.service running; 0 waiting"
        ctl.on_unit_changed("b.service", at_gate())
        await settle()
        assert ctl.status_line() == "1 GPU: a.service running; 1 waiting"
        await two.controller.start()
        assert two.controller.status_line() == "2 GPUs: idle; 0 waiting"

    run(test)


def test_the_status_line_names_units_up_to_exactly_its_limit_then_counts_the_rest(
    tmp_path: Path,
) -> None:
    """STATUS_NAMES_MAX characters of names with their ", " separators: three names of 253
    characters (the longest gpuslice gates), one of 246 and one of 9 fill it exactly
    (3 x 255 + 248 + 11 = 1024) and are all named; a sixth, however short, is counted
    instead. One character more let the datagram grow past what systemd reads."""
    names = [f"{i}{'x' * 244}.service" for i in range(3)]
    names += [f"3{'x' * 237}.service", "4.service", "z.service"]
    assert [len(n) for n in names[:5]] == [253, 253, 253, 246, 9]
    bed = Bed(
        tmp_path,
        {name: "Priority=10\n" for name in names},
        [state(name, "activating", "start-pre", i + 1, "start") for i, name in enumerate(names)],
        config=bed_config(tmp_path, gpus=6),
    )

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.status_line() == f"6 GPUs: {', '.join(names[:5])} and 1 more running; 0 waiting"

    run(test)


def key_orders(text: str) -> list[list[str]]:
    """The keys of each object of a JSON text, as written: the innermost first, the outer last."""
    orders: list[list[str]] = []

    def kept(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        orders.append([key for key, _ in pairs])
        return dict(pairs)

    json.loads(text, object_pairs_hook=kept)
    return orders


def test_the_status_answer_holds_each_part_with_its_keys_sorted_and_the_times_it_knows(
    tmp_path: Path, clock: Clock
) -> None:
    """The Status answer (`busctl call ... Status`, `gpuslice status --json`, metrics) is
    the cached snapshot with the counters appended: each written with its keys sorted (the
    same state, the same text), holding when each waiter began to wait, what each suspended
    unit moved to host memory and since when, when the controller started and its version,
    and the journal entries not written (0 without a journal)."""
    write_unit(tmp_path, "a.service", "Priority=50\n")
    bed = vlm_suspended_for_voice(tmp_path)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("a.service", at_gate())
        await settle()
        # suspended 30 s ago (the state file's Unix time of it is not what status shows)
        suspended = Suspension((4242,), 3 << 30, clock.mono - 30, 1234.5)
        ctl.ladder.suspensions["vlm.service"] = suspended
        ctl.answers.changed()
        text = ctl.status_json()
        status = json.loads(text)
        assert [(w["unit"], w["since"]) for w in status["waiting"]] == [
            ("a.service", 1_700_000_000.0)
        ]
        assert [(s["unit"], s["host_memory"], s["since"]) for s in status["suspended"]] == [
            ("vlm.service", 3 << 30, 1_700_000_000.0 - 30)
        ]
        assert status["controller"]["version"] == __version__
        assert status["controller"]["start_time"] == 1_700_000_000.0
        assert status["admission_wait_seconds"]["count"] == 0
        assert status["counters"]["journal_write_errors"] == 0
        journal = KeptJournal()
        journal.failures = 3
        ctl.journal = cast(Journal, journal)
        assert json.loads(ctl.status_json())["counters"]["journal_write_errors"] == 3
        *inner, top = key_orders(text)
        assert all(keys == sorted(keys) for keys in inner)
        snapshot = sorted(json.loads(ctl.answers._status.text().text))
        assert top == [*snapshot, "admission_wait_seconds", "controller", "counters"]

    run(test)


def test_the_times_status_shows_survive_a_clock_step_and_count_a_host_sleep(
    tmp_path: Path, clock: Clock
) -> None:
    """A waiter's `since`, a suspended unit's and the controller's `start_time` are Unix
    times of moments kept on CLOCK_BOOTTIME (gpuslice/clock.py). The wall clock stepped since
    (NTP at boot correcting an RTC hours off, `date -s`) moves them with it: now less `since`
    is the time that passed, not hours more, nor a wait shown 0 s (`gpuslice status`), and
    `gpuslice_controller_start_time_seconds` is when the controller started by the clock now.
    A host sleep meanwhile (CLOCK_BOOTTIME counts it, CLOCK_MONOTONIC does not) counts, as in
    the grant's GPUSLICE_WAITED_USEC and the admission-wait histogram (the same moments)."""
    write_unit(tmp_path, "a.service", "Priority=50\n")
    bed = vlm_suspended_for_voice(tmp_path)
    ctl = bed.controller

    def shown() -> tuple[float, float, float]:
        ctl.answers.changed()  # built anew: the times as of now
        status = json.loads(ctl.status_json())
        [waiter] = status["waiting"]
        [suspended] = status["suspended"]
        return (
            clock.wall - waiter["since"],
            clock.wall - suspended["since"],
            clock.wall - status["controller"]["start_time"],
        )

    async def test() -> None:
        await ctl.start()
        ctl.ladder.suspensions["vlm.service"] = Suspension((4242,), 1 << 30, clock.mono, clock.wall)
        clock.mono += 5
        clock.wall += 5
        ctl.on_unit_changed("a.service", at_gate())
        await settle()
        clock.mono += 60
        clock.wall += 60 + 6 * 3600  # NTP steps the clock 6 h on a minute later
        assert shown() == (60.0, 65.0, 65.0)
        clock.wall -= 12 * 3600  # an admin sets it 12 h back
        assert shown() == (60.0, 65.0, 65.0)
        clock.mono += 8 * 3600  # the host slept 8 h
        clock.wall += 8 * 3600
        assert shown() == (60.0 + 8 * 3600, 65.0 + 8 * 3600, 65.0 + 8 * 3600)
        assert ctl._waited("a.service") == 60.0 + 8 * 3600

    run(test)


def test_a_plan_is_answered_with_its_keys_sorted_and_an_unmanaged_unit_is_refused_by_name(
    tmp_path: Path,
) -> None:
    """`gpuslice plan UNIT` and its bus answer: the same plan, the same text; a unit without
    an annotation in force is refused saying where to look."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n", "b.service": "Priority=50\n"}, [])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.on_unit_changed("a.service", at_gate())
        await settle()
        text = ctl.plan_json("b.service")
        assert text == json.dumps(json.loads(text), sort_keys=True)
        assert json.loads(text)["verdict"] == "waits"
        with pytest.raises(NotManaged) as refused:
            ctl.plan_json("c.service")
        assert str(refused.value) == (
            "c.service is not managed by gpuslice: no [X-GPUSlice] annotation in force "
            "(`gpuslice check` says why)"
        )

    run(test)
