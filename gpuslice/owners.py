"""Who a process gpuslice does not manage belongs to, said for people: a Slurm job, a
Kubernetes pod, a container, a systemd unit or a user.

Beside Slurm or Kubernetes, "GPU 1 is used by PID 4242 python3" leaves the admin to find
out whose job that is; "Slurm job 881" answers it. The owner is read from the process's
cgroup path (gpuslice.cgroups reads it once, for the unit too), where each of those systems
puts its jobs: only at places that root alone can create, so that a user who names a cgroup
`job_5` in the subtree systemd delegates to them is still that user, never a Slurm job.

  /system.slice/slurmstepd.scope/job_881/step_0/...        slurm       881
    (or NODE_slurmstepd.scope: a slurmd started with a node name)
  /kubepods.slice/kubepods-burstable.slice/
      kubepods-burstable-pod<uid>.slice/cri-containerd-...  kubernetes  <uid>
  /kubepods/burstable/pod<uid>/<container> (cgroupfs)       kubernetes  <uid>
  /system.slice/docker-<id>.scope, /docker/<id>             docker      <id, 12 digits>
  /machine.slice/libpod-<id>.scope                          podman      <id, 12 digits>
  /machine.slice/machine-<name>.scope                       machine     <name>
  /user.slice/user-1000.slice/...                           user        1000
  /system.slice/ollama.service/...                          unit        ollama.service

The owner is information only: no decision reads it. Anything else is `other`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gpuslice.cgroups import unit_of_cgroup_path

SLURM = "slurm"
KUBERNETES = "kubernetes"
DOCKER = "docker"
PODMAN = "podman"
MACHINE = "machine"
USER = "user"
UNIT = "unit"
OTHER = "other"
# Every kind, in the order the README and the metric's label list them; only ever added to.
KINDS = (SLURM, KUBERNETES, DOCKER, PODMAN, MACHINE, USER, UNIT, OTHER)

# slurmd started with a node name (several slurmd on one host) prefixes it: NODE_slurmstepd.scope
_SLURM_SCOPE = re.compile(r"(?:[A-Za-z0-9.-]{1,64}_)?slurmstepd\.scope")
_SLURM_JOB = re.compile(r"job_([0-9]{1,10})")
_POD_UID = r"([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
_POD_SYSTEMD = re.compile(r"kubepods(?:-besteffort|-burstable)?-pod" + _POD_UID + r"\.slice")
_POD_CGROUPFS = re.compile(r"pod" + _POD_UID)
_QOS_SYSTEMD = ("kubepods-besteffort.slice", "kubepods-burstable.slice")
_QOS_CGROUPFS = ("besteffort", "burstable")
_CONTAINER_ID = r"([0-9a-f]{64})"
_DOCKER_SCOPE = re.compile(r"docker-" + _CONTAINER_ID + r"\.scope")
_PODMAN_SCOPE = re.compile(r"libpod-" + _CONTAINER_ID + r"\.scope")
_MACHINE_SCOPE = re.compile(r"machine-([A-Za-z0-9:_.\\-]{1,64})\.scope")
_USER_SLICE = re.compile(r"user-([0-9]{1,10})\.slice")
_ESCAPE = re.compile(r"\\x([0-9a-f]{2})")


# How each kind is said (a unit, and other, say only their id)
_SAID = {
    SLURM: "Slurm job {}",
    KUBERNETES: "Kubernetes pod {}",
    DOCKER: "Docker container {}",
    PODMAN: "Podman container {}",
    MACHINE: "container {}",
    USER: "UID {}",
}


# How owners of each kind are counted where their IDs are not said (a Status answer that
# hides other users' processes: gpuslice/procmount.py): one, several
_COUNTED = {
    SLURM: ("Slurm job", "Slurm jobs"),
    KUBERNETES: ("Kubernetes pod", "Kubernetes pods"),
    DOCKER: ("Docker container", "Docker containers"),
    PODMAN: ("Podman container", "Podman containers"),
    MACHINE: ("container", "containers"),
    USER: ("user", "users"),
    UNIT: ("unit", "units"),
    OTHER: ("other owner", "other owners"),
}


def kind_said(kind: str) -> str:
    """`Slurm job`: one owner of a kind, without its ID (an unknown kind as other)."""
    return _COUNTED.get(kind, _COUNTED[OTHER])[0]


def kinds_counted(counts: Mapping[str, int]) -> tuple[str, ...]:
    """`1 Slurm job`, `2 users`: how many owners of each kind, in KINDS' order."""
    said = []
    for kind in KINDS:
        n = counts.get(kind, 0)
        if n > 0:
            said.append(f"{n} {_COUNTED[kind][0 if n == 1 else 1]}")
    return tuple(said)


@dataclass(frozen=True)
class Owner:
    kind: str
    id: str = ""

    def label(self) -> str:
        """`Slurm job 881`, `Kubernetes pod 1b4e...`, `ollama.service`; "" when unknown."""
        return _SAID.get(self.kind, "{}").format(self.id)

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "id": self.id}


UNKNOWN = Owner(OTHER)


def _unescape(name: str) -> str:
    """systemd's `\\x2d` escapes in a unit name, for a machine's name as machinectl shows it
    (only printable ASCII comes back: the pattern allows nothing else)."""

    def one(m: re.Match[str]) -> str:
        c = chr(int(m.group(1), 16))
        return c if c.isprintable() and c.isascii() else m.group(0)

    return _ESCAPE.sub(one, name)


def _pod(parts: list[str]) -> Owner | None:
    """A pod's UID, below kubepods (systemd's driver) or /kubepods (cgroupfs), in a QoS
    class's cgroup or (Guaranteed pods) right below."""
    if parts[0] == "kubepods.slice":
        classes, pod = _QOS_SYSTEMD, _POD_SYSTEMD
    elif parts[0] == "kubepods":
        classes, pod = _QOS_CGROUPFS, _POD_CGROUPFS
    else:
        return None
    below = parts[1:]
    if below and below[0] in classes:
        below = below[1:]
    found = pod.fullmatch(below[0]) if below else None
    return Owner(KUBERNETES, found.group(1).replace("_", "-")) if found else None


def owner_of_cgroup_path(path: str) -> Owner:
    """The owner of a process in cgroup `path` (relative to PID 1's root, as
    gpuslice.cgroups gives it); UNKNOWN when the path says nothing of one."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return UNKNOWN
    if parts[0] == "system.slice" and len(parts) >= 3 and _SLURM_SCOPE.fullmatch(parts[1]):
        job = _SLURM_JOB.fullmatch(parts[2])
        if job:
            return Owner(SLURM, str(int(job.group(1))))
    pod = _pod(parts)
    if pod is not None:
        return pod
    second = parts[1] if len(parts) >= 2 else ""
    if parts[0] == "system.slice" and (found := _DOCKER_SCOPE.fullmatch(second)):
        return Owner(DOCKER, found.group(1)[:12])
    if parts[0] == "docker" and re.fullmatch(_CONTAINER_ID, second):
        return Owner(DOCKER, second[:12])
    if parts[0] == "machine.slice" and (found := _PODMAN_SCOPE.fullmatch(second)):
        return Owner(PODMAN, found.group(1)[:12])
    if parts[0] == "machine.slice" and (found := _MACHINE_SCOPE.fullmatch(second)):
        return Owner(MACHINE, _unescape(found.group(1)))
    if parts[0] == "user.slice" and (found := _USER_SLICE.fullmatch(second)):
        return Owner(USER, str(int(found.group(1))))
    unit = unit_of_cgroup_path(path)
    return Owner(UNIT, unit) if unit is not None else UNKNOWN
