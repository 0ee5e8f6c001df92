"""gpuslice.cgroups: a process belongs to the unit systemd says it belongs to (issue 8).

systemd's cg_path_get_unit() takes the FIRST unit below the leading slices; gpuslice used to
take the deepest `.service`/`.scope`, so a user's `systemd-run --user --unit=vlm-analysis`
counted as the managed system unit vlm-analysis.service, and a managed unit's own delegated
sub-scope counted as foreign.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice.cgroups import CGROUP_FILE_MAX, unit_of_cgroup_path, unit_of_pid
from gpuslice.unitfiles import is_valid_unit_name

USER = "/user.slice/user-1000.slice/user@1000.service"


@pytest.mark.parametrize(
    ("path", "unit"),
    [
        # system units, plain and templated (instances live in system-PREFIX.slice)
        ("/system.slice/asr.service", "asr.service"),
        ("/system.slice/system-w.slice/w@a.service", "w@a.service"),
        ("/system.slice/system-gpu\\x2dworker.slice/gpu\\x2dworker@b.service",
         "gpu\\x2dworker@b.service"),  # cgroup names are the unit names, escapes included
        ("/system.slice/system-getty.slice/getty@tty1.service", "getty@tty1.service"),
        ("/init.scope", "init.scope"),
        ("/system.slice/dbus.socket", "dbus.socket"),
        # nested slices, a unit's own slice
        ("/gpu.slice/gpu-jobs.slice/gpu-jobs-batch.slice/train.service", "train.service"),
        ("//system.slice///asr.service//", "asr.service"),
        # inside a unit: sub-cgroups, delegated sub-scopes, the .control cgroup, a slice
        ("/system.slice/job.service/worker.scope", "job.service"),
        ("/system.slice/job.service/.control", "job.service"),
        ("/system.slice/job.service/payload/inner.service", "job.service"),
        ("/system.slice/job.service/sub.slice/x.scope", "job.service"),
        ("/system.slice/asr.service/worker/inner", "asr.service"),
        # the user manager's subtree belongs to user@UID.service, never a managed unit
        (f"{USER}/app.slice/vlm-analysis.service", "user@1000.service"),
        (f"{USER}/app.slice/app-vlm.slice/vlm@1.service", "user@1000.service"),
        (f"{USER}/init.scope", "user@1000.service"),
        ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope"),
        # a container without its own cgroup namespace: its machine scope
        ("/machine.slice/machine-gpu.scope/payload/system.slice/asr.service", "machine-gpu.scope"),
        # cgroupfs names systemd had to escape with a leading `_`
        ("/system.slice/_cpu.service", "cpu.service"),
        ("/system.slice/__x.service", "_x.service"),
        ("/_cpu.slice/x.service", "x.service"),
        # no unit: the root, slices only, a cgroup no unit made, templates, garbage
        ("/", None),
        ("", None),
        ("/system.slice", None),
        ("/system.slice/system-w.slice", None),
        ("/system.slice/mygroup", None),
        ("/system.slice/mygroup/asr.service", None),
        ("/mygroup/asr.service", None),
        ("/system.slice/w@.service", None),
        ("/system.slice/foo@bar.slice", None),  # an instance slice: no slice, no unit
        ("/system.slice/a b.service", None),
        ("/system.slice/asr.service\n", None),
        ("/system.slice/\u00e9.service", None),
        ("/system.slice/.service", None),
        ("/system.slice/" + "a" * 248 + ".service", None),  # 256 characters
        ("/system.slice/" + "a" * 247 + ".service", "a" * 247 + ".service"),  # 255
        ("/system.slice" * 10_000 + "/x.service", "x.service"),
        ("/" + "a" * 100_000 + ".service", None),
        ("/system.slice" * 10_000, None),
        ("/a.slice" * 10_000 + "/x.service", "x.service"),
    ],
)  # fmt: skip
def test_unit_of_cgroup_path(path: str, unit: str | None) -> None:
    assert unit_of_cgroup_path(path) == unit


def write_cgroup(proc: Path, pid: int, content: str | bytes) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    (proc / str(pid) / "cgroup").write_bytes(data)


HYBRID = (  # the test bed's systemd 252 (hybrid): both of systemd's hierarchies agree
    "9:name=systemd:/system.slice/asr.service\n8:pids:/\n4:memory:/\n1:cpu:/\n"
    "0::/system.slice/asr.service\n"
)
LEGACY = (  # cgroup v1 only: the kernel still prints an unused `0::/`
    "12:pids:/system.slice/asr.service\n4:memory:/\n1:name=systemd:/system.slice/asr.service\n"
    "0::/\n"
)


@pytest.mark.parametrize(
    ("content", "unit"),
    [
        ("0::/system.slice/asr.service\n", "asr.service"),
        (f"0::{USER}/app.slice/vlm-analysis.service\n", "user@1000.service"),
        ("0::/system.slice/job.service/worker.scope\n", "job.service"),
        (HYBRID, "asr.service"),
        (LEGACY, "asr.service"),
        ("1:name=systemd:/system.slice/x.service\n", "x.service"),
        ("1:name=systemd:/system.slice/x.service", "x.service"),  # no final newline
        # systemd's hierarchies win over a v1 controller (cgexec, a tool that moved it)
        ("4:memory:/system.slice/other.service\n0::/system.slice/x.service\n", "x.service"),
        ("4:memory:/system.slice/other.service\n1:name=systemd:/system.slice/y.service\n",
         "y.service"),
        ("4:memory:/system.slice/other.service\n", None),  # no hierarchy of systemd's
        ("2:cpu,name=systemd:/system.slice/z.service\n", "z.service"),
        # in unified mode the 0:: line decides even if it names no unit
        ("0::/system.slice/mygroup\n1:name=systemd:/system.slice/x.service\n", None),
        ("0::/system.slice/asr.service (deleted)\n", "asr.service"),  # an exiting process
        ("0::/system.slice/a:b.service\n", "a:b.service"),  # a colon in the path
        ("0::/\n", None),
        ("0::/system.slice\n1:name=systemd:/system.slice\n", None),
        ("", None),
        ("garbage\n\n:::\n", None),
        ("0::/system.slice/asr.service\ngarbage\n", None),  # not the kernel's format
        ("0::/system.slice/a\rb.service\n", None),  # only "\n" ends a line
        # a user's cgroup named "x\n0::asr.service" forges a line: it must not count
        (f"1:name=systemd:{USER}/x\n0::asr.service\n0::/\n", None),
        (f"9:name=systemd:{USER}/x\n0::asr.service\n0::{USER}/x\n0::asr.service\n", None),
        (f"0::{USER}/app.slice/x\n0::/system.slice/asr.service\n", None),  # twice
        (b"0::/system.slice/\xff\xfe.service\n", None),
        (b"\x00\x00\x00", None),
        ("0::/system.slice/" + "x" * 100_000 + "\n", None),  # a very long line
        ("9:name=systemd:/x\n" * 100 + "0::/system.slice/asr.service\n", "asr.service"),
    ],
)  # fmt: skip
def test_unit_of_pid(tmp_path: Path, content: str | bytes, unit: str | None) -> None:
    write_cgroup(tmp_path, 42, content)
    assert unit_of_pid(42, tmp_path) == unit


def test_a_file_over_the_limit_is_read_in_whole_lines_only(tmp_path: Path) -> None:
    filler = "5:memory:/" + "x" * 1000 + "\n"
    lines = filler * (CGROUP_FILE_MAX // len(filler) + 1)
    write_cgroup(tmp_path, 42, "0::/system.slice/asr.service\n" + lines + "0::/system.slice/b")
    assert unit_of_pid(42, tmp_path) == "asr.service"
    write_cgroup(tmp_path, 43, lines + "0::/system.slice/late.service\n")
    assert unit_of_pid(43, tmp_path) is None  # past the limit: not read


@pytest.mark.parametrize("pid", [0, -1, True, 10**30])
def test_odd_pids(tmp_path: Path, pid: int) -> None:
    write_cgroup(tmp_path, 1, "0::/init.scope\n")
    assert unit_of_pid(pid, tmp_path) is None


def test_a_process_that_is_gone_or_unreadable(tmp_path: Path) -> None:
    assert unit_of_pid(7, tmp_path) is None
    (tmp_path / "8" / "cgroup").mkdir(parents=True)  # EISDIR
    assert unit_of_pid(8, tmp_path) is None
    assert unit_of_pid(9, tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("init", "content", "unit"),
    [
        # a host, or a container with its own cgroup namespace: PID 1 in /init.scope
        ("0::/init.scope\n", "0::/system.slice/asr.service\n", "asr.service"),
        ("0::/init.scope\n", "0::/init.scope\n", "init.scope"),
        # a container without one: paths are shifted by PID 1's root, as systemd does
        ("0::/machine.slice/machine-gpu.scope/init.scope\n",
         "0::/machine.slice/machine-gpu.scope/system.slice/asr.service\n", "asr.service"),
        ("0::/machine.slice/machine-gpu.scope/init.scope\n",
         "0::/machine.slice/machine-gpu.scope/init.scope\n", "init.scope"),
        ("1:name=systemd:/machine.slice/machine-gpu.scope\n",  # old systemd: no init.scope
         "1:name=systemd:/machine.slice/machine-gpu.scope/system.slice/asr.service\n",
         "asr.service"),
        # a process outside PID 1's tree keeps its path
        ("0::/machine.slice/machine-gpu.scope/init.scope\n",
         "0::/system.slice/other.service\n", "other.service"),
        ("0::/machine.slice/machine-gpu.scope/init.scope\n",
         "0::/machine.slice/machine-gpu.scope-2.scope/system.slice/asr.service\n",
         "machine-gpu.scope-2.scope"),
        # PID 1's file unreadable or odd: no shift
        ("", "0::/system.slice/asr.service\n", "asr.service"),
        ("0::/\n", "0::/system.slice/asr.service\n", "asr.service"),
    ],
)  # fmt: skip
def test_paths_are_relative_to_pid_1s_root(
    tmp_path: Path, init: str, content: str, unit: str | None
) -> None:
    write_cgroup(tmp_path, 1, init)
    write_cgroup(tmp_path, 42, content)
    assert unit_of_pid(42, tmp_path) == unit


# ---- properties ---------------------------------------------------------------------------

EXAMPLES = int(os.environ.get("GPUSLICE_FUZZ_EXAMPLES", "200"))
PART = st.text(st.characters(codec="utf-8", exclude_characters="/"), min_size=1, max_size=12)
SLICE = st.from_regex(r"[a-z][a-z0-9-]{0,8}\.slice", fullmatch=True)
UNIT = st.from_regex(
    r"[a-z][a-z0-9-]{0,8}(@[a-z0-9]{1,4})?\.(service|scope|socket)", fullmatch=True
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(SLICE, max_size=4), UNIT, st.lists(PART | UNIT | SLICE, max_size=4))
def test_the_first_unit_below_the_slices_counts(
    slices: list[str], unit: str, tail: list[str]
) -> None:
    assert unit_of_cgroup_path("/" + "/".join([*slices, unit, *tail])) == unit


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400) | st.text(max_size=400).map(str.encode))
def test_any_cgroup_file(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        write_cgroup(Path(tmp), 42, content)
        unit = unit_of_pid(42, Path(tmp))
    assert unit is None or (is_valid_unit_name(unit) and not unit.endswith(".slice"))
