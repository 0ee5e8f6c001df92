"""config.yaml's reload and the runtime_dir of this boot, as an unlucky admin meets them.

The gates' drop-ins (written by the generator at each daemon-reload) and the controller (which
reads config.yaml at start and keeps its paths at a reload) must name the same runtime_dir,
or a unit starts reading no env file (every GPU visible) or a stale one (another unit's
GPUs): the controller records the one it runs with (paths.RUNTIME_DIR_RECORD), the generator
keeps naming it and tells the controller which one its gates name. And a config.yaml read
while it is being written in place is valid YAML that lacks its last settings: a reload, or
a start, reads it once it has been left alone (config.SETTLE_SECONDS), and again if it
changed while it was read. And a start that comes while the annotations are read again after a
daemon-reload is judged on what that reload read, not on the scan before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuslice import config as config_module
from gpuslice import controller as controller_module
from gpuslice import generator
from gpuslice import reloads as reloads_module
from gpuslice.annotations import Scan, scan
from gpuslice.config import Config, load_config_with_warnings, read_pinned_runtime_dir
from gpuslice.controller import Controller
from gpuslice.paths import RUNTIME_DIR_DROPIN, RUNTIME_DIR_ENV
from gpuslice.systemd import NO_REPLY, SystemdError
from tests.test_controller import (
    Bed,
    answered_when_set,
    at_gate,
    bed_config,
    holding_a_gpu_each,
    low_holds_gpu_0,
    messages,
    run,
    settle,
    shell_reader,
    state,
    until,
    write_unannotated,
    write_unit,
)
from tests.test_controller import _no_notify_socket as _no_notify_socket  # autouse
from tests.test_controller import cgroup_of as cgroup_of  # a fixture
from tests.test_controller import signal as signal_of  # `signal` is the standard module here
from tests.test_controller_run import ENDS_WITHIN, Host
from tests.test_controller_run import host as host  # fixture

ETC_UNIT = "etc/systemd/system/a.service"
CONFIG = "etc/gpuslice/config.yaml"


# ---- the runtime_dir of this boot ------------------------------------------------------------


class Machine:
    """A host's files under `root`: config.yaml, one annotated unit, the generator's output
    (what systemd loaded at the last daemon-reload) and /run/gpuslice, which a reboot
    empties. `controller_starts` runs what run() and start() do with the runtime_dir at a
    start (chosen, then recorded once the bus name is ours), in the environment systemd gives
    gpuslice.service from the generator's drop-in."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.out = root / "run/systemd/generator"
        (root / ETC_UNIT).parent.mkdir(parents=True)
        (root / ETC_UNIT).write_text("[Service]\nExecStart=/bin/a\n[X-GPUSlice]\nPriority=1\n")
        (root / CONFIG).parent.mkdir(parents=True)
        self.boot()
        monkeypatch.setattr(controller_module, "RUNTIME_RECORD", root / "run/gpuslice/runtime-dir")

    def boot(self) -> None:
        for path in sorted((self.root / "run").rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        (self.root / "run/gpuslice").mkdir(parents=True)  # RuntimeDirectory=

    def edit(self, runtime_dir: str) -> None:
        (self.root / CONFIG).write_text(f"gpus: 1\nruntime_dir: {runtime_dir}\n")

    def daemon_reload(self) -> None:
        for path in sorted(self.out.rglob("*"), reverse=True):  # systemd empties it first
            path.rmdir() if path.is_dir() else path.unlink()
        generator.generate(self.out, root=self.root, libexec_dir="/usr/lib/gpuslice")

    def gates_name(self) -> str:
        """The runtime_dir a.service's EnvironmentFile= names."""
        text = (self.out / "a.service.d/gpuslice-gate.conf").read_text()
        [line] = [x for x in text.splitlines() if x.startswith("EnvironmentFile=-")]
        return line.removeprefix("EnvironmentFile=-").removesuffix("/env/%n/gpuslice.env")

    def controller_starts(self) -> str:
        """The runtime_dir a controller started now writes env files in."""
        text = (self.out / RUNTIME_DIR_DROPIN).read_text()
        [line] = [x for x in text.splitlines() if x.startswith("Environment=")]
        name, value = line.removeprefix("Environment=").split("=", 1)
        self.monkeypatch.setenv(name, value)
        config, _ = load_config_with_warnings(self.root / CONFIG)
        return started(config, self.root / CONFIG).runtime_dir


def started(config: Config, config_path: Path) -> Config:
    """The config a controller started now runs with, its runtime_dir recorded as it would
    be once its bus name is its own (Controller.start)."""
    picked = controller_module._runtime_dir_of_this_boot(config, config_path)
    record = controller_module.RUNTIME_RECORD
    controller_module._record_runtime_dir(record, picked.runtime_dir, config_path)
    return picked


def test_the_gates_and_the_controller_name_one_runtime_dir_whatever_config_yaml_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """runtime_dir edited in config.yaml, then, in any order, `systemctl daemon-reload` and a
    restart of gpuslice.service (by hand, by Restart= after a crash, by the exit that a
    driver loaded late asks for). Before, the generator took the new one from the file at
    the daemon-reload while the running controller kept the old one, and a restart alone
    took the new one while the gates named the old: either way units started with no env
    file (every GPU visible) or a stale one (another unit's GPUs). Now the one the
    controller runs with holds until the next boot."""
    machine = Machine(tmp_path, monkeypatch)
    machine.edit("/run/gpuslice/a")
    machine.daemon_reload()  # at boot
    assert machine.gates_name() == "/run/gpuslice/a"
    assert machine.controller_starts() == "/run/gpuslice/a"

    machine.edit("/run/gpuslice/b")
    assert machine.controller_starts() == "/run/gpuslice/a"  # Restart= before a daemon-reload
    machine.daemon_reload()
    assert machine.gates_name() == "/run/gpuslice/a"
    assert machine.controller_starts() == "/run/gpuslice/a"  # and after it
    assert (
        f"gpuslice-generator: warning: {tmp_path / CONFIG}:2: runtime_dir: /run/gpuslice/b "
        "takes effect at the next boot: gpuslice.service runs with /run/gpuslice/a this "
        "boot, which the gates keep naming"
    ) in capsys.readouterr().err.splitlines()

    machine.boot()
    machine.daemon_reload()
    assert machine.gates_name() == "/run/gpuslice/b"
    assert machine.controller_starts() == "/run/gpuslice/b"


def test_a_first_start_after_the_file_changed_since_boot_takes_what_the_gates_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """config.yaml was bad at boot (gpuslice.service failed, exit 78: nothing recorded), and
    the admin fixes it, runtime_dir with it, then `systemctl start gpuslice`: the gates were
    generated at boot with the default. Taken from the file, the controller wrote where no
    gate looked."""
    machine = Machine(tmp_path, monkeypatch)
    (tmp_path / CONFIG).write_text("gpus: 0\n")
    machine.daemon_reload()
    assert machine.gates_name() == "/run/gpuslice"
    machine.edit("/run/gpuslice/new")
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        assert machine.controller_starts() == "/run/gpuslice"
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / CONFIG}:2: runtime_dir: /run/gpuslice/new takes effect at the next "
        "boot: the gates' drop-ins name /run/gpuslice, where gpuslice writes until then"
    ]
    assert read_pinned_runtime_dir(tmp_path / "run/gpuslice/runtime-dir") == "/run/gpuslice"


