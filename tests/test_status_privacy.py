"""Where /proc hides each user's processes from the others (`hidepid=`), Status
hides them too from a caller /proc would hide them from (gpuslice/procmount.py): anyone may
call Status, and the controller, root, sees every process. And each GPU's `foreign` list is
capped in the JSON as in the table (gpuslice/status.py).

Unit tests: the mount table's parser, the caller's credentials, the redacted JSON and its
table, the controller's choice and cache, the service's answer after asking the bus daemon
(one test on a private dbus-daemon, as tests/test_dbus_adapter.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from dbus_next import Message, MessageFlag, MessageType, Variant

from gpuslice import answers, procmount, status
from gpuslice import controller as controller_module
from gpuslice import service as service_module
from gpuslice.annotations import Scan, load_spec
from gpuslice.core.decisions import LISTED_MAX
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Scheduler
from gpuslice.inventory import GpuUse, Sample, _with_foreign
from gpuslice.metrics import exposition
from gpuslice.owners import KINDS, Owner, kinds_counted
from gpuslice.procmount import ProcHiding, proc_hiding_of, read_proc_hiding
from gpuslice.service import BUS_NAME, INTERFACE, OBJECT_PATH, SchedulerService
from gpuslice.status import CachedStatus, render, snapshot_to_json
from gpuslice.systemd import Systemd, SystemdError, credentials_of
from gpuslice.unitfiles import UnitIndex
from tests.service_bus import ServiceBus
from tests.test_config_acl import _acl
from tests.test_controller import UNIT_DIR, Bed, OneForeignProcess, run, write_unit
from tests.test_dbus_adapter import bus_address as bus_address
from tests.test_dbus_adapter import bus_daemon as bus_daemon
from tests.test_dbus_adapter import call, connect
from tests.test_dbus_adapter import run as run_on_bus
from tests.test_status import snapshot

GIB = 1 << 30
MIB = 1 << 20

# /proc/self/mountinfo lines: a root, a /proc (its options to fill in), something beside
ROOT_LINE = "21 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw"
SYS_LINE = "23 21 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw"


def proc_line(super_options: str = "rw", mount_id: int = 22, parent: int = 21) -> str:
    return f"{mount_id} {parent} 0:21 / /proc rw,relatime shared:12 - proc proc {super_options}"


def mountinfo(*lines: str) -> str:
    return "\n".join((ROOT_LINE, *lines, SYS_LINE)) + "\n"


# ---------------------------------------------------------------------------------------------
# the mount table


@pytest.mark.parametrize(
    ("options", "hides", "gid"),
    [
        ("rw", False, None),
        ("rw,hidepid=0", False, None),
        ("rw,hidepid=off", False, None),
        ("rw,hidepid=off,gid=27", False, None),  # the group exempts from nothing hidden
        ("rw,hidepid=1", True, None),
        ("rw,hidepid=noaccess", True, None),
        ("rw,hidepid=2,gid=27", True, 27),
        ("rw,hidepid=invisible,gid=27", True, 27),
        ("rw,hidepid=ptraceable", True, None),
        ("rw,hidepid=4", True, None),
        # the kernel exempts no group from ptraceable: gid= shows its members nothing more
        ("rw,gid=27,hidepid=ptraceable", True, None),
        ("rw,hidepid=4,gid=27", True, None),
        ("rw,hidepid=seven,gid=27", True, None),  # unknown: no group exempt (fail closed)
        # subset=pid hides /proc's files that are no process's, not other users' processes
        ("rw,subset=pid", False, None),
        ("rw,subset=pid,gid=1001", False, None),
        ("rw,subset=pid,hidepid=invisible,gid=1001", True, 1001),
        ("rw,hidepid=seven", True, None),  # unknown: taken to hide
        ("rw,hidepid=2,gid=x27", True, None),
        ("rw,hidepid=2,gid=4294967296", True, None),  # past 32 bits
        ("rw,hidepid=2,gid=99999999999999999999999", True, None),
        ("rw,hidepid=2,gid=\u0663", True, None),  # a digit, not ASCII
    ],
)
def test_what_the_proc_mount_hides_from_its_options(
    options: str, hides: bool, gid: int | None
) -> None:
    found = proc_hiding_of(mountinfo(proc_line(options)))
    assert found is not None
    assert (found.hides, found.gid) == (hides, gid)


def test_hidepid_said_in_the_mounts_own_options_counts_too() -> None:
    """Linux before 5.8 had one /proc super block; the option is read wherever it is said."""
    line = "22 21 0:21 / /proc rw,nosuid,hidepid=2,gid=5 shared:12 - proc proc rw"
    assert proc_hiding_of(mountinfo(line)) == ProcHiding(True, 5, "hidepid=2,gid=5")


def test_only_proc_mounted_on_proc_counts() -> None:
    """Not another file system on /proc, not proc elsewhere, not a mount point that only
    reads as /proc once its escapes are left as they are (`/proc\\040x`: `/proc x`)."""
    others = [
        "30 21 0:40 / /proc rw - tmpfs tmpfs rw,hidepid=2",
        "31 21 0:41 / /var/proc rw - proc proc rw,hidepid=2",
        "32 21 0:42 / /proc\\040x rw - proc proc rw,hidepid=2",
        "33 21 0:43 / /proc/sys/fs/binfmt_misc rw - proc proc rw,hidepid=2",
    ]
    assert proc_hiding_of(mountinfo(*others)) is None
    assert proc_hiding_of(mountinfo(*others, proc_line("rw"))) == ProcHiding()


def test_an_escaped_mount_point_is_read_as_the_kernel_meant_it() -> None:
    r"""`\057` is `/`: the field unescaped is /proc (the kernel escapes only space, tab,
    newline and backslash, but what it says is read as it says it)."""
    line = "22 21 0:21 / \\057proc rw - proc proc rw,hidepid=2"
    found = proc_hiding_of(mountinfo(line))
    assert found is not None and found.hides


@pytest.mark.parametrize(
    "junk",
    [
        "",
        "-",
        "22 21 0:21 / /proc",  # cut short
        "22 21 0:21 / /proc rw a b c d e f",  # no separator
        "22 21 0:21 / /proc rw - proc",  # nothing after the type
        "\x00\xff 22 21 / /proc - proc proc hidepid=2",  # fields out of place
        " " * 50,
        "\\" * 100,
    ],
)
def test_odd_lines_are_skipped(junk: str) -> None:
    assert proc_hiding_of(mountinfo(junk)) is None
    found = proc_hiding_of(mountinfo(junk, proc_line("rw,hidepid=2,gid=9"), junk))
    assert found == ProcHiding(True, 9, "hidepid=2,gid=9")


def test_of_two_proc_mounts_on_proc_the_one_on_top_counts() -> None:
    """A /proc mounted over /proc covers it, whatever order the table lists them in; if
    which is on top cannot be told, hidden if either hides, no group exempt."""
    lower, upper = proc_line("rw", 22, 21), proc_line("rw,hidepid=2,gid=4", 40, 22)
    assert proc_hiding_of(mountinfo(lower, upper)) == ProcHiding(True, 4, "hidepid=2,gid=4")
    assert proc_hiding_of(mountinfo(upper, lower)) == ProcHiding(True, 4, "hidepid=2,gid=4")
    lower, upper = proc_line("rw,hidepid=2,gid=4", 22, 21), proc_line("rw", 40, 22)
    assert proc_hiding_of(mountinfo(lower, upper)) == ProcHiding()
    twins = mountinfo(proc_line("rw", 22, 21), proc_line("rw,hidepid=2,gid=4", 40, 21))
    assert proc_hiding_of(twins) == ProcHiding(True, None, "hidepid=2,gid=4")
    loop = mountinfo(proc_line("rw", 22, 40), proc_line("rw,hidepid=1", 40, 22))
    assert proc_hiding_of(loop) == ProcHiding(True, None, "hidepid=1")


def test_the_mount_table_is_read_bounded_and_fails_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table larger than MOUNTINFO_MAX is read that far: a /proc past it is not seen (and
    then, no /proc seen, taken to hide), and its last line cut short is not read, as its
    options would lose their hidepid. A table that cannot be read: taken to hide."""
    monkeypatch.setattr(procmount, "MOUNTINFO_MAX", 4096)
    path = tmp_path / "mountinfo"
    filler = [f"{100 + i} 21 0:{i} / /mnt/m{i:04d} rw - tmpfs tmpfs rw" for i in range(200)]
    path.write_text(mountinfo(proc_line("rw,hidepid=2"), *filler))
    assert read_proc_hiding(path).hides
    path.write_text(mountinfo(*filler, proc_line("rw")))
    assert read_proc_hiding(path) == procmount.UNKNOWN
    # a /proc line cut at the bound, after "rw": read whole, it says hidepid=2
    head = mountinfo(*filler[:10]).encode()
    line = proc_line("rw,hidepid=2").encode()
    cut = line.index(b" rw,hidepid") + 3
    pad = 4096 - len(head) - cut
    path.write_bytes(head[: len(head) - 1] + b" " * pad + b"\n" + line + b"\n" + b"x" * 100)
    assert path.read_bytes()[:4096].endswith(line[:cut])
    assert read_proc_hiding(path) == procmount.UNKNOWN
    assert read_proc_hiding(tmp_path / "missing") == procmount.UNKNOWN
    assert read_proc_hiding(tmp_path) == procmount.UNKNOWN  # a directory
    path.write_bytes(mountinfo(proc_line("rw")).encode() + b"\xff\xfe")
    assert read_proc_hiding(path) == ProcHiding()


