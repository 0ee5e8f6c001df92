"""The only module that talks to systemd over D-Bus.

Raw messages rather than introspected proxies: a proxy costs an Introspect round trip per
unit, which matters at a thousand units. D-Bus errors become `SystemdError` here, once.

Only systemd is believed. Any local user may send a signal to any connection, so a signal
counts only when its sender is the current owner of `org.freedesktop.systemd1` (followed
through the bus daemon's NameOwnerChanged), its signature is the one systemd sends, and every
unit name in it is a valid unit name. Everything else is dropped before the controller sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import string
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from dbus_next import BusType, Message, MessageFlag, MessageType, Variant
from dbus_next.aio import MessageBus

from gpuslice import busread
from gpuslice.tracker import JOB_PREFIX, START_JOBS, MainExit, UnitState
from gpuslice.unitfiles import is_valid_unit_name

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
SERVICE = "org.freedesktop.systemd1.Service"
JOB = "org.freedesktop.systemd1.Job"
PROPERTIES = "org.freedesktop.DBus.Properties"
UNIT_PATH_PREFIX = "/org/freedesktop/systemd1/unit/"
BUS_DAEMON = "org.freedesktop.DBus"
BUS_DAEMON_PATH = "/org/freedesktop/DBus"

log = logging.getLogger(__name__)

# Units whose PropertiesChanged are matched one rule each, when the controller names them;
# more (or None) and every unit's are matched. The system bus allows 512 match rules per
# connection; one per unit spares the controller unmarshalling every other unit's signals
# (its own STATUS=, journald's socket, slices, targets): a third of its CPU per handover.
MAX_UNIT_RULES = 200
_UNIT_SIGNALS = (
    f"type='signal',sender='{SYSTEMD}',interface='{PROPERTIES}',member='PropertiesChanged',"
    f"arg0='{UNIT}',"
)
_EVERY_UNIT = _UNIT_SIGNALS + "path_namespace='/org/freedesktop/systemd1/unit'"


# Method calls of ours awaiting their reply, at most: the system bus refuses a connection's
# calls beyond 128 pending (max_replies_per_connection), and 200 starts queued at once would
# each ask systemd something. Calls beyond it wait their turn here.
MAX_CALLS_IN_FLIGHT = 64
# Seconds a call of ours waits for its answer, then fails as unanswered (NO_REPLY, transient:
# a job call is sent again). The bus daemon drops any message for a connection whose queue is
# full, answers to our calls included, without a word (and the system bus's reply_timeout is
# "never"): anyone may fill the controller's queue with Status calls, which the policy allows
# them, and so lose the answers to the calls it makes meanwhile (one user's 4 connections of
# 5 KB calls for 10 s lost 18 of 20). Such a call waited for ever, holding one of
# MAX_CALLS_IN_FLIGHT: an audit that asked who owns systemd's name never ended and never
# came again, a gate's Acquire was never checked, a re-match held its lock for good, and once
# 64 were lost no call of the controller's ever left again. Answers that a flood only delays
# come within tens of seconds (a queue full of 127 MiB of calls read in ~40 s); sd-bus gives
# up after 25.
CALL_TIMEOUT = 60.0
# The error of a call that got no answer at all (`_check`, CALL_TIMEOUT): in TRANSIENT_ERRORS
NO_REPLY = "org.gpuslice.Error.NoReply"
# A count systemd does not know (its TasksCurrent and other cgroup counters then): UINT64_MAX
UNKNOWN_COUNT = 2**64 - 1
# Told a job path the moment systemd's answer to a StartUnit/StopUnit is read, before the
# signals systemd sent after it are handled (an awaiting coroutine resumes only after them).
Queued = Callable[[str], None]
# Systemd's refusal of a job in mode "fail" that would replace a conflicting job already queued.
DESTRUCTIVE = "org.freedesktop.systemd1.TransactionIsDestructive"
# A unit's properties that name the units whose stop systemd propagates to it (`needs`)
NEEDS = ("Requires", "BindsTo", "PartOf")
# Their reverse, as systemd keeps each dependency on both units: the units a stop of a unit
# propagates to (`needed_by`)
NEEDED_BY = ("RequiredBy", "BoundBy", "ConsistsOf")


class SystemdError(Exception):
    """A call to systemd failed; `name` is the D-Bus error name."""

    def __init__(self, name: str, text: str) -> None:
        super().__init__(f"{name}: {text}")
        self.name = name
        self.text = text


def refused_for_own_job(error: SystemdError, name: str) -> bool:
    """A stop of NAME in mode "fail" refused for NAME's own job: systemd names the first
    conflicting job it finds, "Transaction for NAME/stop is destructive (UNIT has 'start' job
    queued, but 'stop' is included in transaction)." A text of any other form is a refusal
    for another unit's job (the safe side: nothing is sent again over it)."""
    said = f"Transaction for {name}/stop is destructive ({name} has '"
    return error.name == DESTRUCTIVE and said in error.text


