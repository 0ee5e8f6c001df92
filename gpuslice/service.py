"""gpuslice's own D-Bus interface, `org.gpuslice.Scheduler1` (the 1 is the version).

`Acquire` is what the gate calls from a unit's start job: its reply is deferred until the
unit may run, so `systemctl start` blocks exactly as long as the unit waits. `Plan` says
what a start of a unit would do now (`gpuslice plan`), changing nothing. The shipped bus
policy lets only root call Acquire, Plan and Reload and send us signals; anyone may call
Status (where /proc hides other users' processes, a caller it would hide them from is
answered without them, its own shown: gpuslice/procmount.py). The controller still checks
that an Acquire comes from a process of the unit it names (`refuse` answers those that do
not).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

from dbus_next import DBusError, Message, MessageFlag, MessageType, Variant
from dbus_next.aio import MessageBus
from dbus_next.constants import NameFlag, RequestNameReply

from gpuslice.busread import Unread
from gpuslice.systemd import BUS_DAEMON, bus_daemon_call
from gpuslice.unitfiles import is_valid_unit_name, printable

BUS_NAME = "org.gpuslice.Scheduler1"
OBJECT_PATH = "/org/gpuslice/Scheduler1"
INTERFACE = "org.gpuslice.Scheduler1"

INTROSPECTION = f"""<!DOCTYPE node PUBLIC "-//freedesktop//DTD D-BUS Object Introspection 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/introspect.dtd">
<node>
 <interface name="{INTERFACE}">
  <method name="Acquire"><arg name="unit" type="s" direction="in"/>
   <arg name="gpus" type="s" direction="out"/></method>
  <method name="Status"><arg name="json" type="s" direction="out"/></method>
  <method name="Plan"><arg name="unit" type="s" direction="in"/>
   <arg name="json" type="s" direction="out"/></method>
  <method name="Reload"/>
 </interface>
 <interface name="org.freedesktop.DBus.Introspectable">
  <method name="Introspect"><arg name="xml" type="s" direction="out"/></method>
 </interface>