def test_this_hosts_mount_table_is_read() -> None:
    """The real /proc/self/mountinfo names a /proc (what it hides is this host's)."""
    assert proc_hiding_of(procmount.MOUNTINFO.read_text()) is not None


def test_who_is_exempt() -> None:
    """Root, and the mount's gid= group: hidepid's own exemptions; nobody else, nor a
    caller whose credentials are unknown. Where nothing is hidden, everyone."""
    hiding = ProcHiding(True, 27)
    assert hiding.exempts(0, ())
    assert hiding.exempts(1000, {100, 27})
    assert not hiding.exempts(1000, {100})
    assert hiding.exempts(None, {27})  # the group, said, is enough
    assert not hiding.exempts(None, ())
    assert not ProcHiding(True, None).exempts(1000, {0, 27})
    assert ProcHiding().exempts(None, ())


def test_credentials_are_read_only_of_their_documented_types() -> None:
    good = {"UnixUserID": Variant("u", 1000), "UnixGroupIDs": Variant("au", [1000, 27])}
    assert credentials_of(good) == (1000, frozenset({1000, 27}))
    assert credentials_of({"ProcessID": Variant("u", 5)}) == (None, frozenset())
    assert credentials_of([good]) == (None, frozenset())
    assert credentials_of(None) == (None, frozenset())
    wrong = {"UnixUserID": Variant("s", "0"), "UnixGroupIDs": Variant("as", ["27"])}
    assert credentials_of(wrong) == (None, frozenset())
    bare = {"UnixUserID": 0, "UnixGroupIDs": [27]}  # not variants
    assert credentials_of(bare) == (None, frozenset())
    many = {"UnixUserID": Variant("u", 5), "UnixGroupIDs": Variant("au", [1] * 70_000)}
    assert credentials_of(many) == (5, frozenset())


