"""Whose a process gpuslice does not manage is, from its cgroup path (gpuslice/owners.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuslice.owners import KINDS, OTHER, UNKNOWN, Owner, owner_of_cgroup_path

POD = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
POD_ = POD.replace("-", "_")
CID = "3f4e" + "a" * 60
USER = "/user.slice/user-1000.slice/user@1000.service/app.slice"


@pytest.mark.parametrize(
    ("path", "owner", "label"),
    [
        # Slurm's cgroup v2 plugin: every step of a job, the batch and extern steps too
        (
            "/system.slice/slurmstepd.scope/job_881/step_0/user/task_0",
            Owner("slurm", "881"),
            "Slurm job 881",
        ),
        ("/system.slice/slurmstepd.scope/job_881/step_batch", Owner("slurm", "881"), None),
        ("/system.slice/slurmstepd.scope/job_881", Owner("slurm", "881"), None),
        ("/system.slice/slurmstepd.scope/job_007/step_extern", Owner("slurm", "7"), None),
        # a slurmd started with a node name (several on one host) prefixes it
        (
            "/system.slice/spark-7ff0_slurmstepd.scope/job_21868/step_0",
            Owner("slurm", "21868"),
            None,
        ),
        ("/system.slice/x_y_slurmstepd.scope/job_1", Owner("unit", "x_y_slurmstepd.scope"), None),
        # slurmstepd itself, outside any job: the unit
        ("/system.slice/slurmstepd.scope/system", Owner("unit", "slurmstepd.scope"), None),
        ("/system.slice/slurmstepd.scope/job_12345678901", Owner("unit", "slurmstepd.scope"), None),
        # Kubernetes, systemd cgroup driver: each QoS class, the UID's `_` back to `-`
        (
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice/"
            "cri-containerd-abc.scope",
            Owner("kubernetes", POD),
            f"Kubernetes pod {POD}",
        ),
        (
            f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_}.slice/x",
            Owner("kubernetes", POD),
            None,
        ),
        (
            f"/kubepods.slice/kubepods-pod{POD_}.slice/crio-abc.scope",
            Owner("kubernetes", POD),
            None,
        ),
        # Kubernetes, cgroupfs driver
        (f"/kubepods/burstable/pod{POD}/{CID}", Owner("kubernetes", POD), None),
        (f"/kubepods/pod{POD}/{CID}", Owner("kubernetes", POD), None),
        (  # a pod's own cgroup
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD_}.slice",
            Owner("kubernetes", POD),
            None,
        ),
        ("/kubepods.slice/kubepods-burstable.slice", UNKNOWN, None),
        ("/kubepods.slice", UNKNOWN, None),
        ("/kubepods", UNKNOWN, None),
        ("/kubepods/burstable", UNKNOWN, None),
        ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podXYZ.slice", UNKNOWN, None),
        # containers
        (
            f"/system.slice/docker-{CID}.scope",
            Owner("docker", CID[:12]),
            f"Docker container {CID[:12]}",
        ),
        (f"/docker/{CID}", Owner("docker", CID[:12]), None),
        (f"/machine.slice/{CID}", UNKNOWN, None),  # an id alone is nobody's
        ("/docker", UNKNOWN, None),
        (
            f"/machine.slice/libpod-{CID}.scope/container",
            Owner("podman", CID[:12]),
            f"Podman container {CID[:12]}",
        ),
        (
            "/machine.slice/machine-qemu\\x2d1\\x2dvm.scope",
            Owner("machine", "qemu-1-vm"),
            "container qemu-1-vm",
        ),
        # escapes give only printable ASCII back: a newline or a non-ASCII one stays escaped
        ("/machine.slice/machine-a\\x0ab\\x2dc.scope", Owner("machine", "a\\x0ab-c"), None),
        ("/machine.slice/machine-caf\\xe9.scope", Owner("machine", "caf\\xe9"), None),
        (
            "/machine.slice/systemd-nspawn@bed.service/payload",
            Owner("unit", "systemd-nspawn@bed.service"),
            None,
        ),
        # people
        ("/user.slice/user-1000.slice/session-2.scope", Owner("user", "1000"), "UID 1000"),
        (f"{USER}/vlm.service", Owner("user", "1000"), None),
        # other units, and nothing
        ("/system.slice/ollama.service", Owner("unit", "ollama.service"), "ollama.service"),
        ("/system.slice/system-w.slice/w@a.service/ray", Owner("unit", "w@a.service"), None),
        ("/init.scope", Owner("unit", "init.scope"), None),
        ("/", UNKNOWN, ""),
        ("", UNKNOWN, ""),
        ("/system.slice", UNKNOWN, None),
    ],
)
def test_owner_of_each_place_a_scheduler_puts_its_jobs(
    path: str, owner: Owner, label: str | None
) -> None:
    assert owner_of_cgroup_path(path) == owner
    if label is not None:
        assert owner.label() == label


@pytest.mark.parametrize(
    "path",
    [
        # A user may create cgroups only below user@UID.service (delegated): names there
        # that look like another scheduler's are still that user's.
        f"{USER}/system.slice/slurmstepd.scope/job_5/step_0",
        f"{USER}/kubepods.slice/kubepods-pod{POD_}.slice",
        f"{USER}/system.slice/docker-{CID}.scope",
        f"{USER}/docker/{CID}",
        f"{USER}/machine.slice/machine-x.scope",
        "/user.slice/user-1000.slice/user@1000.service/slurmstepd.scope/job_5",
    ],
)
def test_a_users_cgroup_named_like_a_job_is_still_the_users(path: str) -> None:
    assert owner_of_cgroup_path(path) == Owner("user", "1000")


@pytest.mark.parametrize(
    "path",
    [
        # only where root alone creates cgroups: not deeper in another unit's tree
        "/system.slice/x.service/slurmstepd.scope/job_5",
        f"/system.slice/x.service/docker-{CID}.scope",
        f"/system.slice/x.service/kubepods/pod{POD}",
    ],
)
def test_a_job_lookalike_inside_another_unit_is_that_unit(path: str) -> None:
    assert owner_of_cgroup_path(path) == Owner("unit", "x.service")


def test_unknown_owner_has_no_label() -> None:
    assert Owner(OTHER, "") == UNKNOWN and UNKNOWN.label() == ""
    assert UNKNOWN.to_json() == {"kind": "other", "id": ""}
    assert KINDS[-1] == OTHER and len(set(KINDS)) == len(KINDS)


@given(st.lists(st.text(max_size=80), max_size=8))
def test_any_path_has_a_known_kind_and_a_short_printable_label(parts: list[str]) -> None:
    owner = owner_of_cgroup_path("/" + "/".join(parts))
    assert owner.kind in KINDS
    assert len(owner.label()) <= 300 and owner.label().isprintable()