</node>
"""

log = logging.getLogger(__name__)

ACCESS_DENIED = "org.freedesktop.DBus.Error.AccessDenied"
INVALID_ARGS = "org.freedesktop.DBus.Error.InvalidArgs"
LIMITS_EXCEEDED = "org.freedesktop.DBus.Error.LimitsExceeded"
NOT_MANAGED = "org.gpuslice.Error.NotManaged"
# A call the controller answers only once its start-up is done (Status, Plan): ask again
STARTING = "org.gpuslice.Error.Starting"
# An Acquire answered without a grant, for its gate to ask again (any error does: it retries)
START_ENDED = "org.gpuslice.Error.StartEnded"
# What `gpuslice release-jobs` answers every call to our object with while it holds our name
# (cli._controllers_name, `answer_releasing`): a controller that finds the name held waits for
# it only when its owner says this. Only root may own the name (the bus policy), and the bus
# daemon routes a call to its owner alone and lets no one else answer it: no other user's
# process can say it in its place.
RELEASING = "org.gpuslice.Error.Releasing"
# How long a controller waits for release-jobs to let go of our name: its RELEASE_DEADLINE
# (cli.py, 120 s, after which it starts no resume) and a margin for the resume under way and
# its save. Past it the controller exits 1 and Restart= starts it again, to wait once more.
RELEASE_WAIT = 150.0
# How often the name is asked for again meanwhile.
CLAIM_RETRY = 0.5
# How long the bus daemon and the name's owner are given to say who holds the name: one that
# does not say in time is taken for a controller (refused at once, as before).
OWNER_TIMEOUT = 5.0
# One start job runs one gate; a few more calls per unit can only be a gate that retried
# while an earlier call of it was still on its way. More than this is not a gate.
MAX_PENDING_PER_UNIT = 8
# Bytes of Status answers handed to the bus connection and not yet written to its socket:
# while they are past this, a Status call is refused (LimitsExceeded) instead of answered.
# An answer is the whole status (2 MiB at 1,000 waiting units on 8 GPUs), anyone may ask,
# and dbus-next queues what it sends without bound, in one queue with the controller's own
# calls: callers that asked faster than the bus daemon took the answers filled the
# controller's memory (2.2 GiB from eight connections at 1,000 waiting units) and held its
# own calls to systemd behind them (4.5 s). One answer always goes, however long. A call that
# asks for no answer (NO_REPLY_EXPECTED, which no limit of the bus daemon's counts) gets none.
MAX_STATUS_UNSENT = 16 << 20
# The longest Status answer sent: the system bus's dbus-daemon takes no message over 32 MiB
# (max_message_size) and drops the connection that sends one, and the controller exits with
# its bus. Its status reaches that at ~15,000 waiting units on 8 GPUs (2.2 KiB each), ~2,200
# on 64. Past it, Status is refused with a sentence that says so.
MAX_STATUS_ANSWER = (32 << 20) - 4096  # less a header
# Bytes of our messages the bus daemon may hold for callers that have not read them yet
# (dbus-daemon's IncomingBytes of our connection, GetConnectionStats): while they may be past
# this, a Status call is refused (LimitsExceeded). An answer written to the bus socket is not
# yet read by its caller: dbus-daemon keeps it, counted against our connection, until the
# caller reads it, and once it keeps max_incoming_bytes of ours (127 MiB on the system bus)
# it stops reading our socket. Two connections that called Status ~16,000 times (8 KiB
# answers, ~10 s) and never read did that: every call of the controller's to systemd, its
# StartUnit and StopUnit among them, waited behind them for as long as those callers
# lived. Room is left for the longest answer (MAX_STATUS_ANSWER) and our own calls.
MAX_STATUS_HELD = 64 << 20
# Past MAX_STATUS_HELD by this much, a call anyone may make (all but root's Acquire, Plan and
# Reload: the bus policy) gets no answer at all: a refusal waits in the bus daemon as an
# answer does (~1,000,000 of them, or of Introspect's, reach 127 MiB as well).
MAX_REFUSALS_HELD = 8 << 20
# Bytes counted for each answer a call gets, besides a Status answer's text, until the bus
# daemon says what it holds: more than its header, an error's words or an introspection
# (ours, ~1 KiB, or dbus-next's of another path, which names that path: busread's
# MAX_CALL_HEADER at most).
ANSWER_BYTES = 8 << 10
# Bytes of answers counted between two readings of what the bus daemon holds, at most (one
# more is asked for at each refused call, one at a time, at most every READ_AGAIN s); until
# a reading says otherwise, what was counted since is taken to be held.
READ_EVERY = 4 << 20
READ_AGAIN = 0.1
# How long a reading is waited for; one that does not come is asked for again later.
READ_TIMEOUT = 5.0
# A reading that failed otherwise (an error the daemon need not give next time, NoMemory or
# LimitsExceeded, a lost connection): asked again no sooner than READ_RETRY s later, twice as
# long after each failure in a row, READ_RETRY_MAX s at most (not at every answer, as the
# bytes counted since the last reading would have it); meanwhile what is counted stays held.
READ_RETRY = 1.0
READ_RETRY_MAX = 60.0
STATS = "org.freedesktop.DBus.Debug.Stats"
# The errors of a bus daemon that cannot say what it holds, whenever asked (no Debug.Stats:
# dbus-broker, a dbus-daemon built without it; a policy that refuses it): asked no more.
CANNOT_SAY = frozenset(
    {
        "org.freedesktop.DBus.Error.UnknownMethod",
        "org.freedesktop.DBus.Error.UnknownInterface",
        "org.freedesktop.DBus.Error.UnknownObject",
        "org.freedesktop.DBus.Error.AccessDenied",
        "org.freedesktop.DBus.Error.NotSupported",
    }
)
# Status calls waiting for the bus daemon to say who called (only where /proc hides other
# users' processes: gpuslice/procmount.py): past this many, a Status call that would ask is
# refused (LimitsExceeded, "try again"); one whose caller is known already is answered
# (gpuslice/callers.py). Anyone may call Status as often as they like, and each question
# takes one of the controller's calls in flight, which its calls to systemd share
# (systemd.MAX_CALLS_IN_FLIGHT): a flood of them held its StartUnit and StopUnit back.
MAX_STATUS_ASKING = 8


class NameTaken(Exception):
    """The bus name cannot be ours: another controller owns it, or the bus policy refuses
    it to this user (only root may own it)."""


class Starting(Exception):
    """The controller's start-up is not done: its words say to ask again."""