def test_the_bus_daemon_says_who_is_behind_a_connection(bus_address: str) -> None:
    """GetConnectionCredentials on a real dbus-daemon: this process's user and groups."""

    async def scenario() -> None:
        systemd = Systemd(await connect(bus_address))
        client = await connect(bus_address)
        uid, groups = await systemd.caller_credentials(client.unique_name)
        assert uid == os.getuid()
        assert set(os.getgroups()) <= groups
        with pytest.raises(SystemdError):
            await systemd.caller_credentials(":1.99999")

    run_on_bus(scenario)


# ---------------------------------------------------------------------------------------------
# the redacted JSON and its table


def test_owner_kinds_counted() -> None:
    assert kinds_counted({"user": 2, "slurm": 1, "unit": 0}) == ("1 Slurm job", "2 users")
    assert kinds_counted(dict.fromkeys(KINDS, 1))[-1] == "1 other owner"


OF_EACH_KIND = [
    Owner("slurm", "881"),
    Owner("kubernetes", "1b4e28ba-2fa1-11d2-883f-0016d3cca427"),
    Owner("docker", "0123456789ab"),
    Owner("podman", "0123456789ab"),
    Owner("machine", "Docker container x"),  # a machine's name may hold spaces
    Owner("user", "1000"),
    Owner("unit", "ollama.service"),
    Owner("other"),  # said by no label: named nowhere, as before
]


def test_a_gpu_carries_each_owners_kind_beside_its_label() -> None:
    """The inventory keeps each owner's kind as data, in the order of the labels (sorted,
    once each), for Status to count them without reading their words back."""
    uses = [GpuUse(n, 0, GIB, None, "p", o) for n, o in enumerate(OF_EACH_KIND * 2, start=100)]
    gpu = _with_foreign(Gpu(0, "GPU-0", "Fake 24GB", 24 * GIB), uses, {})
    said = sorted((o.label(), o.kind) for o in OF_EACH_KIND if o.label())
    assert list(zip(gpu.foreign_owners, gpu.foreign_owner_kinds, strict=True)) == said