def job_named(error: SystemdError, name: str) -> str | None:
    """The unit whose job a refusal of NAME's stop in mode "fail" names (the text of
    `refused_for_own_job`); None for a text of any other form, or a name no unit has."""
    said = f"Transaction for {name}/stop is destructive ("
    if error.name != DESTRUCTIVE or not error.text.startswith(said):
        return None
    unit, has, _ = error.text[len(said) :].partition(" has '")
    return unit if has and is_valid_unit_name(unit) else None


# D-Bus errors of the bus, or of a systemd that is away for a moment, after which the same
# call may well work: a job call of ours that fails with one is sent again later
# (Calls._call), not taken for systemd's refusal. Systemd's own errors
# (org.freedesktop.systemd1.*: a unit masked, not found, a destructive transaction, ...)
# and AccessDenied are refusals that a second call would only repeat.
TRANSIENT_ERRORS = frozenset(
    {
        # systemd left the bus with our call unanswered (`systemctl daemon-reexec`, which
        # Debian's systemd upgrade runs), or the bus daemon's reply timeout ran out
        "org.freedesktop.DBus.Error.NoReply",
        # systemd's name had no owner for a moment (between two executions of systemd)
        "org.freedesktop.DBus.Error.ServiceUnknown",
        "org.freedesktop.DBus.Error.NameHasNoOwner",
        # the bus daemon turned the call away for its limits (replies pending per
        # connection, its memory): it takes calls again once those are answered
        "org.freedesktop.DBus.Error.LimitsExceeded",
        "org.freedesktop.DBus.Error.NoMemory",
        # timeouts and a connection lost on the way (a lost bus ends the controller anyway)
        "org.freedesktop.DBus.Error.Timeout",
        "org.freedesktop.DBus.Error.TimedOut",
        "org.freedesktop.DBus.Error.Disconnected",
        "org.freedesktop.DBus.Error.NoServer",
        NO_REPLY,  # ours: no answer at all (`_check`, CALL_TIMEOUT)
    }
)


def is_transient(error: SystemdError) -> bool:
    """Whether a call that failed so may work if sent again (TRANSIENT_ERRORS)."""
    return error.name in TRANSIENT_ERRORS


def unit_path(name: str) -> str:
    """The object path systemd gives a unit (its bus_label_escape)."""
    safe = string.ascii_letters
    out = []
    for i, char in enumerate(name):
        if char in safe or (i > 0 and char in string.digits):
            out.append(char)
        else:
            out.extend(f"_{byte:02x}" for byte in char.encode())
    return UNIT_PATH_PREFIX + ("".join(out) or "_")


def job_path(job_id: int) -> str:
    """The object path systemd gives a job (its job_dbus_path): what a read of a unit,
    which names its job's id, would have named it in the job's signals."""
    return f"{JOB_PREFIX}{job_id}"


def bus_daemon_call(
    member: str, signature: str, body: list[Any], interface: str = BUS_DAEMON
) -> Message:
    """A call of the bus daemon's own interface (`GetNameOwner`, `AddMatch`, ...; another of
    its interfaces: `interface`), addressed in one place for Systemd, which sends it within
    its calls in flight (`send_call`), and for the controller's service, which sends it on
    its bus and reads the reply itself."""
    return Message(
        destination=BUS_DAEMON,
        path=BUS_DAEMON_PATH,
        interface=interface,
        member=member,
        signature=signature,
        body=body,
    )


def unit_name_from_path(path: str) -> str | None:
    """The inverse of `unit_path`; None for paths that are not the object of a valid unit
    name (a forged path may decode to anything: control characters, 10,000 characters)."""
    if not path.startswith(UNIT_PATH_PREFIX):
        return None
    label = path[len(UNIT_PATH_PREFIX) :]
    if len(label) > 3 * 255:
        return None
    raw = bytearray()
    i = 0
    while i < len(label):
        code = label[i + 1 : i + 3]
        if label[i] == "_" and len(code) == 2 and all(c in string.hexdigits for c in code):
            raw.append(int(code, 16))
            i += 3
        else:
            raw.extend(label[i].encode())
            i += 1
    name = raw.decode(errors="replace")
    return name if is_valid_unit_name(name) else None


def _job(value: Any) -> int | None:
    """The job id of a unit's `Job` property, a `(uo)` pair; None when malformed."""
    if isinstance(value, list | tuple) and len(value) == 2 and isinstance(value[0], int):
        return value[0]
    return None


def invocation_hex(value: Any) -> str | None:
    """A unit's InvocationID as systemd sends it (16 bytes; empty for a unit that never ran)
    in the form systemd gives $INVOCATION_ID; None for anything else."""
    if isinstance(value, bytes) and len(value) == 16:
        return value.hex()
    return None