class NotManaged(LookupError):
    """The unit named has no annotation in force (`Plan`): its words say so."""


def answer_releasing(msg: Message) -> Message | bool:
    """release-jobs' answer to every call to our object while it holds our name
    (cli._controllers_name): RELEASING. A gate asks again, as it does of any error; a
    controller starting meanwhile waits for the name (SchedulerService.claim_name)."""
    if msg.message_type != MessageType.METHOD_CALL or msg.path != OBJECT_PATH:
        return False
    if msg.flags & MessageFlag.NO_REPLY_EXPECTED:
        return True
    return Message.new_error(
        msg,
        RELEASING,
        "`gpuslice release-jobs` releases the units of a stopped controller: ask again once "
        "it ends",
    )


def _roots(msg: Message) -> bool:
    """Whether the call is one that only root may make (the bus policy): answered whatever
    the bus daemon holds of ours (a gate's Acquire above all)."""
    return (
        msg.path == OBJECT_PATH
        and msg.interface == INTERFACE
        and msg.member in ("Acquire", "Plan", "Reload")
    )


def _unit_arg(msg: Message) -> str | None:
    """The one unit name a call carries, if it is one."""
    unit = msg.body[0] if msg.signature == "s" else None
    return unit if isinstance(unit, str) and is_valid_unit_name(unit) else None


def _bad_unit(msg: Message) -> Message:
    shown = printable(str(msg.body[0] if msg.body else ""), 80)
    return Message.new_error(msg, INVALID_ARGS, f"not a valid unit name: {shown}")