def test_without_a_word_from_the_generator_the_record_of_this_boot_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No GPUSLICE_RUNTIME_DIR (a generator of an older version, or none): the record of
    this boot, else config.yaml's, which is then recorded. A value in the environment that
    is no runtime_dir is said and ignored."""
    record = tmp_path / "gpuslice" / "runtime-dir"
    record.parent.mkdir()
    monkeypatch.setattr(controller_module, "RUNTIME_RECORD", record)
    path = tmp_path / "config.yaml"
    monkeypatch.delenv(RUNTIME_DIR_ENV, raising=False)
    pick = started
    assert pick(Config(runtime_dir="/run/gpuslice/a"), path).runtime_dir == "/run/gpuslice/a"
    assert record.read_text() == "/run/gpuslice/a\n"
    assert pick(Config(runtime_dir="/run/gpuslice/b"), path).runtime_dir == "/run/gpuslice/a"
    monkeypatch.setenv(RUNTIME_DIR_ENV, "/etc")
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        assert pick(Config(), path).runtime_dir == "/run/gpuslice/a"
    assert "GPUSLICE_RUNTIME_DIR=/etc is not a valid runtime_dir: ignored" in caplog.text


def test_the_daemon_records_the_runtime_dir_it_runs_with(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run() records its runtime_dir before it answers any gate (the generator reads it at
    the next daemon-reload)."""
    record = host.tmp_path / "gpuslice" / "runtime-dir"
    record.parent.mkdir()
    monkeypatch.setattr(controller_module, "RUNTIME_RECORD", record)

    async def test() -> None:
        daemon = host.start()
        await host.waiting_on_its_bus(daemon)
        assert record.read_text() == host.controller.config.runtime_dir + "\n"
        signal.raise_signal(signal.SIGTERM)
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 0

    run(test)


# ---- a config.yaml being written when it is read ---------------------------------------------


