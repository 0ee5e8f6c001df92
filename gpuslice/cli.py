"""The `gpuslice` command: run the controller, show status, check and enroll units."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpuslice import __version__, driver
from gpuslice.annotations import Loader, check_file, load_spec, scan
from gpuslice.config import ConfigError, load_config_with_warnings, read_recorded_state_dir
from gpuslice.core.model import UnitKind, UnitSpec
from gpuslice.envsyntax import NAME_MAX, PATH_MAX
from gpuslice.generator import gate_errors
from gpuslice.newunit import (
    CommandAfterDashes,
    annotation_options,
    annotation_text,
    existing_unit,
    is_user_name,
    lock_unit_dir,
    missing_program,
    own_dropins,
    printable_path,
    read_regular,
    resolve_command,
    unit_name,
    unit_text,
    user_exists,
    write_atomically,
    written_by_new,
)
from gpuslice.paths import BOOT_RECORD, CONFIG_PATH
from gpuslice.unitfiles import (
    MAX_FILE_SIZE,
    UnitFile,
    UnitIndex,
    fits_dropin_dir,
    is_template,
    is_valid_unit_name,
    printable,
)

if TYPE_CHECKING:
    from dbus_next.aio import MessageBus

    from gpuslice.checkpoint import CheckpointError, CheckpointSettings, Resumed
    from gpuslice.core.scheduler import Action, Phase, SavedState
    from gpuslice.state import StateStore

ENROLL_DROPIN = "gpuslice.conf"
ENROLL_MARKER = "# Written by `gpuslice enroll`"
UNIT_DIR = "etc/systemd/system"  # below --root: where `new` and `enroll` write
# release-jobs runs in prerm, and `apt remove` waits for it: no resume starts after this many
# seconds (one under way is left to finish: a restore cut short loses its process for good).
RELEASE_DEADLINE = 120.0
# A `systemctl thaw` of release-jobs' is given this long at most, and no more than is left
# of RELEASE_DEADLINE; past it, THAW_LATE: a thaw is never skipped (a unit left frozen with
# no controller would never run again), but a systemd that does not answer holds `apt
# remove` no longer than that per frozen unit
THAW_TIMEOUT = 60.0
THAW_LATE = 5.0
# A `systemctl show` is given this long at most. release-jobs shows the preempted units (each
# an instance per job: thousands) SHOW_AT_ONCE to a call (argv stays far below its limits),
# within what is left of RELEASE_DEADLINE, at least SHOW_LATE: one call each, 30 s each,
# held `apt remove` for minutes
SHOW_TIMEOUT = 30.0
SHOW_AT_ONCE = 500
SHOW_LATE = 5.0
# how long a gpuslice command waits for the bus: a connection to be made (a bus daemon that
# takes it and never authenticates it), a call to be answered (the controller's Status,
# Plan, Reload; systemd saying when it started, for release-jobs, which `apt remove` waits on)
BUS_TIMEOUT = 30.0
# this boot as a controller of this boot told it (paths.BOOT_RECORD), for release-jobs
THIS_BOOT_RECORD = Path(BOOT_RECORD)

config_option = click.option(
    "--config",
    "config_path",
    default=CONFIG_PATH,
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The gpuslice configuration file.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuslice")
def main() -> None:
    """Priority scheduling of GPU jobs that are ordinary systemd units.

    Annotate a unit with an [X-GPUSlice] section (Priority=0-999, lower is more urgent;
    Type=on-demand|background; GPUs=N; Requeue=yes|no), run `systemctl daemon-reload`,
    and start it with `systemctl start`. Decisions are logged to `journalctl -u gpuslice`.
    """


@main.command()
@config_option
def controller(config_path: str) -> None:
    """Run the controller daemon (started by gpuslice.service)."""
    # Until run() takes SIGHUP in, its default action would end the controller (controller.run);
    # the file is not read yet: nothing to reload.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from gpuslice.controller import run

    sys.exit(asyncio.run(run(Path(config_path), os.environ.get("GPUSLICE_BUS_ADDRESS"))))


@main.command("release-gates", hidden=True)
@config_option
def release_gates(config_path: str) -> None:
    """Send every gate that waits on a pipe to D-Bus (ExecStopPost= of gpuslice.service):
    a gate that opened its pipe before the controller went away must not wait for a writer
    that will never come."""
    _release_gates(config_path)


def _release_gates(config_path: str) -> None:
    from gpuslice.config import runtime_dirs_of_this_boot
    from gpuslice.gatepipes import wake_and_remove
    from gpuslice.paths import (
        DEFAULT_RUNTIME_DIR,
        RUNTIME_DIR_ENV,
        RUNTIME_DIR_RECORD,
        gate_pipe_dir,
    )

    bad: ConfigError | None = None
    try:
        configured = [load_config_with_warnings(Path(config_path))[0].runtime_dir]
    except ConfigError as e:
        # the controller may have started before the file went bad, with its runtime_dir
        # (the generator points the gates there too), or on the defaults: release in both
        configured = [e.valid.get("runtime_dir", DEFAULT_RUNTIME_DIR), DEFAULT_RUNTIME_DIR]
        bad = e
    # where the controller that stopped made its pipes: the runtime_dir of this boot, which
    # config.yaml may no longer say (paths.RUNTIME_DIR_RECORD); released in each, to be sure
    runtime_dirs = sorted(
        runtime_dirs_of_this_boot(os.environ.get(RUNTIME_DIR_ENV), RUNTIME_DIR_RECORD, *configured)
    )
    if bad is not None:
        click.echo(f"gpuslice release-gates: {bad}; using {', '.join(runtime_dirs)}", err=True)
    for runtime_dir in runtime_dirs:
        wake_and_remove(gate_pipe_dir(runtime_dir))


@main.command("release-jobs", hidden=True)
@config_option
def release_jobs(config_path: str) -> None:
    """Undo what only the controller would undo, once gpuslice is being removed and its
    controller has stopped (debian/gpuslice.prerm, `make uninstall`; with it still running,
    nothing is done, as thawing behind its back would fight it): no controller will
    ever thaw, resume or requeue a unit again. A unit frozen beside a more urgent one
    (Preempt=freeze) kept its GPU memory, so it is thawed: left frozen, it held that memory
    and never ended. A unit suspended by cuda-checkpoint in this boot, still active and
    frozen, is resumed by the controller's own code (`_resume_left`): frozen for ever with
    its memory in host memory, only a stop (its work lost) ended it. Thaws come first, then
    resumes, most urgent first, as the controller orders them: a resume needs GPU memory,
    which other jobs may hold now. Each is named on stderr with what was done: resumed (how
    many processes restored), or thawed with nothing to restore (cuda-checkpoint found no
    process checkpointed), never "resumed" for a restore that did not happen. One whose
    resume fails (the tool missing or changeable by others, a restore refused or out of GPU
    memory, a timeout) with nothing restored is left frozen, as it was; one that failed after
    restoring some of its processes is stopped (`systemctl stop`, as the controller stops a
    unit whose resume failed): frozen again it would hold that GPU memory for ever, and the
    rest can never be resumed. No resume starts RELEASE_DEADLINE seconds after this began:
    `apt remove` waits; the units left are named, left suspended, their work kept. These,
    a preempted one, which nothing will start again, and a suspended one systemctl did not
    show (not resumed: it may be down), are named on stderr with why and what to do,
    instead of being left silently. What it did is saved in the state it read
    (`_record_released`): a gpuslice installed again this boot judges those units as they
    are, not as frozen or suspended still, and one installed again in any boot owes those
    named preempted no comeback (`_released`): the admin was told to start them. Units are
    acted on for a state of this boot alone, the boot told as the controller tells it
    (`state.same_boot`, with systemd's start: a container restarted keeps the kernel's boot
    id), and as a controller of this boot recorded it while it can (`_this_boot`): one of
    an earlier boot names units whose processes are gone, and a unit of that name now is
    another. When this boot cannot be told (no record, systemd not reachable on the bus),
    no unit is touched: each is named. The controller's bus name is held meanwhile
    (`_controllers_name`): a controller started then waits for it before it reads the
    state; one that holds it already keeps its units."""
    _release_jobs(config_path)


def _release_jobs(config_path: str) -> None:
    deadline = time.monotonic() + RELEASE_DEADLINE
    controller = _unit_state("gpuslice.service").get("ActiveState", "unknown")
    if controller not in ("inactive", "failed"):  # its stop refused (policy-rc.d), or unknown
        click.echo(
            f"gpuslice release-jobs: gpuslice.service is {printable(controller, 60)}: "
            "its units are left to it",
            err=True,
        )
        return
    with _controllers_name(os.environ.get("GPUSLICE_BUS_ADDRESS")) as taken:
        if taken:  # a controller started since the look above: it loaded the state first
            click.echo(
                f"gpuslice release-jobs: {printable(taken, 300)}: its units are left to it",
                err=True,
            )
            return
        _release_stopped(config_path, deadline)


@contextlib.contextmanager
def _controllers_name(address: str | None) -> Iterator[str]:
    """Hold the controller's bus name (service.BUS_NAME) on a connection of release-jobs' own
    while it thaws, resumes and saves: every controller claims that name before it reads or
    writes anything (Controller.start), so it is the lock both honour. A controller started
    meanwhile (`systemctl start gpuslice` beside a `gpuslice release-jobs` run by hand, a
    Restart= with no removal drop-in to skip it) is refused it, and waits, having loaded
    nothing, until it is let go (SchedulerService.claim_name, told by the RELEASING every
    call to the controller's object is answered with meanwhile, `answer_releasing`);
    before, it loaded the state as it was before release-jobs saved, took a unit
    release-jobs was resuming for suspended still, and granted that unit's GPU to another
    (two jobs on one GPU). Yields "" while held, or why
    not: the name is owned (a controller started after release-jobs' look at
    gpuslice.service). Nothing is held, and "" yielded, when no bus takes the connection or
    the claim (no bus: no controller can claim it either; not allowed: a bus without
    gpuslice's policy). The connection runs in a thread of its own, so that calls sent to
    the name meanwhile (a gate's Acquire) are answered with an error at once, not left
    waiting until release-jobs ends."""
    from dbus_next.constants import NameFlag, RequestNameReply

    from gpuslice.service import BUS_NAME, answer_releasing
    from gpuslice.systemd import close_bus, open_bus

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gpuslice-name", daemon=True)
    thread.start()
    held: list[MessageBus] = []

    async def claim() -> str:
        if _no_bus_socket(address):  # said before dbus-next makes a socket it leaves open
            return ""
        try:
            bus = await open_bus(address, BUS_TIMEOUT)
        except Exception:  # no bus socket, refused, silent: no controller claims it either
            return ""
        held.append(bus)
        bus.add_message_handler(answer_releasing)  # before a call can reach it by the name
        try:
            reply = await asyncio.wait_for(
                bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE), BUS_TIMEOUT
            )
        except Exception:  # AccessDenied (no policy of gpuslice's on this bus), silent
            return ""
        if reply in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
            return ""
        return f"{BUS_NAME} is owned by another process, a controller started meanwhile"

    async def let_go() -> None:
        for bus in held:
            if bus.connected:
                bus.disconnect()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(bus.wait_for_disconnect(), BUS_TIMEOUT)
            close_bus(bus)

    try:
        yield asyncio.run_coroutine_threadsafe(claim(), loop).result()
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(let_go(), loop).result(BUS_TIMEOUT + 5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def _no_bus_socket(address: str | None) -> bool:
    """Whether every way to the bus (`address`, else the system bus's) is a socket file that
    is not there: dbus-next leaves open the socket it made for a connect() that failed."""
    from dbus_next._private.address import get_bus_address, parse_address
    from dbus_next.constants import BusType

    try:
        ways = parse_address(address or get_bus_address(BusType.SYSTEM))
    except Exception:  # dbus-next says why when it connects
        return False
    return all(
        kind == "unix" and "path" in options and not os.path.exists(options["path"])
        for kind, options in ways
    )


def _release_stopped(config_path: str, deadline: float) -> None:
    """release-jobs' work once gpuslice.service is stopped and its name held."""
    from gpuslice.checkpoint import CheckpointError, CheckpointSettings
    from gpuslice.config import Config, runtime_dirs_of_this_boot
    from gpuslice.core.model import PRIORITY_MAX
    from gpuslice.core.scheduler import Phase
    from gpuslice.paths import DEFAULT_STATE_DIR, RUNTIME_DIR_RECORD, STATE_DIR_RECORD
    from gpuslice.state import StateStore, find_saved, same_boot

    try:
        config = load_config_with_warnings(Path(config_path))[0]
    except ConfigError as e:  # the controller kept its last good file's settings, or defaults
        config = Config(**e.valid)
    # state_dir edited since the controller last started: its state is still in the old one
    # (none recorded: the default, where a gpuslice without the record saved it)
    recorded = read_recorded_state_dir(STATE_DIR_RECORD) or DEFAULT_STATE_DIR
    state_path, found = find_saved(Path(config.state_dir), Path(recorded))  # read once
    # the stand-in is in the runtime_dir the controller ran with this boot (pinned at its
    # start), which config.yaml may no longer name
    runtime_dir = runtime_dirs_of_this_boot(None, RUNTIME_DIR_RECORD, config.runtime_dir)[0]
    store = StateStore(state_path, Path(runtime_dir))
    store.read_ahead = found  # read once: to choose it and to load it
    saved, saved_boot = store.load()
    phases = {name: Phase(entry[1]) for name, entry in saved.holders.items()}
    thaws = {n for n, p in phases.items() if p is Phase.FROZEN} | set(saved.thaw_owed)
    caught = {n for n, p in phases.items() if p in (Phase.SUSPENDING, Phase.RESUMING)}
    stopping = {n for n, p in phases.items() if p is Phase.STOPPING}
    of_boot = thaws | caught | stopping | set(saved.suspended)  # true in its boot alone
    # holders and suspended units of another boot ran no process in this one (the
    # controller drops them too, judging the boot as it does: same_boot); a suspended unit
    # then was preempted (forget_boot). Only a state that names them needs this boot's id.
    this_boot, unknown = _this_boot() if saved_boot and of_boot else ("", "")
    ours = same_boot(saved_boot, this_boot)
    holders = saved.holders if ours else {}
    to_thaw = thaws if ours else set()
    suspended = set(saved.suspended) | caught if ours else set()
    preempted = set(saved.preempted) | (stopping if ours else set())
    if unknown:  # a unit of that name may be another now: none is touched, each is named
        _name_left_alone(unknown, thaws, caught | set(saved.suspended), stopping)
        preempted -= of_boot
    elif not ours:
        preempted |= set(saved.suspended)

    def order(unit: str) -> tuple[int, int, int, int, str]:
        """The controller's order: thaws (Scheduler.schedule thaws before it resumes), then
        units caught between suspend and resume (they still hold their GPUs: its `recover`
        resumes them at once), then suspended units most urgent first (`_resume_order`: the
        priority it last held them on, then who was suspended first); the rest by name."""
        if unit in suspended:
            priority = saved.terms[unit][0] if unit in saved.terms else PRIORITY_MAX
            seq = saved.suspended[unit][1] if unit in saved.suspended else holders[unit][2]
            return (1, 0 if unit in holders else 1, priority, seq, unit)
        return (0 if unit in to_thaw else 2, 0, 0, 0, unit)

    settings = CheckpointSettings.from_config(config)
    thawed: list[str] = []
    resumed: dict[str, Phase] = {}  # in the order done: running again, or being stopped
    units = sorted(to_thaw | suspended | preempted, key=order)
    only_preempted = [u for u in units if u not in to_thaw and u not in suspended]
    states: dict[str, dict[str, str]] | None = None
    handed_back: set[str] = set()  # told nothing will start them again: owed no comeback
    for unit in units:
        if unit in to_thaw or unit in suspended:  # few; each read as it is acted on
            shown = _unit_state(unit)
        else:
            if states is None:  # last in the order: shown together, once the rest is done
                states = _unit_states(only_preempted, max(deadline, time.monotonic() + SHOW_LATE))
            shown = states.get(unit, {})
        # one being stopped only once systemd shows it down: its GPUs are still its own
        if unit in preempted and (
            unit not in stopping or shown.get("ActiveState") in ("inactive", "failed")
        ):
            handed_back.add(unit)
        frozen = shown.get("FreezerState") in ("frozen", "freezing")
        where = f"gpuslice is being removed: {printable(unit, 300)}"
        if unit in suspended and shown.get("ActiveState") == "active":
            state = printable(shown.get("FreezerState", "unknown"), 20)
            if not frozen:
                why = f"systemd shows it {state}"
            elif time.monotonic() > deadline:
                why = f"release-jobs spent its {RELEASE_DEADLINE:g} s on the units before it"
            else:
                kept = saved.checkpointed.get(unit)  # a suspended unit's: of this boot
                outcome = _resume_left(unit, settings, None if kept is None else kept[0])
                if not isinstance(outcome, CheckpointError):
                    click.echo(f"{where} {_resumed(outcome)}", err=True)
                    resumed[unit] = Phase.RUNNING
                    continue
                if outcome.restored:
                    stopped, words = _stop_partly_resumed(unit, outcome)
                    click.echo(f"{where} {words}", err=True)
                    resumed[unit] = Phase.STOPPING if stopped else Phase.RUNNING
                    continue
                why = outcome.reason
            click.echo(
                f"{where} is left suspended by cuda-checkpoint: nothing can resume it now; "
                f"`systemctl stop {printable(unit, 300)}` ends it (not resumed: "
                f"{printable(why, 600)})",
                err=True,
            )
        elif unit in suspended and not shown:
            # `systemctl show` failed or took its 30 s: resumed unseen, a unit that is down
            # would be taken for running again (its GPUs booked by the next controller)
            named = printable(unit, 300)
            click.echo(
                f"{where} may be left suspended by cuda-checkpoint: systemctl did not show "
                "its state, so it was not resumed, and nothing can resume it now; if "
                f"`systemctl is-active {named}` says active, it is frozen with its GPU memory "
                f"in host memory: `systemctl stop {named}` ends it",
                err=True,
            )
        elif unit in to_thaw and (frozen or not shown):
            # a state that cannot be read (`systemctl show` failed or took its 30 s) skips no
            # thaw: left frozen, the unit would never run again, and systemd thaws a unit that
            # is not frozen as a no-op. Each thaw up to THAW_TIMEOUT, one after another, held
            # `apt remove` past the deadline by as much as they took (a systemd that does not
            # answer)
            left = deadline - time.monotonic()
            if _thaw(unit, min(THAW_TIMEOUT, max(left, THAW_LATE))):
                thawed.append(unit)
            elif frozen:
                click.echo(f"{where} stays frozen: `systemctl thaw` failed", err=True)
            else:  # unseen: systemd refuses to thaw a unit that is down, not frozen at all
                named = printable(unit, 300)
                click.echo(
                    f"{where} may stay frozen: systemctl did not show its state, and "
                    "`systemctl thaw` failed (as it does for a unit that is not running); if "
                    f"`systemctl show -p FreezerState {named}` says frozen, "
                    f"`systemctl thaw {named}` lets it run",
                    err=True,
                )
        elif unit in preempted and shown.get("ActiveState") in (
            "inactive",
            "failed",
            "deactivating",
        ):
            click.echo(
                f"{where} was preempted and nothing will start it again: "
                f"`systemctl start {printable(unit, 300)}` if it is still wanted",
                err=True,
            )
    unshown = [u for u in only_preempted if states is not None and not states.get(u)]
    if unshown:
        click.echo(
            f"gpuslice is being removed: {len(unshown)} more units were preempted (the first "
            f"{printable(unshown[0], 300)}), which systemctl did not show within release-jobs' "
            f"{RELEASE_DEADLINE:g} s: nothing will start again those of them that are down",
            err=True,
        )
    _record_released(store, saved_boot, saved, _released(saved, thawed, resumed, handed_back))


def _thaw(unit: str, timeout: float) -> bool:
    """`systemctl thaw` of the unit, given `timeout` seconds: whether it did."""
    try:
        command = ["systemctl", "thaw", "--", unit]
        return subprocess.run(command, check=False, timeout=timeout).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _released(
    saved: SavedState,
    thawed: list[str],
    resumed: dict[str, Phase],
    handed_back: Collection[str],
) -> SavedState:
    """The saved state once release-jobs thawed (`thawed`), resumed or stopped (`resumed`:
    running again, or being stopped) these units, as the controller records what it did
    itself: a unit frozen beside another runs again (`thaw_done`; a thaw owed is paid), one
    resumed holds its GPUs running (`resumed`: a thaw owed, as its ThawUnit may have failed),
    one stopped holds them until systemd shows it down (`resume_failed`: then preempted,
    and Requeue= decides). Kept frozen or suspended, the next controller of this boot
    (`apt install` again) said a unit thawed here was thawed outside and never froze it
    again, and booked no GPU for a unit resumed here until a resume found nothing to
    restore: another unit was granted the GPU it runs on. The preempted units it told the
    admin nothing will start again (`handed_back`: preempted, suspended in an earlier boot,
    or down since a stop of the controller's) are theirs now, owed no comeback, as a
    preemption the controller forgets (`_forget_end`): kept, the next controller, of this
    boot or a later one, started again a job the admin had started by hand meanwhile and
    that had finished. What the suspends checkpointed goes with each unit no longer
    suspended. Everything else is kept."""
    from gpuslice.core.scheduler import Phase

    holders = dict(saved.holders)
    suspended = dict(saved.suspended)
    seq = saved.seq
    gone: set[str] = set()  # no longer a holder or suspended: its terms go too
    for unit in handed_back:
        if unit in suspended:  # one of an earlier boot: preempted with it (forget_boot)
            del suspended[unit]
            gone.add(unit)
        if unit in holders and holders[unit][1] == Phase.STOPPING.value:
            del holders[unit]  # down: preempted once the next controller saw it so
            gone.add(unit)
    for unit in thawed:
        gpus, phase, held_since, _ = holders.get(unit, ((), "", 0, ""))
        if phase == Phase.FROZEN.value:
            holders[unit] = (gpus, Phase.RUNNING.value, held_since, "")
    for unit, now in resumed.items():
        if unit in suspended:  # held anew, as a resume numbers its holder (Scheduler)
            gpus, seq = suspended.pop(unit)[0], seq + 1
            holders[unit] = (gpus, now.value, seq, "")
        elif unit in holders:  # caught between suspend and resume
            gpus, _, held_since, _ = holders[unit]
            holders[unit] = (gpus, now.value, held_since, "")
    owed = [n for n in saved.thaw_owed if n not in thawed and n not in gone]
    owed += [n for n, now in resumed.items() if now is Phase.RUNNING and n not in owed]
    frozen_for = {
        n: units
        for n, units in saved.frozen_for.items()
        if n in holders and holders[n][1] == Phase.FROZEN.value
    }
    return replace(
        saved,
        holders=holders,
        suspended=suspended,
        seq=seq,
        frozen_for=frozen_for,
        thaw_owed=owed,
        preempted={n: at for n, at in saved.preempted.items() if n not in handed_back},
        wait_failed=[n for n in saved.wait_failed if n not in handed_back],
        requeued=[n for n in saved.requeued if n not in handed_back],
        terms={n: t for n, t in saved.terms.items() if n not in gone},
        checkpointed={n: c for n, c in saved.checkpointed.items() if n in suspended},
    )


def _record_released(store: StateStore, boot: str, was: SavedState, now: SavedState) -> None:
    """Save `now`, what release-jobs did to the state it loaded (`was`), with the store's own
    atomic save, numbered after it, for the next controller of this boot to judge those units
    as they are. Only over the state it read: none is written when nothing was done, when
    neither the state file nor the stand-in is there any more, when one was saved since or
    cannot be read now, or when gpuslice.service is no longer stopped (started meanwhile,
    where no bus name could be held: it loaded the old state, or loads it, and saves its
    own). While release-jobs holds the controller's name (`_controllers_name`) no controller
    gets that far; without it, one that starts after the last look loaded the state as it
    was, and its saves replace this one; each save is whole (rename(2)). Left, it is said:
    the units it names are taken for still frozen or suspended, and those handed back are
    owed a comeback still."""
    if now == was:
        return
    why = store.saved_since()
    if why is None:  # removed: no controller reads what it said
        return
    if not why:
        controller = _unit_state("gpuslice.service").get("ActiveState", "unknown")
        if controller not in ("inactive", "failed"):
            why = f"gpuslice.service is {printable(controller, 60)} now"
    if not why:
        try:
            store.save(now, boot)
        except OSError as e:
            why = f"cannot write it: {e.strerror or e}"
        else:
            with contextlib.suppress(OSError):  # written; a power cut ends the boot it is of
                store.flush()
            return
    changed = sorted(
        {n for n in now.holders if now.holders[n] != was.holders.get(n)}
        | (set(was.thaw_owed) - set(now.thaw_owed)) & set(now.holders)
    )
    # handed back (`_released`): thousands, an instance per job
    owed = sorted(
        set(was.preempted) - set(now.preempted)
        | (set(was.holders) | set(was.suspended)) - set(now.holders) - set(now.suspended)
    )
    told = []
    if changed:
        names = ", ".join(printable(n, 300) for n in changed)
        told.append(f"this boot takes {names} for still frozen or suspended")
    if owed:
        told.append(
            f"brings back {len(owed)} units named preempted above (the first "
            f"{printable(owed[0], 300)}), even one started by hand since"
        )
    click.echo(
        f"gpuslice release-jobs: the saved state {printable(str(store.path), 300)} is left as it "
        f"was ({printable(why, 300)}): a gpuslice started again {' and '.join(told)}",
        err=True,
    )


def _this_boot() -> tuple[str, str]:
    """This boot as the controller tells it at its start: as a controller of this boot
    recorded it (THIS_BOOT_RECORD, in /run, which every boot empties), else asked as it asks
    (`Systemd.boot_id`, of the systemd on the bus gpuslice is told, GPUSLICE_BUS_ADDRESS):
    the kernel's boot id alone is a container's last boot's too when it restarted without
    its host. The record comes first: in a container the controller's sandbox reads the
    host kernel's boot id and release-jobs the container's, and asked here, no saved state
    was ever this boot's. ("", why) when it cannot be told: no record, and no bus, systemd
    refusing or silent for BUS_TIMEOUT s (`apt remove` waits), no kernel boot id."""
    from gpuslice.state import read_recorded_boot

    recorded = read_recorded_boot(THIS_BOOT_RECORD)
    if recorded is not None:
        return recorded, ""
    try:
        return asyncio.run(asyncio.wait_for(_read_boot(), BUS_TIMEOUT)), ""
    except TimeoutError:
        return "", f"systemd did not answer within {BUS_TIMEOUT:g} s"
    except Exception as e:  # no bus socket, refused, a bad GPUSLICE_BUS_ADDRESS, D-Bus errors
        return "", _reason(e)


async def _read_boot() -> str:
    from gpuslice.systemd import Systemd

    systemd = await Systemd.connect(os.environ.get("GPUSLICE_BUS_ADDRESS"))
    try:
        return await systemd.boot_id()
    finally:
        systemd.bus.disconnect()


def _name_left_alone(why: str, frozen: set[str], suspended: set[str], stopping: set[str]) -> None:
    """Say that release-jobs cannot tell whether the saved state is this boot's (`why`), and
    name each unit that only a state of this boot would have it thaw, resume, stop or call
    preempted, with what to do if it is still so: a state of an earlier boot (a container
    restarted without its host) names units whose processes are gone, and a unit of that
    name now is someone else's, never to be thawed or stopped on its word."""
    click.echo(
        f"gpuslice release-jobs: cannot tell whether the saved state is of this boot "
        f"({printable(why, 300)}): a container restarted without its host has the kernel "
        "boot id of its last boot, whose units are others now; no unit the state names is "
        "thawed, resumed or stopped",
        err=True,
    )
    for unit in sorted(frozen | suspended | stopping):
        shown = printable(unit, 300)
        if unit in suspended:
            what = "suspended by cuda-checkpoint"
            then = f"if systemd shows it frozen, `systemctl stop {shown}` ends it"
        elif unit in frozen:
            what = "frozen beside a more urgent unit"
            then = f"if systemd shows it frozen, `systemctl thaw {shown}`"
        else:
            what = "preempted"
            then = f"if it is down, `systemctl start {shown}` if it is still wanted"
        click.echo(
            f"gpuslice is being removed: {shown} is left as it is ({what} in a state that "
            f"may be an earlier boot's); {then}",
            err=True,
        )


def _resumed(done: Resumed) -> str:
    """What release-jobs' resume of a unit did, in words that claim no restore it did not
    do (the ladder's own, `resumed_words`, the journal's)."""
    from gpuslice.ladder import resumed_words

    words = resumed_words(done)
    if not done.restored:
        return f"thawed, not resumed from host memory: {words}"
    count = len(done.restored)
    return f"resumed from host memory, {count} process{'es' if count > 1 else ''}: {words}"


def _stop_partly_resumed(unit: str, failed: CheckpointError) -> tuple[bool, str]:
    """Stop a unit whose resume restored some of its processes and failed for another: frozen
    again it held their GPU memory for ever, and no controller will try again. Whether its
    stop was sent, and what became of it, in words."""
    shown = printable(unit, 300)
    restored = failed.restored
    pids = ", ".join(map(str, restored[:10])) + (", ..." if len(restored) > 10 else "")
    plural = "s" if len(restored) > 1 else ""
    what = f"restored PID{plural} {pids} but failed for the rest ({printable(failed.reason, 600)})"
    try:
        command = ["systemctl", "stop", "--no-block", "--", unit]
        stopped = subprocess.run(command, check=False, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        stopped = False
    if not stopped:
        return False, (
            f"{what}, and `systemctl stop` failed: it runs thawed, part of its memory never "
            f"restored; `systemctl stop {shown}` ends it"
        )
    return True, (
        f"is being stopped (systemctl stop): its resume {what}; frozen again it would hold "
        "that GPU memory for ever, and nothing can resume the rest now: its work since its "
        "last save is lost"
    )


def _resume_left(
    unit: str, settings: CheckpointSettings, pids: Sequence[int] | None = None
) -> Resumed | CheckpointError:
    """Resume a unit left suspended by the controller that stopped, by the controller's own
    code (Ladder.restore: ThawUnit, then each process that cuda-checkpoint finds checkpointed
    is restored, each locked one unlocked; `pids`: those its suspend checkpointed, as the
    state file kept them, else every process of the unit is asked): what was done, or why
    it failed. The tool is required first (installed, changeable by root alone): nothing is
    thawed without it. A resume that fails once thawed with nothing restored (a restore
    refused, out of GPU memory, timed out) leaves the unit frozen again, as it was; one that
    restored some processes first is left thawed (`restored` on the error) for the caller to
    stop."""
    from gpuslice.checkpoint import CheckpointError, require_tool

    try:
        require_tool(settings.tool, root_only=settings.root_only)
    except CheckpointError as e:
        return e
    return asyncio.run(_resume_by_ladder(unit, settings, pids))


async def _resume_by_ladder(
    unit: str, settings: CheckpointSettings, pids: Sequence[int] | None = None
) -> Resumed | CheckpointError:
    from gpuslice.checkpoint import CheckpointError
    from gpuslice.ladder import Ladder
    from gpuslice.systemd import Systemd

    try:  # `apt remove` waits: a bus daemon that never answers is given up on
        systemd = await Systemd.connect(os.environ.get("GPUSLICE_BUS_ADDRESS"), BUS_TIMEOUT)
    except TimeoutError:
        return CheckpointError(
            f"cannot reach systemd on the system bus (no answer within {BUS_TIMEOUT:g} s)"
        )
    except Exception as e:  # no bus socket, refused, a bad GPUSLICE_BUS_ADDRESS
        return CheckpointError(f"cannot reach systemd on the system bus ({_reason(e)})")
    told = _LadderOutcome()

    def report(event: Callable[[], list[Action]]) -> None:
        event()

    try:
        ladder = Ladder(systemd, told, lambda: None, lambda: settings, report)
        try:
            done = await ladder.restore(unit, pids, recalled=pids is not None)
            if done is not None:
                return done
            failed = CheckpointError("cuda-checkpoint is not installed any more: cannot restore")
        except CheckpointError as e:
            failed = e
        except Exception as e:  # a bug must not end release-jobs: the other units are owed
            failed = CheckpointError(f"gpuslice failed while resuming ({_reason(e)})")
        if failed.restored:  # frozen again, it held their GPU memory for ever
            return failed
        # as it was: thawed, a process left checkpointed would hang (found frozen: ours still)
        await ladder.freeze(unit, thaw_owed=True)
        if told.failed is not None:
            failed.reason += f"; and it could not be frozen again: {told.failed}"
        return failed
    finally:
        systemd.bus.disconnect()


class _LadderOutcome:
    """The core's side of a Ladder (gpuslice.ladder.LadderEvents) for release-jobs, which
    has no scheduler: why the last freeze failed (None when it did not; a resume's outcome
    comes back from Ladder.restore itself)."""

    def __init__(self) -> None:
        self.failed: str | None = None

    def resume_failed(self, name: str, why: str) -> list[Action]:
        self.failed = why
        return []

    def freeze_failed(self, name: str, why: str, *, not_ours: bool = False) -> list[Action]:
        self.failed = why
        return []

    def resumed(self, name: str, detail: str) -> list[Action]:
        return []

    def suspended_done(self, name: str, detail: str) -> list[Action]:
        return []

    def suspend_failed(
        self, name: str, why: str, *, lost: bool = False, not_ours: bool = False
    ) -> list[Action]:
        return []

    def thawed_outside(self, name: str) -> list[Action]:
        return []

    def thaw_done(self, name: str) -> list[Action]:
        return []

    def froze_after_end(self, name: str) -> list[Action]:
        return []


def _unit_state(unit: str, timeout: float = SHOW_TIMEOUT) -> dict[str, str]:
    """The unit's ActiveState and FreezerState as systemctl shows them ({} if it cannot)."""
    shown = _show([unit], timeout)
    return shown[0] if shown else {}


def _unit_states(units: Sequence[str], deadline: float) -> dict[str, dict[str, str]]:
    """Each unit's ActiveState and FreezerState as systemctl shows them ({} if it cannot),
    SHOW_AT_ONCE units to a `systemctl show`, until `deadline`: units left unasked then are
    left out. systemctl prints a block per unit, in the order named (systemd 252 escapes a
    name it finds invalid and shows that unit); blocks that do not match the names in number
    (a systemctl that fails the call) have that call's units asked one by one."""
    states: dict[str, dict[str, str]] = {}
    for start in range(0, len(units), SHOW_AT_ONCE):
        chunk = units[start : start + SHOW_AT_ONCE]
        left = deadline - time.monotonic()
        if left <= 0:
            break
        shown = _show(chunk, min(SHOW_TIMEOUT, left))
        if shown is None:  # it did not answer (or is not there): nor would one by one
            states.update({unit: {} for unit in chunk})
        elif len(shown) == len(chunk):
            states.update(zip(chunk, shown, strict=True))
        else:
            for unit in chunk:
                left = deadline - time.monotonic()
                if left <= 0:
                    return states
                states[unit] = _unit_state(unit, min(SHOW_TIMEOUT, left))
    return states


def _show(units: Sequence[str], timeout: float) -> list[dict[str, str]] | None:
    """What `systemctl show` prints of these units' ActiveState and FreezerState, whatever its
    exit status: a block each, blank-line separated; None if it ran out of `timeout` or could
    not run."""
    command = ["systemctl", "show", "-p", "ActiveState", "-p", "FreezerState", "--", *units]
    try:
        text = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=timeout
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    blocks: list[dict[str, str]] = [{}]
    for line in text.splitlines():
        if line:
            key, _, value = line.partition("=")
            blocks[-1][key] = value
        else:
            blocks.append({})
    return blocks


async def _call_status(address: str | None) -> str:
    return await _call_controller(address, "Status")


async def _call_controller(address: str | None, member: str, *args: str) -> str:
    """One call to the controller's interface on a connection of its own; its JSON answer,
    or a ClickException."""
    bus = await _connect(address)
    try:
        return await _ask(bus, member, *args)
    finally:
        bus.disconnect()


async def _connect(address: str | None) -> MessageBus:
    """A connection to the system bus (GPUSLICE_BUS_ADDRESS's bus where set), or a
    ClickException that says why not."""
    from gpuslice.systemd import open_bus

    try:  # its socket closed when it fails: a watch tries again at each redraw
        return await open_bus(address, BUS_TIMEOUT)
    except Exception as e:  # no bus socket, refused, a bad GPUSLICE_BUS_ADDRESS, silent
        why = f"no answer within {BUS_TIMEOUT:g} s" if isinstance(e, TimeoutError) else _reason(e)
        raise click.ClickException(
            f"cannot reach the system bus to ask the gpuslice controller ({why})"
        ) from None


async def _ask(bus: MessageBus, member: str, *args: str) -> str:
    """One call to the controller's interface on `bus`; its JSON answer, or a
    ClickException in the words each answer gets."""
    from dbus_next import Message, MessageType

    from gpuslice.service import (
        ACCESS_DENIED,
        BUS_NAME,
        INTERFACE,
        LIMITS_EXCEEDED,
        NOT_MANAGED,
        OBJECT_PATH,
        STARTING,
    )

    call = Message(
        destination=BUS_NAME,
        path=OBJECT_PATH,
        interface=INTERFACE,
        member=member,
        signature="s" * len(args),
        body=list(args),
    )
    try:
        reply = await asyncio.wait_for(bus.call(call), BUS_TIMEOUT)
    except TimeoutError:  # a bus daemon that takes calls and passes none on
        raise click.ClickException(
            f"the gpuslice controller did not answer within {BUS_TIMEOUT:g} s; "
            "is it running? Try: systemctl status gpuslice"
        ) from None
    except Exception as e:  # the connection dropped mid-call
        raise click.ClickException(
            f"the gpuslice controller did not answer ({_reason(e)}); "
            "is it running? Try: systemctl status gpuslice"
        ) from None
    if reply is not None and reply.error_name == NOT_MANAGED:
        raise click.ClickException(printable(str(reply.body[0]), 300))
    if reply is not None and reply.error_name == ACCESS_DENIED:
        raise click.ClickException(f"only root may ask the controller for {member}")
    if reply is not None and reply.error_name in (LIMITS_EXCEEDED, STARTING):  # it runs: why not
        detail = printable(str(reply.body[0]) if reply.body else "", 300)
        raise click.ClickException(f"the gpuslice controller refused: {detail}")
    if reply is None or reply.message_type == MessageType.ERROR:
        detail = reply.body[0] if reply is not None and reply.body else "no reply"
        raise click.ClickException(
            f"the gpuslice controller did not answer ({printable(str(detail), 300)}); "
            "is it running? Try: systemctl status gpuslice"
        )
    return str(reply.body[0])


async def _watch_status(address: str | None, interval: float) -> None:
    """`gpuslice status --watch`: the table redrawn every `interval` seconds until cancelled
    (Ctrl-C), each redraw one Status call on ONE connection kept for the whole watch. A new
    connection per redraw cost the bus daemon a Hello each time, and the controller, where
    /proc hides processes, a lookup of the new name's credentials (a unique name is never
    given twice). A failed call (the controller restarting: ServiceUnknown, NoReply) keeps
    the connection; only one the bus dropped is replaced, at the next redraw."""
    from gpuslice.status import render
    from gpuslice.systemd import close_bus

    bus: MessageBus | None = None
    try:
        while True:
            try:
                if bus is not None and not bus.connected:  # the bus dropped it
                    close_bus(bus)
                    bus = None
                if bus is None:
                    bus = await _connect(address)
                shown = render(_answer(await _ask(bus, "Status"), "Status"), time.time())
                shown = _printable_lines(shown)
            except Exception as e:  # the controller restarting: say so, keep watching
                shown = f"no status from the controller: {printable(str(e), 300)}"
            click.clear()
            click.echo(time.strftime("%H:%M:%S ") + f"every {interval:g} s\n\n" + shown)
            await asyncio.sleep(interval)
    finally:
        if bus is not None and bus.connected:
            bus.disconnect()
        elif bus is not None:
            close_bus(bus)


def _finite(text: str) -> float:
    """A JSON number as the controller writes them (allow_nan=False): `1e999` is infinity to
    Python's reader, and the table's sizes and durations raised OverflowError on it."""
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{printable(text, 40)} is not a finite number")
    return number


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")


def _answer(text: str, member: str) -> dict[str, Any]:
    """The controller's JSON answer as an object, or a ClickException that says what came."""
    try:
        data = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise click.ClickException(
            f"the controller's {member} answer is not JSON ({_reason(e)}): {printable(text, 80)}"
        ) from None
    if not isinstance(data, dict):
        raise click.ClickException(
            f"the controller's {member} answer is not a JSON object: {printable(text, 80)}"
        )
    return data


def _malformed(member: str, e: Exception) -> click.ClickException:
    """An answer that is JSON but not what this gpuslice reads (another version, a bug)."""
    what = f"{type(e).__name__}: {printable(str(e), 80)}"
    return click.ClickException(
        f"the controller's {member} answer is not what this gpuslice reads ({what}); "
        f"--json shows it as it came"
    )


def _printable_lines(text: str) -> str:
    """What the controller said, each line escaped: whatever a unit name or a process's name
    holds, no control sequence reaches the terminal."""
    return "\n".join(printable(line, 4000) for line in text.split("\n"))


# ArithmeticError: a number too large for the arithmetic the table does (an int of 400 digits)
_SHAPE_ERRORS = (KeyError, TypeError, AttributeError, ValueError, IndexError, ArithmeticError)


@main.command()
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the stable JSON form (version 1; see gpuslice/status.py).",
)
@click.option("--watch", is_flag=True, help="Redraw in place until Ctrl-C.")
@click.option(
    "-n",
    "--interval",
    type=click.FloatRange(0.1, 3600),
    default=2.0,
    show_default=True,
    help="Seconds between redraws with --watch.",
)
def status(as_json: bool, watch: bool, interval: float) -> None:
    """Show each GPU's holder, waiting units with their reasons, preempted, held,
    finished and failed units."""
    from gpuslice.status import render

    address = os.environ.get("GPUSLICE_BUS_ADDRESS")
    if watch and not as_json:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the watch ends, no traceback
            asyncio.run(_watch_status(address, interval))
        return
    data = _answer(asyncio.run(_call_status(address)), "Status")
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    try:
        shown = render(data, time.time())
    except _SHAPE_ERRORS as e:
        raise _malformed("Status", e) from None
    click.echo(_printable_lines(shown))


@main.command()
@click.argument("unit")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON form.")
def plan(unit: str, as_json: bool) -> None:
    """Say what `systemctl start UNIT` would make gpuslice do now, changing nothing:
    start at once, preempt which units first, or wait and why (as root)."""
    _plan(unit, as_json)


def _plan(unit: str, as_json: bool) -> None:
    if "." not in unit:
        unit += ".service"
    if not is_valid_unit_name(unit):
        raise click.BadParameter(f"{printable(unit)!r}: not a unit name", param_hint="UNIT")
    if is_template(unit):  # systemd starts only instances; one's Devices= may be its name
        raise click.BadParameter(
            f"{unit} is a template: name one of its instances ({unit.replace('@', '@0', 1)})",
            param_hint="UNIT",
        )
    data = _answer(
        asyncio.run(_call_controller(os.environ.get("GPUSLICE_BUS_ADDRESS"), "Plan", unit)),
        "Plan",
    )
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    try:
        lines = [str(data["summary"]), *(f"  {step['message']}" for step in data["decisions"])]
    except _SHAPE_ERRORS as e:
        raise _malformed("Plan", e) from None
    click.echo(_printable_lines("\n".join(lines)))


@main.command()
@click.option(
    "--serve",
    is_flag=True,
    hidden=True,
    help="Answer one HTTP request on standard input (gpuslice-metrics@.service).",
)
def metrics(serve: bool) -> None:
    """Print the Prometheus text exposition of the controller's status (for node_exporter's
    textfile collector). When the controller does not answer: only gpuslice_up 0, exit 1."""
    _metrics(serve)


def _metrics(serve: bool) -> None:
    from gpuslice.metrics import exposition

    failed: list[str] = []

    def scrape() -> bytes:
        address = os.environ.get("GPUSLICE_BUS_ADDRESS")
        try:
            text = asyncio.run(asyncio.wait_for(_call_status(address), 10))
            return exposition(json.loads(text))
        except Exception as e:  # the controller is away, hung, or answered nonsense
            failed.append(printable(str(e) or type(e).__name__, 300))
            click.echo(f"gpuslice metrics: no status from the controller: {failed[-1]}", err=True)
            return exposition(None)

    if serve:
        from gpuslice.exporter import serve_stdin

        serve_stdin(scrape)
        return
    sys.stdout.buffer.write(scrape())
    sys.stdout.flush()
    if failed:
        raise SystemExit(1)


def _not_checkable(path: str) -> str | None:
    """Why `path` cannot be read as a file to check, or None. Only `stat`: a FIFO or a device
    is never opened (opening a FIFO blocks)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return e.strerror or str(e)
    except ValueError as e:  # a NUL in the path
        return str(e)
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory, not a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO, not a regular file"
    return "not a regular file"


def _reason(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return printable(str(e) or type(e).__name__, 200)


@main.command()
@click.argument("files", nargs=-1, type=click.Path())
@click.option(
    "--config",
    "config_path",
    default=CONFIG_PATH,
    show_default=True,
    type=click.Path(),
    help="The gpuslice configuration file.",
)
@click.option(
    "--config-only",
    is_flag=True,
    help="Check only the configuration file (gpuslice.service's ExecReload= runs this).",
)
@click.option("--root", default="/", show_default=True, hidden=True)
def check(files: tuple[str, ...], config_path: str, config_only: bool, root: str) -> None:
    """Validate config.yaml and unit annotations; exit 1 on any error.

    Without FILES, checks the configuration and every installed unit. With FILES, checks
    those unit files (and any .yaml file as a gpuslice configuration).
    """
    _check(files, config_path, config_only, root)


def _check(files: tuple[str, ...], config_path: str, config_only: bool, root: str) -> None:
    if config_only and files:
        raise click.UsageError("--config-only takes no FILES")
    # (severity, line) in the order found
    messages: list[tuple[str, str]] = []

    def error(text: str) -> None:
        messages.append(("error", text))

    yaml_files = [f for f in files if f.endswith((".yaml", ".yml"))]
    unit_files = [f for f in files if f not in yaml_files]
    for path in yaml_files or ([] if files else [config_path]):
        shown = printable(path)
        if path in yaml_files and not os.path.lexists(path):
            error(f"{shown}: cannot read: No such file or directory")
            continue
        try:
            _, warnings = load_config_with_warnings(Path(path))
            messages += [("warning", w) for w in warnings]
        except ConfigError as e:
            messages += [("error", p) for p in e.problems]
        except Exception as e:  # belt and braces: config.py raises only ConfigError
            error(f"{shown}: cannot check: {_reason(e)}")
    checked = 0
    for path in unit_files:
        why = _not_checkable(path)
        try:
            if why is None:
                UnitFile(path, path).read_text()  # unreadable, too large: say so
                messages += [(p.severity, str(p)) for p in check_file(path)]
                checked += 1
        except Exception as e:
            why = _reason(e)
        if why is not None:
            error(f"{printable(path)}: cannot read: {why}")
    if not files and not config_only:
        try:
            loader = Loader(UnitIndex(root))
            result = scan(root, loader)
            messages += [(p.severity, str(p)) for p in result.problems]
            messages += [("error", e) for e in gate_errors(loader, result)]
            checked = len(result.specs)
        except Exception as e:
            error(f"cannot read the unit files below {printable(root)}: {_reason(e)}")
        messages += [("error", p) for p in _device_access_problems(Path(root))]
    for severity, text in messages:
        click.echo(printable(f"{severity}: {text}", 2000), err=True)
    if any(severity == "error" for severity, _ in messages):
        raise SystemExit(1)
    if config_only:
        click.echo(f"ok: {printable(config_path)}, {len(messages)} warning(s)")
    else:
        click.echo(f"ok: {checked} annotated unit(s) checked, {len(messages)} warning(s)")


def _device_access_problems(root: Path) -> list[str]:
    """On a host whose nvidia module is loaded: NVIDIA device nodes that are missing or that
    gpuslice.service's sandbox (its DeviceAllow=, as systemd shows it) would refuse NVML."""
    if not driver.module_version(root)[0]:
        return []
    try:
        shown = subprocess.run(
            ["systemctl", "show", "-P", "DeviceAllow", "gpuslice.service"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return [f"cannot read gpuslice.service's DeviceAllow= to check NVIDIA devices: {e}"]
    return driver.device_access_problems(_device_allow_entries(shown), root)


def _device_allow_entries(shown: str) -> list[str]:
    """`systemctl show -P DeviceAllow` prints "char-nvidia-frontend rw char-nvidia-uvm rw"
    (one line, pairs) or one pair per line, by version: NODE RIGHTS pairs either way."""
    words = shown.split()
    return [f"{words[i]} {words[i + 1]}" for i in range(0, len(words) - 1, 2)]


@main.command()
@click.argument("unit")
@annotation_options
@click.option("--no-reload", is_flag=True, help="Do not run systemctl daemon-reload.")
@click.option("--root", default="/", show_default=True, hidden=True)
def enroll(**options: Any) -> None:
    """Annotate UNIT through a drop-in (for units you cannot edit), validate it, reload."""
    _enroll(**options)


def _enroll(unit: str, no_reload: bool, root: str, **keys: Any) -> None:
    if "." not in unit:
        unit += ".service"
    if not is_valid_unit_name(unit):
        raise click.BadParameter(f"{printable(unit)!r}: not a unit name", param_hint="UNIT")
    if not unit.endswith(".service"):  # the scan reads services only: the rest runs ungated
        raise click.BadParameter(
            f"{unit}: only services are scheduled; enroll the service it starts",
            param_hint="UNIT",
        )
    # An alias (`Alias=`, `ln -s a.service b.service`) is enrolled under the name systemd loads
    # the unit by, where `systemctl edit` puts its drop-ins (an alias's directory, read too,
    # is no place an admin looks for the unit's).
    primary = UnitIndex(root).primary_name(unit)
    if primary != unit:
        click.echo(f"{unit} is an alias of {primary}: enrolling {primary}", err=True)
        unit = primary
    _check_gateable(unit, "UNIT")
    dropin = Path(root) / UNIT_DIR / f"{unit}.d" / ENROLL_DROPIN
    text = f"{ENROLL_MARKER}; edit or remove it with systemctl edit.\n"
    # every key the parser knows by default, so that the drop-in says the whole annotation
    defaults = {"kind": UnitKind.ON_DEMAND.value, "gpus": 1, "requeue": True}
    with _unit_dir_locked(root, dropin):
        previous = read_regular(dropin)
        found = os.path.lexists(dropin)
        # an admin's own gpuslice.conf (the README says any drop-in may carry the section)
        # was replaced whole, its other settings with it
        if found and not (previous or b"").startswith(ENROLL_MARKER.encode()):
            raise click.ClickException(
                f"{dropin} exists and was not written by gpuslice enroll: not overwritten "
                "(edit its [X-GPUSlice] section, or remove it first)"
            )
        made_dir = not os.path.lexists(dropin.parent)
        # none found: created, never replaced (as `new`'s unit: one written since the look stays)
        written = _write(
            dropin,
            text + annotation_text({**defaults, **_given(keys)}),
            exclusive=not found,
            command="enroll",
        )
        spec = _validated(unit, root, dropin, written, previous, made_dir)
        # As `new`'s, under the lock: a failed reload leaves no drop-in that systemd has not
        # loaded (and loads at some later reload), and its undo meets no other command's.
        if not no_reload and (failed := _systemctl_failure("daemon-reload")):
            undone = _undo(dropin, written, previous, made_dir)
            raise click.ClickException(
                f"{failed}, so systemd has not loaded {unit}'s drop-in: {undone}"
            )
    if spec.priority != int(keys["priority"]):
        click.echo(
            f"warning: a later drop-in overrides this one: {unit} has priority {spec.priority}",
            err=True,
        )
    click.echo(f"enrolled {spec.describe()} via {dropin}")


@main.command(cls=CommandAfterDashes)
@click.argument("name")
@annotation_options
@click.option("--user", help="User= the job runs as (default: root).")
@click.option("--workdir", help="WorkingDirectory= (an absolute path).")
@click.option("--now", is_flag=True, help="Start it at once (queued: it may wait for its GPUs).")
@click.option("--no-reload", is_flag=True, help="Do not run systemctl daemon-reload.")
@click.option("--root", default="/", show_default=True, hidden=True)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def new(**options: Any) -> None:
    """Write a complete unit NAME.service that runs COMMAND (after --) as a GPU job.

    gpuslice new voice --priority 10 --memory 8G -- /usr/bin/python3 /srv/voice.py
    """
    _new(**options)


def _new(
    name: str,
    user: str | None,
    workdir: str | None,
    now: bool,
    no_reload: bool,
    root: str,
    command: tuple[str, ...],
    **keys: Any,
) -> None:
    unit = unit_name(name)
    _check_gateable(unit, "NAME")
    if now and no_reload:  # systemd would start the unit it knew before: none, or the old one
        raise click.UsageError("--now needs the daemon-reload that --no-reload leaves out")
    if user is not None and not is_user_name(user):
        raise click.BadParameter(
            f"{printable(user)!r}: not a user name systemd takes (none is empty, '.' or "
            "'..', has a control character, ':' or '/', a blank at either end, or is all "
            "digits but a UID 0-4294967294 other than 65535), or it has a '%' (a specifier) "
            "or a '\\' at the end (which joins the next line)",
            param_hint="--user",
        )
    if user is not None and not user_exists(user):  # systemd would fail each start
        raise click.BadParameter(
            f"{printable(user)!r}: no such user on this host (systemd would fail the start: "
            '"Failed to determine user credentials")',
            param_hint="--user",
        )
    if workdir is not None and (not os.path.isabs(workdir) or not printable_path(workdir)):
        raise click.BadParameter(
            f"{printable(workdir)!r}: not an absolute path (printable ASCII, no backslash "
            "or blank at the end, no '..', names of at most 255 characters)",
            param_hint="--workdir",
        )
    kind = UnitKind(keys["kind"]) if keys.get("kind") else UnitKind.ON_DEMAND
    argv = resolve_command(command)
    text = unit_text(
        unit,
        argv,
        annotation_text(_given(keys)),
        kind=kind,
        user=user,
        workdir=workdir,
    ).encode("utf-8")
    if len(text) > MAX_FILE_SIZE:  # systemd's longest line; the parser reads no more
        raise click.BadParameter(
            f"too long: the unit file would be {len(text)} bytes, at most {MAX_FILE_SIZE}",
            param_hint="COMMAND",
        )
    path = Path(root) / UNIT_DIR / unit
    with _unit_dir_locked(root, path):
        found = existing_unit(unit, Path(root))
        if found is not None and not (found == path and written_by_new(path)):
            raise click.ClickException(
                f"{found} exists and was not written by gpuslice new: not overwritten "
                f"(use gpuslice enroll {unit} to annotate it)"
            )
        previous = read_regular(path) if found is not None else None
        left = own_dropins(unit, Path(root)) if found is None else []
        # none found: created, never replaced (an admin's unit written since the look stays)
        written = _write(path, text, exclusive=found is None)
        spec = _validated(unit, root, path, written, previous)
        click.echo(f"wrote {path}: {spec.describe()}")
        if missing_program(argv[0]):  # not refused: it may be on a later mount
            click.echo(
                f"warning: {printable(argv[0], PATH_MAX)} does not exist (yet): each start of "
                f"{unit} fails (status=203/EXEC) until it does",
                err=True,
            )
        if left:  # a unit of this name before left them; they apply to this one
            click.echo(
                f"warning: drop-ins made before {unit} apply to it too: "
                + printable(", ".join(left), 1000)
                + " (remove those an earlier unit of this name left)",
                err=True,
            )
        # Still under the lock: a reload that fails leaves nothing half-done (a unit on disk
        # that systemd has not loaded, and loads at some later reload), and its undo meets no
        # other `gpuslice new`'s unit.
        if not no_reload and (failed := _systemctl_failure("daemon-reload")):
            raise click.ClickException(
                f"{failed}, so systemd has not loaded {unit}: {_undo(path, written, previous)}"
            )
    if now:
        # The unit is valid and loaded: it stays, and the start can be tried again.
        if failed := _systemctl_failure("start", "--no-block", unit):
            raise click.ClickException(
                f"{failed}: {unit} is written ({path}) and installed, but not started; "
                f"`systemctl status {unit}` and `journalctl -u {unit}` say why, "
                f"`systemctl start {unit}` tries again"
            )
        click.echo(f"queued {unit}: `systemctl status {unit}` says whether it waits and why")


def _given(keys: dict[str, Any]) -> dict[str, Any]:
    return {field: value for field, value in keys.items() if value is not None}


def _check_gateable(unit: str, hint: str) -> None:
    """The generator gates a unit through `UNIT.d/`, which must fit in one file name: a
    longer name (254 or 255 characters, valid for systemd) would run ungated."""
    if not fits_dropin_dir(unit):
        raise click.BadParameter(
            f"{printable(unit, 60)}: {len(unit)} characters; a unit gpuslice gates has at most "
            f"{NAME_MAX - 2}, so that its drop-in directory (UNIT.d) fits in a file name",
            param_hint=hint,
        )


@contextlib.contextmanager
def _unit_dir_locked(root: str, path: Path) -> Iterator[None]:
    """Hold the unit directory's lock (newunit.LOCK_NAME) while `path` is looked at, written,
    read back and perhaps undone; says so while another `gpuslice new` or `enroll` holds it."""
    try:
        directory = Path(root) / UNIT_DIR
        try:
            fd = lock_unit_dir(directory, wait=False)
        except BlockingIOError:
            click.echo(f"waiting for another gpuslice new or enroll ({directory})...", err=True)
            fd = lock_unit_dir(directory)
    except OSError as e:  # not root, a read-only /etc, a file where the directory should be
        raise _cannot_write(path, e) from None
    try:
        yield
    finally:
        os.close(fd)


def _write(
    path: Path, data: str | bytes, *, exclusive: bool, command: str = "new"
) -> os.stat_result:
    try:
        return write_atomically(path, data, exclusive=exclusive)
    except FileExistsError as e:
        if not (exclusive and os.path.lexists(path)):
            raise _cannot_write(path, e) from None
        raise click.ClickException(
            f"{path} appeared while gpuslice {command} wrote it (another program, or an admin, "
            "wrote it meanwhile): not overwritten"
        ) from None
    except OSError as e:  # a read-only /etc, a file where a directory should be, not root
        raise _cannot_write(path, e) from None


def _cannot_write(path: Path, e: OSError) -> click.ClickException:
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
    return click.ClickException(printable(f"cannot write {path}: {_reason(e)}{where}", 600))


def _systemctl_failure(*args: str) -> str | None:
    """Run `systemctl ARGS`; why it failed, if it did."""
    try:
        status = subprocess.run(["systemctl", *args], check=False).returncode
    except OSError as e:
        return f"cannot run systemctl: {_reason(e)}"
    if status != 0:
        return f"systemctl {' '.join(args)} failed (exit status {status})"
    return None


def _validated(
    unit: str,
    root: str,
    written: Path,
    identity: os.stat_result,
    previous: bytes | None = None,
    made_dir: bool = False,
) -> UnitSpec:
    """Read the unit back through the parser. If it is refused, undo the write (`_undo`): a
    command that fails leaves what worked before."""
    spec, problems = load_spec(unit, root)
    for problem in problems:
        click.echo(f"{problem.severity}: {problem}", err=True)
    if spec is not None and not any(p.severity == "error" for p in problems):
        return spec
    undone = _undo(written, identity, previous, made_dir)
    if spec is None and not problems:
        raise click.ClickException(
            f"{unit}: no such unit in systemd's search path (or masked); {undone}"
        )
    raise click.ClickException(f"{unit}: annotation rejected; {undone}")


def _undo(
    written: Path, identity: os.stat_result, previous: bytes | None, made_dir: bool = False
) -> str:
    """Put back the file `written` replaced (`previous`), else remove it, and the directory
    made for it (`made_dir`); what was done, said. Only while `written` is still the file this
    command wrote (`identity`, from `write_atomically`: same device and inode): one another
    writer put there since (an admin's editor, another program) is left as it is."""
    try:
        there = os.lstat(written)
        if (there.st_dev, there.st_ino) != (identity.st_dev, identity.st_ino):
            return f"left {written} as it is: another program replaced it since it was written"
        if previous is not None:
            write_atomically(written, previous)
            return f"put back the previous {written}"
        written.unlink()
        if made_dir:
            written.parent.rmdir()
        return f"removed {written}"
    except OSError as e:
        return f"could not undo {written}: {_reason(e)}"


if __name__ == "__main__":
    main()
