"""The gate's fast way through: one named pipe per unit, RUNTIME_DIR/gate/UNIT.

Asking over D-Bus costs every start a second process (dbus-send) and a round trip through
the bus daemon, ~10 ms on a 2-core host (issue 10). Systemd already tells the controller,
in the PropertiesChanged that shows a unit in its start-pre phase, that the unit's gate
runs and which start it is (InvocationID). So the controller decides then, and once it
grants that start it writes the start's InvocationID into the unit's pipe; the gate, a
`read` built into sh, passes when it reads its own $INVOCATION_ID. Anything else it reads
(a line for another start, "-", end of file) sends it to the D-Bus Acquire, which stays
the one way that works whatever happened (data/gpuslice-gate).

Why this is as safe as the bus:
- Only root can open the pipes (the directory is 0700, the controller's own).
- A grant names one start: a line left over from a start that was cancelled never lets a
  later start through (its InvocationID differs).
- A gate never waits on a pipe nobody will write. It blocks in open() until a writer
  opens the pipe, and the controller opens it for every start it sees at the gate (or
  sends the gate to the bus with "-" when systemd's word came without an InvocationID and
  no signal named the start soon after). Pipes are made (`expect`, at JobNew, ahead of the
  gate) only for units whose starts the controller follows, once it is ready: the same as
  the pipe an earlier start leaves.
  When the controller dies, the kernel closes its ends and the gates read end of file;
  one blocked in open() before the controller opened its pipe is woken by `reset`, which
  `gpuslice release-gates` (ExecStopPost= of gpuslice.service) and every start-up run. One
  whose start's signals the bus daemon dropped (anyone can fill the controller's queue) is
  held by the next audit (`wake_unheard`, every 30 s), and woken by the one after when no
  signal of that start came between.
- Too many gates at once (more than MAX_OPEN) are sent to the bus rather than holding
  more file descriptors.

A failure here (a full /run, a pipe that cannot be written) is logged and sends the gate to
the bus: it never blocks a start and never takes the controller down. One exception: when the
controller can open no file at all (EMFILE, ENFILE), a gate already blocked in open() on its
pipe cannot be woken, as only an open does that; the pipe is then kept, not removed (removed,
nothing could ever reach that gate again), and the journal says so: `gpuslice release-gates`
at the controller's stop, and the next controller, wake it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import resource
import select
import shutil
import stat
import sys
import termios
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The line that sends a gate to the bus: no InvocationID, which the gate takes in hex digits
# alone (a unit's own Environment=INVOCATION_ID=- never reads it as its grant).
TO_THE_BUS = "-"
# Gates holding a pipe open at once (one file descriptor each); beyond, new ones ask over the
# bus, each holding a connection of root's to the bus daemon until it is answered: the system
# bus allows 256 per user, and past them every other root client (pam_systemd at a login,
# `gpuslice status` as root) is refused. So as many as the descriptors allow (pipe_budget),
# up to this: the controller raises its soft limit to what it needs (raise_fd_limit).
MAX_OPEN = 16384
# Descriptors kept for the rest of the controller: the bus, NVML, the journal, the state file,
# cuda-checkpoint's pipes, Python's own.
RESERVED_FDS = 512


def raise_fd_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to what MAX_OPEN pipes need, within the hard limit (a
    service gets 1024 soft and 524288 hard from systemd): raised by `LimitNOFILE=` instead,
    a container's lower hard limit would stop the controller from starting at all."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_OPEN + RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < want:
        limit = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


def pipe_budget() -> int:
    """How many pipes may be open at once under this process's soft RLIMIT_NOFILE (1024 for
    a service that does not raise it: 512)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN
    return max(0, min(MAX_OPEN, soft - RESERVED_FDS))


# How every pipe is opened: for reading and writing, so that open() never blocks on the gate
# and the pipe stays open when a gate goes; never through a link someone put in its place
_PIPE_FLAGS = os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
# How a pipe is opened to find a gate that waits on it unheard (wake_unheard): for writing
# only, so that it fails (ENXIO) when no gate waits on it, and never blocks
_PROBE_FLAGS = os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
# Why an open fails for want of room, whatever the pipe (not for what is in its place)
_NO_ROOM = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


@dataclass
class _Open:
    fd: int
    invocation: str
    answered: bool = False