def counting(monkeypatch: pytest.MonkeyPatch, meanwhile: Any = None) -> list[Path]:
    """The controller's reads of config.yaml; `meanwhile(n)` runs after the n-th read, as a
    writer would while the file was read."""
    loads: list[Path] = []
    load = load_config_with_warnings

    def counted(path: Path) -> tuple[Config, list[str]]:
        loads.append(path)
        read = load(path)
        if meanwhile is not None:
            meanwhile(len(loads))
        return read

    monkeypatch.setattr(controller_module, "load_config_with_warnings", counted)
    return loads


def held_at_its_change(path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """The clock config.py reads a file's age by stands at the file's last change until the
    call returned is made: written now, it stays "changed less than CONFIG_SETTLE ago" for
    as long as the test takes to write it whole. On a clock that ran on, a loaded machine
    that ran the test late let the controller read the file cut short."""
    held = [path.stat().st_ctime]
    clock = types.SimpleNamespace(time=lambda: held[0] or time.time())
    monkeypatch.setattr(config_module, "time", clock)
    monkeypatch.setattr(reloads_module, "CONFIG_SETTLE_WAITS", 10**6)  # each look is one

    def let_go() -> None:
        held[0] = 0.0

    return let_go


def test_a_reload_waits_for_a_file_being_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cp new.yaml /etc/gpuslice/config.yaml` (truncate, then write) as `systemctl reload`
    comes: read at once, the file cut before `manage_gpus: [1]` was valid YAML, and every GPU
    was handed out (this host shares GPU 0 with a cluster); the whole file was never read.
    The reload reads the file once it has been left alone for CONFIG_SETTLE s."""
    monkeypatch.setattr(reloads_module, "CONFIG_SETTLE", 0.3)
    path = tmp_path / "config.yaml"
    config = bed_config(tmp_path, gpus=2, manage_gpus=("1",))
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [], config=config)
    loads = counting(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.scheduler.gpus == {1}
        path.write_text("gpus: 2\n")  # cut short
        let_go = held_at_its_change(path, monkeypatch)
        ctl.reloads.request()
        await settle()
        assert loads == []
        path.write_text("gpus: 2\nmanage_gpus: [1]\nlog_level: warning\n")
        let_go()
        await until(lambda: ctl.config.log_level == "warning")
        assert ctl.scheduler.gpus == {1}
        assert loads == [path]

    run(test)


def test_a_reload_reads_again_a_file_that_changed_while_it_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file was left alone when the reload began to read it, and a writer truncated it
    meanwhile: what was read is not applied; the file is read again once left alone."""
    monkeypatch.setattr(reloads_module, "CONFIG_SETTLE", 0.05)
    path = tmp_path / "config.yaml"
    path.write_text("gpus: 2\n")
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    applied: list[int] = []

    def writer(n: int) -> None:
        applied.append(bed.controller.config.gpus)
        if n == 1:
            path.write_text("gpus: 3\n")

    loads = counting(monkeypatch, writer)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.reloads.request()
        await until(lambda: len(loads) == 2)
        await settle()
        assert ctl.scheduler.gpus == {0, 1, 2}
        assert applied == [1, 1]  # the first read was never applied

    run(test)


def test_ten_thousand_sighups_while_the_file_settles_are_one_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload storm while the reload waits for the file: one read, once."""
    monkeypatch.setattr(reloads_module, "CONFIG_SETTLE", 0.1)
    path = tmp_path / "config.yaml"
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    loads = counting(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        path.write_text("gpus: 2\n")
        for _ in range(10_000):
            ctl.reloads.request()
        await until(lambda: loads != [])
        for _ in range(10_000):
            ctl.reloads.request()  # after that read: one more
        await until(lambda: len(loads) == 2)
        await asyncio.sleep(0.2)
        assert len(loads) == 2
        assert ctl.scheduler.gpus == {0, 1}

    run(test)


def test_a_file_that_never_stops_changing_is_read_after_so_many_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tool rewriting config.yaml without end: the reload is not put off for ever."""
    monkeypatch.setattr(reloads_module, "CONFIG_SETTLE_WAITS", 3)
    waits: list[Path] = []

    def unsettled(path: Path, now: float, settle: float) -> float:
        waits.append(path)
        return 0.01

    monkeypatch.setattr(config_module, "unsettled", unsettled)
    (tmp_path / "config.yaml").write_text("gpus: 2\n")
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    loads = counting(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        with caplog.at_level(logging.INFO, logger="gpuslice"):
            ctl.reloads.request()
            await until(lambda: loads != [])
        assert len(waits) == 4 and ctl.scheduler.gpus == {0, 1}

    run(test)
    said = [r.getMessage() for r in caplog.records]
    assert (
        f"{tmp_path / 'config.yaml'} changed less than 1 s ago: reloading it once it has "
        "been left alone that long (a file written in place may be cut short)"
    ) in said
    assert f"{tmp_path / 'config.yaml'} kept changing for 3 s: reloading it as it is now" in said


def test_a_start_reads_a_file_being_written_once_it_is_whole(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpuslice.service (re)started while config.yaml is being written: the start reads it
    once it has been left alone, as a reload does."""
    monkeypatch.setattr(reloads_module, "CONFIG_SETTLE", 0.3)
    host.config_path.write_text("")  # truncated, not written yet
    let_go = held_at_its_change(host.config_path, monkeypatch)

    async def test() -> None:
        daemon = host.start()
        await settle()
        host.config_path.write_text("gpus: 2\n")
        let_go()
        await host.waiting_on_its_bus(daemon)
        assert host.controller.scheduler.gpus == {0, 1}
        signal.raise_signal(signal.SIGTERM)
        assert await asyncio.wait_for(daemon, ENDS_WITHIN) == 0

    run(test)


# ---- fewer GPUs configured while units hold them -----------------------------------------------


def gpu_1_configured_away(tmp_path: Path, units: dict[str, str]) -> Bed:
    """The two `units` hold GPU 0 and GPU 1 of a host without NVML (`gpus: 2`); an admin
    has made it `gpus: 1` in config.yaml, not yet reloaded."""
    bed = holding_a_gpu_each(tmp_path, units, config=bed_config(tmp_path, gpus=2))
    (tmp_path / "config.yaml").write_text("gpus: 1\n")
    return bed


async def reloaded_with_gpu_1_lost(bed: Bed) -> Controller:
    """`gpu_1_configured_away`'s controller, started and reloaded: GPU 1, still held, is
    reported lost."""
    ctl = bed.controller
    await ctl.start()
    assert ctl.reload_config()
    assert [(g.index, g.lost) for g in ctl.watch.sample.gpus] == [(0, False), (1, True)]
    return ctl


def test_a_gpu_configured_away_while_held_is_lost_only_until_its_holder_ends(
    tmp_path: Path,
) -> None:
    """A host without NVML schedules `gpus:` from config.yaml. An admin makes it 1 and
    reloads while b.service holds GPU 1: GPU 1 is reported lost while b.service runs there.
    Once b.service ended, nothing sampled again: GPU 1 stayed lost in status (and in
    `gpuslice_gpu_lost`, an alert) until the next reload."""
    units = {"a.service": "Priority=10\n", "b.service": "Priority=20\n"}
    bed = gpu_1_configured_away(tmp_path, units)

    async def test() -> None:
        ctl = await reloaded_with_gpu_1_lost(bed)
        assert ctl.scheduler.grants()["b.service"] == frozenset({1})
        bed.systemd.units["b.service"] = state("b.service", "inactive", "dead")
        ctl.on_unit_changed("b.service", {"ActiveState": "inactive", "SubState": "dead"})
        await settle()
        assert [(g.index, g.lost) for g in ctl.watch.sample.gpus] == [(0, False)]
        assert ctl.scheduler.gpus == {0}
        assert [g["index"] for g in json.loads(ctl.status_json())["gpus"]] == [0]

    run(test)


# ---- a daemon-reload while starts are in flight ------------------------------------------------


class HeldScan:
    """The controller's first rescan (after start-up's own read, made before it is
    ready) reads the unit files, then waits for `go` before it is applied: a scan of many
    units (~1 s at 10,000) under way while the loop goes on. Made before start-up."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read = threading.Event()
        self.go = threading.Event()
        self.scans = 0

        def held(root: str) -> Scan:
            result = scan(root)
            self.scans += 1
            if self.scans == 2:
                self.read.set()
                self.go.wait(ENDS_WITHIN)
            return result

        monkeypatch.setattr(controller_module, "scan", held)

    async def has_read(self) -> None:
        await until(self.read.is_set)

    async def reloaded(self, bed: Bed) -> None:
        """A daemon-reload ends (its Reloading signal): the rescan it begins has read the unit
        files once this returns, and waits for `go`."""
        bed.controller.on_reloading(False)
        await self.has_read()


def test_a_gate_asking_during_a_scan_older_than_its_reload_gets_a_scan_of_its_own(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rescan is under way (a config reload, an earlier daemon-reload) and has read the unit
    files when an admin annotates new.service and runs daemon-reload, whose Reloading signal
    is lost (a full bus queue, which any user can cause). new.service's gate asks: it waited
    for the scan under way, which did not know it, and was let through on it, ungated, onto
    GPU 0 that top.service holds. It gets a scan read after its gate asked."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    cgroup_of[4243] = "new.service"
    held = HeldScan(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.rescans.request()
        await held.has_read()
        write_unit(tmp_path, "new.service", "Priority=50\n")  # daemon-reload: signal lost
        bed.systemd.units["new.service"] = state("new.service", "activating", "start-pre", 5)
        await bed.acquire("new.service", ":1.8", 4243)
        held.go.set()
        await until(lambda: ctl.rescans.task is None)
        await settle()
        assert bed.service.granted == []
        assert ctl.scheduler.is_waiting("new.service")
        assert ctl.scheduler.grants() == {"low.service": frozenset({0})}
        assert held.scans == 3  # start-up's, the one under way, the one for its gate

    run(test)


def start_in_flight(bed: Bed, way: str) -> Callable[[], Any]:
    """urgent.service's start, as systemd shows it right after a daemon-reload: a start job
    queued (its JobNew), its gate seen in systemd's signal (the pipe), or its gate's call."""
    ctl = bed.controller
    job = "/org/freedesktop/systemd1/job/7"
    if way == "queued":
        bed.systemd.units["urgent.service"] = state(
            "urgent.service", "inactive", "dead", 7, "start"
        )
        ctl.on_job_new(7, job, "urgent.service")
        return lambda: asyncio.sleep(0.1)  # past QUEUED_DELAY: the queue is read
    bed.systemd.units["urgent.service"] = state(
        "urgent.service", "activating", "start-pre", 7, "start"
    )
    if way == "pipe":
        ctl.on_job_new(7, job, "urgent.service")
        signal_of(bed, "urgent.service", {**at_gate(), "Job": (7, job)})
        return settle
    return lambda: bed.acquire("urgent.service", ":1.9", 4242)


WAYS = ["queued", "pipe", "dbus"]


async def start_during_rescan(bed: Bed, held: HeldScan, way: str) -> None:
    """bed's controller starts; a daemon-reload's rescan reads the unit files, and
    urgent.service's start comes (`way`, as in start_in_flight) before the scan is applied."""
    await bed.controller.start()
    await held.reloaded(bed)
    await start_in_flight(bed, way)()


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("edit", ["less urgent", "unannotated"])
def test_a_start_right_after_a_daemon_reload_is_judged_on_what_that_reload_read(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    way: str,
    edit: str,
) -> None:
    """`gpuslice enroll urgent --priority 95` (or its annotation taken out), then
    `systemctl daemon-reload && systemctl start urgent`: systemd runs the new unit files
    while the controller still reads them (its rescan, off the loop: ~35 ms at 250 units,
    ~1 s at 10,000). Its start was judged on the scan before, with priority 10, and
    low.service (90) was stopped for a unit that now waits behind it, or that is no longer
    managed: its work lost, and then thrash as each came back. The start is judged once
    the rescan is read: low.service keeps its GPU."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    held = HeldScan(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        if edit == "less urgent":
            write_unit(tmp_path, "urgent.service", "Priority=95\n")
        else:
            write_unannotated(tmp_path, "urgent.service")
        await held.reloaded(bed)
        await start_in_flight(bed, way)()
        held.go.set()
        await until(lambda: ctl.rescans.task is None)
        await settle()
        assert ("stop", "low.service") not in bed.systemd.calls
        assert ctl.scheduler.grants() == {"low.service": frozenset({0})}
        if edit == "less urgent":
            assert ctl.scheduler.is_waiting("urgent.service")
        else:
            assert not ctl.scheduler.is_waiting("urgent.service")
            if way == "dbus":
                assert bed.service.granted == [("urgent.service", "")]

    run(test)


@pytest.mark.parametrize("way", WAYS)
def test_a_start_held_back_by_a_rescan_is_left_to_the_next_controller_when_this_one_stops(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """`gpuslice enroll urgent --priority 95`, `systemctl daemon-reload`, and urgent's start
    comes during the rescan; `systemctl restart gpuslice` then stops the controller, and
    asyncio.run cancels the rescan. Judged at that cancel on the scan before (priority 10),
    low.service (90) was stopped, its work lost, by a controller on its way out, for a unit
    that now waits behind it. The next controller reads the unit files anew."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    held = HeldScan(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        write_unit(tmp_path, "urgent.service", "Priority=95\n")
        await held.reloaded(bed)
        await start_in_flight(bed, way)()
        task = ctl.rescans.task
        assert task is not None
        task.cancel()  # as asyncio.run does once run() returns
        with contextlib.suppress(asyncio.CancelledError):
            await task
        held.go.set()
        await settle()
        assert ("stop", "low.service") not in bed.systemd.calls
        assert bed.service.granted == []
        assert ctl.scheduler.grants() == {"low.service": frozenset({0})}

    run(test)


@pytest.mark.parametrize("way", WAYS)
def test_a_start_held_back_by_a_rescan_is_served_once_it_is_read(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """The same with an annotation the reload left as it was: the start held back is not
    lost: it preempts low.service once the rescan is read, and is granted GPU 0."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    held = HeldScan(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await start_during_rescan(bed, held, way)
        assert ("stop", "low.service") not in bed.systemd.calls
        held.go.set()
        await until(lambda: ("stop", "low.service") in bed.systemd.calls)
        assert ctl.scheduler.is_waiting("urgent.service")
        bed.systemd.units["low.service"] = state("low.service", "inactive", "dead")
        ctl.on_unit_changed("low.service", {"ActiveState": "inactive", "SubState": "dead"})
        await settle()
        assert ctl.scheduler.grants() == {"urgent.service": frozenset({0})}

    run(test)


@pytest.mark.parametrize("way", WAYS)
def test_a_start_held_back_is_not_kept_waiting_by_daemon_reloads_that_keep_coming(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """A daemon-reload during every scan (a tool that writes units and reloads in a loop)
    keeps the controller scanning: a start held back until the last scan waited as long
    as they came. It is judged on the first scan that began after it came."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    storm = threading.Event()
    storm.set()
    scans: list[int] = []

    async def test() -> None:
        ctl = bed.controller
        loop = asyncio.get_running_loop()

        def reloading(root: str) -> Scan:
            scans.append(len(scans) + 1)
            if storm.is_set():  # a daemon-reload ends while this scan reads
                loop.call_soon_threadsafe(ctl.on_reloading, False)
                threading.Event().wait(0.02)
            return scan(root)

        await ctl.start()
        monkeypatch.setattr(controller_module, "scan", reloading)
        ctl.on_reloading(False)
        await until(lambda: len(scans) >= 1)
        await start_in_flight(bed, way)()
        await until(lambda: ("stop", "low.service") in bed.systemd.calls)
        assert ctl.rescans.task is not None  # judged while the reloads still come
        storm.clear()
        await until(lambda: ctl.rescans.task is None)

    run(test)


def test_a_start_held_back_by_a_rescan_is_not_woken_as_a_start_never_heard(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """urgent.service's start is seen at its gate while a rescan is under way, and held back
    until it is read; its gate waits in open() on the pipe its JobNew made. An audit then
    (every 30 s; a scan of 10,000 units takes ~1 s) took it for a start whose signals were
    all lost: a warning that they were, `gpuslice_dbus_signals_lost` counted, its gate sent
    to D-Bus (one such line and one dbus-send for each start of a burst held back). It
    waits on its pipe, and is answered there once the scan is read."""
    bed = low_holds_gpu_0(tmp_path, cgroup_of)
    held = HeldScan(monkeypatch)
    pipe = Path(bed.config.runtime_dir) / "gate" / "urgent.service"

    async def test() -> None:
        ctl = bed.controller
        await start_during_rescan(bed, held, "pipe")
        assert ctl.rescans.after_scan and pipe.exists()
        gate = await shell_reader(pipe)  # as a gate that found its pipe
        try:
            with caplog.at_level(logging.WARNING, logger="gpuslice"):
                await ctl.reads.audit()
            await asyncio.sleep(0.1)
            assert gate.returncode is None  # still waits on its pipe
            assert ctl.counters.errors["dbus_signals_lost"] == 0
            assert not any("signals were lost" in m for m in messages(caplog))
            held.go.set()
            await until(lambda: ("stop", "low.service") in bed.systemd.calls)
            assert ctl.gates.holds("urgent.service")  # taken in at its pipe
        finally:
            if gate.returncode is None:
                gate.kill()
            await gate.wait()

    run(test)


@pytest.mark.parametrize("scan_applied", [False, True])
def test_starts_queued_together_right_after_their_reload_are_served_in_priority_order(
    tmp_path: Path, cgroup_of: dict[int, str], monkeypatch: pytest.MonkeyPatch, scan_applied: bool
) -> None:
    """Two units annotated, then `systemctl daemon-reload && systemctl start later sooner`:
    their JobNews come while the rescan reads the new files (taken for unannotated units'),
    no signal of theirs is matched yet, and later.service's gate (priority 50) asks first,
    over D-Bus, before the rescan is applied or once it is, while the reads of the units
    its re-match sends are not answered yet. Known by nothing but its own call, it was
    granted GPU 0, and preempted a moment later by sooner.service (10), whose gate asked
    next: its work lost. Its call waits for systemd's queued starts (gpuslice/queued.py):
    sooner.service gets the GPU, later.service waits, never granted then stopped (README,
    "The rules in short")."""
    bed = Bed(tmp_path, {}, [])
    held = HeldScan(monkeypatch)
    cgroup_of[4242] = "later.service"
    cgroup_of[4243] = "sooner.service"
    answered = answered_when_set(bed, monkeypatch, "unit_state")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        write_unit(tmp_path, "later.service", "Priority=50\n")
        write_unit(tmp_path, "sooner.service", "Priority=10\n")
        await held.reloaded(bed)
        for job, name in ((7, "later.service"), (8, "sooner.service")):
            bed.systemd.units[name] = state(name, "activating", "start-pre", job, "start")
            ctl.on_job_new(job, f"/org/freedesktop/systemd1/job/{job}", name)
        if scan_applied:
            held.go.set()
            await until(lambda: ctl.rescans.task is None)
        await bed.acquire("later.service", ":1.9", 4242)
        held.go.set()
        await until(lambda: ctl.rescans.task is None)
        await settle()
        await bed.acquire("sooner.service", ":1.10", 4243)
        answered.set()
        await settle()
        assert bed.service.granted == [("sooner.service", "0")]
        assert ("stop", "later.service") not in bed.systemd.calls
        assert ctl.scheduler.is_waiting("later.service")
        assert bed.service.pending("later.service")

    run(test)


@pytest.mark.parametrize("signal_when", ["during the rescan", "once it is applied"])
def test_a_known_start_at_its_pipe_waits_for_the_new_starts_of_its_transaction(
    tmp_path: Path,
    cgroup_of: dict[int, str],
    monkeypatch: pytest.MonkeyPatch,
    signal_when: str,
) -> None:
    """later.service (priority 50) is annotated and matched for long; sooner.service (10) is
    annotated, then `systemctl daemon-reload && systemctl start later sooner`: sooner's JobNew
    comes while the rescan reads the new files (dropped: taken for an unannotated unit's),
    and later's start-pre signal, with its InvocationID, while the rescan runs (held until it
    is applied, Rescans.hold_gate) or once it is, before sooner's re-match is answered. Later
    was granted at its pipe, before sooner's start was known, and preempted by sooner's gate
    a moment later: its work lost. Its start waits for a read of systemd's queued starts
    (gpuslice/queued.py): sooner gets the GPU, later waits, never granted then stopped."""
    bed = Bed(tmp_path, {"later.service": "Priority=50\n"}, [])
    held = HeldScan(monkeypatch)
    cgroup_of[4243] = "sooner.service"
    answered = answered_when_set(bed, monkeypatch, "unit_state")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await until(lambda: bed.systemd.watched == {"later.service"})
        write_unit(tmp_path, "sooner.service", "Priority=10\n")
        await held.reloaded(bed)
        for job, name in ((7, "later.service"), (8, "sooner.service")):
            bed.systemd.units[name] = state(name, "activating", "start-pre", job, "start")
            ctl.on_job_new(job, f"/org/freedesktop/systemd1/job/{job}", name)
        path = "/org/freedesktop/systemd1/job/7"
        if signal_when == "during the rescan":
            signal_of(bed, "later.service", {**at_gate(), "Job": (7, path)})
        held.go.set()
        await until(lambda: ctl.rescans.task is None)
        if signal_when == "once it is applied":
            signal_of(bed, "later.service", {**at_gate(), "Job": (7, path)})
        await settle()
        assert not ctl.gates.answered("later.service")
        await bed.acquire("sooner.service", ":1.10", 4243)
        answered.set()
        await settle()
        assert bed.service.granted == [("sooner.service", "0")]
        assert ("stop", "later.service") not in bed.systemd.calls
        assert not ctl.gates.answered("later.service")
        assert ctl.scheduler.is_waiting("later.service")
        assert not ctl.queued.unplaced  # the next gate at its pipe reads nothing

    run(test)


def test_a_read_of_the_queue_sent_during_a_rescan_keeps_the_doubt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JobNew dropped while a rescan reads the unit files (its unit not annotated yet)
    puts later starts at their pipe in doubt (`unplaced`). A read of systemd's queued starts
    sent while that rescan still runs was judged on the scan before, which may not annotate
    that start: the doubt stays, and the next start at its pipe waits for a read again."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    held = HeldScan(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await held.reloaded(bed)
        write_unit(tmp_path, "new.service", "Priority=10\n")
        bed.systemd.units["new.service"] = state("new.service", "inactive", "dead", 8, "start")
        ctl.on_job_new(8, "/org/freedesktop/systemd1/job/8", "new.service")
        assert ctl.queued.unplaced
        ctl.queued.wait("a.service")  # a gate's call while the rescan runs
        await until(lambda: not ctl.queued.reading)
        assert ("start_jobs", "") in bed.systemd.calls
        assert ctl.queued.unplaced
        held.go.set()
        await until(lambda: ctl.rescans.task is None)

    run(test)


@pytest.mark.parametrize("reload", [False, True])
def test_a_start_at_its_pipe_reads_no_queue_when_no_job_new_was_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reload: bool
) -> None:
    """The common path: a known unit's start at its pipe, with no daemon-reload before it
    or one whose rescan dropped no JobNew, is granted at once: no read of systemd's jobs."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    held = HeldScan(monkeypatch)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        if reload:
            await held.reloaded(bed)
            held.go.set()
            await until(lambda: ctl.rescans.task is None)
        bed.systemd.units["a.service"] = state("a.service", "activating", "start-pre", 7, "start")
        ctl.on_job_new(7, "/org/freedesktop/systemd1/job/7", "a.service")
        signal_of(bed, "a.service", {**at_gate(), "Job": (7, "/org/freedesktop/systemd1/job/7")})
        await settle()
        assert ctl.gates.answered("a.service")
        assert ("start_jobs", "") not in bed.systemd.calls

    run(test)


def _rematch_held(bed: Bed) -> asyncio.Event:
    """Units the controller asks systemd to watch are answered once the event returned is set
    (a re-match under way)."""
    rematch = asyncio.Event()
    watch = bed.systemd.watch

    async def late_watch(units: Any) -> list[str]:
        await rematch.wait()
        return await watch(units)

    bed.systemd.watch = late_watch  # type: ignore[method-assign]
    return rematch


def test_a_known_start_at_its_pipe_waits_for_a_new_instance_started_with_it(
    tmp_path: Path, cgroup_of: dict[int, str]
) -> None:
    """`systemctl start later sooner@1` with no daemon-reload: later.service (50) is matched,
    the instance sooner@1.service (10) is not until its re-match is answered, so only its
    gate's call and a read of its queued start (QUEUED_DELAY on) tell its start. Later's
    start-pre signal came first and was granted at its pipe, then preempted by sooner@1.
    Its start waits for a read of systemd's queued starts: sooner@1 gets the GPU."""
    bed = Bed(tmp_path, {"later.service": "Priority=50\n", "sooner@.service": "Priority=10\n"}, [])
    cgroup_of[4243] = "sooner@1.service"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await until(lambda: bed.systemd.watched == {"later.service"})
        rematch = _rematch_held(bed)
        for job, name in ((7, "later.service"), (8, "sooner@1.service")):
            bed.systemd.units[name] = state(name, "activating", "start-pre", job, "start")
            ctl.on_job_new(job, f"/org/freedesktop/systemd1/job/{job}", name)
        signal_of(
            bed, "later.service", {**at_gate(), "Job": (7, "/org/freedesktop/systemd1/job/7")}
        )
        await settle()
        assert not ctl.gates.answered("later.service")
        await bed.acquire("sooner@1.service", ":1.10", 4243)
        rematch.set()
        await settle()
        assert bed.service.granted == [("sooner@1.service", "0")]
        assert ("stop", "later.service") not in bed.systemd.calls
        assert ctl.scheduler.is_waiting("later.service")
        assert not ctl.queued.unplaced

    run(test)


def test_a_start_at_its_pipe_is_judged_after_a_read_of_the_queue_that_failed(
    tmp_path: Path,
) -> None:
    """As above, but systemd's ListJobs fails (no answer within its timeout): later.service,
    held at its pipe for the read, is judged on the starts known once it failed (granted:
    nobody else asked), counted as a D-Bus error. The doubt stays (`unplaced`), yet that
    start is not held for a read again: once is enough, and a queue that keeps failing
    would keep its gate waiting for ever. Nor is it once answered, shown at its gate again."""
    bed = Bed(tmp_path, {"later.service": "Priority=50\n", "sooner@.service": "Priority=10\n"}, [])

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        await until(lambda: bed.systemd.watched == {"later.service"})
        rematch = _rematch_held(bed)

        async def failing_start_jobs() -> list[str]:
            bed.systemd.calls.append(("start_jobs", ""))
            await asyncio.sleep(0)  # a reply read later, as systemd's error is
            raise SystemdError(NO_REPLY, "no answer within 25 s")

        bed.systemd.start_jobs = failing_start_jobs  # type: ignore[method-assign]
        errors = ctl.counters.errors["dbus_call_errors"]
        for job, name in ((7, "later.service"), (8, "sooner@1.service")):
            bed.systemd.units[name] = state(name, "activating", "start-pre", job, "start")
            ctl.on_job_new(job, f"/org/freedesktop/systemd1/job/{job}", name)
        signal_of(
            bed, "later.service", {**at_gate(), "Job": (7, "/org/freedesktop/systemd1/job/7")}
        )
        await until(lambda: ctl.gates.answered("later.service"))
        await settle()
        assert bed.systemd.calls.count(("start_jobs", "")) == 1
        assert ctl.counters.errors["dbus_call_errors"] == errors + 1
        assert ctl.queued.unplaced
        assert not ctl.queued.reading
        # its start, answered, is shown at its gate again (the gate has not exited yet):
        # not held for a read, whatever the doubt
        signal_of(
            bed, "later.service", {**at_gate(), "Job": (7, "/org/freedesktop/systemd1/job/7")}
        )
        await settle()
        assert bed.systemd.calls.count(("start_jobs", "")) == 1
        assert ctl.gates.answered("later.service")
        rematch.set()
        await settle()

    run(test)