def _short_text(value: Any) -> str | None:
    return value if isinstance(value, str) and len(value) <= 32 else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _u64(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


# The properties of a unit the controller reads from PropertiesChanged: each one's check and
# form (None drops it). InvocationID names the start (16 bytes, hex as in $INVOCATION_ID).
# ConditionResult and ConditionTimestampMonotonic tell a start its `Condition*=` skipped
# (Tracker.job_removed); systemd sends them with every change of the unit, so knowing it
# costs no read.
_UNIT_PROPERTIES: dict[str, Callable[[Any], Any]] = {
    "ActiveState": _short_text,
    "SubState": _short_text,
    "Job": lambda v: v if _job(v) is not None else None,
    "InvocationID": invocation_hex,
    "ConditionResult": _bool,
    "ConditionTimestampMonotonic": _u64,
}


class _PatientSocket:
    """The bus socket as dbus-next's writer sees it: a send that would block sent nothing.

    dbus-next 0.2.3 (Debian 12's python3-dbus-next) writes its queued messages in a loop and
    takes EAGAIN, the socket's send buffer full between two messages (the bus daemon reads
    slower than a burst of calls is queued), for a lost connection: the controller exits
    (altdesktop/python-dbus-next#153, open). Told that nothing was sent, the writer waits
    until the socket is writable and goes on. No file descriptors are passed on this bus."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send(self, data: bytes, *flags: int) -> int:
        try:
            return self._sock.send(data, *flags)
        except BlockingIOError:
            return 0

    def sendmsg(self, buffers: list[bytes], *args: Any) -> int:
        try:
            return self._sock.sendmsg(buffers, *args)
        except BlockingIOError:
            return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _write_patiently(bus: MessageBus) -> None:
    writer = getattr(bus, "_writer", None)
    if writer is not None and isinstance(getattr(writer, "sock", None), socket.socket):
        writer.sock = _PatientSocket(writer.sock)


def _listed(u: list[Any]) -> UnitState:
    """A unit of ListUnits' answer: (name, description, load, active, sub, following, path,
    job id, job type, job path)."""
    return UnitState(u[0], u[3], u[4], u[7], u[8] if u[7] else "")


class _Slots:
    """MAX_CALLS_IN_FLIGHT, handed out in order. Unlike asyncio.Semaphore, a free one can
    be taken without awaiting: a call is then sent before its caller's task first runs."""

    def __init__(self, count: int) -> None:
        self.free = count
        self._waiting: deque[asyncio.Future[None]] = deque()

    def take_now(self) -> bool:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        if self.take_now():
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give()  # handed over, then cancelled before it was used
            raise

    def give(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.free += 1


def _flush(bus: MessageBus) -> None:
    """Write what dbus-next queued now, not at the loop's next turn (dbus-next 0.2.3 writes
    only when the loop finds the socket writable): a StopUnit leaves with its decision.
    What cannot be written now is written as before, when the socket takes it."""
    writer = getattr(bus, "_writer", None)
    write = getattr(writer, "write_callback", None)
    if callable(write):
        write()


def _check(reply: Message | None) -> Message:
    if reply is None:
        raise SystemdError(NO_REPLY, "no reply from systemd")
    if reply.message_type == MessageType.ERROR:
        text = reply.body[0] if reply.body else ""
        raise SystemdError(reply.error_name or "unknown", str(text))
    return reply


async def _job_path(answer: Awaitable[list[Any]]) -> str:
    (job,) = await answer
    return str(job)


def close_bus(bus: MessageBus) -> None:
    """Put away a connection that will not be used again and that disconnect() cannot end
    cleanly: one whose connect() did not finish, or that the bus daemon dropped. dbus-next
    only shuts its socket down, and leaves it open (a descriptor per attempt or per bus
    restart), the reader it may have added, and the error it ended with unretrieved
    (asyncio then prints "Future exception was never retrieved" with a traceback)."""
    with contextlib.suppress(Exception):  # dbus-next's own fields: none of them may fail us
        ended = bus._disconnect_future
        if ended.done() and not ended.cancelled():
            ended.exception()
    with contextlib.suppress(Exception):
        bus._loop.remove_reader(bus._fd)
    for closable in ("_stream", "_sock"):
        with contextlib.suppress(Exception):
            getattr(bus, closable).close()


async def open_bus(address: str | None = None, timeout: float | None = None) -> MessageBus:
    """A connection to the system bus (or `address`); past `timeout` seconds without the bus
    daemon's hello (one that takes the connection and never authenticates it), or when
    cancelled, TimeoutError or CancelledError with the connection closed, not leaked."""
    bus = MessageBus(bus_address=address, bus_type=BusType.SYSTEM)
    try:
        await asyncio.wait_for(bus.connect(), timeout)
    except BaseException:
        close_bus(bus)
        raise
    return bus


class Systemd:
    """A connection to the system bus and the systemd manager on it."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        _write_patiently(bus)
        self._calls = _Slots(MAX_CALLS_IN_FLIGHT)
        self.on_job_new: Callable[[int, str, str], None] = lambda job_id, path, unit: None
        self.on_job_removed: Callable[[int, str, str, str], None] = lambda i, p, u, r: None
        self.on_unit_changed: Callable[[str, dict[str, Any]], None] = lambda unit, props: None
        self.on_reloading: Callable[[bool], None] = lambda active: None
        self.on_systemd_restarted: Callable[[], None] = lambda: None
        self.owner: str | None = None  # systemd's unique name on the bus: the only sender believed
        self._last_owner: str | None = None
        self._owner_heard = 0  # NameOwnerChanged of systemd's name handled: check_owner
        self.dropped = 0  # signals not believed, for status and tests
        # the units whose PropertiesChanged are matched one by one; None: every unit's
        self._watching: frozenset[str] | None = None
        self._watch_lock = asyncio.Lock()
        self._told: dict[int, Callable[[Message], None]] = {}  # call serial -> told its reply
        # units' PropertiesChanged read with only the properties _signal reads (busread.py)
        self.fast_reader = busread.install(bus, UNIT, frozenset(_UNIT_PROPERTIES))
        bus.add_message_handler(self._dispatch)

    @classmethod
    async def connect(cls, address: str | None = None, timeout: float | None = None) -> Systemd:
        """Connect to the system bus (or `address`), as `open_bus` does."""
        return cls(await open_bus(address, timeout))

    async def call(
        self,
        member: str,
        signature: str = "",
        body: list[Any] | None = None,
        *,
        path: str = MANAGER_PATH,
        interface: str = MANAGER,
        destination: str = SYSTEMD,
    ) -> list[Any]:
        """Call a method and return its answer's body."""
        message = Message(
            destination=destination,
            path=path,
            interface=interface,
            member=member,
            signature=signature,
            body=body or [],
        )
        return await self.send_call(message)

    def send_call(
        self, message: Message, told: Callable[[Message], None] | None = None
    ) -> Awaitable[list[Any]]:
        """Send a call now, when fewer than MAX_CALLS_IN_FLIGHT are (else when one
        answers), and return what awaits its answer's body: sent with the decision, not
        when the task awaiting it first runs (issue 10: up to a millisecond later, in the
        middle of a handover). `told` is called with a successful answer from systemd as
        the answer is read, in the order of systemd's messages. The awaitable must be
        awaited: it gives the call's place back."""
        if self._calls.take_now():
            return self._answer(self._send(message, told), message.serial)
        return self._send_in_turn(message, told)

    async def _send_in_turn(
        self, message: Message, told: Callable[[Message], None] | None
    ) -> list[Any]:
        await self._calls.take()
        return await self._answer(self._send(message, told), message.serial)

    def _send(
        self, message: Message, told: Callable[[Message], None] | None
    ) -> asyncio.Future[Message | None]:
        reply: asyncio.Future[Message | None] = asyncio.get_running_loop().create_future()

        def answered(msg: Message | None, err: Exception | None) -> None:
            if reply.done():
                return
            if err is not None:
                reply.set_exception(err)
            else:
                reply.set_result(msg)

        message.serial = self.bus.next_serial()
        if told is not None:
            self._told[message.serial] = told
        try:
            self.bus._call(message, answered)
            _flush(self.bus)
        except BaseException:
            self._told.pop(message.serial, None)
            self._calls.give()
            raise
        lost = reply.get_loop().call_later(CALL_TIMEOUT, self._unanswered, reply, message)
        reply.add_done_callback(lambda _: lost.cancel())
        return reply

    def _unanswered(self, reply: asyncio.Future[Message | None], message: Message) -> None:
        """No answer within CALL_TIMEOUT: the bus daemon dropped it (CALL_TIMEOUT says when),
        or it is later than any we wait for. Failed as unanswered; an answer that comes
        after all is dropped by dbus-next, which no longer expects it."""
        if reply.done():
            return
        handlers = getattr(self.bus, "_method_return_handlers", None)
        if isinstance(handlers, dict):
            handlers.pop(message.serial, None)
        self._told.pop(message.serial, None)  # not taken: nobody is told of a late answer
        log.warning(
            "no answer to %s.%s within %g s: the bus daemon drops answers to a connection "
            "whose queue is full (a flood of calls to gpuslice?); taken as unanswered",
            message.interface,
            message.member,
            CALL_TIMEOUT,
        )
        reply.set_exception(SystemdError(NO_REPLY, f"no answer within {CALL_TIMEOUT:g} s"))

    async def _answer(self, reply: asyncio.Future[Message | None], serial: int) -> list[Any]:
        try:
            answer = await reply
        finally:
            self._told.pop(serial, None)
            self._calls.give()
        return list(_check(answer).body)

    async def subscribe(self) -> None:
        """Follow who owns systemd's name, match the signals we act on, then ask systemd to
        emit them (supervisor's order)."""
        await self._add_match(
            f"type='signal',sender='{BUS_DAEMON}',path='{BUS_DAEMON_PATH}',"
            f"interface='{BUS_DAEMON}',member='NameOwnerChanged',arg0='{SYSTEMD}'"
        )
        (self.owner,) = await self._bus_daemon("GetNameOwner", "s", [SYSTEMD])
        self._last_owner = self.owner
        manager = f"type='signal',sender='{SYSTEMD}',path='{MANAGER_PATH}',interface='{MANAGER}'"
        for member in ("JobNew", "JobRemoved", "Reloading"):  # not UnitNew, UnitRemoved, ...
            await self._add_match(f"{manager},member='{member}'")
        await self._add_match(_EVERY_UNIT)
        self._watching = None
        await self.call("Subscribe")

    def watches(self, unit: str) -> bool:
        """Whether the unit's PropertiesChanged reach us: its rule (or every unit's) was in
        place before any message read from now on was routed (`_watching` changes only once
        the bus daemon has answered the AddMatch). So a start whose JobNew is handled now
        will be seen at its gate."""
        return self._watching is None or unit in self._watching

    async def watch(self, units: Collection[str] | None) -> list[str]:
        """Receive the PropertiesChanged of these units only; of every unit when None or more
        than MAX_UNIT_RULES. The new rules are added before the old ones go, so no unit
        watched before and after misses a signal. Returns the units watched now that were
        not before: a change of theirs before their rule was added went unseen."""
        async with self._watch_lock:
            new = None if units is None or len(units) > MAX_UNIT_RULES else frozenset(units)
            old = self._watching
            if new == old:
                return []
            if new is None:
                await self._add_matches([_EVERY_UNIT])
            else:
                await self._add_matches(
                    [_UNIT_SIGNALS + f"path='{unit_path(n)}'" for n in sorted(new - (old or set()))]
                )
            self._watching = new
            if old is None:
                await self._remove_match(_EVERY_UNIT)
                return []
            for name in sorted(old - (new or frozenset())):
                await self._remove_match(_UNIT_SIGNALS + f"path='{unit_path(name)}'")
            return sorted((set(units or ()) if new is None else set(new)) - old)

    async def _add_matches(self, rules: list[str]) -> None:
        """Add every rule or none: the bus daemon keeps a rule until it is removed, and one
        left by a change refused halfway (max_match_rules_per_connection) went unrecorded;
        each later try of that change added it again, until no rule could be added at all
        and every unit's signals were read for good."""
        added: list[str] = []
        try:
            for rule in rules:
                try:
                    await self._add_match(rule)
                except SystemdError as e:
                    if e.name == NO_REPLY:  # its answer was lost, not the call: maybe added
                        added.append(rule)
                    raise
                added.append(rule)
        except SystemdError:
            for rule in added:
                with contextlib.suppress(SystemdError):
                    await self._remove_match(rule)
            raise

    async def _add_match(self, rule: str) -> None:
        await self._bus_daemon("AddMatch", "s", [rule])

    async def _remove_match(self, rule: str) -> None:
        await self._bus_daemon("RemoveMatch", "s", [rule])

    async def _bus_daemon(self, member: str, signature: str, body: list[Any]) -> list[Any]:
        return await self.send_call(bus_daemon_call(member, signature, body))

    async def caller_pid(self, sender: str) -> int:
        """The process ID behind a bus connection, as the bus daemon saw it connect."""
        (pid,) = await self._bus_daemon("GetConnectionUnixProcessID", "s", [sender])
        return int(pid)

    async def caller_credentials(self, sender: str) -> tuple[int | None, frozenset[int]]:
        """The user ID and group IDs behind a bus connection, as the bus daemon saw it
        connect (GetConnectionCredentials): None and none when it did not say them."""
        (found,) = await self._bus_daemon("GetConnectionCredentials", "s", [sender])
        return credentials_of(found)

    async def list_units(self) -> list[UnitState]:
        (units,) = await self.call("ListUnits")
        return [_listed(u) for u in units]

    async def unit_state(self, name: str) -> UnitState:
        """One unit's state, as ListUnits gives it: a reply of a few hundred bytes where the
        unit's GetAll is kilobytes that dbus-next unmarshals in pure Python (most of the
        controller's CPU time, measured with cProfile over handovers)."""
        (units,) = await self.call("ListUnitsByNames", "as", [[name]])
        for u in units:
            if u[0] == name:
                return _listed(u)
        raise SystemdError("org.gpuslice.Error.NoUnit", f"systemd did not list {name}")

    async def units_state(self, names: Collection[str]) -> list[UnitState]:
        """The states of `names` in one call (those systemd lists)."""
        (units,) = await self.call("ListUnitsByNames", "as", [sorted(names)])
        return [_listed(u) for u in units]

    async def start_jobs(self) -> list[str]:
        """The units systemd has a start job for, queued or running (ListJobs), in the order
        it made them: the starts of one transaction together. SystemdError for a reply not
        of the form systemd gives (a(usssoo))."""
        (jobs,) = await self.call("ListJobs")
        try:
            listed = sorted((int(j[0]), str(j[1]), str(j[2])) for j in jobs)
        except (TypeError, ValueError, IndexError) as e:
            raise SystemdError("org.gpuslice.Error.BadReply", f"ListJobs: {e}") from None
        return [unit for _, unit, kind in listed if kind in START_JOBS]

    async def jobs_waited_for(self, job_id: int) -> list[tuple[int, str, str]]:
        """The jobs systemd runs before this one, by an ordering (After=/Before=) of their
        units: its Job.GetBefore (systemd's job_get_before; GetAfter names the jobs that
        wait for this one), as (id, unit, type). SystemdError for a job gone or a reply not
        of the form systemd gives (a(usssoo))."""
        (jobs,) = await self.call("GetBefore", path=job_path(job_id), interface=JOB)
        try:
            return [(int(j[0]), str(j[1]), str(j[2])) for j in jobs]
        except (TypeError, ValueError, IndexError) as e:
            raise SystemdError("org.gpuslice.Error.BadReply", f"GetBefore: {e}") from None

    def start_unit(self, name: str, queued: Queued | None = None) -> Awaitable[str]:
        return self._queue("StartUnit", name, queued)

    def _queue(
        self, member: str, name: str, queued: Queued | None, mode: str = "replace"
    ) -> Awaitable[str]:
        """Queue a job, sent now (send_call); the awaitable gives its path. `queued` is told
        it as soon as systemd's answer is read. Systemd sends JobNew, then its answer, then
        every other signal about the job (the unit's PropertiesChanged, JobRemoved), so
        whoever keeps account of whose jobs are whose knows it before any of them is
        handled (traced in issue 10)."""

        def told(reply: Message) -> None:
            if queued is not None and reply.signature == "o":
                queued(str(reply.body[0]))

        message = Message(
            destination=SYSTEMD,
            path=MANAGER_PATH,
            interface=MANAGER,
            member=member,
            signature="ss",
            body=[name, mode],
        )
        return _job_path(self.send_call(message, told))

    def restart_preempted(self, name: str, queued: Queued | None = None) -> Awaitable[str]:
        """Start a unit gpuslice itself stopped or holds back, resetting its start rate
        limit first: being preempted five times in ten seconds must not make systemd refuse
        to bring it back. Units that failed are never started this way."""
        # sent, not awaited: StartUnit must follow it at once, before any later StopUnit
        self.bus.send(
            Message(
                destination=SYSTEMD,
                path=MANAGER_PATH,
                interface=MANAGER,
                member="ResetFailedUnit",
                signature="s",
                body=[name],
                flags=MessageFlag.NO_REPLY_EXPECTED,
            )
        )
        return self.start_unit(name, queued)

    def stop_unit(self, name: str, queued: Queued | None = None) -> Awaitable[str]:
        """StopUnit in mode "fail", so that systemd refuses a stop that would cancel another
        unit's job: the start of a unit that needs NAME (`Requires=`, `BindsTo=`, `PartOf=`:
        a stop of NAME stops it too). In mode "replace" a preemption for that very start
        cancelled it, which was taken for someone's stop (held), and its victim came back.
        A refusal for NAME's own job (`refused_for_own_job`) is the caller's to weigh
        (Calls._over_own_job): systemd names one conflicting job, so the start it was for
        may conflict too."""
        return self._queue("StopUnit", name, queued, "fail")

    def stop_unit_replacing(self, name: str, queued: Queued | None = None) -> Awaitable[str]:
        """StopUnit in mode "replace": it replaces NAME's own job (a start under way past its
        gate), as any stop of it does, and cancels the start of every unit that needs NAME."""
        return self._queue("StopUnit", name, queued)

    def try_restart_unit(self, name: str) -> Awaitable[str]:
        """TryRestartUnit, mode replace: on a unit still activating, systemd merges it into
        the start job under way (one job, its id kept: whoever waits for the start is told
        how that ends), stops the unit, then starts it from its unit file of now. On a unit
        inactive, failed or being stopped it does nothing (a no-op job): RestartUnit there
        started it, over the stop of whoever stopped it meanwhile."""
        return self._queue("TryRestartUnit", name, None)

    async def exec_start_pre(self, name: str) -> list[tuple[str, list[str]]]:
        """A service's ExecStartPre= list as systemd holds it now (since its last
        daemon-reload): each command's path and argv. SystemdError for a reply not of the
        form systemd gives (a(sasbttttuii))."""
        (value,) = await self.call(
            "Get", "ss", [SERVICE, "ExecStartPre"], path=unit_path(name), interface=PROPERTIES
        )
        if not isinstance(value, Variant) or value.signature != "a(sasbttttuii)":
            raise SystemdError(
                "org.gpuslice.Error.BadReply", f"ExecStartPre of {name}: {repr(value)[:80]}"
            )
        return [(str(c[0]), [str(a) for a in c[1]]) for c in value.value]

    async def freeze_unit(self, name: str) -> None:
        """Freeze the unit's cgroup (cgroup v2 only); the reply comes when it is frozen
        (systemd 252 sends no PropertiesChanged for FreezerState)."""
        await self.call("FreezeUnit", "s", [name])

    async def thaw_unit(self, name: str) -> None:
        await self.call("ThawUnit", "s", [name])

    async def freezer_state(self, name: str) -> str:
        """`running`, `frozen`, `freezing` or `thawing` (systemd 252 signals no change of it:
        whoever needs it asks)."""
        (value,) = await self.call(
            "Get", "ss", [UNIT, "FreezerState"], path=unit_path(name), interface=PROPERTIES
        )
        return str(value.value)

    async def invocation(self, name: str) -> str | None:
        """The InvocationID of the unit's current (or last) start, hex as in $INVOCATION_ID;
        None for a unit that never ran."""
        (value,) = await self.call(
            "Get", "ss", [UNIT, "InvocationID"], path=unit_path(name), interface=PROPERTIES
        )
        return invocation_hex(value.value)

    async def main_exit(self, name: str) -> MainExit:
        """How a service's main process last ended (ExecMainCode=, ExecMainStatus=, Result=):
        three Gets, where the Service's GetAll is kilobytes. SystemdError for a reply not of
        the form systemd gives."""
        path = unit_path(name)
        found: list[Any] = []
        for prop, signature in (("ExecMainCode", "i"), ("ExecMainStatus", "i"), ("Result", "s")):
            (value,) = await self.call(
                "Get", "ss", [SERVICE, prop], path=path, interface=PROPERTIES
            )
            if not isinstance(value, Variant) or value.signature != signature:
                raise SystemdError(
                    "org.gpuslice.Error.BadReply", f"{prop} of {name}: {repr(value)[:80]}"
                )
            found.append(value.value)
        code, status, result = found
        return MainExit(code, status, _short_text(result) or "")

    async def needs(self, name: str) -> dict[str, list[str]]:
        """The units a stop of which systemd propagates to this one, by the property that
        says so (Requires=, BindsTo=, PartOf=, as systemd holds them now): three Gets, where
        the Unit's GetAll is kilobytes. SystemdError for a reply not of the form systemd
        gives (as)."""
        return await self._unit_lists(name, NEEDS)

    async def needed_by(self, name: str) -> dict[str, list[str]]:
        """The units systemd propagates a stop of this one to (RequiredBy=, BoundBy=,
        ConsistsOf=: whoever `needs` it), as `needs` reads them."""
        return await self._unit_lists(name, NEEDED_BY)

    async def _unit_lists(self, name: str, props: tuple[str, ...]) -> dict[str, list[str]]:
        path = unit_path(name)
        found: dict[str, list[str]] = {}
        for prop in props:
            (value,) = await self.call("Get", "ss", [UNIT, prop], path=path, interface=PROPERTIES)
            if not isinstance(value, Variant) or value.signature != "as":
                raise SystemdError(
                    "org.gpuslice.Error.BadReply", f"{prop} of {name}: {repr(value)[:80]}"
                )
            found[prop] = [str(v) for v in value.value]
        return found

    async def unit_pids(self, name: str) -> list[int]:
        """Every process in the unit's cgroup, as systemd lists them."""
        (processes,) = await self.call("GetUnitProcesses", "s", [name])
        return [int(p[1]) for p in processes]

    async def tasks_current(self, name: str) -> int | None:
        """How many tasks (processes and threads) a service's cgroup holds, its pids.current
        as systemd reads it (TasksCurrent, on the cgroup interfaces: Service here): eight
        bytes, where GetUnitProcesses lists every process with its command line, up to the
        bus's message limit, decoded in pure Python on the loop. None where systemd does not
        know it (UINT64_MAX: tasks accounting off, no cgroup). SystemdError for a unit
        without it (not a service) or a reply not of the form systemd gives (t)."""
        (value,) = await self.call(
            "Get", "ss", [SERVICE, "TasksCurrent"], path=unit_path(name), interface=PROPERTIES
        )
        if not isinstance(value, Variant) or value.signature != "t":
            raise SystemdError(
                "org.gpuslice.Error.BadReply", f"TasksCurrent of {name}: {repr(value)[:80]}"
            )
        count = int(value.value)
        return None if count == UNKNOWN_COUNT else count

    async def boot_id(self) -> str:
        """What changes with every boot: the kernel's boot id and when systemd started.

        The second part matters in containers, which share the host's kernel (and a
        sandboxed service may see the host's boot id even where nspawn gives the container
        its own)."""
        with open("/proc/sys/kernel/random/boot_id") as f:
            kernel = f.read().strip()
        (started,) = await self.call(
            "Get", "ss", [MANAGER, "UserspaceTimestamp"], interface=PROPERTIES
        )
        return f"{kernel}/{started.value}"

    async def system_state(self) -> str:
        (state,) = await self.call("Get", "ss", [MANAGER, "SystemState"], interface=PROPERTIES)
        return str(state.value)

    def _dispatch(self, msg: Message) -> bool:
        if msg.message_type == MessageType.METHOD_RETURN:
            self._answered(msg)
            return False
        if msg.message_type != MessageType.SIGNAL:
            return False
        try:
            if msg.sender == BUS_DAEMON:  # its own word (no one else can send as it)
                self._follow_owner(msg)
                return False
            if not self._believed(msg):
                self.dropped += 1
                return False
            self._signal(msg)
        except Exception:  # a bug must not cost the connection (dbus-next would only log it)
            log.exception("error handling %s.%s from %s", msg.interface, msg.member, msg.sender)
        return False

    def _answered(self, msg: Message) -> None:
        """An answer to a call whose caller is told in message order. Only systemd's own
        (the bus daemon routes an answer only from the connection called, and systemd's
        name may have changed hands since): otherwise the caller learns it when it resumes."""
        told = self._told.pop(msg.reply_serial, None)
        if told is None or not self._believed(msg):
            return
        try:
            told(msg)
        except Exception:  # a bug must not cost the connection (dbus-next would only log it)
            log.exception("error handling the answer to call %d", msg.reply_serial)

    def _follow_owner(self, msg: Message) -> None:
        """Follow systemd's name as it changes hands (daemon-reexec) through the bus daemon's
        NameOwnerChanged. Its other signals (NameAcquired of our own names) are not systemd's
        and are not counted as dropped: that counter is for signals someone forged."""
        if msg.member == "NameOwnerChanged" and msg.signature == "sss" and msg.body[0] == SYSTEMD:
            self._owner_heard += 1
            self._take_owner(msg.body[2] or None)

    def _take_owner(self, owner: str | None) -> None:
        self.owner = owner
        if owner is not None and owner != self._last_owner:
            if self._last_owner is not None:
                log.info("systemd is back on the bus as %s", owner)
                self.on_systemd_restarted()
            self._last_owner = owner

    async def check_owner(self) -> bool:
        """Ask the bus daemon who owns systemd's name now, and follow it if NameOwnerChanged
        did not say: whether it had not. That signal is dropped like any other for a
        connection whose queue in the bus daemon is full (anyone can fill it: Rereads.audit),
        and one lost at a daemon-reexec left the old, gone name believed: every signal of
        systemd's was taken for forged, and every later start, stop and daemon-reload went
        unheard, until the controller restarted. A NameOwnerChanged handled while the answer
        was on its way is the newer word."""
        heard = self._owner_heard
        try:
            (owner,) = await self._bus_daemon("GetNameOwner", "s", [SYSTEMD])
        except SystemdError as e:
            if e.name != "org.freedesktop.DBus.Error.NameHasNoOwner":
                raise
            owner = None  # between two executions of systemd
        owner = owner if isinstance(owner, str) and owner else None
        if heard != self._owner_heard or owner == self.owner:
            return False
        log.warning(
            "systemd's name is owned by %s, not %s as last heard: a NameOwnerChanged was "
            "lost on the bus; following it now",
            owner,
            self.owner,
        )
        self._take_owner(owner)
        return True

    def _believed(self, msg: Message) -> bool:
        """Whether the signal comes from systemd (its current owner, as followed)."""
        return self.owner is not None and msg.sender == self.owner

    def _signal(self, msg: Message) -> None:
        member, body = msg.member, msg.body
        if member == "PropertiesChanged":
            if msg.signature != "sa{sv}as" or body[0] != UNIT or not msg.path:
                return
            name = unit_name_from_path(msg.path)
            if name is None:
                return
            changed = {}
            for key, form in _UNIT_PROPERTIES.items():
                variant = body[1].get(key)
                value = variant.value if isinstance(variant, Variant) else variant
                value = form(value) if variant is not None else None
                if value is not None:
                    changed[key] = value
            if changed:
                self.on_unit_changed(name, changed)
        elif msg.interface != MANAGER or msg.path != MANAGER_PATH:
            return
        elif member == "JobNew" and msg.signature == "uos" and is_valid_unit_name(body[2]):
            self.on_job_new(body[0], body[1], body[2])
        elif member == "JobRemoved" and msg.signature == "uoss" and is_valid_unit_name(body[2]):
            self.on_job_removed(body[0], body[1], body[2], body[3])
        elif member == "Reloading" and msg.signature == "b":
            self.on_reloading(bool(body[0]))


# More group IDs than a caller's are taken for no answer (the kernel's NGROUPS_MAX is 65,536)
_GROUPS_MAX = 1 << 16


def credentials_of(found: object) -> tuple[int | None, frozenset[int]]:
    """UnixUserID and UnixGroupIDs of a GetConnectionCredentials answer, each only when it
    is of its documented type (u, au)."""
    if not isinstance(found, dict):
        return None, frozenset()
    uid, groups = found.get("UnixUserID"), found.get("UnixGroupIDs")
    user = uid.value if isinstance(uid, Variant) and uid.signature == "u" else None
    listed = groups.value if isinstance(groups, Variant) and groups.signature == "au" else []
    if not isinstance(listed, list) or len(listed) > _GROUPS_MAX:
        listed = []
    return (
        user if isinstance(user, int) else None,
        frozenset(g for g in listed if isinstance(g, int)),
    )