def test_owners_are_counted_by_their_kind_whatever_their_labels_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Status counted a redacted part's owners by parsing each label back into a kind
    (owners.kind_of_label): words reworded, or an ID that reads as another kind's words,
    miscounted silently. Here each owner is said by its ID alone, as a unit is: read back,
    all three were `unit`s."""
    monkeypatch.setattr(Owner, "label", lambda self: self.id)
    [waiter] = _json(True)["waiting"]
    assert waiter["decision"]["parts"][0]["owner_kinds"] == {"slurm": 1, "user": 2}
    assert "(1 Slurm job, 2 users)" in waiter["reason"]


def _foreign_host() -> tuple[Sample, Scheduler]:
    """GPU 0 used by a Slurm job's and two users' processes, GPU 1 by none; a waiter for
    20 GiB kept off GPU 0 by them."""
    uses = [
        GpuUse(881, 0, 10 * GIB, None, "python3", Owner("slurm", "881")),
        GpuUse(4242, 0, 2 * GIB, None, "secret-name", Owner("user", "1000")),
        GpuUse(4343, 0, None, None, "nvtop", Owner("user", "1001"), compute=True),
    ]
    gpus = [_with_foreign(Gpu(0, "GPU-0", "Fake 24GB", 24 * GIB), uses, {})]
    gpus.append(Gpu(1, "GPU-1", "Fake 24GB", 24 * GIB))
    scheduler = Scheduler(gpus, {})
    scheduler.request(UnitSpec("big.service", 10, memory=20 * GIB, gpus=2))
    return Sample(gpus, uses), scheduler


def _json(redact: bool) -> dict[str, Any]:
    sample, scheduler = _foreign_host()
    return snapshot_to_json(scheduler.snapshot(), Scan(), sample, redact=redact)


def test_a_redacted_answer_names_no_foreign_process_or_owner() -> None:
    """The foreign entries keep their memory, owner kind and compute, and lose PID, command
    and owner ID; the waiter's part counts the owners by kind, and its reason says them so;
    the answer says it is redacted. The full answer is as before, without `redacted`."""
    full, redacted = _json(False), _json(True)
    assert "redacted" not in full
    assert redacted["redacted"] is True
    assert redacted["gpus"][0]["foreign"] == [
        {
            "pid": None,
            "command": None,
            "memory": 10 * GIB,
            "owner": {"kind": "slurm", "id": None},
            "compute": True,
        },
        {
            "pid": None,
            "command": None,
            "memory": 2 * GIB,
            "owner": {"kind": "user", "id": None},
            "compute": True,
        },
        {
            "pid": None,
            "command": None,
            "memory": None,
            "owner": {"kind": "user", "id": None},
            "compute": True,
        },
    ]
    assert [p["pid"] for p in full["gpus"][0]["foreign"]] == [881, 4242, 4343]
    [waiter] = redacted["waiting"]
    part = waiter["decision"]["parts"][0]
    assert (part["kind"], part["owners"], part["owners_left_out"]) == ("memory", [], 3)
    assert part["owner_kinds"] == {"slurm": 1, "user": 2}
    assert waiter["decision"]["parts"][1]["owner_kinds"] == {}
    said = "12 GiB used by processes of no holder (1 Slurm job, 2 users)"
    assert said in waiter["reason"]
    [full_waiter] = full["waiting"]
    assert "(Slurm job 881, UID 1000, UID 1001)" in full_waiter["reason"]
    assert "owner_kinds" not in full_waiter["decision"]["parts"][0]
    text = json.dumps(redacted)
    for secret in ("881", "4242", "4343", "1000", "1001", "secret-name", "nvtop", "python3"):
        assert secret not in text, secret
    # everything else is the full answer's
    for data in (full, redacted):
        for gpu in data["gpus"]:
            del gpu["foreign"]
        data["waiting"][0].pop("reason")
        for p in data["waiting"][0].pop("decision")["parts"]:
            p.pop("owner_kinds", None)
    redacted.pop("redacted")
    assert full == redacted


def test_the_table_of_a_redacted_answer() -> None:
    """It says why PIDs are missing, and each process's memory and whose kind it is."""
    table = render(_json(True))
    lines = table.split("\n")
    assert lines[0] == status.REDACTED_SAID
    hidden = f"0    {'foreign: ' + status.HIDDEN:<40} {'':>8}  {'':<9} "
    assert [line for line in lines if line.startswith("0    foreign")] == [
        hidden + "10 GiB  (Slurm job)",
        hidden + "2 GiB  (user)",
        hidden + "?  (user)",
    ]
    assert "(1 Slurm job, 2 users)" in table
    assert "None" not in table
    assert status.REDACTED_SAID not in render(_json(False))


# ---------------------------------------------------------------------------------------------
# the cap on each GPU's foreign list


def _many(count: int) -> list[GpuUse]:
    """`count` processes on GPU 0: one of 30 GiB (a Slurm job), the rest 100 MiB each (users),
    every third of unknown memory."""
    uses = [GpuUse(1000, 0, 30 * GIB, None, "big", Owner("slurm", "7"))]
    for i in range(1, count):
        used = None if i % 3 == 0 else 100 * MIB
        uses.append(GpuUse(1000 + i, 0, used, None, "w", Owner("user", str(2000 + i))))
    return uses


def _capped(count: int, redact: bool = False) -> dict[str, Any]:
    sample = Sample([Gpu(0, "GPU-0", "Fake 80GB", 80 * GIB)], _many(count))
    return snapshot_to_json(snapshot(gpus={0: []}), Scan(), sample, redact=redact)


def test_the_json_names_at_most_listed_max_foreign_processes_and_counts_the_rest() -> None:
    """500 processes: the 8 using the most memory, the largest first, and how many more,
    the memory they use (of those known), how many of unknown memory, and by owner kind."""
    gpu = _capped(500)["gpus"][0]
    assert [p["pid"] for p in gpu["foreign"]] == [1000, 1001, 1002, 1004, 1005, 1007, 1008, 1010]
    unknown = len(range(3, 500, 3))
    known = 499 - unknown - (LISTED_MAX - 1)
    assert (gpu["foreign_left_out"], gpu["foreign_left_out_unknown"]) == (500 - LISTED_MAX, unknown)
    assert gpu["foreign_left_out_memory"] == known * 100 * MIB
    assert gpu["foreign_left_out_by_kind"] == {"user": known * 100 * MIB}
    few = _capped(LISTED_MAX)["gpus"][0]
    assert [p["pid"] for p in few["foreign"]] == list(range(1000, 1000 + LISTED_MAX))  # by PID
    assert few["foreign_left_out"] == 0
    assert len(_capped(500, redact=True)["gpus"][0]["foreign"]) == LISTED_MAX


