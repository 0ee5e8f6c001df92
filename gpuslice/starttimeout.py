"""The start timeout a gated unit had, which its gate's `TimeoutStartSec=infinity` overrides.

The gate's drop-in sets `TimeoutStartSec=infinity`: a start may wait hours at its gate. A
unit has one start timeout, and systemd (v252 as today's, src/core/service.c) arms it afresh,
whole, for each command a start spawns (`service_spawn`: each `ExecCondition=` and
`ExecStartPre=` line, the gate first, the `ExecStart=` of a Type=notify, notify-reload,
forking, dbus or oneshot unit, each `ExecStartPost=`): no value bounds the steps after the
gate but not the gate's wait. Only `EXTEND_TIMEOUT_USEC=` could stretch a finite one while the
gate waits, and systemd takes that from an `ExecStartPre=` process only under
`NotifyAccess=exec` or `all` (`service_notify_message_authorized`), which would let the
unit's other start commands send `READY=1` too. So the override stays, and is said: a
`TimeoutStartSec=`/`TimeoutSec=` of the unit's own that it overrides (in its file or a
drop-in named before the gate's), and a Type=notify, notify-reload, forking or dbus unit
with none, whose 90 s default is gone. One set in a drop-in named after the gate's wins and
is said by nobody: it bounds the wait at the gate too (README). Pure (stdlib, paths,
unitfiles).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from gpuslice.paths import GATE_DROPIN_NAME
from gpuslice.unitfiles import Entry, printable

_COMMANDS = ("ExecCondition", "ExecStartPre", "ExecStartPost")
# The [Service] keys `StartTimeout.assign` reads.
KEYS = frozenset({"TimeoutStartSec", "TimeoutSec", "Type", "BusName", *_COMMANDS})
_TYPES = frozenset(
    {"simple", "exec", "forking", "oneshot", "dbus", "notify", "notify-reload", "idle"}
)
# what the start timeout bounds beyond the unit's own ExecCondition=/ExecStartPre=/
# ExecStartPost= lines (simple, exec and idle: nothing; an exec's ends at its execve)
_MAIN_STEP = {
    "notify": "its start until READY=1",
    "notify-reload": "its start until READY=1",
    "dbus": "its start until its bus name appears",
    "forking": "its ExecStart= until it returns",
    "oneshot": "its ExecStart=",
}
# types whose start systemd bounds by default (DefaultTimeoutStartSec=); a oneshot's is
# infinity unless it sets one
_BOUNDED_BY_DEFAULT = frozenset({"notify", "notify-reload", "dbus", "forking"})
_QUOTE_MAX = 100

_USEC_INFINITY = 2**64 - 1
# systemd's extract_multiplier: tried in this order, the first prefix wins ("ms" before "m")
_MULTIPLIERS = (
    ("seconds", 10**6),
    ("second", 10**6),
    ("sec", 10**6),
    ("s", 10**6),
    ("minutes", 60 * 10**6),
    ("minute", 60 * 10**6),
    ("min", 60 * 10**6),
    ("months", 2629800 * 10**6),
    ("month", 2629800 * 10**6),
    ("M", 2629800 * 10**6),
    ("msec", 10**3),
    ("ms", 10**3),
    ("m", 60 * 10**6),
    ("hours", 3600 * 10**6),
    ("hour", 3600 * 10**6),
    ("hr", 3600 * 10**6),
    ("h", 3600 * 10**6),
    ("days", 86400 * 10**6),
    ("day", 86400 * 10**6),
    ("d", 86400 * 10**6),
    ("weeks", 604800 * 10**6),
    ("week", 604800 * 10**6),
    ("w", 604800 * 10**6),
    ("years", 31557600 * 10**6),
    ("year", 31557600 * 10**6),
    ("y", 31557600 * 10**6),
    ("usec", 1),
    ("us", 1),
    ("\u03bcs", 1),
    ("\u00b5s", 1),
)
_MULTIPLIER = dict(_MULTIPLIERS)
_UNIT = "|".join(re.escape(suffix) for suffix, _ in _MULTIPLIERS)
_NUMBER = r"(\+(?=[0-9]))?([0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
# A whole time span as systemd's parse_time takes it: numbers (strtoll's "+"; a fraction),
# each followed by blanks, a unit, or the end ("12.34.56" is refused); the alternation keeps
# extract_multiplier's order (the first prefix wins; a path that fails after it fails at
# once).
_SPAN = re.compile(rf"[ \t\n\r]*(?:{_NUMBER}(?:[ \t\n\r]*(?:{_UNIT})[ \t\n\r]*|[ \t\n\r]+|\Z))+")
_COMPONENT = re.compile(rf"{_NUMBER}[ \t\n\r]*({_UNIT})?")
_LLONG_MAX = 2**63 - 1  # strtoll's last, for a span's whole numbers
_NONZERO = re.compile(r"[1-9]")
_BLANKS = " \t\n\r"
# A longer value is taken for one systemd refuses (a 1 MiB line of "0s0s..." is one it takes,
# read in seconds): it only ever costs a warning.
SPAN_MAX = 256

_GATE = (
    f"the gate's TimeoutStartSec=infinity ({GATE_DROPIN_NAME}: a start may wait hours at its gate)"
)
REMEDY = (
    f"to keep a limit, set TimeoutStartSec= in a drop-in named after {GATE_DROPIN_NAME} "
    "(it then bounds the wait at the gate too: systemd gives each step of a start the whole "
    "limit), or have the job bound its own start; `TimeoutStartSec=infinity` in the unit "
    "says there is none to keep (no warning)"
)


def seconds_usec(text: str) -> int | None:
    """systemd's parse_sec_fix_0: microseconds, `_USEC_INFINITY` for `infinity` and for 0
    (no timeout), None where systemd refuses the value (the empty one too), which it then
    ignores; also past `SPAN_MAX` characters."""
    if len(text) > SPAN_MAX:
        return None
    rest = text.lstrip(_BLANKS)
    if rest.startswith("infinity"):
        return _USEC_INFINITY if rest[len("infinity") :].strip(_BLANKS) == "" else None
    if _SPAN.fullmatch(text) is None:
        return None
    if _NONZERO.search(text) is None:
        return _USEC_INFINITY  # 0: no timeout (units hold no digit)
    usec = 0
    for found in _COMPONENT.finditer(text):
        _, number, suffix = found.groups()
        whole, _, fraction = number.partition(".")
        multiplier = _MULTIPLIER[suffix] if suffix is not None else 10**6
        count = int(whole or "0")
        if count > _LLONG_MAX or count >= _USEC_INFINITY // multiplier:
            return None  # strtoll's ERANGE, or parse_time's
        usec += count * multiplier
        scale = multiplier // 10
        for digit in fraction[:13]:  # a microsecond is the 13th digit of a year's
            usec += int(digit) * scale
            scale //= 10
        if usec >= _USEC_INFINITY:
            return None  # ERANGE
    return usec


class Finding(NamedTuple):
    """A warning at one assignment: file, line, key and message."""

    path: str
    line: int
    key: str
    message: str


class _At(NamedTuple):
    path: str
    line: int
    key: str
    value: str


class StartTimeout:
    """The `[Service]` settings that say what the gate's `TimeoutStartSec=infinity` takes
    away, fed in systemd's order (`assign`, the gate's own drop-in skipped): the last
    `TimeoutStartSec=`/`TimeoutSec=` systemd takes (one it refuses, the empty one too, is
    ignored), before or after the gate's; `Type=` (one it refuses ignored); `BusName=` (a
    unit without `Type=` is Type=dbus with one; the empty one resets it); and which of
    `ExecCondition=`, `ExecStartPre=` and `ExecStartPost=` have lines left (an empty one
    resets its list)."""

    def __init__(self) -> None:
        self.timeout: tuple[_At, int] | None = None  # the one in force, and its microseconds
        self.timeout_after_gate = False
        self.type: _At | None = None
        self.bus_name: _At | None = None
        self.commands: set[str] = set()  # those of `_COMMANDS` with lines left

    def assign(self, path: str, entry: Entry, before_gate: bool) -> None:
        at = _At(path, entry.line, entry.key, entry.value)
        key, value = entry.key, entry.value
        if key in ("TimeoutStartSec", "TimeoutSec"):
            usec = seconds_usec(value)
            if usec is not None:
                self.timeout, self.timeout_after_gate = (at, usec), not before_gate
        elif key == "Type":
            if value in _TYPES:
                self.type = at
        elif key == "BusName":
            self.bus_name = at if value else None
        elif key in _COMMANDS:
            if value:
                self.commands.add(key)
            else:
                self.commands.discard(key)

    def findings(self) -> list[Finding]:
        """The warning for what the gate's override takes away; none where it takes nothing
        (no limit of the unit's own, or one set after the gate's, or nothing it bounded)."""
        kind = self._kind()
        steps = [_MAIN_STEP[kind]] if kind in _MAIN_STEP else []
        own = [key for key in _COMMANDS if key in self.commands]
        if own:
            steps.append("its " + " and ".join(f"{k}=" for k in own) + " lines")
        what = " and ".join(steps)
        hangs = (
            f"nothing bounds {what} any more, and one that hangs holds its GPUs until someone "
            "stops it"
        )
        if self.timeout is not None:
            at, usec = self.timeout
            if self.timeout_after_gate or usec == _USEC_INFINITY or not steps:
                return []
            message = f"{printable(at.value, _QUOTE_MAX)}: overridden by {_GATE}: {hangs}"
            return [Finding(at.path, at.line, at.key, f"{message}; {REMEDY}")]
        typed = self.type or self.bus_name  # what made it that type
        if kind not in _BOUNDED_BY_DEFAULT or typed is None:
            return []
        said = "Type=dbus by this BusName=, " if typed.key == "BusName" else ""
        message = (
            f"{printable(typed.value, _QUOTE_MAX)}: {said}no TimeoutStartSec= of its own, and "
            f"{_GATE} replaces systemd's default start timeout (DefaultTimeoutStartSec=, 90 s "
            f"unless system.conf says otherwise): {hangs}"
        )
        return [Finding(typed.path, typed.line, typed.key, f"{message}; {REMEDY}")]

    def _kind(self) -> str:
        """systemd's service_fix_output: Type= if set, else dbus with a BusName=, else simple
        (a unit without ExecStart= is a oneshot, and bounded by no default)."""
        if self.type is not None:
            return self.type.value
        return "dbus" if self.bus_name is not None else "simple"
