"""Which unit a process belongs to, by the rule systemd itself applies.

systemd's cg_path_get_unit(): skip the leading slices of the cgroup path; the next component
is the unit if it is a valid unit name (no template) of a type other than slice, and there is
no unit otherwise. The FIRST unit counts, never a deeper one: a managed unit's own `Delegate=`
sub-scopes and its `.control` cgroup belong to it, and a user's
`systemd-run --user --unit=job` (under `/user.slice/user-1000.slice/user@1000.service/...`)
belongs to `user@1000.service`, which gpuslice never manages, however its inner unit is named.

Cgroup directories carry unit names verbatim (`gpu\\x2dworker@b.service` stays escaped, as the
unit name itself is); systemd prefixes `_` to a name that would clash with cgroupfs' own files
(`_cpu.service`), and that one `_` is dropped here as in cg_unescape().
"""

from __future__ import annotations

from pathlib import Path

from gpuslice.unitfiles import is_valid_unit_name

# /proc/PID/cgroup is one line per hierarchy (a dozen with cgroup v1), each a path; 1 MiB is
# far beyond any real file and bounds what a hostile cgroup tree can make us read.
CGROUP_FILE_MAX = 1 << 20
_DELETED = " (deleted)"  # the kernel's suffix for a cgroup v2 directory already removed


def _unescape(part: str) -> str:
    return part[1:] if part.startswith("_") else part


def _is_slice(name: str) -> bool:
    """A plain `foo.slice` (slices take no instance), as systemd's valid_slice_name()."""
    return name.endswith(".slice") and "@" not in name and is_valid_unit_name(name)


def unit_of_cgroup_path(path: str) -> str | None:
    """The unit a cgroup belongs to (`/system.slice/x.service/worker.scope` -> `x.service`),
    or None (the root, slices only, a cgroup no unit made)."""
    for part in path.split("/"):
        if not part:
            continue
        name = _unescape(part)
        if _is_slice(name):
            continue
        concrete = name.find("@") + 1 != name.rfind(".")  # `foo@.service` is a template
        if is_valid_unit_name(name) and concrete and not name.endswith(".slice"):
            return name
        return None
    return None


def _systemd_path(text: str) -> str | None:
    """The process's path in systemd's own hierarchy: the cgroup v2 `0::` line unless it is
    `/` (cgroup2 present but unused: legacy mode), else the v1 `name=systemd` line. Other v1
    controller lines say nothing about units (cgexec and friends move processes there).

    The kernel prints cgroup names raw, and whoever may create cgroups (a user in the subtree
    systemd delegates to user@UID.service) may put a newline in a name, to forge a line such
    as `0::vlm.service` ahead of the real `0::` line (v1 lines come first). A cgroup name
    cannot hold `/`, so a line whose path does not start with one is forged: then None."""
    unified: str | None = None
    legacy: str | None = None
    for line in text.split("\n"):
        if not line:
            continue
        hierarchy, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep1 and sep2 and hierarchy.isascii() and hierarchy.isdigit()):
            return None
        if not path.startswith("/"):
            return None
        if path.endswith(_DELETED):
            path = path[: -len(_DELETED)]
        if hierarchy == "0" and not controllers:
            if unified is not None:  # the kernel prints each hierarchy once
                return None
            unified = path
        elif "name=systemd" in controllers.split(",") and legacy is None:
            legacy = path
    if unified is not None and unified.strip("/"):
        return unified
    return legacy if legacy is not None else unified


def _read_cgroup(pid: int, proc: Path) -> str | None:
    try:
        with open(proc / str(pid) / "cgroup", "rb") as f:
            raw = f.read(CGROUP_FILE_MAX + 1)
    except (OSError, ValueError):
        return None
    if len(raw) > CGROUP_FILE_MAX:  # cut: keep whole lines only
        raw = raw[: raw.rfind(b"\n") + 1]
    # names outside ASCII are no unit names: replacing them cannot create a valid one
    return raw.decode("utf-8", errors="replace")


def _root_of(proc: Path) -> str:
    """Where PID 1's tree starts, as systemd's cg_get_root_path(): `` on a host and in a
    container with its own cgroup namespace; `/machine.slice/x.scope` in one without."""
    text = _read_cgroup(1, proc)
    path = _systemd_path(text) if text is not None else None
    if path is None:
        return ""
    for tail in ("/init.scope", "/system.slice", "/system"):
        if path.endswith(tail):
            return path[: -len(tail)].rstrip("/")
    return path.rstrip("/")


def cgroup_path_of_pid(pid: int, proc: Path = Path("/proc")) -> str | None:
    """Process `pid`'s cgroup in systemd's hierarchy, relative to PID 1's root (what a unit
    name and an owner are read from); None for a process that is gone or a forged file.
    Never raises."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    text = _read_cgroup(pid, proc)
    if text is None:
        return None
    path = _systemd_path(text)
    if path is None:
        return None
    root = _root_of(proc)
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return path


def unit_of_pid(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The unit process `pid` runs in, as systemd would name it; None for a process of no
    unit or one that is gone. Never raises."""
    path = cgroup_path_of_pid(pid, proc)
    return unit_of_cgroup_path(path) if path is not None else None