def test_the_table_of_a_capped_json_is_the_table_of_the_whole_list() -> None:
    """An older controller's JSON named every process, and the table capped it: the table
    of the capped JSON is the same, line for line."""
    for count in (LISTED_MAX, LISTED_MAX + 1, 30, 500):
        capped = _capped(count)
        uses = _many(count)
        whole = json.loads(json.dumps(capped))
        whole["gpus"][0]["foreign"] = [
            {
                "pid": p.pid,
                "command": p.command,
                "memory": p.used,
                "owner": (p.owner or Owner("other")).to_json(),
                "compute": p.compute,
            }
            for p in uses
        ]
        for key in list(whole["gpus"][0]):
            if key.startswith("foreign_left_out"):
                del whole["gpus"][0][key]
        assert render(capped) == render(whole), count
    assert "... and 492 more foreign processes using at least " in render(_capped(500))


def test_metrics_count_the_memory_of_the_foreign_processes_left_out() -> None:
    """`gpuslice_gpu_foreign_memory_bytes` sums every foreign process's memory by kind, as
    when the JSON named them all."""
    data = _capped(500)
    data["controller"] = {"version": "1", "start_time": 0.0, "status_time": 0.0}
    values = {}
    for line in exposition(data).decode().splitlines():
        if line.startswith(("gpuslice_gpu_foreign_memory_bytes{", "gpuslice_gpu_memory_unm")):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    users = sum(p.used or 0 for p in _many(500) if p.owner is not None and p.owner.kind == "user")
    assert values == {
        'gpuslice_gpu_foreign_memory_bytes{gpu="0",owner="slurm",uuid="GPU-0"}': 30 * GIB,
        'gpuslice_gpu_foreign_memory_bytes{gpu="0",owner="user",uuid="GPU-0"}': users,
        'gpuslice_gpu_memory_unmanaged_bytes{gpu="0",uuid="GPU-0"}': 30 * GIB + users,
    }


# ---------------------------------------------------------------------------------------------
# the cache


def test_the_redacted_text_is_built_once_per_change_only_when_asked() -> None:
    built: list[str] = []

    def build(which: str) -> Callable[[], str]:
        def one() -> str:
            built.append(which)
            return "{}"

        return one

    full = CachedStatus(build("full"))
    redacted = full.variant(build("redacted"))
    for _ in range(3):
        redacted.text()
    assert built == ["redacted"]
    full.changed()
    redacted.text()
    full.text()
    redacted.text()
    assert built == ["redacted", "redacted", "full"]


# ---------------------------------------------------------------------------------------------
# the controller


class Credentials:
    """The bus daemon's word on each caller (a FakeSystemd has no caller_credentials)."""

    def __init__(self) -> None:
        self.of: dict[str, tuple[int | None, frozenset[int]]] = {}
        self.asked: list[str] = []

    async def __call__(self, sender: str) -> tuple[int | None, frozenset[int]]:
        self.asked.append(sender)
        if sender not in self.of:
            raise SystemdError("org.freedesktop.DBus.Error.NameHasNoOwner", sender)
        return self.of[sender]


def _foreign_bed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: str) -> Bed:
    """A controller whose /proc is mounted with `options`, a user's process on GPU 1."""
    table = tmp_path / "mountinfo"
    table.write_text(mountinfo(proc_line(options)))
    monkeypatch.setattr(procmount, "MOUNTINFO", table)
    proc = tmp_path / "proc" / "200"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("0::/user.slice/user-1000.slice/session-2.scope\n")
    (proc / "comm").write_text("secret\n")
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [], nvml=OneForeignProcess())
    credentials = Credentials()
    credentials.of = {
        ":1.1": (1000, frozenset({1000})),
        ":1.2": (0, frozenset()),
        ":1.3": (1001, frozenset({1001, 27})),
        ":1.4": (None, frozenset()),
        ":1.5": (1002, frozenset({1002})),
    }
    bed.systemd.caller_credentials = credentials  # type: ignore[attr-defined]
    return bed


async def _answer(ctl: controller_module.Controller, sender: str) -> dict[str, Any]:
    answer = ctl.status_for(sender)
    text = answer if isinstance(answer, str) else await answer
    data: dict[str, Any] = json.loads(text)
    return data