class SchedulerService:
    """Routes method calls on our object to the controller; holds deferred Acquire calls."""

    def __init__(
        self,
        bus: MessageBus,
        on_acquire: Callable[[str, str], None],
        on_status: Callable[[], str],
        on_reload: Callable[[], None],
        on_plan: Callable[[str], str] | None = None,
        on_status_for: Callable[[str], str | Coroutine[Any, Any, str]] | None = None,
    ) -> None:
        """`on_status_for`, given, answers Status instead of `on_status`: the answer for the
        caller of that unique bus name, now (a string: known already) or once it has asked
        who that is (a coroutine, closed unawaited when MAX_STATUS_ASKING are in wait)."""
        self.bus = bus
        self._on_acquire = on_acquire
        self._on_status = on_status
        self._on_reload = on_reload
        self._on_plan = on_plan
        self._on_status_for = on_status_for
        self._pending: dict[str, list[Message]] = {}
        self._status_unsent = 0  # bytes of Status answers not yet written: MAX_STATUS_UNSENT
        self._asking: set[asyncio.Task[None]] = set()  # Status calls: MAX_STATUS_ASKING
        # what the bus daemon holds of ours (MAX_STATUS_HELD): its last word (IncomingBytes),
        # the bytes of answers counted in all, and of those, counted before that word was
        # asked for; None once it said it cannot tell (no Debug.Stats: dbus-broker's or a
        # dbus-daemon built without it), then nothing is read nor refused for it
        self._held_said: int | None = 0
        self._answers_sent = 0
        self._sent_when_asked = 0
        self._reading: asyncio.Task[None] | None = None
        self._read_at = -math.inf  # time.monotonic() of the last reading asked for
        self._failures = 0  # readings failed in a row (READ_RETRY), none since the last word
        self._retry_at = -math.inf  # time.monotonic() before which none is asked for again
        bus.add_message_handler(self._handle)

    async def claim_name(self, waiting: Callable[[int], None] = lambda pid: None) -> None:
        """Own BUS_NAME, or NameTaken. Held by `gpuslice release-jobs` (its owner answers
        RELEASING), it is asked for again every CLAIM_RETRY s, `waiting` told release-jobs'
        PID each time, for up to RELEASE_WAIT s: refused, the controller exited 1, and under
        systemd Restart= tried again every second or two, reached the start limit (5 in
        10 s) and left gpuslice.service failed, every gated start waiting, until someone ran
        `systemctl reset-failed`. Held by anyone else (a second controller), refused at once."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + RELEASE_WAIT
        while True:
            try:
                reply = await self.bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
            except DBusError as e:  # AccessDenied: not root
                raise NameTaken(f"cannot own {BUS_NAME}: {printable(e.text, 300)}") from None
            if reply in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
                return
            pid = await self._release_jobs_pid()
            if pid is None:
                raise NameTaken(
                    f"{BUS_NAME} is owned by another process ({reply.name}): another gpuslice "
                    "controller runs (systemctl status gpuslice), or `gpuslice release-jobs` "
                    "releases the units of a stopped one (apt remove)"
                )
            if loop.time() >= give_up:
                held_by = f"`gpuslice release-jobs` (PID {pid})" if pid else "its owner"
                raise NameTaken(f"{BUS_NAME} is still held by {held_by} after {RELEASE_WAIT:g} s")
            if pid:
                waiting(pid)
            await asyncio.sleep(CLAIM_RETRY)

    async def _release_jobs_pid(self) -> int | None:
        """The PID of the `gpuslice release-jobs` that holds BUS_NAME now (its owner answers
        RELEASING, `answer_releasing`); 0 when no one holds it any longer; None when another
        does (a controller, which answers otherwise, or an owner that says nothing)."""
        try:
            return await asyncio.wait_for(self._ask_owner(), OWNER_TIMEOUT)
        except Exception:  # silent, an answer not of the bus's, the bus lost: refused as before
            return None

    async def _ask_owner(self) -> int | None:
        owner = await self._ask(BUS_DAEMON, "GetNameOwner", BUS_NAME)
        if owner.message_type is MessageType.ERROR:  # NameHasNoOwner: let go since
            return 0
        [unique] = owner.body
        said = await self._ask(unique, "Status")
        if said.error_name != RELEASING or said.sender != unique:  # a controller, its status
            return None
        pid = await self._ask(BUS_DAEMON, "GetConnectionUnixProcessID", unique)
        if pid.message_type is MessageType.ERROR:  # gone since it answered: let go
            return 0
        [found] = pid.body
        return found if isinstance(found, int) and found > 0 else None

    async def _ask(self, destination: str, member: str, *name: str) -> Message:
        """The reply to a call of the bus daemon's (`member` of `name`), or of our interface
        on `destination` (no argument)."""
        reply = await self.bus.call(
            bus_daemon_call(member, "s" * len(name), list(name))
            if destination == BUS_DAEMON
            else Message(
                destination=destination, path=OBJECT_PATH, interface=INTERFACE, member=member
            )
        )
        if reply is None:  # none comes back only for a call that asks for none
            raise ValueError(f"no reply to {member}")
        return reply

    def grant(self, unit: str, gpus: str) -> int:
        """Answer every gate call of this unit: its start job continues. How many there were."""
        calls = self._pending.pop(unit, [])
        for call in calls:
            self.bus.send(Message.new_method_return(call, "s", [gpus]))
        return len(calls)

    def forget(self, unit: str) -> None:
        """The unit's start ended (or was cancelled): its calls are answered with an error,
        never dropped. A call may be the gate of the unit's next start, read before that
        end's signals (systemd holds them back while its bus queue is long): dropped, its
        dbus-send waited for ever (its reply timeout is ~24 days); answered, it asks again.
        The gate of the start that ended is gone: its answer goes nowhere."""
        for call in self._pending.pop(unit, []):
            text = f"the start of {unit} this call waited for has ended: ask again"
            self.bus.send(Message.new_error(call, START_ENDED, text))

    def pending(self, unit: str) -> bool:
        return bool(self._pending.get(unit))

    def refuse(self, unit: str, sender: str, error: str, text: str) -> None:
        """Answer this sender's Acquire calls for the unit with an error."""
        calls = self._pending.get(unit, [])
        for call in [c for c in calls if c.sender == sender]:
            calls.remove(call)
            self.bus.send(Message.new_error(call, error, text))
        if not calls:
            self._pending.pop(unit, None)

    def _handle(self, msg: Message) -> Message | bool:
        if msg.message_type != MessageType.METHOD_CALL:
            return False
        if not msg.flags & MessageFlag.NO_REPLY_EXPECTED:  # it gets an answer, ours or not
            if self._held() >= MAX_STATUS_HELD + MAX_REFUSALS_HELD and not _roots(msg):
                self._read_held(again=True)
                return True  # no answer: it too would wait in the bus daemon
            self._answers_sent += ANSWER_BYTES
            self._read_held()
        answer: Message | bool
        if isinstance(msg, Unread) and msg.header_len:  # its path was not read: not ours
            answer = Message.new_error(
                msg, LIMITS_EXCEEDED, f"a header of {msg.header_len} bytes: not read"
            )
        elif msg.path != OBJECT_PATH:
            return False
        else:
            try:
                answer = self._route(msg)
            except Exception:  # never a traceback to a caller, never a lost connection
                log.exception("error handling %s from %s", msg.member, msg.sender)
                answer = Message.new_error(
                    msg, "org.freedesktop.DBus.Error.Failed", "internal error"
                )
        if isinstance(answer, Message) and msg.flags & MessageFlag.NO_REPLY_EXPECTED:
            return True  # the caller asked for none (the bus daemon would drop it, once read)
        return answer

    def _route(self, msg: Message) -> Message | bool:
        if isinstance(msg, Unread):  # arguments longer than any method of ours takes
            return Message.new_error(
                msg, LIMITS_EXCEEDED, f"arguments of {msg.body_len} bytes: not read"
            )
        if msg.interface == "org.freedesktop.DBus.Introspectable" and msg.member == "Introspect":
            return Message.new_method_return(msg, "s", [INTROSPECTION])
        if msg.interface not in (INTERFACE, None):
            return False
        if msg.member == "Acquire":
            unit = _unit_arg(msg)
            if unit is None:
                return _bad_unit(msg)
            calls = self._pending.setdefault(unit, [])
            if len(calls) >= MAX_PENDING_PER_UNIT:
                return Message.new_error(msg, LIMITS_EXCEEDED, f"too many calls for {unit}")
            calls.append(msg)
            self._on_acquire(unit, msg.sender)
            return True
        if msg.member == "Status":
            return self._status(msg)
        if msg.member == "Plan" and self._on_plan is not None:
            unit = _unit_arg(msg)
            if unit is None:
                return _bad_unit(msg)
            try:
                return Message.new_method_return(msg, "s", [self._on_plan(unit)])
            except NotManaged as e:
                return Message.new_error(msg, NOT_MANAGED, str(e))
            except Starting as e:
                return Message.new_error(msg, STARTING, str(e))
        if msg.member == "Reload":
            self._on_reload()
            return Message.new_method_return(msg)
        return Message.new_error(
            msg, "org.freedesktop.DBus.Error.UnknownMethod", f"no method {msg.member}"
        )

    def _status(self, msg: Message) -> Message | bool:
        """The answer is sent here, to know when it is written (MAX_STATUS_UNSENT); a call
        that asks for no answer costs nothing."""
        if msg.flags & MessageFlag.NO_REPLY_EXPECTED:
            return True
        refused = self._status_refused(msg)
        if refused is not None:
            return refused
        try:
            if self._on_status_for is None:
                return self._send_status(msg, self._on_status())
            answer = self._on_status_for(msg.sender or "")
        except Starting as e:
            return Message.new_error(msg, STARTING, str(e))
        if isinstance(answer, str):  # known already: no question, whatever is in flight
            return self._send_status(msg, answer)
        if len(self._asking) >= MAX_STATUS_ASKING:
            answer.close()  # not begun: nothing was asked
            return Message.new_error(
                msg, LIMITS_EXCEEDED, "too many status calls being answered: try again"
            )
        task = asyncio.ensure_future(self._send_status_later(msg, answer))
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)
        return True

    def _status_refused(self, msg: Message) -> Message | None:
        if self._status_unsent >= MAX_STATUS_UNSENT:
            return Message.new_error(
                msg, LIMITS_EXCEEDED, "too many status answers still being sent: try again"
            )
        if self._held() >= MAX_STATUS_HELD:
            self._read_held(again=True)
            return Message.new_error(
                msg,
                LIMITS_EXCEEDED,
                "too many status answers not yet read by their callers: try again",
            )
        return None

    def _held(self) -> int:
        """The bytes of ours the bus daemon may hold, at most: its last word, and every
        answer counted since that word was asked for (0 when it cannot tell)."""
        if self._held_said is None:
            return 0
        return self._held_said + self._answers_sent - self._sent_when_asked

    def _read_held(self, again: bool = False) -> None:
        """Ask the bus daemon what it holds of ours, unless it cannot tell or is being
        asked; `again` (a refused call): at most every READ_AGAIN s, else every READ_EVERY
        bytes of answers."""
        if self._held_said is None or self._reading is not None:
            return
        if time.monotonic() < self._retry_at:
            return
        if again:
            if time.monotonic() - self._read_at < READ_AGAIN:
                return
        elif self._answers_sent - self._sent_when_asked < READ_EVERY:
            return
        self._read_at = time.monotonic()
        self._reading = asyncio.get_running_loop().create_task(self._read_held_now())

    async def _read_held_now(self) -> None:
        sent = self._answers_sent  # every answer sent so far is read by the daemon before this
        try:
            reply = await asyncio.wait_for(
                self.bus.call(
                    bus_daemon_call(
                        "GetConnectionStats", "s", [self.bus.unique_name], interface=STATS
                    )
                ),
                READ_TIMEOUT,
            )
        except TimeoutError:  # asked again at the next answers
            return
        except Exception as e:  # the connection's (lost, ...): asked again later
            self._read_failed(printable(str(e) or type(e).__name__, 200))
            return
        finally:
            self._reading = None
        said = (
            printable(str(reply.body[0]), 200) if reply is not None and reply.body else "no count"
        )
        failed = reply is not None and reply.message_type is MessageType.ERROR
        if failed and reply.error_name not in CANNOT_SAY:  # the daemon's, this time
            self._read_failed(f"{printable(str(reply.error_name), 100)}: {said}")
            return
        held = _incoming_bytes(reply)
        if held is None:
            self._held_said = None
            log.info(
                "the bus daemon does not say how much of ours it holds (%s): Status answers "
                "its callers do not read are not bounded",
                said,
            )
            return
        if self._failures:
            log.info("the bus daemon says again how much of ours it holds")
        self._failures, self._retry_at = 0, -math.inf
        self._held_said, self._sent_when_asked = held, sent

    def _read_failed(self, why: str) -> None:
        """A reading that may come next time: asked again after READ_RETRY s, doubled at each
        failure in a row; said once for them all (the journal is not flooded)."""
        self._failures += 1
        delay = min(READ_RETRY * 2 ** min(self._failures - 1, 32), READ_RETRY_MAX)
        self._retry_at = time.monotonic() + delay
        if self._failures == 1:
            log.warning(
                "cannot read what the bus daemon holds of ours (%s): asked again later; until "
                "then the Status answers sent count as held",
                why,
            )

    async def _send_status_later(self, msg: Message, answer: Coroutine[Any, Any, str]) -> None:
        """An answer that waited for the bus daemon: the answers sent meanwhile count."""
        try:
            text = await answer
            reply = self._status_refused(msg) or self._send_status(msg, text)
        except Exception:  # never a traceback to a caller, never a lost connection
            log.exception("error handling Status from %s", msg.sender)
            reply = Message.new_error(msg, "org.freedesktop.DBus.Error.Failed", "internal error")
        if isinstance(reply, Message):
            self.bus.send(reply)

    def _send_status(self, msg: Message, text: str) -> Message | bool:
        size = len(text)  # bytes: the JSON is ASCII
        if size > MAX_STATUS_ANSWER:
            return Message.new_error(
                msg,
                LIMITS_EXCEEDED,
                f"the status is {size} bytes, more than one D-Bus message carries "
                f"({MAX_STATUS_ANSWER})",
            )
        sent = self.bus.send(Message.new_method_return(msg, "s", [text]))
        self._status_unsent += size
        self._answers_sent += size
        self._read_held()

        def written(_: object) -> None:
            self._status_unsent -= size

        sent.add_done_callback(written)
        return True


def _incoming_bytes(reply: Message | None) -> int | None:
    """dbus-daemon's IncomingBytes of a GetConnectionStats answer: the bytes of the
    connection's messages it holds (a u); None for any other answer."""
    if reply is None or reply.message_type is not MessageType.METHOD_RETURN:
        return None
    stats = reply.body[0] if reply.signature == "a{sv}" and reply.body else None
    found = stats.get("IncomingBytes") if isinstance(stats, dict) else None
    if not isinstance(found, Variant) or found.signature != "u":
        return None
    value: int = found.value  # a Variant is checked against its signature: a u is an int
    return value