class GatePipes:
    """The controller's ends of the pipes of units at their gate."""

    def __init__(self, directory: Path, max_open: int | None = None) -> None:
        self.directory = directory
        self.max_open = pipe_budget() if max_open is None else max_open
        self._open: dict[str, _Open] = {}
        # our write-only ends of the pipes whose gates the last audit found waiting unheard
        # (wake_unheard): each gate now waits in read(), for its start's signal (at_gate)
        # or the next audit
        self._unheard: dict[str, int] = {}

    def reset(self) -> None:
        """Wake every gate that waits on a pipe of an earlier controller, and remove the
        pipes: their gates read end of file and ask over the bus."""
        self.close_all()
        wake_and_remove(self.directory)

    def at_gate(self, unit: str, invocation: str) -> bool:
        """Systemd shows this start of the unit at its gate: hold its pipe open so that the
        gate can be answered there. Whether the controller should now decide on the start as
        if its gate had asked (False when this start was taken in already, or its gate was
        sent to the bus, where it asks)."""
        held = self._open.get(unit)
        if held is not None and held.invocation == invocation:
            return False
        found = self._unheard.pop(unit, None)
        if found is not None:  # the signal an audit held its gate for: our end is open already
            self._open[unit] = _Open(found, invocation)
            return True
        self.close(unit)
        if len(self._open) + len(self._unheard) >= self.max_open:
            self._to_the_bus(unit, "too many gates wait at once")
            return False
        fd = self._open_pipe(unit)
        if fd is None:
            return False
        self._open[unit] = _Open(fd, invocation)
        return True

    def expect(self, unit: str) -> None:
        """Systemd queued a job for the unit (JobNew): make its pipe now if there is none, so
        that a gate spawned a moment later finds it and waits there. Otherwise the first
        start of each unit after a controller start found no pipe and asked over D-Bus (3
        of 5 on an idle host, every one in a burst): a second process and two round trips.
        Only for units whose starts the controller follows: a gate that finds a pipe waits
        until the controller opens it (at_gate) or sends it to the bus (at_gate_unknown),
        as for the pipe any earlier start left. Nothing is opened or held."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.mkfifo(self.directory / unit, 0o600)
        except FileExistsError:
            pass
        except OSError as e:  # its gate asks over D-Bus, or at_gate says why
            log.debug("gate pipe of %s not made ahead: %s", unit, e)

    def retire(self, unit: str) -> None:
        """The unit is down and its name may never come again (an instance such as
        `transcribe@RECORDING`): remove its pipe, or /run would keep one for every instance
        ever started until the controller restarts. A gate of a start that came meanwhile and
        waits on it reads "-" and asks over D-Bus; the next start's JobNew makes a new one."""
        self.close(unit)
        self._to_the_bus(unit, "")

    def at_gate_unknown(self, unit: str) -> None:
        """Systemd shows the unit at its gate, but said nothing of which start (a state we
        read, not a signal): its gate, if it waits on the pipe, asks over the bus."""
        if unit not in self._open:
            self._to_the_bus(unit, "its start is not known")

    def grant(self, unit: str) -> bool:
        """Let the unit's gate through, if it waits on its pipe. Whether a line was written."""
        held = self._open.get(unit)
        if held is None or held.answered:
            return False
        held.answered = True
        return self._write(unit, held.fd, held.invocation)

    def holds(self, unit: str) -> bool:
        return unit in self._open

    def answered(self, unit: str) -> bool:
        """Whether this start of the unit was granted at its pipe."""
        held = self._open.get(unit)
        return held is not None and held.answered

    def granted(self, unit: str) -> str | None:
        """The InvocationID of the start granted at the unit's pipe (None: none was)."""
        held = self._open.get(unit)
        return held.invocation if held is not None and held.answered else None

    def close(self, unit: str) -> bool:
        """The unit left its gate (it runs, or went down): drop our end of its pipe. Whether
        its gate took the grant from the pipe (it may have asked over D-Bus instead)."""
        self._let_go_unheard(unit)
        held = self._open.pop(unit, None)
        if held is None:
            return False
        taken = held.answered and _unread(held.fd) == 0
        with contextlib.suppress(OSError):
            os.close(held.fd)
        return taken

    def close_all(self) -> None:
        for unit in [*self._open, *self._unheard]:
            self.close(unit)

    def holding(self) -> list[str]:
        return sorted(self._open)

    def wake_unheard(self, unheard: Callable[[str], bool]) -> list[str]:
        """Wake every gate that has waited a whole audit on a pipe we do not hold, of a unit
        `unheard` says no word of systemd's will bring us to (the controller's audit reads
        only the units the core knows): its start's signals were lost, as the bus daemon
        drops them for a connection whose queue is full, and anyone can fill it (a flood of
        Status calls). Nothing then opened the pipe a unit's earlier start left, and its gate
        waited in open() for ever (TimeoutStartSec=infinity).

        Opened for writing without blocking, a pipe opens only when a reader waits on it
        (else ENXIO), whose open() it ends. Such a gate is not woken at once: its start's
        signal may be on its way (systemd holds its PropertiesChanged back while its own bus
        queue is long, and a busy controller reads its socket late), and woken then it asked
        over D-Bus, a second process and two round trips, and the journal said signals were
        lost that were not. Our end stays open, so it waits in read(): its signal, when it
        comes, answers it through that end (`at_gate`). At the next audit each end still
        kept is closed: its gate reads end of file and asks over D-Bus, where it is served.
        The units whose gate was woken so, still unheard."""
        woken = []
        kept, self._unheard = self._unheard, {}
        for unit, fd in kept.items():
            try:
                waits = _has_reader(fd)
            finally:
                os.close(fd)
            if waits and unheard(unit):
                woken.append(unit)
        try:
            entries = list(os.scandir(self.directory))
        except OSError:  # no directory: no pipe, no gate waits on one
            return sorted(woken)
        for entry in entries:
            unit = entry.name
            if unit in self._open or unit in kept or not unheard(unit):
                continue  # one just closed: its gate is on its way to D-Bus
            try:
                fd = os.open(entry.path, _PROBE_FLAGS)
            except OSError:  # ENXIO: no gate waits on it (or not a pipe we can open)
                continue
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)
            elif len(self._open) + len(self._unheard) >= self.max_open:
                os.close(fd)  # no descriptor to spare: woken now, as over the budget at_gate
                woken.append(unit)
            else:
                self._unheard[unit] = fd
        return sorted(woken)

    # -- files ------------------------------------------------------------------------------

    def _let_go_unheard(self, unit: str) -> None:
        """Close our end of the unit's pipe that an audit kept (wake_unheard), if any."""
        found = self._unheard.pop(unit, None)
        if found is not None:
            os.close(found)

    def _open_pipe(self, unit: str) -> int | None:
        """Open (making it if needed) the unit's pipe for writing without blocking: O_RDWR
        never waits for a reader and never fails for want of one."""
        path = self.directory / unit
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkfifo(path, 0o600)
            fd = os.open(path, _PIPE_FLAGS)
        except OSError as e:
            if e.errno not in _NO_ROOM:  # else _to_the_bus cannot open it either, and says so
                log.warning("gate pipe of %s: %s; its gate asks over D-Bus", unit, e)
            self._to_the_bus(unit, "")
            return None
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            log.warning("gate pipe of %s is not a pipe; its gate asks over D-Bus", unit)
            self._to_the_bus(unit, "")
            return None
        return fd

    def _write(self, unit: str, fd: int, line: str) -> bool:
        try:
            os.write(fd, f"{line}\n".encode())
        except OSError as e:
            # a pipe buffer is 64 KiB and we write one line per start: not expected
            log.warning("gate pipe of %s: %s; its gate asks over D-Bus", unit, e)
            self.close(unit)
            self._to_the_bus(unit, "")
            return False
        return True

    def _to_the_bus(self, unit: str, why: str) -> None:
        """Send whatever gate waits on the unit's pipe to the bus, and remove the pipe so
        that the next gate goes there at once: open (which wakes a gate blocked in open()),
        unlink, say "-", close (end of file for a gate that reads later)."""
        if why:
            log.debug("gate of %s sent to D-Bus: %s", unit, why)
        self._let_go_unheard(unit)  # a gate an audit held reads end of file, or our "-"
        path = self.directory / unit
        try:
            fd = os.open(path, _PIPE_FLAGS)
        except OSError as e:
            if e.errno in _NO_ROOM:  # a gate blocked in open() on it is woken by an open only
                log.warning(
                    "gate pipe of %s: %s; kept: a gate waiting on it waits until gpuslice can "
                    "open it (`systemctl restart gpuslice` wakes it)",
                    unit,
                    e,
                )
                return
            # no pipe (the gate asks over the bus anyway), or not ours: remove it
            with contextlib.suppress(OSError):
                path.unlink()
            return
        try:
            with contextlib.suppress(OSError):
                path.unlink()
            with contextlib.suppress(OSError):
                os.write(fd, f"{TO_THE_BUS}\n".encode())
        finally:
            os.close(fd)


def _has_reader(fd: int) -> bool:
    """Whether a process has the pipe of our write-only `fd` open for reading (a gate that
    was stopped meanwhile has not: POLLERR)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return not any(events & select.POLLERR for _, events in poller.poll(0))


def _unread(fd: int) -> int:
    """Bytes in the pipe nobody read (FIONREAD); -1 when it cannot be told."""
    try:
        buf = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return -1
    return int.from_bytes(buf, sys.byteorder)


def wake_and_remove(directory: Path) -> None:
    """Move the directory aside (new gates find no pipe and ask over the bus), open and
    close each pipe in it (a gate blocked in open() wakes and reads end of file), remove
    it. Safe to run with no directory, or twice."""
    aside = directory.with_name(f".{directory.name}.released-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(directory, aside)
    except FileNotFoundError:
        return
    except OSError as e:
        log.warning("cannot move %s aside: %s", directory, e)
        aside = directory
    try:
        entries = list(os.scandir(aside))
    except OSError as e:
        log.warning("cannot read %s: %s", aside, e)
        entries = []
    for entry in entries:
        with contextlib.suppress(OSError):
            fd = os.open(entry.path, _PIPE_FLAGS)
            os.close(fd)
    shutil.rmtree(aside, ignore_errors=True)