def test_without_hidepid_status_is_answered_at_once_without_asking_who(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bed = _foreign_bed(tmp_path, monkeypatch, "rw")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        answer = ctl.status_for(":1.1")
        assert isinstance(answer, str)
        assert json.loads(answer)["gpus"] == json.loads(ctl.status_json())["gpus"]
        [foreign] = json.loads(answer)["gpus"][1]["foreign"]
        assert foreign["pid"] == 200
        assert bed.systemd.caller_credentials.asked == []  # type: ignore[attr-defined]

    run(test)


def test_with_hidepid_only_root_and_the_group_see_other_users_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user, a caller the bus daemon does not name, or names without a UID:
    redacted. Root and a member of gid=27: everything. (The user whose process it is sees
    it: tests/test_status_own_processes.py.)"""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=invisible,gid=27")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert ctl.answers.proc_hiding == ProcHiding(True, 27, "hidepid=invisible,gid=27")
        for sender in (":1.5", ":1.4", ":1.9"):
            data = await _answer(ctl, sender)
            assert data["redacted"] is True, sender
            assert data["gpus"][1]["foreign"] == [
                {
                    "pid": None,
                    "command": None,
                    "memory": GIB,
                    "owner": {"kind": "user", "id": None},
                    "compute": True,
                }
            ]
            assert "counters" in data and "controller" in data
        for sender in (":1.2", ":1.3"):
            data = await _answer(ctl, sender)
            assert "redacted" not in data, sender
            [foreign] = data["gpus"][1]["foreign"]
            assert (foreign["pid"], foreign["command"], foreign["owner"]["id"]) == (
                200,
                "secret",
                "1000",
            )

    run(test)


@pytest.mark.skipif(os.geteuid() != 0, reason="a file root's alone is made with chown")
@pytest.mark.parametrize("options", ["rw", "rw,hidepid=invisible,gid=27"])
def test_a_value_of_roots_environment_file_reaches_root_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, options: str
) -> None:
    """A unit refused for what its EnvironmentFile= sets (gpuslice/envsafety.py): root's
    Status and the journal quote the value, the line it is on; no other caller's answer
    does, whatever /proc hides (a member of the gid= group, everyone where it hides nothing,
    one the bus daemon does not name), and its metrics count the same problems."""
    bed = _foreign_bed(tmp_path, monkeypatch, options)
    env = tmp_path / "root" / "etc" / "job" / "x.env"
    env.parent.mkdir(parents=True, mode=0o755)
    env.write_text("LD_PRELOAD=/home/asr/x.so TOKEN=s3cret\n")
    os.chown(env, 0, 0)
    env.chmod(0o600)
    service = "Priority=10\n[Service]\nUser=asr\nEnvironmentFile=/etc/job/x.env\n"
    write_unit(tmp_path, "leak.service", service)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        root = await _answer(ctl, ":1.2")
        [problem] = root["problems"]
        assert problem.startswith("/etc/systemd/system/leak.service:8: [Service] Environment")
        assert "LD_PRELOAD=/home/asr/x.so TOKEN=s3cret (set in /etc/job/x.env)" in problem
        assert "s3cret" in ctl.status_json()
        count = b"gpuslice_annotation_problems 1.0"
        assert count in exposition(root)
        for sender in (":1.1", ":1.3", ":1.4", ":1.5", ":1.9"):
            data = await _answer(ctl, sender)
            assert "s3cret" not in json.dumps(data), sender
            [public] = data["problems"]
            assert "LD_PRELOAD=... (set in /etc/job/x.env; its value is shown to root " in public
            assert count in exposition(data)
            assert "shown to root alone" in render(data)

    with caplog.at_level(logging.INFO):
        run(test)
    assert any("TOKEN=s3cret" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("options", ["rw", "rw,hidepid=invisible,gid=27"])
def test_what_a_file_others_cannot_read_says_reaches_root_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: str
) -> None:
    """A drop-in whose mode lets no one but its owner read it (root's 0600): root's Status
    quotes its [X-GPUSlice] values and its unknown keys' names; any other caller's gives
    where each problem is (file, line, a known key) but not what the file says. A problem in
    a file anyone may read is quoted to all. The priorities are public as ever (the table)."""
    bed = _foreign_bed(tmp_path, monkeypatch, options)
    write_unit(tmp_path, "leak.service", "Priority=10\nMemory=open1\n")
    dropin = tmp_path / "root" / UNIT_DIR / "leak.service.d" / "private.conf"
    dropin.parent.mkdir()
    dropin.write_text("[X-GPUSlice]\nMemory=s3cret\nT0ken=x\n")
    dropin.chmod(0o600)
    shown = f"/{UNIT_DIR}/leak.service"
    withheld = "not shown: the file is not everyone's to read (`gpuslice check` as root says what)"

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        root = await _answer(ctl, ":1.2")
        assert len(root["problems"]) == 3
        assert "s3cret" in json.dumps(root) and "T0ken" in json.dumps(root)
        for sender in (":1.1", ":1.3", ":1.4", ":1.5"):
            data = await _answer(ctl, sender)
            assert "s3cret" not in json.dumps(data) and "T0ken" not in json.dumps(data), sender
            assert data["problems"] == [
                f"{shown}:6: [X-GPUSlice] Memory: expected a size such as 512M, 20G or 20GiB "
                '(binary units, at most 1P), got "open1" (overridden at '
                "/etc/systemd/system/leak.service.d/private.conf:2)",
                f"{shown}.d/private.conf:3: [X-GPUSlice] {withheld}",
                f"{shown}.d/private.conf:2: [X-GPUSlice] Memory: {withheld}",
            ], sender

    run(test)


def _privacy(root: Path, unit: str = "leak.service") -> dict[str, bool]:
    """Each problem's file (its system path) -> whether it is withheld from others."""
    _spec, problems = load_spec(unit, root)
    assert problems
    return {p.path: p.private for p in problems}


LEAK = f"/{UNIT_DIR}/leak.service"
DROPIN = f"{LEAK}.d/x.conf"


@pytest.mark.parametrize("mode, private", [(0o700, True), (0o750, True), (0o711, False)])
def test_a_readable_file_in_a_directory_others_cannot_search_is_private(
    tmp_path: Path, mode: int, private: bool
) -> None:
    """A 0644 drop-in in root's 0700 `leak.service.d/` was quoted to every Status caller,
    though no one else could read it (the file's mode alone counted). Searching (o+x) is
    what reading it needs; listing (o+r) is not."""
    root = tmp_path / "root"
    write_unit(tmp_path, "leak.service", "Priority=10\nMemory=open1\n")
    dropin = root / UNIT_DIR / "leak.service.d" / "x.conf"
    dropin.parent.mkdir()
    dropin.write_text("[X-GPUSlice]\nMemory=s3cret\n")
    dropin.chmod(0o644)
    dropin.parent.chmod(mode)
    assert _privacy(root) == {LEAK: False, DROPIN: private}
    (root / "etc").chmod(0o700)  # a directory higher up shuts others out of both
    assert _privacy(root) == {LEAK: True, DROPIN: True}


@pytest.mark.parametrize("target_mode, private", [(0o700, True), (0o755, False)])
def test_a_linked_unit_file_is_private_by_its_target_s_directories(
    tmp_path: Path, target_mode: int, private: bool
) -> None:
    """`systemctl link /srv/secret/leak.service`: others read the file where it is, so the
    target's directories count, not the link's."""
    root = tmp_path / "root"
    target = root / "srv" / "jobs" / "leak.service"
    target.parent.mkdir(parents=True)
    target.write_text("[Service]\nExecStart=/bin/true\n\n[X-GPUSlice]\nPriority=high\n")
    target.chmod(0o644)
    (root / UNIT_DIR).mkdir(parents=True)
    (root / UNIT_DIR / "leak.service").symlink_to("/srv/jobs/leak.service")
    (root / "srv").chmod(target_mode)
    assert _privacy(root) == {LEAK: private}
    # a link in a directory others cannot search, to a file they can read where it is
    (root / UNIT_DIR / "leak.service").unlink()
    write_unit(tmp_path, "leak.service", "Priority=10\n")
    (root / "srv").chmod(0o755)
    target.write_text("[X-GPUSlice]\nMemory=open1\n")
    hidden = root / UNIT_DIR / "leak.service.d"
    hidden.mkdir(mode=0o700)
    (hidden / "x.conf").symlink_to("/srv/jobs/leak.service")
    assert _privacy(root) == {DROPIN: False}


def test_a_readable_unit_file_with_an_access_acl_is_private(tmp_path: Path) -> None:
    """`setfacl -m u:bob:--- x.conf` shuts bob out of a 0644 file: an access ACL names someone
    whose access the mode does not say, on the file or a directory above it (as config and
    envsafety take one as not root's alone, `safefile.has_access_acl`)."""
    root = tmp_path / "root"
    write_unit(tmp_path, "leak.service", "Priority=10\nMemory=open1\n")
    dropin = root / UNIT_DIR / "leak.service.d" / "x.conf"
    dropin.parent.mkdir()
    dropin.write_text("[X-GPUSlice]\nMemory=s3cret\n")
    assert _privacy(root) == {LEAK: False, DROPIN: False}
    _acl(dropin, 0)
    assert stat.S_IMODE(dropin.stat().st_mode) & 0o004  # others may read, as the mode says
    assert _privacy(root) == {LEAK: False, DROPIN: True}
    dropin.unlink()
    dropin.write_text("[X-GPUSlice]\nMemory=s3cret\n")
    _acl(dropin.parent, 0)
    assert _privacy(root) == {LEAK: False, DROPIN: True}


def test_a_file_thousands_of_directories_deep_is_looked_at_without_recursion(
    tmp_path: Path,
) -> None:
    deep = f"{tmp_path}/root"
    os.mkdir(deep)
    for _ in range(1500):  # os.makedirs recurses, one call a directory
        deep += "/d"
        os.mkdir(deep)
    try:
        index = UnitIndex(tmp_path / "root")
        assert index.reachable(f"{deep}/x.service")
        os.chmod(tmp_path / "root" / "d", 0o700)
        assert not UnitIndex(tmp_path / "root").reachable(f"{deep}/x.service")
        assert index.reachable(f"{deep}/x.service")  # one look per directory and scan
    finally:  # from the deepest up: shutil.rmtree (pytest's clean-up) recurses too
        while deep != f"{tmp_path}/root":
            os.rmdir(deep)
            deep = os.path.dirname(deep)


def test_the_redacted_answer_is_built_once_per_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bed = _foreign_bed(tmp_path, monkeypatch, "rw,hidepid=2")
    built: list[bool] = []
    real = status.snapshot_to_json

    def counted(*args: Any, **kwargs: Any) -> dict[str, Any]:
        built.append(bool(args[6] if len(args) > 6 else kwargs.get("redact", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(answers, "snapshot_to_json", counted)

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        ctl.answers.changed()
        built.clear()
        for _ in range(5):
            await _answer(ctl, ":1.1")
        assert built == [True]
        ctl.answers.changed()
        await _answer(ctl, ":1.1")
        await _answer(ctl, ":1.2")
        await _answer(ctl, ":1.2")
        assert built == [True, True, False]

    run(test)


def test_a_reload_reads_the_proc_mount_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGHUP (reload_config) reads /proc's mount again, whatever config.yaml holds."""
    bed = _foreign_bed(tmp_path, monkeypatch, "rw")

    async def test() -> None:
        ctl = bed.controller
        await ctl.start()
        assert isinstance(ctl.status_for(":1.1"), str)
        procmount.MOUNTINFO.write_text(mountinfo(proc_line("rw,hidepid=2")))
        ctl.reload_config()
        assert (await _answer(ctl, ":1.1"))["redacted"] is True
        procmount.MOUNTINFO.write_text(mountinfo(proc_line("rw,hidepid=0")))
        ctl.reload_config()
        assert isinstance(ctl.status_for(":1.1"), str)

    run(test)


# ---------------------------------------------------------------------------------------------
# the service


def status_call(serial: int, flags: MessageFlag = MessageFlag.NONE) -> Message:
    return Message(
        destination=BUS_NAME,
        path=OBJECT_PATH,
        interface=INTERFACE,
        member="Status",
        sender=f":1.{serial}",
        serial=serial,
        flags=flags,
    )


class Asked:
    """on_status_for whose answers wait until `go` is set; who was asked about (once its
    question began: a refused call's is closed unbegun)."""

    def __init__(self, text: str = '{"a": 1}') -> None:
        self.text = text
        self.go = asyncio.Event()
        self.asked: list[str] = []

    def __call__(self, sender: str) -> str | Coroutine[Any, Any, str]:
        return self._later(sender)

    async def _later(self, sender: str) -> str:
        self.asked.append(sender)
        await self.go.wait()
        return self.text


def _service(bus: ServiceBus, asked: Any) -> SchedulerService:
    return SchedulerService(
        bus,
        lambda u, s: None,
        lambda: "not this one",
        lambda: None,
        on_status_for=asked,
    )


async def _turns() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_an_answer_that_asks_who_is_sent_once_known_and_those_in_wait_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each asks the bus daemon (one of the controller's calls in flight): past
    MAX_STATUS_ASKING in wait, a call is refused; a call that wants no answer asks nothing."""
    monkeypatch.setattr(service_module, "MAX_STATUS_ASKING", 3)

    async def scenario() -> None:
        bus, asked = ServiceBus(), Asked()
        service = _service(bus, asked)
        assert service._handle(status_call(1, MessageFlag.NO_REPLY_EXPECTED)) is True
        assert asked.asked == []
        for serial in (2, 3, 4):
            assert service._handle(status_call(serial)) is True
        refused = service._handle(status_call(5))
        assert isinstance(refused, Message)
        assert refused.error_name == "org.freedesktop.DBus.Error.LimitsExceeded"
        await _turns()
        assert asked.asked == [":1.2", ":1.3", ":1.4"]
        assert bus.sent == []
        asked.go.set()
        await _turns()
        assert [(m.reply_serial, m.body) for m in bus.sent] == [
            (2, ['{"a": 1}']),
            (3, ['{"a": 1}']),
            (4, ['{"a": 1}']),
        ]
        assert service._handle(status_call(6)) is True  # none in wait now
        await _turns()
        assert bus.sent[-1].reply_serial == 6

    asyncio.run(scenario())


def test_an_answer_that_asked_who_keeps_the_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    """The answers sent while it asked count (MAX_STATUS_UNSENT), and one too long for the
    bus is refused (MAX_STATUS_ANSWER); an error while asking is an error, not silence."""
    monkeypatch.setattr(service_module, "MAX_STATUS_UNSENT", 10)
    monkeypatch.setattr(service_module, "MAX_STATUS_ANSWER", 20)

    async def scenario() -> None:
        bus, asked = ServiceBus(), Asked("x" * 12)
        service = _service(bus, asked)
        service._handle(status_call(1))
        service._handle(status_call(2))
        asked.go.set()
        await _turns()
        assert bus.sent[0].message_type is MessageType.METHOD_RETURN
        assert bus.sent[1].error_name == "org.freedesktop.DBus.Error.LimitsExceeded"
        assert bus.sent[1].body == ["too many status answers still being sent: try again"]
        bus.write(1)
        await _turns()
        asked.text = "x" * 21
        service._handle(status_call(3))
        await _turns()
        assert bus.sent[2].error_name == "org.freedesktop.DBus.Error.LimitsExceeded"
        assert "more than one D-Bus message carries" in bus.sent[2].body[0]

        async def broken() -> str:
            raise RuntimeError("bug")

        service._on_status_for = lambda sender: broken()
        service._handle(status_call(4))
        await _turns()
        assert bus.sent[3].error_name == "org.freedesktop.DBus.Error.Failed"
        assert service._asking == set()

    asyncio.run(scenario())


def test_status_over_the_bus_is_answered_after_asking_who_calls(bus_address: str) -> None:
    """On a real dbus-daemon: the answer the caller gets is the one for its credentials."""

    async def scenario() -> None:
        systemd = Systemd(await connect(bus_address))

        async def for_caller(sender: str) -> str:
            uid, _ = await systemd.caller_credentials(sender)
            return json.dumps({"uid": uid})

        service = SchedulerService(
            systemd.bus, lambda u, s: None, lambda: "{}", lambda: None, None, for_caller
        )
        await service.claim_name()
        client = await connect(bus_address)
        reply = await call(client, "Status")
        assert json.loads(reply.body[0]) == {"uid": os.getuid()}

    run_on_bus(scenario)
