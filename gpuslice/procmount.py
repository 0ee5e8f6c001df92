"""Whether the host hides processes from other users (/proc mounted `hidepid=`), read from
the controller's own mount table. (`subset=pid` hides /proc's files that are not of a
process, not other users' processes: it changes nothing here.)

An admin who mounts /proc so (proc(5)) hides each user's processes from the others: their
PIDs, command lines, owners. The controller is root and sees them all (where /proc lets it:
`sees_every_process`); `Status`, which anyone may call, said them (each GPU's foreign
processes, whose they are). Where /proc hides them, Status answers a caller that /proc would
not show them to with those details left out (gpuslice/status.py, `redacted`), but of its
own processes (RedactedStatus): root, and members of the mount's `gid=` group (hidepid's own
exemption, but under `hidepid=ptraceable`), see everything.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MOUNTINFO = Path("/proc/self/mountinfo")
PROC = Path("/proc")
# The most of it read: /proc is mounted at boot, among the first lines; a host of tens of
# thousands of mounts (containers) has megabytes of them, read at start and on each reload.
MOUNTINFO_MAX = 4 << 20
# hidepid values that hide nothing (numbers before Linux 5.8, words since)
_SHOWS_ALL = ("0", "off")
# hidepid values whose hiding the gid= group is exempt from. Not `ptraceable` (4): the kernel
# shows each caller only the processes it may ptrace, whatever its groups (a member of gid=
# sees no other user's), and Status gave that group every PID, command and owner. Nor a value
# this list does not know (a later kernel's): no group is exempt (fail closed).
_GROUP_EXEMPT = ("1", "2", "noaccess", "invisible")
_OCTAL = re.compile(r"\\([0-7]{3})")
_GID_DIGITS = 10  # a gid_t is 32 bits


@dataclass(frozen=True)
class ProcHiding:
    """`hides`: /proc hides other users' processes; `gid`: the group /proc still shows
    them all to (None: none, as under hidepid=ptraceable whatever gid= says:
    `_GROUP_EXEMPT`); `said`: the options that say so, for the log."""

    hides: bool = False
    gid: int | None = None
    said: str = ""

    def exempts(self, uid: int | None, groups: Collection[int]) -> bool:
        """Whether a caller of this UID and these groups may see every process: always
        where nothing is hidden; else root and members of `gid` only. Unknown (None, no
        groups): not exempt."""
        if not self.hides:
            return True
        if uid == 0:
            return True
        return self.gid is not None and self.gid in groups


# Unreadable, or no /proc in what was read: taken to hide (fail closed)
UNKNOWN = ProcHiding(True, None, "the mount table could not be read")


def _unescape(field: str) -> str:
    """The kernel's octal escapes in a mount table field (`\\040` a space, `\\134` a
    backslash)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def _hiding_of(options: list[str]) -> ProcHiding:
    hides, gid, said = False, None, []
    group_exempt = True
    for option in options:
        key, _, value = option.partition("=")
        if key == "hidepid":
            said.append(option)
            hides = hides or value not in _SHOWS_ALL  # an unknown value: taken to hide
            group_exempt = group_exempt and (value in _SHOWS_ALL or value in _GROUP_EXEMPT)
        elif key == "gid":
            said.append(option)
            ok = value.isascii() and value.isdigit() and len(value) <= _GID_DIGITS
            gid = int(value) if ok and int(value) < 1 << 32 else None
    return ProcHiding(hides, gid if hides and group_exempt else None, ",".join(said))


def proc_hiding_of(mountinfo: str) -> ProcHiding | None:
    """What the /proc mount in `mountinfo` (proc(5)'s format) hides: of several proc mounts
    on /proc, the one on top (no other is mounted on it); if that cannot be told, hidden
    where any hides, with no group exempt. None when no line mounts proc on /proc. Lines
    not of the format are skipped."""
    found: dict[str, tuple[str, ProcHiding]] = {}  # mount ID: parent ID, what it hides
    for line in mountinfo.split("\n"):
        fields = line.split(" ")
        # ID, parent, major:minor, root, mount point, options, [optional...], -, type,
        # source, super options
        if len(fields) < 10 or _unescape(fields[4]) != "/proc":
            continue
        try:
            dash = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < dash + 4 or fields[dash + 1] != "proc":
            continue
        # hidepid is the super block's option since Linux 5.8; the mount's
        # own are read too
        options = fields[5].split(",") + fields[dash + 3].split(",")
        found[fields[0]] = (fields[1], _hiding_of([_unescape(o) for o in options]))
    if not found:
        return None
    below = {parent for parent, _ in found.values()}
    top = [hiding for mount, (_, hiding) in found.items() if mount not in below]
    if len(top) == 1:
        return top[0]
    hiding = [h for _, h in found.values() if h.hides]
    return ProcHiding(True, None, hiding[0].said) if hiding else ProcHiding()


def sees_every_process(proc: Path = PROC) -> bool:
    """Whether /proc lets this process read PID 1's cgroup, and so every process's (what
    the controller reads of each process on a GPU): hidepid= hides from root too a process
    it may not ptrace, and the controller has no CAP_SYS_PTRACE (CapabilityBoundingSet=), so
    only the mount's gid= group exempts it (or no gid=: the group is then root's). PID 1
    holds capabilities the controller lacks: where it is hidden, every process of another
    user and every root job is. (`hidepid=noaccess` shows its directory, not what is in it.)"""
    try:
        with open(proc / "1" / "cgroup", "rb"):
            return True
    except OSError:
        return False


def read_proc_hiding(path: Path | None = None) -> ProcHiding:
    """What this process's /proc hides, from its mount table (MOUNTINFO_MAX bytes of it);
    UNKNOWN (hides, no group) when it cannot be read or names no /proc."""
    try:
        with open(path or MOUNTINFO, "rb") as f:
            raw = f.read(MOUNTINFO_MAX)
        if len(raw) == MOUNTINFO_MAX:  # cut short: its last line may have lost its options
            raw = raw[: raw.rfind(b"\n") + 1]
        text = raw.decode("utf-8", "replace")
    except (OSError, ValueError) as e:
        log.warning("cannot read the mount table (%s): Status hides other users' processes", e)
        return UNKNOWN
    found = proc_hiding_of(text)
    if found is None:
        log.warning("no /proc in the mount table: Status hides other users' processes")
        return UNKNOWN
    return found
