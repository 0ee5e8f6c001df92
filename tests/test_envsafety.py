"""A unit that runs as another user is not managed while someone but root can change one of
its EnvironmentFile=s: gpuslice's gate (`ExecStartPre=+`) runs as root with its environment.

Each test scans a root under tmp_path whose files are made root's or another UID's with
os.chown (the tests run as root), and pairs what is refused with what is not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import gc
import os
import stat
import struct
import subprocess
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from gpuslice import envsafety, envsyntax
from gpuslice.annotations import Problem, load_spec, scan
from gpuslice.envsafety import FIX_OWNERS, FIX_PATH, FIX_TREE, EnvFileChecker, Refusal, RunAs
from gpuslice.unitfiles import Entry
from tests.test_unitfiles import link  # a symlink at a system path under the root

T = TypeVar("T")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

ETC = "/etc/systemd/system"
ASR = 1000  # a user's UID and GID
ANNOTATION = "\n[X-GPUSlice]\nPriority=10\n"
GATE = "gpuslice's gate runs as root with this unit's environment, so gpuslice does not manage"
TREE = "where users make files or file systems are mounted after systemd runs gpuslice's generator"


def put(root: Path, path: str, text: str = "X=1\n", uid: int = 0, mode: int = 0o644) -> Path:
    """A file at the system path `path` under root, its new directories root's 0755."""
    real = root / path.lstrip("/")
    for parent in reversed(real.parents):
        if parent != root and root in parent.parents and not parent.exists():
            parent.mkdir(mode=0o755)
    real.write_text(text)
    os.chown(real, uid, uid)
    real.chmod(mode)
    return real


def service(name: str, *service_lines: str) -> tuple[str, str]:
    """(path, text) of an annotated unit: its [Service] lines start on line 3."""
    body = "\n".join(["ExecStart=/bin/true", *service_lines])
    return f"{ETC}/{name}", f"[Unit]\n[Service]\n{body}\n{ANNOTATION}"


def install(root: Path, name: str, *service_lines: str) -> None:
    path, text = service(name, *service_lines)
    put(root, path, text)


def errors(root: Path, name: str) -> list[str]:
    spec, problems = load_spec(name, root)
    found = [str(p) for p in problems if p.severity == "error"]
    assert (spec is None) == bool(found), (spec, found)
    return found


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root whose / is root's 0755 (pytest's tmp_path is root's 0700)."""
    tmp_path.chmod(0o755)
    return tmp_path


def test_a_root_only_file_is_managed_and_one_another_uid_owns_is_not(root: Path) -> None:
    put(root, "/etc/asr/ok.env")
    put(root, "/etc/asr/theirs.env", uid=ASR)
    install(root, "ok.service", "User=asr", "EnvironmentFile=/etc/asr/ok.env")
    install(root, "theirs.service", "User=asr", "EnvironmentFile=/etc/asr/theirs.env")
    assert errors(root, "ok.service") == []
    assert errors(root, "theirs.service") == [
        f"{ETC}/theirs.service:5: [Service] EnvironmentFile: /etc/asr/theirs.env is owned by "
        f"UID {ASR}, who can change it; {GATE} theirs.service until only root can change "
        "that file and its directories"
    ]


def test_the_problem_is_an_error_located_at_the_assignment(root: Path) -> None:
    put(root, "/etc/asr/theirs.env", uid=ASR)
    put(root, f"{ETC}/x.service.d/env.conf", "[Service]\n\nEnvironmentFile=/etc/asr/theirs.env\n")
    install(root, "x.service", "User=asr")
    spec, problems = load_spec("x.service", root)
    assert spec is None
    assert [(p.path, p.line, p.section, p.key, p.severity, p.unit) for p in problems] == [
        (f"{ETC}/x.service.d/env.conf", 3, "Service", "EnvironmentFile", "error", "x.service")
    ]
    assert isinstance(problems[0], Problem)


def test_an_environment_file_in_a_prefix_or_an_aliass_dir_is_checked(root: Path) -> None:
    """systemd applies `job-@a.service.d/` to `job-x@a.service` and `web.service.d/` to the
    unit `web.service` is an alias of: a User= and an EnvironmentFile= there reach the gate."""
    put(root, "/etc/asr/theirs.env", uid=ASR)
    install(root, "job-x@.service")
    put(
        root,
        f"{ETC}/job-@a.service.d/env.conf",
        "[Service]\nUser=asr\nEnvironmentFile=/etc/asr/theirs.env\n",
    )
    install(root, "real.service")
    link(root, f"{ETC}/web.service", f"{ETC}/real.service")
    put(
        root,
        f"{ETC}/web.service.d/env.conf",
        "[Service]\nUser=asr\nEnvironmentFile=/etc/asr/theirs.env\n",
    )
    scanned = scan(root)
    assert set(scanned.specs) == {"job-x@.service"}
    assert sorted((p.unit, p.path, p.line) for p in scanned.problems if p.severity == "error") == [
        ("job-x@a.service", f"{ETC}/job-@a.service.d/env.conf", 3),
        ("real.service", f"{ETC}/web.service.d/env.conf", 3),
    ]


def test_group_writable_by_a_users_group_is_refused_by_gid_0_is_not(root: Path) -> None:
    put(root, "/etc/asr/group.env", mode=0o664)
    os.chown(root / "etc/asr/group.env", 0, ASR)
    put(root, "/etc/asr/root-group.env", mode=0o664)
    put(root, "/etc/asr/read-only.env", mode=0o644)  # a user's group that may only read
    os.chown(root / "etc/asr/read-only.env", 0, ASR)
    install(root, "group.service", "User=asr", "EnvironmentFile=/etc/asr/group.env")
    install(root, "root-group.service", "User=asr", "EnvironmentFile=/etc/asr/root-group.env")
    install(root, "read-only.service", "User=asr", "EnvironmentFile=/etc/asr/read-only.env")
    assert errors(root, "root-group.service") == []
    assert errors(root, "read-only.service") == []
    [error] = errors(root, "group.service")
    assert f"/etc/asr/group.env is writable by group GID {ASR} (mode 0664); {GATE}" in error


def _acl(path: Path, user: int, perm: int = 6) -> None:
    """An access ACL that gives `user` `perm` (rw by default), as `setfacl -m u:USER:rw`
    makes it: the mask, shown as the group bits, is `perm` with the group's r."""

    def entry(tag: int, perm: int, ident: int = 0xFFFFFFFF) -> bytes:
        return struct.pack("<HHI", tag, perm, ident)

    blob = struct.pack("<I", 2) + b"".join(
        [
            entry(0x01, 6),
            entry(0x02, perm, user),
            entry(0x04, 4),
            entry(0x10, perm | 4),
            entry(0x20, 4),
        ]
    )
    try:
        os.setxattr(path, "system.posix_acl_access", blob)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            pytest.skip("no POSIX ACLs on this file system")
        raise


def test_an_acl_that_lets_a_user_write_is_refused(root: Path) -> None:
    """An access ACL whose mask lets write may let a named user write; one that does not
    (group bits r--) lets no one but the owner write, and is fine."""
    real = put(root, "/etc/asr/acl.env", mode=0o644)
    _acl(real, ASR)
    assert stat.S_IMODE(real.stat().st_mode) == 0o664 and real.stat().st_gid == 0
    read = put(root, "/etc/asr/acl-read.env", mode=0o644)
    _acl(read, ASR, perm=4)
    assert stat.S_IMODE(read.stat().st_mode) == 0o644
    put(root, "/etc/asr/plain.env", mode=0o664)
    install(root, "acl.service", "User=asr", "EnvironmentFile=/etc/asr/acl.env")
    install(root, "acl-read.service", "User=asr", "EnvironmentFile=/etc/asr/acl-read.env")
    install(root, "plain.service", "User=asr", "EnvironmentFile=/etc/asr/plain.env")
    assert errors(root, "plain.service") == []
    assert errors(root, "acl-read.service") == []
    assert errors(root, "acl.service") == [
        f"{ETC}/acl.service:5: [Service] EnvironmentFile: /etc/asr/acl.env is group-writable "
        f"with an access ACL, which may let others write it; {GATE} acl.service until only "
        "root can change that file and its directories"
    ]


@pytest.mark.parametrize(
    ("uid", "mode", "why"),
    [
        (ASR, 0o755, f"is owned by UID {ASR}, who can change it"),
        (0, 0o757, "is writable by anyone (mode 0757)"),
        (0, 0o1777, "is a sticky directory anyone can make files in (as /tmp)"),
        (0, 0o775, f"is writable by group GID {ASR} (mode 0775)"),
    ],
)
def test_a_directory_above_the_file_that_a_user_can_write(
    root: Path, uid: int, mode: int, why: str
) -> None:
    put(root, "/srv/asr/conf/asr.env")
    os.chown(root / "srv/asr", uid, ASR)
    (root / "srv/asr").chmod(mode)
    install(root, "asr.service", "User=asr", "EnvironmentFile=/srv/asr/conf/asr.env")
    assert errors(root, "asr.service") == [
        f"{ETC}/asr.service:5: [Service] EnvironmentFile: /srv/asr/conf/asr.env: its "
        f"directory /srv/asr {why}; {GATE} asr.service until only root can change that "
        "file and its directories"
    ]
    os.chown(root / "srv/asr", 0, 0)  # group-writable by root's group alone: fine
    (root / "srv/asr").chmod(0o775)
    assert errors(root, "asr.service") == []


def test_a_symlink_to_a_file_a_user_owns(root: Path) -> None:
    put(root, "/srv/asr/real.env", uid=ASR)
    link(root, "/etc/asr/asr.env", "/srv/asr/real.env")
    link(root, "/etc/asr/rel.env", "../../srv/asr/real.env")
    put(root, "/etc/asr/root.env")
    link(root, "/etc/asr/good.env", "root.env")
    install(root, "abs.service", "User=asr", "EnvironmentFile=/etc/asr/asr.env")
    install(root, "rel.service", "User=asr", "EnvironmentFile=/etc/asr/rel.env")
    install(root, "good.service", "User=asr", "EnvironmentFile=/etc/asr/good.env")
    assert errors(root, "good.service") == []
    for name, via in (("abs", "/etc/asr/asr.env"), ("rel", "/etc/asr/rel.env")):
        [error] = errors(root, f"{name}.service")
        assert (
            f"EnvironmentFile: {via}: /srv/asr/real.env, reached through the symlink {via}, "
            f"is owned by UID {ASR}, who can change it; {GATE}"
        ) in error


def test_a_symlink_in_a_directory_a_user_can_write_to_a_root_file(root: Path) -> None:
    put(root, "/etc/root.env")
    link(root, "/srv/asr/asr.env", "/etc/root.env")
    os.chown(root / "srv/asr", ASR, ASR)
    os.chown(root / "srv/asr/asr.env", 0, 0, follow_symlinks=False)
    install(root, "asr.service", "User=asr", "EnvironmentFile=/srv/asr/asr.env")
    install(root, "direct.service", "User=asr", "EnvironmentFile=/etc/root.env")
    assert errors(root, "direct.service") == []
    [error] = errors(root, "asr.service")
    assert f"/srv/asr/asr.env: its directory /srv/asr is owned by UID {ASR}" in error


def test_an_optional_file_not_there_under_a_root_dir_or_a_user_tree(root: Path) -> None:
    (root / "etc/asr").mkdir(parents=True)
    (root / "home").mkdir()  # at boot, an empty mount point: root's
    install(root, "etc.service", "User=asr", "EnvironmentFile=-/etc/asr/not-yet.env")
    install(root, "home.service", "User=asr", "EnvironmentFile=-/home/asr/asr.env")
    install(root, "tmp.service", "User=asr", "EnvironmentFile=-/tmp/asr.env")
    link(root, "/etc/asr/to-home", "/home/asr")
    install(root, "via.service", "User=asr", "EnvironmentFile=-/etc/asr/to-home/asr.env")
    assert errors(root, "etc.service") == []
    assert errors(root, "home.service") == [
        f"{ETC}/home.service:5: [Service] EnvironmentFile: /home/asr/asr.env is under /home, "
        "where users make files or file systems are mounted after systemd runs gpuslice's "
        f"generator at boot; {GATE} home.service until it names a file elsewhere, that only "
        "root can change"
    ]
    [error] = errors(root, "tmp.service")
    assert "/tmp/asr.env is under /tmp, " in error
    [error] = errors(root, "via.service")
    assert "/etc/asr/to-home/asr.env is under /home (by way of /home), " in error


def test_the_user_trees_can_be_pointed_elsewhere(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (root / "data").mkdir()
    install(root, "asr.service", "User=asr", "EnvironmentFile=-/data/asr.env")
    assert errors(root, "asr.service") == []
    monkeypatch.setattr(envsafety, "USER_TREES", ("/data",))
    [error] = errors(root, "asr.service")
    assert "/data/asr.env is under /data, " in error


def test_nothing_in_a_user_tree_is_looked_at(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path in a user tree is refused whatever it holds, so nothing in it is looked at: an
    lstat there goes through an automounted or network home (every GPU cluster's /home),
    which a server that does not answer hangs, and with it the generator at each
    daemon-reload (systemd kills it: no gate for any unit) and the controller's scans. And
    the refusal says why it is one: a home directory that root made its own is refused too,
    so "until only root can change that file" was a fix that fixed nothing."""
    put(root, "/home/asr/asr.env", uid=ASR)
    os.chown(root / "home/asr", ASR, ASR)
    link(root, "/etc/asr/to-home", "/home/asr")
    install(root, "home.service", "User=asr", "EnvironmentFile=/home/asr/asr.env")
    install(root, "via.service", "User=asr", "EnvironmentFile=/etc/asr/to-home/asr.env")
    looked: list[str] = []
    real_lstat, real_readlink = os.lstat, os.readlink

    def lstat(path: str) -> os.stat_result:
        looked.append(path)
        return real_lstat(path)

    def readlink(path: str) -> str:
        looked.append(path)
        return real_readlink(path)

    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(os, "readlink", readlink)
    [error] = errors(root, "home.service")
    assert "/home/asr/asr.env is under /home, where users make files" in error
    assert error.endswith("until it names a file elsewhere, that only root can change")
    [error] = errors(root, "via.service")
    assert "/etc/asr/to-home/asr.env is under /home (by way of /home), " in error
    home = str(root / "home")
    assert [p for p in looked if p == home or p.startswith(home + "/")] == []


def test_specifiers_are_expanded_per_instance_and_unknown_ones_refused(root: Path) -> None:
    put(root, "/etc/job/good.env")
    put(root, "/etc/job/bad.env", uid=ASR)
    put(root, "/etc/job/a/b.env")
    install(root, "job@.service", "User=asr", "EnvironmentFile=/etc/job/%i.env")
    for instance in ("good", "bad"):
        put(root, f"{ETC}/job@{instance}.service.d/x.conf", "[Unit]\n")
    install(root, "home.service", "User=asr", "EnvironmentFile=%h/asr.env")
    install(root, "other.service", "User=asr", "EnvironmentFile=/etc/job/%I.env")
    install(root, "plain@.service", "User=asr", "EnvironmentFile=/etc/%P/%t.env")
    result = scan(root)
    assert "job@good.service" in result.specs
    assert {"job@.service", "job@bad.service", "home.service"} <= result.invalid
    by_unit = {p.unit: str(p) for p in result.problems}
    assert f"/etc/job/%i.env (/etc/job/bad.env) is owned by UID {ASR}" in by_unit["job@bad.service"]
    assert (
        "/etc/job/%i.env cannot be checked: %i depends on the instance's name, which whoever "
        "starts an instance of job@.service chooses, so the file cannot be checked for every "
        f"instance; {GATE} job@.service until it names"
    ) in by_unit["job@.service"]
    assert (
        "%h/asr.env cannot be checked: the specifier %h has a value gpuslice does not work out"
    ) in by_unit["home.service"]
    # %I of a plain unit is empty; %P and %t are known: /etc/plain//run.env, not there
    assert {"other.service", "plain@.service"} <= set(result.specs)


NAMES = "/%n/%N/%p/%P/%i/%I/%j/%J"


@pytest.mark.parametrize(
    ("unit", "value", "expected"),
    [
        pytest.param(
            "x-y@a-b.service",
            "/a" + NAMES,
            ("/a/x-y@a-b.service/x-y@a-b/x-y/x/y/a-b/a/b/y/y", None),
            id="instance",
        ),
        pytest.param(
            "x-y@a-b.service",
            "%t %S %C %L %E %T %V %% %",
            ("/run /var/lib /var/cache /var/log /etc /tmp /var/tmp % %", None),
            id="system-dirs",
        ),
        pytest.param("x-y@a-b.service", "/e/%I", ("/e/a/b", None), id="unescaped-instance"),
        # no instance: %i and %I are empty, the prefix is the name without its suffix, and
        # %j the prefix's part after its last dash
        pytest.param(
            "a-b-c.service", NAMES, ("/a-b-c.service/a-b-c/a-b-c/a/b/c///c/c", None), id="plain"
        ),
        pytest.param("a@b-c.service", "/%p/%i/%j", ("/a/b-c/a", None), id="one-letter-prefix"),
        # the instance runs from the first @ to the suffix's dot
        pytest.param("x@a@b.service", "/%p/%i/%I", ("/x/a@b/a@b", None), id="two-ats"),
        # \xNN is a byte: an ASCII one is its character, any other kept as that byte
        pytest.param("x@a\\x2dbc.service", "/%I", ("/a-bc", None), id="escape"),
        pytest.param(
            "x@a\\x2db\\xe9\\x80.service",
            "/%I",
            ("/a-b\udce9\udc80", None),
            id="escapes",
        ),
        pytest.param(
            "x@\\y41.service",
            "/%I",
            (None, "%I of x@\\y41.service cannot be unescaped"),
            id="bad-escape",
        ),
    ],
)
def test_specifier_values(
    unit: str, value: str, expected: tuple[str, None] | tuple[None, str]
) -> None:
    """Each name specifier has systemd's value for the unit (systemd.unit(5))."""
    assert envsafety.expand(unit, value) == expected


def test_an_unescaped_instance_is_walked_as_systemd_would_name_it(root: Path) -> None:
    put(root, "/srv/asr/asr.env", uid=ASR)
    install(root, "job@.service", "User=asr", "EnvironmentFile=-/%I")
    name = "job@srv-asr-asr.env.service"  # %I is srv/asr/asr.env
    put(root, f"{ETC}/{name}.d/x.conf", "[Unit]\n")
    [error] = errors(root, name)
    assert f"EnvironmentFile: -/%I (/srv/asr/asr.env) is owned by UID {ASR}" in error


def test_dynamic_user_is_another_user(root: Path) -> None:
    put(root, "/var/lib/private/asr/hook.so", uid=61000)
    for value, refused in (("yes", True), ("no", False), ("bogus", True)):
        install(
            root,
            f"dyn-{value}.service",
            f"DynamicUser={value}",
            "Environment=LD_PRELOAD=/var/lib/private/asr/hook.so",
        )
        assert bool(errors(root, f"dyn-{value}.service")) is refused, value


RUNS_AS: dict[str, tuple[list[str], list[str]]] = {
    # name: (lines before EnvironmentFile=, lines after it)
    "root.service": (["User=root"], []),
    "uid0.service": (["User=0"], []),
    "nobody-said.service": ([], []),
    "reset.service": (["User=asr"], ["User="]),  # an empty User= resets it
    "asr.service": (["User=asr"], []),
    "specifier.service": (["User=%i"], []),  # a specifier: not known to be root
    "last-wins.service": (["User=root"], ["User=1000"]),
    "env-reset.service": (["User=asr"], ["EnvironmentFile="]),  # the list restarts
    "env-again.service": (
        ["User=asr"],
        ["EnvironmentFile=", "EnvironmentFile=/etc/asr/theirs.env"],
    ),
}


def test_who_the_unit_runs_as(root: Path) -> None:
    """A unit run as root loads its loader paths as root already: they are not checked. Only
    the last User= counts, and the list of files restarts at an empty one."""
    put(root, "/etc/asr/ours.env", "LD_PRELOAD=/srv/asr/hook.so\n")
    put(root, "/srv/asr/hook.so", uid=ASR)
    put(root, "/etc/asr/theirs.env", uid=ASR)
    for name, (before, after) in RUNS_AS.items():
        install(root, name, *before, "EnvironmentFile=/etc/asr/ours.env", *after)
    result = scan(root)
    assert result.invalid == {
        "asr.service",
        "specifier.service",
        "last-wins.service",
        "env-again.service",
    }
    assert set(result.specs) == set(RUNS_AS) - result.invalid


def test_an_empty_environment_file_in_a_dropin_resets_an_unsafe_one(root: Path) -> None:
    put(root, "/etc/asr/theirs.env", uid=ASR)
    put(root, "/etc/asr/ours.env")
    install(root, "x.service", "User=asr", "EnvironmentFile=/etc/asr/theirs.env")
    install(root, "y.service", "User=asr", "EnvironmentFile=/etc/asr/theirs.env")
    put(
        root,
        f"{ETC}/x.service.d/fix.conf",
        "[Service]\nEnvironmentFile=\nEnvironmentFile=-/etc/asr/ours.env\n",
    )
    assert errors(root, "x.service") == []
    assert len(errors(root, "y.service")) == 1


def test_unannotated_units_and_the_generators_gate_are_not_checked(root: Path) -> None:
    put(root, "/etc/asr/theirs.env", uid=ASR)
    put(root, f"{ETC}/plain.service", "[Service]\nUser=asr\nEnvironmentFile=/etc/asr/theirs.env\n")
    install(root, "x.service", "User=asr")
    put(
        root,
        "/run/systemd/generator/x.service.d/gpuslice-gate.conf",
        "[Service]\nEnvironmentFile=-/tmp/x.env\n",
    )
    put(root, f"{ETC}/y.service.d/env.conf", "[Service]\nEnvironmentFile=/etc/asr/theirs.env\n")
    install(root, "y.service", "User=asr")
    result = scan(root)
    assert set(result.specs) == {"x.service"}
    assert [(p.unit, p.path) for p in result.problems] == [
        ("y.service", f"{ETC}/y.service.d/env.conf")
    ]


LONG_NAME = "/etc/asr/" + "a" * 260  # a name longer than the file system's 255 bytes


@pytest.mark.parametrize(
    ("make", "value", "reason"),
    [
        pytest.param(
            "fifo",
            "/etc/asr/fifo.env",
            "/etc/asr/fifo.env is a FIFO, not a regular file",
            id="fifo",
        ),
        pytest.param("dir", "/etc/asr", "/etc/asr is a directory, not a regular file", id="dir"),
        pytest.param(
            "to-dir",
            "/etc/asr/to-dir",
            "/etc/asr/to-dir: /etc/asr/real, reached through the symlink /etc/asr/to-dir, is a "
            "directory, not a regular file",
            id="link-to-dir",
        ),
        pytest.param(
            "loop",
            "/etc/asr/loop1",
            "/etc/asr/loop1 cannot be checked: more than 32 symlinks (a loop?)",
            id="loop",
        ),
        pytest.param(
            None,
            LONG_NAME,
            f"{LONG_NAME} cannot be checked: {LONG_NAME}: File name too long",
            id="long-name",
        ),
        pytest.param(
            None,
            "/a" * 10_000,
            "/a" * 100 + "... cannot be checked: longer than 4095 bytes",
            id="long-path",
        ),
        pytest.param(
            None,
            "asr.env",
            "asr.env is not an absolute path, which gpuslice cannot check",
            id="relative",
        ),
        pytest.param(
            None, "-", "- is not an absolute path, which gpuslice cannot check", id="dash"
        ),
        pytest.param(
            None,
            "/etc/asr/*.env",
            "/etc/asr/*.env cannot be checked: systemd reads it as a wildcard pattern (*, ?, [ "
            "or \\), which gpuslice does not expand; name each file",
            id="wildcard",
        ),
        pytest.param(
            None, "/etc/asr/%I", "/etc/asr/%I cannot be checked: it holds a NUL", id="nul"
        ),
        pytest.param(
            None,
            "/etc/%Z",
            "/etc/%Z cannot be checked: the specifier %Z has a value gpuslice does not work out "
            "(it knows %n %N %p %P %i %I %j %J %t %S %C %L %E %T %V %%)",
            id="unknown-specifier",
        ),
    ],
)
def test_hostile_paths_are_located_refusals(
    root: Path, make: str | None, value: str, reason: str
) -> None:
    """What cannot be checked, or is no regular file, is refused saying why, its fix to name
    a file by an absolute path (the messages are an admin's only guide)."""
    asr = root / "etc/asr"
    asr.mkdir(parents=True)
    if make == "fifo":
        os.mkfifo(asr / "fifo.env")
    elif make == "to-dir":
        (asr / "real").mkdir()
        (asr / "to-dir").symlink_to("real")
    elif make == "loop":
        (asr / "loop1").symlink_to("loop2")
        (asr / "loop2").symlink_to("loop1")
    # an instance whose %I holds a NUL: \x00 is valid in a unit name
    name = "x@a\\x00b.service"
    install(root, "x@.service", "User=asr", f"EnvironmentFile={value}")
    put(root, f"{ETC}/{name}.d/x.conf", "[Unit]\n")
    result = scan(root)  # never raises
    found = [str(p) for p in result.problems if p.unit == name and p.severity == "error"]
    assert found == [
        f"{ETC}/x@.service:5: [Service] EnvironmentFile: {reason}; {GATE} {name} until it "
        "names, by an absolute path, a file only root can change"
    ]


def test_odd_paths_of_roots_are_checked_like_any_other(root: Path) -> None:
    (root / "etc").mkdir()
    (root / "srv").mkdir()
    values = {
        "deep.service": "-" + "/a" * 2_000,  # 2,000 components, not there: only root makes /a
        "percent.service": "-/etc/%",  # a lone % stays, as in systemd
        "users.service": "-/srv" + "/a" * 2_000,
    }
    os.chown(root / "srv", ASR, ASR)
    for name, value in values.items():
        install(root, name, "User=asr", f"EnvironmentFile={value}")
    result = scan(root)
    assert set(result.specs) == {"deep.service", "percent.service"}
    [problem] = result.problems
    assert f"its directory /srv is owned by UID {ASR}" in str(problem)


def test_a_failure_of_the_walk_is_a_refusal_not_an_exception(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RecursionError

    """Whatever the walk raises is a refusal naming the exception, the value cut at 200
    characters as in every other refusal; for a unit run as root too (a root template's
    check of where its instances may lead it raised: taken for root's own, unsaid)."""
    value = "/etc/asr/" + "a" * 250
    install(root, "x.service", "User=asr", f"EnvironmentFile={value}")
    install(root, "r@.service", "EnvironmentFile=/etc/asr/%i.env")
    monkeypatch.setattr(EnvFileChecker, "_walk", boom)
    monkeypatch.setattr(EnvFileChecker, "_tree", boom)
    monkeypatch.setattr(EnvFileChecker, "_entries_of", boom)
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] EnvironmentFile: {value[:200]}... cannot be checked "
        f"(RecursionError); {GATE} x.service until it names, by an absolute path, a file only "
        "root can change"
    ]
    [error] = errors(root, "r@.service")
    assert "/etc/asr/%i.env cannot be checked (RecursionError)" in error


def test_a_failure_of_the_loader_or_mount_checks_is_a_refusal_not_an_exception(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RecursionError

    install(root, "x.service", "User=asr", "BindPaths=/a:/b", "Environment=A=1")
    monkeypatch.setattr(EnvFileChecker, "_mount_refusal", boom)
    monkeypatch.setattr(EnvFileChecker, "_split", boom)
    said = (
        f"x.service cannot be checked (RecursionError); {GATE} x.service until it names, by an "
        "absolute path, a file only root can change"
    )
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:6: [Service] Environment: {said}",
        f"{ETC}/x.service:5: [Service] BindPaths: {said}",
    ]


def test_a_shared_file_is_walked_once_per_scan(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    put(root, "/etc/asr/ours.env")
    for i in range(50):
        install(root, f"j{i}.service", "User=asr", "EnvironmentFile=/etc/asr/ours.env")
        install(root, f"k{i}.service", "User=asr", f"EnvironmentFile=-/etc/asr/k{i}.env")
    calls: list[str] = []
    real_lstat = os.lstat

    def counting(path: str, *args: object, **kwargs: object) -> os.stat_result:
        calls.append(os.fspath(path))
        return real_lstat(path)

    monkeypatch.setattr(os, "lstat", counting)
    result = scan(root)
    assert len(result.specs) == 100 and result.problems == []
    # /etc, /etc/asr once; ours.env once; each k*.env once
    assert sorted(c for c in calls if c.startswith(f"{root}/")) == sorted(
        [str(root / "etc"), str(root / "etc/asr"), str(root / "etc/asr/ours.env")]
        + [str(root / f"etc/asr/k{i}.env") for i in range(50)]
    )
    assert calls.count(str(root)) <= 2  # / once, and once as the checker resolves its root


def test_a_symlink_is_read_and_a_directory_checked_once_per_scan(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10,000 files in one directory cost one walk of its parents: each directory above a
    file is checked once per scan, and each symlink read once."""
    (root / "etc/asr/deep/er").mkdir(parents=True)
    link(root, "/etc/asr/conf", "deep/er")
    read: list[str] = []
    checked: list[str] = []
    real_readlink, real_component = os.readlink, EnvFileChecker._component

    def readlink(path: str) -> str:
        read.append(path)
        return real_readlink(path)

    def component(
        self: EnvFileChecker, shown: str, here: str, st: os.stat_result, via: str, last: bool
    ) -> Refusal | None:
        checked.append(here)
        return real_component(self, shown, here, st, via, last)

    checker = EnvFileChecker(root)
    monkeypatch.setattr(os, "readlink", readlink)
    monkeypatch.setattr(EnvFileChecker, "_component", component)
    for i in range(20):
        assert checker.refusal("x.service", f"-/etc/asr/deep/er/k{i}.env") is None
    directories = Counter(checked)
    del directories["/"]
    assert directories == {"/etc": 1, "/etc/asr": 1, "/etc/asr/deep": 1, "/etc/asr/deep/er": 1}
    for i in range(20):
        assert checker.refusal("x.service", f"-/etc/asr/conf/k{i}.env") is None
    assert read == [str(root / "etc/asr/conf")]


def test_the_limits_hold_at_their_boundaries(root: Path) -> None:
    """32 symlinks (systemd's), 1024 components walked and 4095 bytes (PATH_MAX with its
    NUL) are checked; one more of any is refused, as what cannot be checked."""
    put(root, "/etc/asr/ours.env")
    for i in range(33):  # l0 -> l1 -> ... -> l32 -> ours.env
        link(root, f"/etc/asr/l{i}", f"l{i + 1}" if i < 32 else "ours.env")
    checker = EnvFileChecker(root)
    assert checker.refusal("x.service", "/etc/asr/l1") is None
    assert checker.refusal("x.service", "/etc/asr/l0") == Refusal(
        "/etc/asr/l0 cannot be checked: more than 32 symlinks (a loop?)", FIX_PATH
    )
    components = "/etc/asr" + "/." * 1021 + "/ours.env"  # . is a component walked
    assert checker.refusal("x.service", components) is None
    more = "/etc/asr" + "/." * 1022 + "/ours.env"
    assert checker.refusal("x.service", more) == Refusal(
        f"{more[:300]}... cannot be checked: more than 1024 path components to walk, "
        "symlinks' targets included",
        FIX_PATH,
    )
    longest = "/a" * 2046 + "/bc"  # /a is not there: only root can make it
    assert len(longest) == 4095 and checker.refusal("x.service", longest) is None
    assert checker.refusal("x.service", "/a" * 2048) == Refusal(
        "/a" * 100 + "... cannot be checked: longer than 4095 bytes", FIX_PATH
    )


def test_dot_and_dot_dot_are_walked_as_the_kernel_resolves_them(root: Path) -> None:
    """`.` stays where the walk is and `..` goes up from there; a refusal names the path as
    written and, when it differs, the file the walk reached."""
    put(root, "/etc/asr/ours.env")
    put(root, "/etc/asr/theirs.env", uid=ASR)
    checker = EnvFileChecker(root)
    assert checker.refusal("x.service", "/etc/./asr/../asr/ours.env") is None
    for value in ("/etc/asr/../asr/theirs.env", "/etc/./asr/theirs.env"):
        assert checker.refusal("x.service", value) == Refusal(
            f"{value}: /etc/asr/theirs.env is owned by UID {ASR}, who can change it", FIX_OWNERS
        )
    # /etc/asr was walked above: a name after it that is no file's is still walked
    for value, reached in [
        ("/", "/"),
        ("/etc/..", "/"),
        ("/etc/asr/", "/etc/asr"),
        ("/etc/asr/.", "/etc/asr"),
    ]:
        subject = value if value == reached else f"{value}: {reached}"
        assert checker.refusal("x.service", value) == Refusal(
            f"{subject} is a directory, not a regular file", FIX_PATH
        )


def test_a_path_through_a_user_tree_is_refused_however_it_is_written(root: Path) -> None:
    """A path whose walk meets a user tree is refused, naming the tree; `by way of` only
    when the path as written does not start with it and the walk reached it otherwise."""
    put(root, "/etc/asr/ours.env")
    (root / "run").mkdir()
    link(root, "/etc/asr/to-run", "/run")
    checker = EnvFileChecker(root)
    for value, tree in [
        ("/home", "/home"),
        ("/etc/../home/asr.env", "/home"),
        ("/home/../etc/asr/ours.env", "/home"),
        ("/etc/asr/to-run/user/1000/x.env", "/run/user (by way of /run/user)"),
    ]:
        assert checker.refusal("x.service", value) == Refusal(
            f"{value} is under {tree}, {TREE} at boot", FIX_TREE
        )


def test_the_scans_root_directory_is_walked_like_any_other(root: Path) -> None:
    """The root of the scan is the first directory of every walk: another UID's is refused,
    root's group-writable by GID 0 is fine, and one that is not there cannot be checked."""
    put(root, "/etc/asr/ours.env")
    os.chown(root, ASR, ASR)
    assert EnvFileChecker(root).refusal("x.service", "/etc/asr/ours.env") == Refusal(
        f"/etc/asr/ours.env: its directory / is owned by UID {ASR}, who can change it",
        FIX_OWNERS,
    )
    os.chown(root, 0, 0)
    root.chmod(0o775)
    assert EnvFileChecker(root).refusal("x.service", "/etc/asr/ours.env") is None
    assert EnvFileChecker(root / "gone").refusal("x.service", "/etc/asr/ours.env") == Refusal(
        "/etc/asr/ours.env cannot be checked: /: No such file or directory", FIX_PATH
    )


@pytest.mark.parametrize("name", ["image", "image/", "imageX", "image "])
def test_the_root_is_taken_as_named(tmp_path: Path, name: str) -> None:
    """Paths are looked up under the root as it is named (a trailing slash aside)."""
    tmp_path.chmod(0o755)
    image = tmp_path / name.rstrip("/")
    image.mkdir(mode=0o755)
    put(image, "/etc/asr/theirs.env", uid=ASR)
    assert EnvFileChecker(f"{tmp_path}/{name}").refusal("x.service", "/etc/asr/theirs.env") == (
        Refusal(f"/etc/asr/theirs.env is owned by UID {ASR}, who can change it", FIX_OWNERS)
    )


def test_a_root_named_through_a_symlink_is_its_target(tmp_path: Path) -> None:
    """A root named through a symlink is the directory it leads to (the symlink itself,
    mode 0777, was taken for a directory anyone can write: every file was refused)."""
    tmp_path.chmod(0o755)
    image = tmp_path / "image"
    image.mkdir(mode=0o755)
    put(image, "/etc/asr/ours.env")
    (tmp_path / "link").symlink_to("image")
    assert EnvFileChecker(tmp_path / "link").refusal("x.service", "/etc/asr/ours.env") is None


def test_the_default_root_is_the_systems() -> None:
    """Without a root, paths are the system's own (the host's / is a directory of root's)."""
    assert EnvFileChecker().refusal("x.service", "/") == Refusal(
        "/ is a directory, not a regular file", FIX_PATH
    )


def test_a_symlink_that_cannot_be_read_is_refused_naming_it(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symlink that cannot be read (replaced by a file between its lstat and its readlink:
    EINVAL) is refused, naming it and why."""
    put(root, "/etc/asr/ours.env")
    link(root, "/etc/asr/asr.env", "ours.env")

    def readlink(path: str) -> str:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    checker = EnvFileChecker(root)
    monkeypatch.setattr(os, "readlink", readlink)
    assert checker.refusal("x.service", "/etc/asr/asr.env") == Refusal(
        "/etc/asr/asr.env cannot be checked: the symlink /etc/asr/asr.env cannot be read: "
        "Invalid argument",
        FIX_PATH,
    )


def test_run_as_collects_as_systemd_reads() -> None:
    run_as = RunAs()
    for key, value in [
        ("User", "asr"),
        ("EnvironmentFile", "/a"),
        ("EnvironmentFile", ""),
        ("EnvironmentFile", "-/b"),
        ("DynamicUser", "yes"),
        ("DynamicUser", "off"),
        ("User", ""),
    ]:
        run_as.assign("/f", Entry("Service", key, value, 1))
    assert run_as.env_files == [envsafety.Assignment("/f", 1, "-/b")]
    assert not run_as.other_user()


# ---------------------------------------------------------------------------------------------
# the loader's paths: the gate's /bin/sh loads what LD_LIBRARY_PATH=, LD_PRELOAD=, ... name,
# as root, before its first line

LOADER = (
    "until only root can change each path it names (a directory and everything in it), named "
    "by an absolute path"
)
CUDA = "/usr/local/cuda/lib64"


def cuda(root: Path) -> None:
    """A CUDA toolkit as its installer leaves it, root's: links to the version, to the
    target's lib directory, between a library's names, and a subdirectory."""
    lib = "/usr/local/cuda-12.4/targets/x86_64-linux/lib"
    put(root, f"{lib}/libcudart.so.12.4.99", "elf")
    link(root, f"{lib}/libcudart.so.12", "libcudart.so.12.4.99")
    put(root, f"{lib}/stubs/libcuda.so", "elf")
    link(root, "/usr/local/cuda-12.4/lib64", "targets/x86_64-linux/lib")
    link(root, "/usr/local/cuda", "/usr/local/cuda-12.4")


def test_a_users_library_path_leaves_a_unit_run_as_that_user_unmanaged(root: Path) -> None:
    """`User=asr` plus a root-written `LD_LIBRARY_PATH=/home/asr/cuda/lib64` (a classic CUDA
    setup): the gate's /bin/sh loaded asr's libc.so.6 as root. A unit run as root loads it as
    root anyway: not checked. A toolkit only root can change is fine."""
    cuda(root)
    install(root, "asr.service", "User=asr", "Environment=LD_LIBRARY_PATH=/home/asr/cuda/lib64")
    install(root, "rooted.service", "Environment=LD_LIBRARY_PATH=/home/asr/cuda/lib64")
    install(root, "toolkit.service", "User=asr", f"Environment=LD_LIBRARY_PATH={CUDA}:/opt/x")
    assert errors(root, "asr.service") == [
        f"{ETC}/asr.service:5: [Service] Environment: LD_LIBRARY_PATH=/home/asr/cuda/lib64: "
        f"/home/asr/cuda/lib64 is under /home, {TREE} at boot; {GATE} asr.service {LOADER}"
    ]
    assert errors(root, "rooted.service") == []
    assert errors(root, "toolkit.service") == []


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("LD_PRELOAD", "/opt/hook/libhook.so", "/opt/hook/libhook.so is owned by UID 1000"),
        ("LD_PRELOAD", "libc.so.6 /opt/hook/libhook.so", "/opt/hook/libhook.so is owned"),
        ("LD_PRELOAD", "libc.so.6::/opt/hook/libhook.so", "/opt/hook/libhook.so is owned"),
        ("LD_AUDIT", "/opt/hook/libhook.so", "/opt/hook/libhook.so is owned by UID 1000"),
        ("LD_LIBRARY_PATH", "/opt/hook", "/opt/hook/libhook.so is owned by UID 1000"),
        ("LD_LIBRARY_PATH", f"{CUDA};/opt/hook", "/opt/hook/libhook.so is owned"),
        ("GCONV_PATH", "/opt/hook", "/opt/hook/libhook.so is owned by UID 1000"),
        ("LOCPATH", "/opt/hook", "/opt/hook/libhook.so is owned by UID 1000"),
        ("LD_LIBRARY_PATH", f"{CUDA}:", "its empty element is the current directory"),
        ("LD_LIBRARY_PATH", f":{CUDA}", "its empty element is the current directory"),
        ("LD_LIBRARY_PATH", f"{CUDA}::/usr/lib", "its empty element is the current directory"),
        ("LD_LIBRARY_PATH", "lib64", "lib64 is relative to the current directory"),
        ("LD_PRELOAD", "hook/libhook.so", "hook/libhook.so is relative to the current directory"),
        ("LD_LIBRARY_PATH", "$ORIGIN/../lib", "the dynamic loader expands $ORIGIN"),
        ("LD_PRELOAD", "/opt/${LIB}/libhook.so", "the dynamic loader expands $ORIGIN"),
        ("LD_LIBRARY_PATH", "/opt/hook/libhook.so", "/opt/hook/libhook.so is owned by UID"),
        ("LD_PRELOAD", "/opt/hook", "/opt/hook is a directory, not a regular file"),
    ],
)
def test_each_loader_path_is_checked_as_the_loader_reads_it(
    root: Path, variable: str, value: str, said: str
) -> None:
    """Directories (LD_LIBRARY_PATH split at `:` and `;`, GCONV_PATH, LOCPATH) with all they
    hold; files (LD_PRELOAD split at blanks and `:`, LD_AUDIT), a bare name being looked up
    in those directories. An empty directory element is the current directory, the unit's
    WorkingDirectory= (a home, maybe); `$ORIGIN`, `$LIB`, `$PLATFORM` are expanded by the
    loader."""
    cuda(root)
    put(root, "/opt/hook/libhook.so", "elf", uid=ASR)
    install(root, "x.service", "User=asr", f'Environment="{variable}={value}"')
    [error] = errors(root, "x.service")
    assert error.startswith(f"{ETC}/x.service:5: [Service] Environment: {variable}={value}: ")
    assert said in error
    assert error.endswith(f"{GATE} x.service {LOADER}")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("LD_LIBRARY_PATH", ""),  # an empty list: glibc ignores it
        ("LD_LIBRARY_PATH", CUDA),
        ("LD_LIBRARY_PATH", "/usr/local/cuda-12.4/targets/x86_64-linux/lib/libcudart.so.12"),
        ("LD_LIBRARY_PATH", "/opt/not-there/lib"),  # only root can make it
        ("LD_PRELOAD", "libhook.so"),  # a name, looked up in the directories checked
        ("LD_PRELOAD", " libhook.so: :"),  # empty elements skipped
        ("LD_PRELOAD", f"{CUDA}/libcudart.so.12"),
        ("GCONV_PATH", "/usr/local/cuda-12.4"),
        ("OTHER_PATH", "/home/asr/x:"),  # not the loader's
    ],
)
def test_loader_paths_only_root_can_change_are_managed(
    root: Path, variable: str, value: str
) -> None:
    cuda(root)
    install(root, "x.service", "User=asr", f'Environment="{variable}={value}"')
    assert errors(root, "x.service") == []


def test_what_a_loader_directory_holds_is_checked_at_any_depth(root: Path) -> None:
    """The loader opens files in it and in subdirectories (glibc-hwcaps/x86-64-v3/, tls/):
    each entry, symlinks followed, must be root's alone too."""
    cuda(root)
    lib = "/usr/local/cuda-12.4/targets/x86_64-linux/lib"
    install(root, "x.service", "User=asr", f"Environment=LD_LIBRARY_PATH={CUDA}")
    put(root, "/opt/asr/libc.so.6", "elf", uid=ASR)
    link(root, f"{lib}/glibc-hwcaps/x86-64-v3/libc.so.6", "/opt/asr/libc.so.6")
    [error] = errors(root, "x.service")
    assert f"{ETC}/x.service:5: [Service] Environment: LD_LIBRARY_PATH={CUDA}: " in error
    assert f"{lib}/glibc-hwcaps/x86-64-v3/libc.so.6: /opt/asr/libc.so.6, reached through " in error
    assert f"is owned by UID {ASR}" in error
    os.unlink(root / f"{lib[1:]}/glibc-hwcaps/x86-64-v3/libc.so.6")
    (root / f"{lib[1:]}/glibc-hwcaps").chmod(0o777)  # anyone may put a libc.so.6 in
    [error] = errors(root, "x.service")
    assert f"{lib}/glibc-hwcaps is writable by anyone (mode 0777)" in error
    (root / f"{lib[1:]}/glibc-hwcaps").chmod(0o755)
    link(root, f"{lib}/loop", ".")  # a link back up is walked once
    assert errors(root, "x.service") == []


def test_a_loader_directory_too_large_to_walk_is_refused(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda(root)
    monkeypatch.setattr(envsafety, "MAX_TREE", 3)  # the toolkit has 4 entries
    install(root, "x.service", "User=asr", f"Environment=LD_LIBRARY_PATH={CUDA}")
    [error] = errors(root, "x.service")
    assert f"{CUDA} cannot be checked: more than 3 entries in it and its directories" in error
    monkeypatch.setattr(envsafety, "MAX_TREE", 4)
    assert errors(root, "x.service") == []


def test_a_refused_file_is_named_as_written_then_as_its_specifiers_make_it(root: Path) -> None:
    """An admin looks for the unit's `EnvironmentFile=-%S/asr/env`: a message that named only
    /var/lib/asr/env sent them looking for a line no unit has. A value without specifiers
    (a `-` aside) names its file once."""
    put(root, "/var/lib/asr/env", uid=ASR)
    put(root, "/etc/asr/asr.env", "LD_PRELOAD=/home/asr/x.so\n")
    put(root, "/etc/asr/big.env", "A=1\n" * 300_000)  # over MAX_ENV_FILE
    install(
        root,
        "x.service",
        "User=asr",
        "EnvironmentFile=-%S/asr/env",
        "EnvironmentFile=-/var/lib/asr/env",
        "EnvironmentFile=%t/user/1000/env",
        "EnvironmentFile=-%E/asr/asr.env",
        "EnvironmentFile=%E/asr/big.env",
        "EnvironmentFile=-%E/asr/*.env",
    )
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] EnvironmentFile: -%S/asr/env (/var/lib/asr/env) is "
        f"owned by UID {ASR}, who can change it; {GATE} x.service until only root can change "
        "that file and its directories",
        f"{ETC}/x.service:6: [Service] EnvironmentFile: /var/lib/asr/env is owned by UID "
        f"{ASR}, who can change it; {GATE} x.service until only root can change that file and "
        "its directories",
        f"{ETC}/x.service:7: [Service] EnvironmentFile: %t/user/1000/env (/run/user/1000/env) "
        f"is under /run/user, {TREE} at boot; {GATE} x.service until it names a file "
        "elsewhere, that only root can change",
        f"{ETC}/x.service:9: [Service] EnvironmentFile: %E/asr/big.env (/etc/asr/big.env) "
        f"cannot be checked: larger than {envsafety.MAX_ENV_FILE} bytes; {GATE} x.service "
        "until it names, by an absolute path, a file only root can change",
        f"{ETC}/x.service:10: [Service] EnvironmentFile: -%E/asr/*.env cannot be checked: "
        "systemd reads it as a wildcard pattern (*, ?, [ or \\), which gpuslice does not "
        f"expand; name each file; {GATE} x.service until it names, by an absolute path, a "
        "file only root can change",
        f"{ETC}/x.service:8: [Service] EnvironmentFile: LD_PRELOAD=/home/asr/x.so (set in "
        "-%E/asr/asr.env, that is /etc/asr/asr.env): /home/asr/x.so is under /home, "
        f"{TREE} at boot; {GATE} x.service {LOADER}",
    ]


def test_a_path_of_roots_is_no_setting_value(root: Path) -> None:
    """`path_refusal` (cuda-checkpoint's path, which gpuslice runs as root): a `%`, `*` or
    `[` in it is part of the name, no specifier or wildcard."""
    put(root, "/opt/cuda[12]/100%/cuda-checkpoint")
    put(root, "/opt/x*/cuda-checkpoint", uid=ASR)
    checker = EnvFileChecker(root)
    assert checker.path_refusal("/opt/cuda[12]/100%/cuda-checkpoint") is None
    assert checker.path_refusal("/opt/x*/cuda-checkpoint") == Refusal(
        f"/opt/x*/cuda-checkpoint is owned by UID {ASR}, who can change it", FIX_OWNERS
    )


OUTPUT = "until it names, by an absolute path, a place only root can change"


def test_a_users_directory_the_loader_writes_in_leaves_the_unit_unmanaged(root: Path) -> None:
    """The gate's /bin/sh, dbus-send, sleep and systemctl write as root where LD_DEBUG_OUTPUT=
    (FILE.PID) and LD_PROFILE_OUTPUT= (LIB.profile; /var/tmp where empty) say:
    asr makes /srv/asr a symlink to /etc, and root creates files there."""
    put(root, "/srv/asr/keep", uid=ASR)
    os.chown(root / "srv/asr", ASR, ASR)
    install(root, "x.service", "User=asr", "Environment=LD_DEBUG=all LD_DEBUG_OUTPUT=/srv/asr/d")
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] Environment: LD_DEBUG_OUTPUT=/srv/asr/d: the gate's "
        "programs would write /srv/asr/d.PID as root, and /srv/asr is owned by UID 1000, who "
        f"can change it; {GATE} x.service {OUTPUT}"
    ]


@pytest.mark.parametrize(
    ("assignments", "said"),
    [
        ("LD_DEBUG_OUTPUT=/srv/asr/d", "write /srv/asr/d.PID as root, and /srv/asr is owned"),
        ("LD_DEBUG_OUTPUT=/home/asr/d", "/home/asr/d.PID as root, and /home/asr is under /home"),
        ("LD_DEBUG_OUTPUT=d", "write d.PID as root, relative to the current directory"),
        ("LD_DEBUG_OUTPUT=", "write .PID as root, relative to the current directory"),
        ("LD_PROFILE_OUTPUT=/srv/asr", "/srv/asr/LIBRARY.profile as root, and /srv/asr is"),
        ("LD_PROFILE_OUTPUT=", "write /var/tmp/LIBRARY.profile as root, and /var/tmp is under"),
        ("LD_PROFILE=libc.so.6", "write /var/tmp/LIBRARY.profile as root, and /var/tmp is under"),
        ("LD_PROFILE=libc.so.6 LD_PROFILE_OUTPUT=/srv/asr", "/srv/asr/LIBRARY.profile as root"),
        ("LD_DEBUG_OUTPUT=/etc/t/d", "/etc/t/d.PID as root, and /etc/t: /srv/asr, reached "),
        ("LD_DEBUG_OUTPUT=/" + "d" * 4091, "ddd... as root: longer than 4095 bytes"),
    ],
)
def test_each_path_the_gates_programs_write_is_checked(
    root: Path, assignments: str, said: str
) -> None:
    """The directory of the file the loader opens (O_NOFOLLOW), symlinks followed: root's
    /etc/t pointing into asr's directory counts as asr's."""
    put(root, "/srv/asr/keep", uid=ASR)
    os.chown(root / "srv/asr", ASR, ASR)
    link(root, "/etc/t", "/srv/asr/t")
    install(root, "x.service", "User=asr", f"Environment={assignments}")
    [error] = errors(root, "x.service")
    assert said in error
    assert error.endswith(f"{GATE} x.service {OUTPUT}")


@pytest.mark.parametrize(
    "assignments",
    [
        "LD_DEBUG=all LD_DEBUG_OUTPUT=/var/log/gpu/d",
        "LD_PROFILE=libc.so.6 LD_PROFILE_OUTPUT=/var/log",
        "LD_PROFILE=",  # ignored by glibc
        "MALLOC_TRACE=/home/asr/trace",  # mtrace(3), which none of the gate's programs calls
        "LANG=/home/asr/locale LANGUAGE=/home/asr/x",  # looked for under /usr/lib/locale/
        "LD_BIND_NOW=1 MALLOC_ARENA_MAX=2 GLIBC_TUNABLES=glibc.malloc.check=3 TMPDIR=/tmp",
    ],
)
def test_written_paths_only_root_can_change_are_managed(root: Path, assignments: str) -> None:
    put(root, "/var/log/keep")
    install(root, "x.service", "User=asr", f"Environment={assignments}")
    assert errors(root, "x.service") == []


def test_a_written_directory_that_does_not_answer_is_refused_until_it_does(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = EnvFileChecker._ask

    def ask(self: EnvFileChecker, fn: Callable[[str], T], path: str) -> object:
        if path.startswith("/srv/nfs"):
            return envsafety._Unanswered("/srv/nfs")
        return real(self, fn, path)

    monkeypatch.setattr(EnvFileChecker, "_ask", ask)
    put(root, "/srv/nfs/keep")
    install(root, "x.service", "User=asr", "Environment=LD_DEBUG_OUTPUT=/srv/nfs/d")
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] Environment: LD_DEBUG_OUTPUT=/srv/nfs/d: the gate's "
        "programs would write /srv/nfs/d.PID as root, and /srv/nfs cannot be checked: "
        f"/srv/nfs did not answer within {envsafety.DEADLINE:g} s (a network file system not "
        f"answering?); {GATE} x.service until that file system answers at a later scan "
        "(systemctl daemon-reload)"
    ]


def test_a_written_path_in_an_environment_file_names_the_file(root: Path) -> None:
    put(root, "/etc/asr/asr.env", "LD_DEBUG=files\nLD_DEBUG_OUTPUT=/home/asr/ld\n")
    install(root, "x.service", "User=asr", "EnvironmentFile=/etc/asr/asr.env")
    install(root, "root.service", "EnvironmentFile=/etc/asr/asr.env")  # writes as root anyway
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] EnvironmentFile: LD_DEBUG_OUTPUT=/home/asr/ld (set in "
        "/etc/asr/asr.env): the gate's programs would write /home/asr/ld.PID as root, and "
        f"/home/asr is under /home, {TREE} at boot; {GATE} x.service {OUTPUT}"
    ]
    assert errors(root, "root.service") == []


def test_a_value_read_from_an_environment_file_is_left_out_of_the_public_message(
    root: Path,
) -> None:
    """Status shows anyone the problems (Problem.public): a value of root's 0600 file,
    which systemd shows no one else, is for root's eyes (`str`: the journal, `gpuslice
    check`), the whole line of it, more than the path refused. A value of the unit file's
    own (systemctl show says it to anyone) stays in both."""
    put(root, "/etc/job/x.env", "LD_PRELOAD=/home/asr/x.so TOKEN=s3cret\n", mode=0o600)
    put(root, "/etc/job/debug.env", "LD_DEBUG=help,s3cret\n", mode=0o600)
    put(root, "/etc/job/out.env", "LD_DEBUG_OUTPUT=/home/asr/s3cret\n", mode=0o600)
    install(
        root,
        "x.service",
        "User=asr",
        "EnvironmentFile=/etc/job/x.env",
        "EnvironmentFile=/etc/job/debug.env",
        "EnvironmentFile=-%E/job/out.env",
        "Environment=LD_AUDIT=/home/asr/a.so",
    )
    spec, problems = load_spec("x.service", root)
    assert spec is None
    said = {p.line: (str(p), p.public()) for p in problems}
    assert sorted(said) == [5, 6, 7, 8]
    assert all("s3cret" in text for text, _ in (said[5], said[6], said[7]))
    assert all("s3cret" not in public for _, public in said.values())
    assert said[8][1] == said[8][0]  # Environment=: the unit file's own
    assert [said[line][1] for line in (5, 6, 7)] == [
        f"{ETC}/x.service:5: [Service] EnvironmentFile: LD_PRELOAD=... (set in /etc/job/x.env; "
        "its value is shown to root alone): the gate's programs would load code from what it "
        f"names as root, which someone but root can change or gpuslice cannot check; {GATE} "
        f"x.service {LOADER}",
        f"{ETC}/x.service:6: [Service] EnvironmentFile: LD_DEBUG=... (set in "
        "/etc/job/debug.env; its value is shown to root alone): glibc's loader prints "
        "LD_DEBUG's options and exits 0 instead of running the program, so gpuslice's gate "
        f"would let the start through without asking for its GPUs; {GATE} x.service until its "
        "environment does not set it so",
        f"{ETC}/x.service:7: [Service] EnvironmentFile: LD_DEBUG_OUTPUT=... (set in "
        "-%E/job/out.env, that is /etc/job/out.env; its value is shown to root alone): the "
        "gate's programs would write to what it names as root, which someone but root can "
        f"change or gpuslice cannot check; {GATE} x.service {OUTPUT}",
    ]


def test_environment_is_read_as_systemd_reads_it(root: Path) -> None:
    """Quotes, several assignments on a line, C escapes, the later assignment winning, an
    empty Environment= resetting the list, a syntax error dropping the rest of its line, and
    UnsetEnvironment= (a name, or that very assignment) applied last."""
    bad = "LD_PRELOAD=/home/asr/x.so"
    cases = {
        # name: (lines, refused)
        "quoted.service": ([f'Environment=A=1 "{bad}" B=2'], True),
        "escaped.service": (["Environment=LD_PRELOAD=\\x2fhome/asr/x.so"], True),
        "later-wins.service": ([f"Environment={bad}", "Environment=LD_PRELOAD="], False),
        "later-bad.service": (["Environment=LD_PRELOAD=", f"Environment=A=1 {bad}"], True),
        "reset.service": ([f"Environment={bad}", "Environment="], False),
        "syntax.service": ([f"Environment=A=\\q {bad}"], False),  # systemd ignores it too
        "before-syntax.service": ([f"Environment={bad} A=\\q"], True),
        "unset.service": ([f"Environment={bad}", "UnsetEnvironment=LD_PRELOAD"], False),
        "unset-that.service": ([f"Environment={bad}", f"UnsetEnvironment={bad}"], False),
        "unset-other.service": ([f"Environment={bad}", "UnsetEnvironment=LD_PRELOAD=/y"], True),
        "unset-reset.service": (
            [f"Environment={bad}", "UnsetEnvironment=LD_PRELOAD", "UnsetEnvironment="],
            True,
        ),
        "specifier.service": (["Environment=LD_PRELOAD=%t/x.so"], False),  # /run/x.so
        "unknown.service": (["Environment=LD_PRELOAD=%h/x.so"], True),  # %h: not known here
        "named.service": (["Environment=%p=1"], False),  # named.service's %p: `named`
    }
    for name, (lines, _) in cases.items():
        install(root, name, "User=asr", *lines)
    refused = {name for name in cases if errors(root, name)}
    assert refused == {name for name, (_, bad_one) in cases.items() if bad_one}
    [error] = errors(root, "unknown.service")
    assert error == (
        f"{ETC}/unknown.service:5: [Service] Environment: LD_PRELOAD=%h/x.so cannot be "
        "checked: the specifier %h has a value gpuslice does not work out (it knows %n %N %p "
        f"%P %i %I %j %J %t %S %C %L %E %T %V %%); {GATE} unknown.service until it names, by "
        "an absolute path, a file only root can change"
    )
    [error] = errors(root, "later-bad.service")
    assert error.startswith(f"{ETC}/later-bad.service:6: [Service] Environment: {bad}: ")


def test_a_loader_path_in_an_environment_file_only_root_can_change(root: Path) -> None:
    """The file is root's alone, what it says is not: located at the EnvironmentFile= line,
    naming the file. Its assignment wins over Environment=, a later file's over its own."""
    put(root, "/etc/asr/asr.env", "# the job\nLD_PRELOAD='/home/asr/x.so'\nA=1\n")
    put(root, "/etc/asr/fix.env", 'LD_PRELOAD=""\n')
    install(root, "x.service", "User=asr", "EnvironmentFile=/etc/asr/asr.env")
    install(
        root,
        "fixed.service",
        "User=asr",
        "EnvironmentFile=/etc/asr/asr.env",
        "EnvironmentFile=-/etc/asr/fix.env",
    )
    install(
        root,
        "overridden.service",
        "User=asr",
        "Environment=LD_PRELOAD=",
        "EnvironmentFile=/etc/asr/asr.env",
    )
    install(root, "missing.service", "User=asr", "EnvironmentFile=-/etc/asr/none.env")
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] EnvironmentFile: LD_PRELOAD=/home/asr/x.so (set in "
        f"/etc/asr/asr.env): /home/asr/x.so is under /home, {TREE} at boot; {GATE} x.service "
        f"{LOADER}"
    ]
    assert errors(root, "fixed.service") == []
    assert len(errors(root, "overridden.service")) == 1
    assert errors(root, "missing.service") == []


def test_a_variable_with_which_the_gate_exits_0_without_asking_is_refused(root: Path) -> None:
    """LD_TRACE_LOADED_OBJECTS (any value, empty too; LD_TRACE_PRELINKING before glibc 2.36)
    and LD_DEBUG=help have glibc's loader exit 0 instead of running the gate's /bin/sh, and
    SHELLOPTS=noexec (or onecmd) a /bin/sh that is bash read the gate without running it (or
    run its first line alone): the start went on without asking, a static job ran ungated.
    Other LD_DEBUG and SHELLOPTS values, and what UnsetEnvironment= takes away, are fine."""
    put(root, "/etc/asr/asr.env", "LD_TRACE_LOADED_OBJECTS=\n")
    cases = {
        # name: (lines, refused)
        "trace.service": (["Environment=LD_TRACE_LOADED_OBJECTS=1"], True),
        "trace-0.service": (["Environment=LD_TRACE_LOADED_OBJECTS=0"], True),
        "trace-file.service": (["EnvironmentFile=/etc/asr/asr.env"], True),
        "trace-unset.service": (
            ["Environment=LD_TRACE_LOADED_OBJECTS=1", "UnsetEnvironment=LD_TRACE_LOADED_OBJECTS"],
            False,
        ),
        "help.service": (["Environment=LD_DEBUG=libs,help"], True),
        "help-spaced.service": (['Environment="LD_DEBUG=files help"'], True),
        "debug.service": (["Environment=LD_DEBUG=libs,helper"], False),
        "noexec.service": (["Environment=SHELLOPTS=xtrace:noexec"], True),
        # bash runs the gate's first command (PATH=...), then exits with its status, 0
        "onecmd.service": (["Environment=SHELLOPTS=onecmd"], True),
        "xtrace.service": (["Environment=SHELLOPTS=xtrace"], False),
        # glibc before 2.36 (Ubuntu 22.04, RHEL 9): ldd's trace mode too, whatever the value
        "prelink.service": (["Environment=LD_TRACE_PRELINKING="], True),
    }
    for name, (lines, _) in cases.items():
        install(root, name, "User=asr", *lines)
    refused = {name for name in cases if errors(root, name)}
    assert refused == {name for name, (_, bad_one) in cases.items() if bad_one}
    assert errors(root, "trace-file.service") == [
        f"{ETC}/trace-file.service:5: [Service] EnvironmentFile: LD_TRACE_LOADED_OBJECTS= (set "
        "in /etc/asr/asr.env): glibc's loader lists a program's libraries and exits 0 instead "
        "of running it, whatever the value, so gpuslice's gate would let the start through "
        f"without asking for its GPUs; {GATE} trace-file.service until its environment does "
        "not set it so"
    ]
    [error] = errors(root, "noexec.service")
    assert (
        "a /bin/sh that is bash reads the gate without running it (noexec), or runs its first "
        "command alone (onecmd), and exits 0" in error
    )


def test_a_unit_run_as_root_whose_environment_skips_the_gate_is_not_managed(root: Path) -> None:
    """A unit run as root gains nothing by LD_TRACE_LOADED_OBJECTS=, LD_DEBUG=help or
    SHELLOPTS=noexec, but its gate exited 0 unasked and it ran ungated, on GPUs another job
    holds, without a word: a located error says why it is not managed instead. Its
    environment file is read where it is root's alone; one a user can change (a unit of
    root's may read it, as root) or under /home is refused whatever it holds now: they could
    add LD_TRACE_LOADED_OBJECTS=1 after the scan. Its loader paths and a specifier gpuslice
    does not work out are still its own business."""
    put(root, "/etc/job/job.env", "LD_DEBUG=help\n")
    put(root, "/srv/asr/job.env", "LD_DEBUG=help\n", uid=1000)
    put(root, "/srv/asr/plain.env", "X=1\n", uid=1000)
    cases = {
        # name: (lines, refused)
        "trace.service": (["Environment=LD_TRACE_LOADED_OBJECTS=1"], True),
        "noexec.service": (["User=root", "Environment=SHELLOPTS=noexec"], True),
        "file.service": (["User=0", "EnvironmentFile=/etc/job/job.env"], True),
        "unset.service": (["EnvironmentFile=/etc/job/job.env", "UnsetEnvironment=LD_DEBUG"], False),
        "debug.service": (["Environment=LD_DEBUG=libs"], False),
        "users-file.service": (["EnvironmentFile=/srv/asr/job.env"], True),
        "users-plain.service": (["EnvironmentFile=/srv/asr/plain.env"], True),
        "home-file.service": (["EnvironmentFile=-/home/asr/job.env"], True),
        "unknown.service": (["Environment=LD_DEBUG=%h"], False),
        "loader.service": (["Environment=LD_PRELOAD=/home/asr/x.so LD_DEBUG_OUTPUT=d"], False),
    }
    for name, (lines, _) in cases.items():
        install(root, name, *lines)
    refused = {name for name in cases if errors(root, name)}
    assert refused == {name for name, (_, bad_one) in cases.items() if bad_one}
    assert errors(root, "file.service") == [
        f"{ETC}/file.service:5: [Service] EnvironmentFile: LD_DEBUG=help (set in "
        "/etc/job/job.env): glibc's loader prints LD_DEBUG's options and exits 0 instead of "
        "running the program, so gpuslice's gate would let the start through without asking "
        f"for its GPUs; {GATE} file.service until its environment does not set it so"
    ]
    assert errors(root, "users-plain.service") == [
        f"{ETC}/users-plain.service:4: [Service] EnvironmentFile: /srv/asr/plain.env is "
        f"owned by UID 1000, who can change it; {GATE} "
        "users-plain.service until only root can change that file and its directories"
    ]
    assert errors(root, "home-file.service") == [
        f"{ETC}/home-file.service:4: [Service] EnvironmentFile: /home/asr/job.env is under "
        f"/home, {TREE} at boot; {GATE} home-file.service until it names a file elsewhere, "
        "that only root can change"
    ]


def test_a_root_units_wildcard_environment_file_where_a_user_makes_files_is_refused(
    root: Path,
) -> None:
    """systemd reads every file a pattern matches: asr, who owns /srv/asr, could add
    /srv/asr/x.env with LD_TRACE_LOADED_OBJECTS=1 after the scan, and a unit run as root was
    managed with the pattern neither read nor refused. One whose directory is root's alone,
    however deep, matches only root's files: still managed."""
    put(root, "/srv/asr/job.env", uid=ASR)
    (root / "srv/asr").chmod(0o755)
    os.chown(root / "srv/asr", ASR, ASR)
    put(root, "/etc/job/a/job.env")
    install(root, "users.service", "EnvironmentFile=-/srv/asr/*.env")
    install(root, "deep.service", "EnvironmentFile=/srv/*/job.env")
    install(root, "roots.service", "EnvironmentFile=/etc/job/*/job.env")
    assert errors(root, "users.service") == [
        f"{ETC}/users.service:4: [Service] EnvironmentFile: -/srv/asr/*.env cannot be checked: "
        "systemd reads it as a wildcard pattern (*, ?, [ or \\), which gpuslice does not "
        f"expand; name each file; {GATE} users.service until it names, by an absolute path, a "
        "file only root can change"
    ]
    assert len(errors(root, "deep.service")) == 1
    assert errors(root, "roots.service") == []


def test_a_root_templates_instance_in_its_environment_file_may_not_lead_it_anywhere(
    root: Path,
) -> None:
    """Whoever may start an instance (polkit can let others than root) names it: %I unescapes
    `-` to `/`, so job@..-..-home-asr-x.service read /home/asr/x.env, asr's, for a template run
    as root that was managed unread (SKIPS_GATE there: its start let through ungated). %i
    holds no `/` but may be `.` or `..` (job@...service): a directory of %i's alone, or of
    dots and %i, walks out (/etc/job/%i/x.env: /etc/x.env). %P and %J are the template's own
    name, walked as written; %%I is no specifier."""
    for directory in ("/etc/job", "/etc/openvpn", "/etc/default", "/etc/job/a.d"):
        put(root, f"{directory}/a.env")
    (root / "srv/asr").mkdir(parents=True)
    os.chown(root / "srv/asr", ASR, ASR)
    fine = (
        "/etc/job/%i.env",
        "-/etc/openvpn/%i.conf",
        "/etc/default/%i",
        "%E/job/%n.env",
        "/etc/job/%i.d/a.env",
        "/etc/job/%%I.env",
        "/etc/%J/%p.env",
    )
    for i, value in enumerate(fine):
        install(root, f"fine{i}-job@.service", f"EnvironmentFile={value}")
        assert errors(root, f"fine{i}-job@.service") == [], value
    refused = (
        ("/etc/job/%I.env", "%I"),
        ("-%E/job/%I", "%I"),
        ("/etc/job/%i/x.env", ".."),
        ("/etc/job/.%i./x.env", ".."),
        ("/etc/job/%i*/x.env", ".."),
        ("/etc/job/%i.d/../../asr/x.env", ".."),
        ("/srv/asr/%i.env", "depends"),
        # %f is %I after a `/` (gpuslice does not work it out): bad8@home-asr-x.env.service
        # read /home/asr/x.env, and \x5c.\x5c. unescapes to `\.\.`, `..` to glob(3)
        ("-%f", "%f"),
        ("/etc/job%f", "%f"),
    )
    for i, (value, why) in enumerate(refused):
        install(root, f"bad{i}@.service", f"EnvironmentFile={value}")
        [error] = errors(root, f"bad{i}@.service")
        assert error.startswith(f"{ETC}/bad{i}@.service:4: [Service] EnvironmentFile: {value}")
        assert why in error, error
    [error] = errors(root, "bad0@.service")
    assert error == (
        f"{ETC}/bad0@.service:4: [Service] EnvironmentFile: /etc/job/%I.env cannot be checked: "
        "%I is the instance's name unescaped, which whoever starts an instance of bad0@.service "
        "chooses: a `-` in it is a `/` (bad0@..-..-home-x.service: ../../home/x), so it can "
        f"name any file; {GATE} bad0@.service {envsafety.FIX_INSTANCE}"
    )
    [error] = errors(root, "bad2@.service")
    assert error == (
        f"{ETC}/bad2@.service:4: [Service] EnvironmentFile: /etc/job/%i/x.env cannot be "
        "checked: %i is the instance's name, which whoever starts an instance of bad2@.service "
        "chooses: it may be `.` or `..` (bad2@...service), and the path then leads out of "
        f"/etc/job; {GATE} bad2@.service {envsafety.FIX_INSTANCE}"
    )
    # an instance whose name is known is walked as it is named, as before
    put(root, f"{ETC}/bad0@a.service.d/x.conf", "[Unit]\n")
    put(root, "/etc/job/a.env")
    assert errors(root, "bad0@a.service") == []


def test_a_root_units_file_named_in_a_directory_is_refused_only_by_what_is_right_in_it(
    root: Path,
) -> None:
    """An instance's name, or a wildcard, in the file's own name holds no `/`: it names an
    entry of the directory, no deeper. /etc/%i.conf of a template run as root was refused
    wherever a directory in /etc was another user's (Debian's /etc/postgresql, the postgres
    user's), which a directory cannot be named by (systemd cannot read one); a file or
    symlink there someone but root can change still is refused, as is a directory of the
    instance's or the pattern's, walked whole."""
    put(root, "/etc/job/a.conf")
    put(root, "/etc/postgresql/main/pg.conf", uid=ASR)
    os.chown(root / "etc/postgresql", ASR, ASR)
    os.chown(root / "etc/postgresql/main", ASR, ASR)
    lines = {
        "fine0@.service": "EnvironmentFile=/etc/%i.conf",
        "fine1.service": "EnvironmentFile=-/etc/*.conf",
        "fine2@.service": "EnvironmentFile=-/etc/job/%i",
        "deep0@.service": "EnvironmentFile=/etc/%i.d/x.conf",
        "deep1.service": "EnvironmentFile=/etc/p*/main/x.conf",
    }
    for name, line in lines.items():
        install(root, name, line)
    refused = {name for name in lines if errors(root, name)}
    assert refused == {"deep0@.service", "deep1.service"}
    put(root, "/etc/job/theirs.conf", uid=ASR)
    install(root, "theirs@.service", "EnvironmentFile=/etc/job/%i.conf")
    [error] = errors(root, "theirs@.service")
    assert "EnvironmentFile: /etc/job/%i.conf cannot be checked: %i depends" in error


def test_a_root_templates_environment_that_its_instance_may_make_skip_the_gate_is_refused(
    root: Path,
) -> None:
    """Whoever may start an instance (polkit can let others than root) names it: a@help.service
    of a template run as root with Environment=LD_DEBUG=%i had its gate exit 0 unasked, and
    so did b@LD_TRACE_LOADED_OBJECTS.service with Environment=%i=1: the value not worked out
    was skipped, and the job ran ungated. A name not worked out may be any variable that
    skips, as may a value by the instance of one that skips with a word of it; one that skips
    whatever its value (LD_TRACE_LOADED_OBJECTS=%h) does so. Ordinary words, a value of
    root's own (%h), one a later assignment replaces or UnsetEnvironment= takes away, and
    UnsetEnvironment=%i (it only takes away) stay the unit's own business."""
    cases = {
        # name: (lines, refused)
        "a@.service": (["Environment=LD_DEBUG=%i"], True),
        "b@.service": (["Environment=%i=1"], True),
        "c@.service": (["Environment=SHELLOPTS=xtrace:%I"], True),
        "d@.service": (["Environment=LD_DEBUG=files:%N"], True),
        "e@.service": (["Environment=LD_TRACE_%i=1"], True),
        # %f is %I after a `/` (x@a:help.service: /a, help), %d holds the unit's name
        # (x@a:help:b.service: /run/credentials/x@a, help, b.service)
        "g@.service": (["Environment=LD_DEBUG=%f"], True),
        "h@.service": (["Environment=SHELLOPTS=%d"], True),
        "f@.service": (["Environment=LD_TRACE_LOADED_OBJECTS=%h"], True),
        "trace.service": (["Environment=LD_TRACE_LOADED_OBJECTS=%h"], True),
        "name.service": (["Environment=LD_%h=1"], True),
        "job@.service": (["Environment=JOB=%i MODEL=/srv/models/%i"], False),
        # a name whose known part no such name has (JOB_ and the instance's) was refused
        "jobs@.service": (["Environment=JOB_%i=1 %i_MODEL=x GPU%iDEBUG=%i"], False),
        "trace@.service": (["Environment=%i_OBJECTS=1"], True),
        "own@.service": (["Environment=LD_DEBUG=%h SHELLOPTS=%u LD_PRELOAD=/x/%i.so"], False),
        "later@.service": (["Environment=LD_DEBUG=%i", "Environment=LD_DEBUG=files"], False),
        "unset@.service": (["Environment=LD_DEBUG=%i", "UnsetEnvironment=LD_DEBUG"], False),
        "unsets@.service": (["UnsetEnvironment=%i LD_DEBUG=%i"], False),
        "known.service": (["Environment=LD_DEBUG=%i"], False),  # no instance: %i is empty
    }
    for name, (lines, _) in cases.items():
        install(root, name, *lines)
    refused = {name for name in cases if errors(root, name)}
    assert refused == {name for name, (_, bad_one) in cases.items() if bad_one}
    assert errors(root, "a@.service") == [
        f"{ETC}/a@.service:4: [Service] Environment: LD_DEBUG=%i cannot be checked: %i is the "
        "instance's name, or holds it, which whoever starts an instance of a@.service "
        "chooses, and glibc's loader prints LD_DEBUG's options and exits 0 instead of running "
        f"the program where one of its words is help; {GATE} a@.service until its environment "
        "does not set it so"
    ]
    [error] = errors(root, "b@.service")
    assert error.startswith(
        f"{ETC}/b@.service:4: [Service] Environment: %i=1 cannot be checked: its name is not "
        "worked out (%i depends on the instance's name"
    ), error
    assert "LD_TRACE_LOADED_OBJECTS, LD_TRACE_PRELINKING, LD_DEBUG, SHELLOPTS" in error
    [error] = errors(root, "trace.service")
    assert "LD_TRACE_LOADED_OBJECTS=%h cannot be checked: glibc's loader lists" in error
    assert "%h has a value gpuslice does not work out" in error


def test_an_environment_word_no_instance_makes_an_assignment_is_dropped_as_systemd_does(
    root: Path,
) -> None:
    """systemd v252's config_parse_environ expands a word's specifiers, then drops one that is
    no assignment: Environment=LD_%i (LD_x, no `=`) sets nothing, whatever the instance (a unit
    name holds no `=`; nor do %n, %N, %j, %p or %d, which hold it as written), in a template
    run as root or as asr, yet was refused. %I and %f unescape the name (`\\x3d` is `=`:
    b@DEBUG\\x3dhelp.service makes LD_%I LD_DEBUG=help), and a `=` of the word's own or one
    of a specifier not worked out (%h) may make an assignment: those stay refused."""
    cases = {
        # name: (lines, refused)
        "a@.service": (["Environment=LD_%i"], False),
        "b@.service": (["Environment=LD_%n%N%j%p%d SHELLOPTS%i LD_%%i"], False),
        "c@.service": (["User=asr", "Environment=LD_%i LD_PRELOAD%i"], False),
        "d@.service": (["Environment=LD_%I"], True),
        "e@.service": (["Environment=LD_DEBUG%f"], True),
        "f@.service": (["Environment=LD_%i=1"], True),
        "g@.service": (["Environment=LD_%i%h"], True),
        "h@.service": (["User=asr", "Environment=LD_PRELOAD%I"], True),
    }
    for name, (lines, _) in cases.items():
        install(root, name, *lines)
    refused = {name for name in cases if errors(root, name)}
    assert refused == {name for name, (_, bad_one) in cases.items() if bad_one}
    [error] = errors(root, "d@.service")
    assert "Environment: LD_%I cannot be checked: its name is not worked out" in error


def test_a_root_units_environment_file_pattern_that_may_lead_out_by_dot_dot_is_refused(
    root: Path,
) -> None:
    """glob(3) without GLOB_PERIOD lists `.` and `..`, and `.*` matches `..`: a unit run as root
    with EnvironmentFile=/etc/job/.*/asr/x.env read /etc/asr/x.env, though only /etc/job was
    found root's alone (systemd's safe_glob skips `.` and `..` now; an older systemd's glob(3)
    did not, and `\\.\\.`, no wildcard, is `..` for both). `*`, `?` and `[.]` match no
    leading dot: a directory of theirs is one of /etc/job's."""
    put(root, "/etc/job/a/job.env")
    (root / "srv/asr").mkdir(parents=True)
    os.chown(root / "srv/asr", ASR, ASR)
    put(root, "/srv/asr/x.env", "LD_DEBUG=help\n", uid=ASR)
    fine = ("/etc/job/*/job.env", "/etc/job/?/job.env", "/etc/job/[.a]*/job.env", "/etc/job/.d*/x")
    for i, value in enumerate(fine):
        install(root, f"fine{i}.service", f"EnvironmentFile={value}")
        assert errors(root, f"fine{i}.service") == [], value
    refused = (
        "/etc/job/.*/asr/x.env",
        "-/etc/job/.?/../srv/asr/x.env",
        "/etc/job/.[.]/asr/*.env",
        "/etc/job/\\.\\./asr/x.env",
        "/etc/job/*/../../srv/asr/x.env",
        "/etc/job/.[[:punct:]]/asr/x.env",  # a class holds `.`: not `[[:punct:]`, then `]`
        "/etc/job/..\\/..\\/srv/asr/x.env",  # glob(3) drops a `\` before a `/`
    )
    for i, value in enumerate(refused):
        install(root, f"bad{i}.service", f"EnvironmentFile={value}")
        assert errors(root, f"bad{i}.service") == [
            f"{ETC}/bad{i}.service:4: [Service] EnvironmentFile: {value} cannot be checked: "
            "systemd reads it as a wildcard pattern, and a directory of it may be `..` as "
            f"glob(3) reads it (`.*` matches `..`), so it leads out of /etc/job; {GATE} "
            f"bad{i}.service {FIX_PATH}"
        ], value


class _Glob(ctypes.Structure):
    _fields_ = [
        ("pathc", ctypes.c_size_t),
        ("pathv", ctypes.POINTER(ctypes.c_char_p)),
        ("offs", ctypes.c_size_t),
        ("flags", ctypes.c_int),
        ("rest", ctypes.c_void_p * 8),
    ]


@pytest.fixture
def reaches_up(tmp_path: Path) -> Callable[[str], bool]:
    """Whether glibc's own glob(3) (no flags, as systemd before safe_glob) of /x/y/PART/z
    reaches /x/y/../z."""
    if not (found := ctypes.util.find_library("c")):
        pytest.skip("no C library")
    libc = ctypes.CDLL(found)
    (tmp_path / "x/y/.d").mkdir(parents=True)
    (tmp_path / "x/z").write_text("")

    def reaches(part: str) -> bool:
        globbed = _Glob()
        if libc.glob(os.fsencode(f"{tmp_path}/x/y/{part}/z"), 0, None, ctypes.byref(globbed)):
            return False
        paths = [globbed.pathv[i] for i in range(globbed.pathc)]
        libc.globfree(ctypes.byref(globbed))
        return os.fsencode(f"{tmp_path}/x/y/../z") in paths

    return reaches


def test_which_glob_component_may_be_dot_dot_is_as_glibcs_glob_reads_it(
    reaches_up: Callable[[str], bool],
) -> None:
    """`_may_be_up` against glibc's own glob(3) (no flags, as systemd before safe_glob): each
    component it says may be `..` reaches /x/y/.., and none it says may not does."""
    ups = [".*", "..*", ".?", ".[.]", "\\.\\.", ".\\.", ".."]
    # a bracket's class, or escaped `]`, holds a dot too (the first `]` is not its end)
    ups += [".[[:punct:]]", ".[![:alnum:]]", ".[[=.=]]", ".[\\].]", ".[[:alpha:].]"]
    # a `\` before the `/` is dropped (`..\/z` is `../z`); an escaped one is itself
    ups += ["..\\", ".\\.\\", ".*\\", ".[.]\\"]
    for part in [*ups, "*", "?.", "[.][.]", ".d*", "?*", "[.]*", "x.", ".x", "..\\\\", "\\"]:
        assert envsafety._may_be_up(part) == reaches_up(part), part


def test_a_bracket_is_dot_dot_maybe_wherever_glibcs_glob_reads_it_so(
    reaches_up: Callable[[str], bool],
) -> None:
    """A bracket expression is taken for a dot whatever it holds, read on from each `]` that
    may end it: never "no" where glibc's glob(3) says `..`. Those glibc says are not (a
    class or range without a dot) are refused too, knowingly: reading them as glibc does is
    fnmatch_loop.c again, for patterns only root writes (README, "The gate's
    environment")."""
    parts = [".[[:alpha:]]", ".[a-z]", ".[A-Z0-9_]", ".[!.]", ".[![:punct:]]", ".[[=a=]]"]
    parts += [".[[.a.]]", ".[![...]]", ".[!a.]", ".[[:alnum:][:space:]]", ".[]a]", ".[!\\.]"]
    parts += [".[!a-z]", ".[,-.]", ".[--0]", ".[.-a]", ".[!+--]", ".[[.,.]-0]", ".[[:graph:]]"]
    parts += [".[[:print:]]", ".[a-a.]", ".[^]]", ".[\\.]", ".[[...]]", ".[[=.=]]", ".[.-.]"]
    parts += [".[[=,=]]", ".[+--]", ".[a-.]", ".[[:foo:]]", ".[[.period.]]", ".[A-z]"]
    for part in parts:
        assert envsafety._may_be_up(part) or not reaches_up(part), part
    assert envsafety._may_be_up(".[[:alpha:]]") and not reaches_up(".[[:alpha:]]")
    for part in ("[.]", ".[.]x", "a[.]", ".[a]]b]c]x"):
        assert not envsafety._may_be_up(part) and not reaches_up(part), part


def test_a_bracket_with_more_ends_than_are_tried_is_dot_dot_maybe() -> None:
    """Each `]` after a bracket is tried as its end, and each reading may hold another
    bracket: past BRACKET_ENDS_MAX, `..` maybe, at once (a pattern only root writes)."""
    tried = ".[" + "]" * envsafety.BRACKET_ENDS_MAX
    assert not envsafety._may_be_up(tried + "x")
    assert envsafety._may_be_up(tried + "]x")


def test_a_bracket_glibc_ends_elsewhere_than_at_its_first_free_close_may_be_dot_dot(
    root: Path, reaches_up: Callable[[str], bool]
) -> None:
    """glibc's fnmatch(3) ends a bracket where it reads it, and skips the rest of one whose
    item matched otherwise than it reads it: `.[.[:Alpha:]` is `..` (once the dot matched,
    `[:A` is no class, and `:]` ends it), as are `.[,-[=.=]` (a range's end `[` is itself),
    `.[![=ab=]` and `.[![:zz:]` (no class: `[` is itself) and `.[\\[.a.]` (an escaped
    `[` starts no collating symbol). gpuslice read each as a `[` with no end, never a dot:
    EnvironmentFile=/etc/job/.[.[:Alpha:]/asr/x.env of a unit run as root read
    /etc/asr/x.env, unsaid."""
    ups = [".[.[:Alpha:]", ".[,-[=.=]", ".[![=ab=]", ".[![:zz:]", ".[\\[.a.]", ".[--[:punct:]"]
    for part in ups:
        assert envsafety._may_be_up(part) == reaches_up(part) is True, part
    put(root, "/etc/job/a/job.env")
    value = "/etc/job/.[.[:Alpha:]/asr/x.env"
    install(root, "bad.service", f"EnvironmentFile={value}")
    assert errors(root, "bad.service") == [
        f"{ETC}/bad.service:4: [Service] EnvironmentFile: {value} cannot be checked: "
        "systemd reads it as a wildcard pattern, and a directory of it may be `..` as "
        f"glob(3) reads it (`.*` matches `..`), so it leads out of /etc/job; {GATE} "
        f"bad.service {FIX_PATH}"
    ]


def test_exported_shell_functions_never_reach_the_gate() -> None:
    """bash, /bin/sh on Fedora, RHEL and Arch, imports BASH_FUNC_NAME%%= as a function, which
    overrides the gate's dbus-send; systemd drops such names from Environment= and
    EnvironmentFile= (env-util.c's env_name_is_valid: letters, digits and `_`), so gpuslice
    need not look for them."""
    for word in ("BASH_FUNC_dbus-send%%=() { :; }", "BASH_FUNC_sleep()=() { :; }"):
        assert envsyntax.assignment(word) is None
    assert envsyntax.assignment("BASH_FUNC_x=1") == ("BASH_FUNC_x", "1")  # a plain variable


def test_a_large_environment_file_many_units_share_is_read_once(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100,000 assignments, 3,000 units: each unit went through all of them (300 million
    steps, tens of seconds of a scan or the generator at boot); now one pass per scan.
    Passes counted, and the units' cost weighed against the first parse: a bound of 3 s
    CPU failed under mutmut's instrumented copy."""
    put(root, "/etc/asr/big.env", "".join(f"V{i}=x\n" for i in range(100_000)))
    parsed: list[int] = []
    parse = envsyntax.parse_env_file

    def counted(text: str) -> list[tuple[str, str]] | None:
        parsed.append(len(text))
        return parse(text)

    monkeypatch.setattr(envsyntax, "parse_env_file", counted)
    checker = EnvFileChecker(root)
    run_as = RunAs(user="asr")
    run_as.env_files.append(envsafety.Assignment(f"{ETC}/x.service", 5, "/etc/asr/big.env"))
    began = time.process_time()  # CPU time: a loaded machine stretches the wall time
    assert checker.check("x.service", run_as) == []  # reads and parses the file
    first = time.process_time() - began
    for i in range(3_000):
        assert checker.check(f"x{i}.service", run_as) == []
    rest = time.process_time() - began - first
    print(f"first {first:.3f} s, next 3,000 {rest:.3f} s")
    assert len(parsed) == 1
    # a pass over the assignments per unit cost each unit about what the first parse did
    assert rest < 20 * first


def test_an_environment_file_systemd_refuses_whole_overrides_nothing(root: Path) -> None:
    """A NUL, or a value that is not UTF-8, anywhere in a file: systemd refuses all of it,
    and a `-` file's `LD_PRELOAD=` no longer clears the unit's own. Taken up to the NUL,
    the file's empty LD_PRELOAD= hid asr's library, which the gate's shell loaded as root."""
    put(root, "/etc/asr/nul.env", "LD_PRELOAD=\n#\0\n")
    put(root, "/etc/asr/latin1.env", "LD_PRELOAD=\nNAME=caf\xe9\n")
    (root / "etc/asr/latin1.env").write_bytes(b"LD_PRELOAD=\nNAME=caf\xe9\n")
    for name in ("nul", "latin1"):
        install(
            root,
            f"{name}.service",
            "User=asr",
            "Environment=LD_PRELOAD=/home/asr/x.so",
            f"EnvironmentFile=-/etc/asr/{name}.env",
        )
        assert errors(root, f"{name}.service") == [
            f"{ETC}/{name}.service:5: [Service] Environment: LD_PRELOAD=/home/asr/x.so: "
            f"/home/asr/x.so is under /home, {TREE} at boot; {GATE} {name}.service {LOADER}"
        ]


def test_an_environment_file_that_cannot_be_read_whole_is_refused(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(root, "/etc/asr/big.env", "A=1\n" * 10)
    install(root, "x.service", "User=asr", "EnvironmentFile=/etc/asr/big.env")
    monkeypatch.setattr(envsafety, "MAX_ENV_FILE", 39)
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] EnvironmentFile: /etc/asr/big.env cannot be checked: "
        f"larger than 39 bytes; {GATE} x.service until it names, by an absolute path, a file "
        "only root can change"
    ]
    monkeypatch.setattr(envsafety, "MAX_ENV_FILE", 40)
    assert errors(root, "x.service") == []


# ---------------------------------------------------------------------------------------------
# mounts: systemd applies a unit's root directory and mounts to its ExecStartPre=+ too

MOUNTS = "gpuslice's gate runs as root with this unit's mounts (ExecStartPre=+ keeps them), so"
USES = (
    "where gpuslice's gate finds the programs and libraries it runs as root, or its way to "
    "the controller"
)
ANYWHERE = "until none of its mounts lands on, in or above a path the gate uses"


@pytest.mark.parametrize("user", ["", "User=asr"])
def test_mounts_over_what_the_gate_uses_leave_any_unit_unmanaged(root: Path, user: str) -> None:
    """A user's bind over /usr/local/bin (first in the gate's PATH) ran their dbus-send as
    root; a TemporaryFileSystem=/run hid the bus and the pipe (the start waited for ever,
    without a word why); a root directory is where the gate ran. Ordinary data mounts, a
    path bound onto itself, and RootDirectoryStartOnly=yes are fine."""
    cases = {
        "bin.service": ["BindPaths=/home/asr/bin:/usr/local/bin"],
        "lib.service": ["BindReadOnlyPaths=/srv/x:/usr/lib/x86_64-linux-gnu"],
        "lib64.service": ["BindReadOnlyPaths=/srv/x:/lib64"],
        "root.service": ["TemporaryFileSystem=/"],
        "run.service": ["TemporaryFileSystem=/run:mode=0755"],
        "var-run.service": ["BindPaths=/srv/x:/var/run/dbus"],
        "var.service": ["BindPaths=/srv/x:/var:norbind"],
        "preload.service": ["BindReadOnlyPaths=/srv/x:/etc/ld.so.preload"],
        "gate.service": ["TemporaryFileSystem=/run/gpuslice/gate"],
        "usr.service": ["BindPaths=/srv/x:/usr"],
        "chroot.service": ["RootDirectory=/srv/chroot"],
        "image.service": ["RootImage=/srv/image.raw", "RootDirectoryStartOnly=bogus"],
        "ext.service": ["ExtensionImages=/srv/ext.raw"],
        "extdir.service": ["ExtensionDirectories=/srv/ext"],
        "mountimg.service": ["MountImages=/srv/img.raw:/data"],
        "norbind.service": ["BindPaths=/run:/run:norbind"],
        "spec.service": ["BindPaths=/srv/x:%h/bin"],
        # fine
        "data.service": ["BindPaths=/data/models:/models", "TemporaryFileSystem=/run/myapp"],
        "same.service": ["BindReadOnlyPaths=/run/dbus/system_bus_socket /usr/local/bin"],
        "usrshare.service": ["BindPaths=/data/ollama:/usr/share/ollama/.ollama/models"],
        "varrunapp.service": ["TemporaryFileSystem=/var/run/myapp /etc/myapp"],
        "startonly.service": ["RootDirectory=/srv/chroot", "RootDirectoryStartOnly=yes"],
        "reset.service": [
            "RootImage=/srv/image.raw",
            "RootImage=",
            "BindPaths=/x:/usr/bin",
            "BindPaths=",
        ],
    }
    for name, lines in cases.items():
        install(root, name, *([user] if user else []), *lines)
    refused = {name for name in cases if errors(root, name)}
    assert refused == set(list(cases)[:17])
    line = 5 if user else 4
    assert errors(root, "bin.service") == [
        f"{ETC}/bin.service:{line}: [Service] BindPaths: /home/asr/bin:/usr/local/bin: its "
        f"mount at /usr/local/bin lands on, in or above /usr/local/bin, {USES}; {MOUNTS} "
        f"gpuslice does not manage bin.service {ANYWHERE}"
    ]
    assert errors(root, "run.service") == [
        f"{ETC}/run.service:{line}: [Service] TemporaryFileSystem: /run:mode=0755: its mount "
        f"at /run lands on, in or above /run/dbus, {USES}; {MOUNTS} gpuslice does not manage "
        f"run.service {ANYWHERE}"
    ]
    assert errors(root, "chroot.service") == [
        f"{ETC}/chroot.service:{line}: [Service] RootDirectory: /srv/chroot: gpuslice's gate "
        "would run inside it, with its programs and without the controller's bus and pipe; "
        f"{MOUNTS} gpuslice does not manage chroot.service until RootDirectoryStartOnly=yes "
        "(the gate then runs outside it)"
    ]
    assert errors(root, "ext.service") == [
        f"{ETC}/ext.service:{line}: [Service] ExtensionImages: /srv/ext.raw: what it mounts "
        f"may replace the programs the gate runs; {MOUNTS} gpuslice does not manage "
        "ext.service until it has none (gpuslice does not look into images)"
    ]


def test_a_bind_of_another_users_unit_must_land_where_only_root_can_change(root: Path) -> None:
    """systemd follows symlinks where a mount lands: asr could point ~/data at /usr/local/bin,
    where the gate's bind of asr's files then ran as root. A unit that runs as root is not
    checked so (its own processes run with the same mounts), nor a temporary file system
    (empty: it hides, it brings nothing), nor a path bound onto itself."""
    put(root, "/srv/links/keep", "")
    link(root, "/srv/links/bin", "/usr/local/bin")
    install(root, "home.service", "User=asr", "BindPaths=/srv/asr:/home/asr/data")
    install(root, "link.service", "User=asr", "BindPaths=/srv/asr:/srv/links/bin/x")
    install(root, "rooted.service", "BindPaths=/srv/asr:/home/asr/data")
    install(root, "tmpfs.service", "User=asr", "TemporaryFileSystem=/home/asr/tmp")
    install(root, "same.service", "User=asr", "BindPaths=/home/asr/project")
    install(root, "fine.service", "User=asr", "BindPaths=/srv/asr:/srv/links/new")
    assert errors(root, "home.service") == [
        f"{ETC}/home.service:5: [Service] BindPaths: /srv/asr:/home/asr/data: systemd follows "
        f"symlinks where a mount lands, and /home/asr/data is under /home, {TREE} at boot; "
        f"{MOUNTS} gpuslice does not manage home.service until each bind lands on a path only "
        "root can change (or on its own source, which shows what is there)"
    ]
    assert errors(root, "link.service") == [
        f"{ETC}/link.service:5: [Service] BindPaths: /srv/asr:/srv/links/bin/x: its mount at "
        "/srv/links/bin/x lands at /usr/local/bin/x (symlinks followed), on, in or above "
        f"/usr/local/bin, {USES}; {MOUNTS} gpuslice does not manage link.service {ANYWHERE}"
    ]
    for name in ("rooted.service", "tmpfs.service", "same.service", "fine.service"):
        assert errors(root, name) == [], name


# ---------------------------------------------------------------------------------------------
# a file system that does not answer

NFS = "/srv/nfs"  # the mount point of a network file system whose server is gone
MISSING = "no such file: the mount table cannot be read"


class Hang:
    """A file system that does not answer: each lstat, readlink and getxattr of a path at or
    under `at` (system paths under the root) blocks until `release`, as a call to an NFS
    server that is gone does (for at most CAP s: a checker that waits for it fails its test,
    it does not hang the run). The mount table says what `mounts` lists (system paths, or
    MISSING). A call the worker makes is waited for until it answers, however late a loaded
    machine runs the worker; only one that blocks here is given up on, at DEADLINE
    (`_PatientLock`), and counted in `timeouts`."""

    # far past a test's run on a loaded machine: a call let go by CAP while the test ran
    # was no longer stuck, and was made again
    CAP = 60.0

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, mountinfo: Path) -> None:
        self.root = root
        self.at: tuple[str, ...] = ()
        self.calls: tuple[str, ...] = ("lstat", "readlink", "getxattr")
        self.blocked: list[str] = []  # system paths of the calls that blocked
        self.threads: list[threading.Thread] = []
        self.timeouts = 0  # the waits for a call that ran out (DEADLINE waited, each)
        self._released = threading.Event()
        self._mountinfo = mountinfo
        self._lock = threading.Lock()
        self._blocking: set[threading.Thread] = set()  # blocked now, not given up on yet
        monkeypatch.setattr(envsafety, "DEADLINE", 1.0)
        shim = types.SimpleNamespace(Lock=lambda: _PatientLock(self), Thread=threading.Thread)
        monkeypatch.setattr(envsafety, "threading", shim)
        monkeypatch.setattr(envsafety, "MOUNTINFO", str(mountinfo))
        # the process-wide record of stuck calls, made afresh: no test sees another's, and
        # each one's is built by the code under test (not once, at import)
        monkeypatch.setattr(envsafety, "_STUCK", envsafety._StuckWorkers())
        for name in ("lstat", "readlink", "getxattr"):
            monkeypatch.setattr(os, name, self._fake(name, getattr(os, name)))

    def mounts(self, *points: str) -> None:
        """A mount table (/proc/self/mountinfo) with the host's / and `points` under the root
        (each a network file system)."""
        if points == (MISSING,):
            return
        lines = ["22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw"]
        for i, point in enumerate(points):
            escaped = str(self.root / point.lstrip("/")).replace(" ", "\\040")
            lines.append(f"{40 + i} 22 0:{50 + i} / {escaped} rw shared:9 - nfs4 nas:/x rw")
        self._mountinfo.write_text("\n".join(lines) + "\n")

    def _fake(self, name: str, real: Callable[..., T]) -> Callable[..., T]:
        def call(path: str | os.PathLike[str], *args: object, **kwargs: object) -> T:
            system = os.fspath(path).removeprefix(str(self.root)) or "/"
            if name in self.calls and any(
                system == at or system.startswith(at + "/") for at in self.at
            ):
                self.blocked.append(system)
                self.block()
            return real(path, *args, **kwargs)

        return call

    def block(self) -> None:
        """Block, as a call here does, until `release` (CAP s at most)."""
        me = threading.current_thread()
        self.threads.append(me)
        with self._lock:
            if not self._released.is_set():
                self._blocking.add(me)
        try:
            self._released.wait(self.CAP)
        finally:
            with self._lock:
                self._blocking.discard(me)

    def given_up(self) -> bool:
        """Whether a wait for a call gives up now: a call blocks here that no wait has given
        up on yet (it is taken as given up on from now on)."""
        with self._lock:
            if not self._blocking:
                return False
            self._blocking.clear()
            self.timeouts += 1
            return True

    def release(self) -> None:
        """Lets every blocked call answer; each thread that made one then ends."""
        self._released.set()
        for thread in set(self.threads) - {threading.current_thread()}:
            thread.join(PATIENCE)
            assert not thread.is_alive(), thread


class _PatientLock:
    """envsafety's locks, each a real one. A wait with a timeout (`_Caller.call`, for the
    worker's answer) lasts until the call answers, however late a loaded machine runs the
    worker (PATIENCE at most); at its timeout only once a call blocks in `Hang`. A deadline
    of 1 s for every call refused a healthy file system when the worker ran 1 s late."""

    def __init__(self, hang: Hang) -> None:
        self._real = threading.Lock()
        self._hang = hang

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not blocking or timeout < 0:
            return self._real.acquire(blocking, timeout)
        end = time.monotonic() + PATIENCE
        while not self._real.acquire(timeout=0.005):
            if self._hang._blocking:  # read without its lock: `given_up` decides under it
                answered = self._real.acquire(timeout=timeout)
                if answered or self._hang.given_up():
                    return answered
            if time.monotonic() > end:
                return False
        return True

    def release(self) -> None:
        self._real.release()

    def locked(self) -> bool:
        return self._real.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


PATIENCE = 30.0  # seconds a call that answers may take (a pass never waits this long)


@pytest.fixture
def hang(
    root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hang]:
    hanging = Hang(root, monkeypatch, tmp_path_factory.mktemp("proc") / "mountinfo")
    yield hanging
    hanging.release()


def no_answer(path: str, where: str) -> str:
    return (
        f"{path} cannot be checked: {where} did not answer within 1 s (a network file system "
        f"not answering?); {GATE}"
    )


@pytest.mark.parametrize("mount_point_answers", [True, False])
def test_a_file_system_that_does_not_answer_costs_one_deadline_per_scan(
    root: Path, hang: Hang, mount_point_answers: bool
) -> None:
    """An lstat on an NFS mount whose server is gone never returns: the walk made it on the
    scan's own thread, so the generator hung until systemd killed it (it plans every unit
    before writing any drop-in: no unit gated, every GPU job then ran ungated) and a
    controller's scan hung for good (no later annotation change taken in). Each call now
    waits at most DEADLINE; the one that does not answer refuses its unit, and every later
    path on that file system (under its mount point) is refused without asking: 300 units
    there cost one deadline, not 300. The units elsewhere, beside the mount point included,
    are checked as before."""
    put(root, "/etc/asr/ok.env")
    put(root, "/srv/local/ok.env")
    put(root, "/srv/local/theirs.env", uid=ASR)
    for d in range(3):
        (root / f"srv/nfs/d{d}").mkdir(parents=True)
        for i in range(100):
            install(root, f"n{d}-{i}.service", "User=asr", f"EnvironmentFile={NFS}/d{d}/{i}.env")
    install(root, "ok.service", "User=asr", "EnvironmentFile=/etc/asr/ok.env")
    install(root, "local.service", "User=asr", "EnvironmentFile=/srv/local/ok.env")
    install(root, "theirs.service", "User=asr", "EnvironmentFile=/srv/local/theirs.env")
    hang.mounts(NFS)
    # the mount point's attributes cached, or not: the calls below it hang, or it does too
    hang.at = tuple(f"{NFS}/d{d}" for d in range(3)) if mount_point_answers else (NFS,)
    result = scan(root)
    # one call blocked, one deadline waited (timed, it was < 5 s: a loaded machine can take
    # that for 303 units)
    assert len(hang.blocked) == 1 and hang.timeouts == 1, hang.blocked
    assert sorted(result.specs) == ["local.service", "ok.service"]
    errors = [p for p in result.problems if p.severity == "error"]
    assert len(errors) == 301
    by_unit = {p.unit: p.message for p in errors}
    for d in range(3):
        for i in range(100):
            assert by_unit[f"n{d}-{i}.service"] == (
                no_answer(f"{NFS}/d{d}/{i}.env", NFS) + f" n{d}-{i}.service until that file "
                "system answers at a later scan (systemctl daemon-reload)"
            )
    assert "is owned by UID 1000" in by_unit["theirs.service"]
    # the scan's own worker thread ended with it (the one stuck in the kernel ends when let
    # go); those of checkers that earlier tests left in reference cycles are collected first
    gc.collect()
    for thread in threading.enumerate():
        if thread.name == "gpuslice-envsafety" and thread not in hang.threads:
            thread.join(5)
            assert not thread.is_alive()


@pytest.mark.parametrize("call", ["readlink", "getxattr"])
def test_a_readlink_or_getxattr_that_does_not_answer(root: Path, hang: Hang, call: str) -> None:
    """readlink (of a symlink there) and getxattr (of a file of root's group-writable by GID 0,
    whose access ACL is asked for) wait at most DEADLINE too."""
    put(root, "/etc/asr/ok.env")
    (root / "srv/nfs").mkdir(parents=True)
    put(root, f"{NFS}/group.env", mode=0o664)
    link(root, f"{NFS}/link.env", "/etc/asr/ok.env")
    hang.mounts(NFS)
    hang.calls = (call,)
    hang.at = (NFS,)
    checker = EnvFileChecker(root)
    path = f"{NFS}/link.env" if call == "readlink" else f"{NFS}/group.env"
    refusal = checker.refusal("x.service", path)
    assert refusal is not None and refusal.reason == no_answer(path, NFS).split(";")[0]
    assert refusal.fix == envsafety.FIX_ANSWER
    assert len(hang.blocked) == 1
    # refused without asking, whatever is asked next there; asked as ever elsewhere
    other = f"{NFS}/group.env" if call == "readlink" else f"{NFS}/link.env"
    assert checker.refusal("x.service", other) == Refusal(
        no_answer(other, NFS).split(";")[0], envsafety.FIX_ANSWER
    )
    assert checker.refusal("x.service", "/etc/asr/ok.env") is None
    assert len(hang.blocked) == 1


def test_without_the_mount_table_every_path_is_refused_unasked(root: Path, hang: Hang) -> None:
    """Where the mount table cannot be opened, a walk cannot tell a FUSE file system a user
    mounted (allow_other, no default_permissions: it shows root's 0644 over asr's own file)
    or a cifs `noperm` from root's own: it took them for root's, and let asr's file set a
    unit's loader. Every path is refused, naming the table, as for an fstab not read whole;
    nothing is asked meanwhile (not even /, which does not answer here), and a later checker
    that can read the table judges as ever."""
    put(root, "/etc/asr/ok.env")
    hang.mounts(MISSING)
    checker = EnvFileChecker(root)  # its realpath of the root is made here, unhung
    hang.at = ("/",)
    table = envsafety.MOUNTINFO  # Hang's, never written
    for path in ("/etc/asr/ok.env", f"{NFS}/a.env"):
        assert checker.refusal("x.service", path) == Refusal(
            f"{path} cannot be checked: {table} cannot be read (No such file or directory): "
            "which file systems users mounted is not known",
            envsafety.FIX_MOUNTINFO,
        )
    assert hang.blocked == []
    hang.at = ()
    hang.mounts()
    assert EnvFileChecker(root).refusal("x.service", "/etc/asr/ok.env") is None


def test_without_the_mount_table_a_unit_s_own_user_is_told_why(root: Path, hang: Hang) -> None:
    """The finding names the table and what fixes it, for one run as root too, as for an
    fstab that cannot be read (`_ANYONES`): its file may be on a FUSE a user mounted, and
    could set what skips the gate."""
    put(root, "/etc/asr/ok.env")
    install(root, "ok.service", "User=asr", "EnvironmentFile=/etc/asr/ok.env")
    install(root, "mine.service", "EnvironmentFile=/etc/asr/ok.env")
    hang.mounts(MISSING)
    [error] = errors(root, "ok.service")
    assert envsafety.MOUNTINFO in error and envsafety.FIX_MOUNTINFO in error
    [error] = errors(root, "mine.service")
    assert envsafety.MOUNTINFO in error and envsafety.FIX_MOUNTINFO in error


def test_calls_on_the_roots_file_system_are_made_directly_others_on_the_worker(
    root: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unit files are read from the root's own file system without a deadline: a call
    there is made on the scan's thread (a call on the worker costs two thread switches,
    ~20-60 us: 10,000 files in /etc would cost ~0.5 s more). One under a mount point is made
    on the worker, and a mount made during the scan (the kernel flags the table) is seen
    before the next call."""
    put(root, "/etc/asr/a.env")
    put(root, "/etc/asr/b.env")
    put(root, "/srv/nfs/a.env")
    (root / "etc/nas").mkdir()
    put(root, "/etc/nas/b.env")
    hang.mounts(NFS)
    threads: dict[str, str] = {}
    real_lstat = os.lstat

    def lstat(path: str, *args: object, **kwargs: object) -> os.stat_result:
        threads[os.fspath(path).removeprefix(str(root)) or "/"] = threading.current_thread().name
        return real_lstat(path)

    checker = EnvFileChecker(root)
    monkeypatch.setattr(os, "lstat", lstat)
    for path in ("/etc/asr/a.env", f"{NFS}/a.env"):
        assert checker.refusal("x.service", path) is None
    assert threads == {
        "/": "MainThread",
        "/etc": "MainThread",
        "/etc/asr": "MainThread",
        "/etc/asr/a.env": "MainThread",
        "/srv": "MainThread",
        NFS: "gpuslice-envsafety",
        f"{NFS}/a.env": "gpuslice-envsafety",
    }
    # /etc/nas mounted now: the table is read again
    hang.mounts(NFS, "/etc/nas")
    monkeypatch.setattr(envsafety._MountTable, "changed", lambda self: True)
    for path in ("/etc/asr/b.env", "/etc/nas/b.env"):
        assert checker.refusal("x.service", path) is None
    assert threads["/etc/asr/b.env"] == "MainThread"
    assert threads["/etc/nas"] == threads["/etc/nas/b.env"] == "gpuslice-envsafety"


def mount_table(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, lines: bytes
) -> Path:
    """The mount table envsafety reads (its MOUNTINFO), holding `lines`."""
    mountinfo = tmp_path_factory.mktemp("proc") / "mountinfo"
    mountinfo.write_bytes(lines)
    monkeypatch.setattr(envsafety, "MOUNTINFO", str(mountinfo))
    return mountinfo


def on_lstat_of(monkeypatch: pytest.MonkeyPatch, path: Path, act: Callable[[], None]) -> None:
    """`act` runs as each lstat of `path` begins: a mount made then, or a FUSE program's
    answer in place of the file system's (it raises)."""
    real_lstat = os.lstat

    def lstat(at: str, *args: object, **kwargs: object) -> os.stat_result:
        if os.fspath(at) == str(path):
            act()
        return real_lstat(at)

    monkeypatch.setattr(os, "lstat", lstat)


# Why /srv/asr/job.env is refused where asr (UID 1000) mounted a FUSE file system on /srv/asr
ON_ASRS_FUSE = (
    "/srv/asr/job.env: its directory /srv/asr is a FUSE file system that UID 1000 "
    "mounted, whose files show whatever owner its program likes"
)


def test_a_fuse_file_system_a_user_mounted_is_no_root_directory(
    root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FUSE shows whatever owner and mode its program likes: asr's sshfs (allow_other, which
    /etc/fuse.conf's user_allow_other lets users ask for) on /srv/asr, a directory of asr's,
    showed root's 0755 there, and asr's files passed for root's. Mounted by root
    (user_id=0), or another file system, it is judged by what it shows."""
    for name in ("asr", "rooted", "nfs"):
        put(root, f"/srv/{name}/job.env")
        install(root, f"{name}.service", "User=asr", f"EnvironmentFile=/srv/{name}/job.env")
    mountinfo = mount_table(
        tmp_path_factory,
        monkeypatch,
        b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        + f"60 22 0:60 / {root}/srv/asr rw,nosuid,nodev shared:1 - fuse.sshfs asr@h:/ "
        "rw,user_id=1000,group_id=1000,allow_other\n"
        f"61 22 0:61 / {root}/srv/rooted rw - fuse.sshfs h:/ rw,user_id=0,group_id=0\n"
        f"62 22 0:62 / {root}/srv/nfs rw - nfs4 nas:/x rw,user_id=1000\n".encode(),
    )
    assert errors(root, "asr.service") == [
        f"{ETC}/asr.service:5: [Service] EnvironmentFile: /srv/asr/job.env: its directory "
        "/srv/asr is a FUSE file system that UID 1000 mounted, whose files show whatever "
        f"owner its program likes; {GATE} asr.service until only root can change that file "
        "and its directories"
    ]
    assert errors(root, "rooted.service") == []
    assert errors(root, "nfs.service") == []
    assert envsafety._user_mounts(mountinfo.read_bytes(), str(root)) == {"/srv/asr": ASR}


def test_a_fuse_file_system_mounted_while_its_mount_point_is_looked_at_is_seen(
    root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table is polled again after each lstat: asr's sshfs mounted on /srv/asr between
    the table's read (before the lstat) and the lstat showed its root's 0755, and the table
    as read named no FUSE there: asr's file passed for root's."""
    put(root, "/srv/asr/job.env")
    mountinfo = mount_table(tmp_path_factory, monkeypatch, b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
    flagged: list[bool] = []  # the kernel's flag on the table, raised at the mount
    monkeypatch.setattr(
        envsafety._MountTable, "changed", lambda self: bool(flagged and flagged.pop())
    )

    def mount() -> None:
        if not mountinfo.read_bytes().count(b"fuse"):
            with mountinfo.open("ab") as f:  # asr's sshfs, mounted just before this lstat
                f.write(
                    f"60 22 0:60 / {root}/srv/asr rw - fuse.sshfs asr@h:/ "
                    "rw,user_id=1000,group_id=1000,allow_other\n".encode()
                )
            flagged.append(True)

    on_lstat_of(monkeypatch, root / "srv/asr", mount)
    refusal = EnvFileChecker(root).refusal("x.service", "/srv/asr/job.env")
    assert refusal is not None
    assert refusal.reason == ON_ASRS_FUSE


def test_a_fuse_file_system_of_a_user_that_says_its_root_is_not_there_is_refused(
    root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asr's FUSE program answers ENOENT (or ENOTDIR) for the lstat of its own root while
    gpuslice looks: /srv/asr/job.env passed for a file not there that only root could make,
    and the gate then read the job.env that program served."""
    put(root, "/srv/asr/job.env")
    mount_table(
        tmp_path_factory,
        monkeypatch,
        b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        + f"60 22 0:60 / {root}/srv/asr rw - fuse.asrfs asrfs "
        "rw,user_id=1000,group_id=1000,allow_other\n".encode(),
    )
    asrs_root = root / "srv/asr"

    def not_there() -> None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(asrs_root))

    on_lstat_of(monkeypatch, asrs_root, not_there)
    refusal = EnvFileChecker(root).refusal("x.service", "/srv/asr/job.env")
    assert refusal is not None
    assert refusal.reason == ON_ASRS_FUSE


def test_the_fuse_mounts_of_users_in_the_mount_table() -> None:
    """Any FUSE type (fuse, fuse.PROGRAM, fuseblk) whose options name a user_id other than 0;
    other file systems, and lines the kernel would not write, are not."""
    table = (
        b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        b"60 22 0:60 / /r/a rw - fuse x rw,user_id=1000,group_id=1000\n"
        b"61 22 0:61 / /r/b rw shared:2 - fuseblk /dev/sdb1 rw,user_id=1001\n"
        b"62 22 0:62 / /r/c rw - fuse.rclone x rw,group_id=5,user_id=1002\n"
        b"63 22 0:63 / /r/d rw - fuse.rclone x rw,user_id=0,group_id=0\n"
        b"64 22 0:64 / /r/e rw - ext4 /dev/sdc1 rw,user_id=1003\n"
        b"65 22 0:65 / /r/f rw - fuse.x x rw,user_id=x\n"
        b"66 22 0:66 / /r/g rw - fuse.x\n"
        b"67 22 0:67 / /q/h rw - fuse.x x rw,user_id=1004\n"
        b"68 22 0:68 / /r/i rw fuse.x x rw,user_id=1005\n"
    )
    assert envsafety._user_mounts(table, "/r") == {"/a": 1000, "/b": 1001, "/c": 1002}


def test_file_systems_whose_kernel_does_not_check_what_they_show_in_the_mount_table() -> None:
    """Mounted by root all the same: a FUSE that lets others in (allow_other) without
    default_permissions, cifs or smb3 noperm, ntfs3 noacsrules. Owner options the kernel shows
    and checks (vfat, cifs uid=), the option elsewhere than in the super block's options (the
    source, the mount's own), and lines the kernel would not write, are not; a mount point
    with the kernel's escapes, and a line of a megabyte, are read as any."""
    long = b"x" * (1 << 20)
    table = (
        b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        b"60 22 0:60 / /r/a rw - fuse.sshfs h:/ rw,user_id=0,group_id=0,allow_other\n"
        b"61 22 0:61 / /r/b rw - fuse.sshfs h:/ rw,user_id=0,default_permissions,allow_other\n"
        b"62 22 0:62 / /r/c rw - fuse.sshfs h:/ rw,user_id=0,group_id=0\n"
        b"63 22 0:63 / /r/d\\040e rw shared:3 - fuseblk /dev/sdb1 rw,allow_other,\n"
        b"64 22 0:64 / /r/f rw - cifs //nas/x rw,vers=3.1.1,noperm,uid=0\n"
        b"65 22 0:65 / /r/g rw - cifs //nas/x rw,uid=1000,forceuid,file_mode=0755\n"
        b"66 22 0:66 / /r/h rw - smb3 //nas/noperm rw,noperm\n"
        b"67 22 0:67 / /r/i rw - ntfs3 /dev/sdc1 rw,uid=0,noacsrules\n"
        b"68 22 0:68 / /r/j rw - vfat /dev/sdd1 rw,uid=1000,gid=1000,fmask=0022\n"
        b"69 22 0:69 / /r/k rw - ext4 /dev/sde1 rw,noperm,allow_other\n"
        b"70 22 0:70 / /r/l rw - cifs //nas/noperm rw,uid=0\n"
        b"71 22 0:71 / /r/m rw,noperm - cifs //nas/x rw\n"
        b"72 22 0:72 / /q/n rw - cifs //nas/x rw,noperm\n"
        b"73 22 0:73 / /r/o rw cifs //nas/x rw,noperm\n"
        b"74 22 0:74 / /r/p rw - fuse x rw,allow_other," + long + b"\n"
        b"75 22 0:75 / /r/" + long + b" rw - cifs //nas/x rw,noperm\n"
    )
    found = envsafety._unchecked_mounts(table, "/r")
    fuse = "whose program, not the kernel, decides who writes there, whatever owner it shows"
    anyone = "where the kernel lets anyone write, whatever owner and mode it shows"
    assert found == {
        "/a": f"a FUSE file system mounted allow_other without default_permissions, {fuse}",
        "/d e": f"a FUSE file system mounted allow_other without default_permissions, {fuse}",
        "/f": f"a cifs file system mounted noperm, {anyone}",
        "/h": f"a smb3 file system mounted noperm, {anyone}",
        "/i": f"a ntfs3 file system mounted noacsrules, {anyone}",
        "/p": f"a FUSE file system mounted allow_other without default_permissions, {fuse}",
        "/" + long.decode(): f"a cifs file system mounted noperm, {anyone}",
    }


def test_a_file_system_whose_kernel_does_not_check_what_it_shows_is_no_root_directory(
    root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """root's sshfs with allow_other and without default_permissions on /srv/nas showed
    root's 0755, and any user wrote there as its remote user: asr's job.env passed for
    root's. With default_permissions the kernel checks what it shows."""
    for name in ("nas", "checked"):
        put(root, f"/srv/{name}/job.env")
        install(root, f"{name}.service", "User=asr", f"EnvironmentFile=/srv/{name}/job.env")
    mountinfo = tmp_path_factory.mktemp("proc") / "mountinfo"
    mountinfo.write_bytes(
        b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        + f"60 22 0:60 / {root}/srv/nas rw - fuse.sshfs h:/ "
        "rw,user_id=0,group_id=0,allow_other\n"
        f"61 22 0:61 / {root}/srv/checked rw - fuse.sshfs h:/ "
        "rw,user_id=0,group_id=0,default_permissions,allow_other\n".encode()
    )
    monkeypatch.setattr(envsafety, "MOUNTINFO", str(mountinfo))
    assert errors(root, "nas.service") == [
        f"{ETC}/nas.service:5: [Service] EnvironmentFile: /srv/nas/job.env: its directory "
        "/srv/nas is a FUSE file system mounted allow_other without default_permissions, "
        "whose program, not the kernel, decides who writes there, whatever owner it shows; "
        f"{GATE} nas.service until only root can change that file and its directories"
    ]
    assert errors(root, "checked.service") == []


def test_where_fstab_lets_users_mount_a_file_system_of_theirs_is_no_root_directory(
    root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """/etc/fstab's `user` (or `users`, `owner`, `group`) lets asr mount a USB stick on
    /mnt/usb whenever they like: its files show whatever owner they were made with elsewhere
    (root's), and the empty mount point looked root's at the scan. A path there is refused,
    one a symlink leads there too (mount(8) follows the fstab's symlinks), whether or not it
    is mounted; an entry users may not mount is judged by what it shows."""
    put(
        root,
        "/etc/fstab",
        "# <file system> <mount point> <type> <options> <dump> <pass>\n"
        "UUID=1 / ext4 errors=remount-ro 0 1\n"
        "/dev/sdb1 /mnt/usb auto noauto,user 0 0\n"
        "/dev/sdc1\t/srv/link/stick  vfat  users,noauto  0  0\n"
        "/dev/sdd1 /mnt/data ext4 defaults,nouser 0 2\n",
    )
    put(root, "/mnt/usb/job.env")
    put(root, "/mnt/data/job.env")
    (root / "data/stick").mkdir(parents=True)
    link(root, "/srv/link", "/data")
    link(root, "/etc/asr/usb", "/mnt/usb")
    cases = {
        "usb.service": "/mnt/usb/job.env",
        "missing.service": "-/mnt/usb/none/job.env",
        "linked.service": "-/data/stick/job.env",
        "through.service": "/etc/asr/usb/job.env",
        "data.service": "/mnt/data/job.env",
    }
    for name, path in cases.items():
        install(root, name, "User=asr", f"EnvironmentFile={path}")
    refused = {name for name in cases if errors(root, name)}
    assert refused == set(cases) - {"data.service"}
    assert errors(root, "usb.service") == [
        f"{ETC}/usb.service:5: [Service] EnvironmentFile: /mnt/usb/job.env: its directory "
        "/mnt/usb is where /etc/fstab lets users mount a file system of theirs (user, users, "
        f"owner or group), whose files show whatever owner they were made with; {GATE} "
        "usb.service until it names a file elsewhere, that only root can change"
    ]
    # the mount points something is mounted on are not looked at: a network file system
    # there that does not answer would cost every scan a deadline
    mount_table(
        tmp_path_factory,
        monkeypatch,
        b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        + f"23 22 8:17 / {root}/mnt/usb rw - vfat /dev/sdb1 rw\n".encode()
        + f"24 22 8:33 / {root}/data/stick rw - vfat /dev/sdc1 rw\n".encode(),
    )
    put(root, "/etc/asr/ok.env")
    looked: list[str] = []
    real_lstat = os.lstat

    def lstat(path: str, *args: object, **kwargs: object) -> os.stat_result:
        looked.append(os.fspath(path))
        return real_lstat(path)

    monkeypatch.setattr(os, "lstat", lstat)
    assert EnvFileChecker(root).refusal("x.service", "/etc/asr/ok.env") is None
    assert f"{root}/srv/link" in looked
    assert f"{root}/mnt/usb" not in looked and f"{root}/data/stick" not in looked


def test_an_fstab_entry_under_another_is_no_way_around_it(root: Path) -> None:
    """The directories of fstab's user mount points are walked before those points are known
    (as the scan's first walk starts): /srv/usb, the directory of /srv/usb/part2, was then
    remembered as root's alone, and a later walk to /srv/usb/job.env started there, past
    /srv/usb, which asr may mount a USB stick on. /srv/usb/part2, under another user mount
    point, is now one a user can redirect (a symlink part2 on their stick): every path is
    refused, /srv/usb/job.env too, with what fixes it."""
    put(
        root,
        "/etc/fstab",
        "/dev/sdb1 /srv/usb auto noauto,user 0 0\n/dev/sdb2 /srv/usb/part2 auto noauto,user 0 0\n",
    )
    (root / "srv/usb/part2").mkdir(parents=True)
    put(root, "/srv/usb/job.env")
    install(root, "usb.service", "User=asr", "EnvironmentFile=/srv/usb/job.env")
    [error] = errors(root, "usb.service")
    assert "/srv/usb is where /etc/fstab lets users mount a file system of theirs" in error
    assert "/etc/fstab lets users mount on /srv/usb/part2, where a symlink" in error
    assert error.endswith(envsafety.FIX_USER_POINT)


def test_an_fstab_mount_point_under_another_refuses_every_walk(root: Path) -> None:
    """asr mounts a stick of theirs on /srv/usb holding the symlink part2 -> /etc/asr, then
    `mount /srv/usb/part2`: mount(8) follows it as asr, the second entry matches, and the
    second device lands on /etc/asr, whose files were taken for root's. A point under where
    another's symlink leads (/srv/link -> /opt/stick, and /opt/stick/part2), one whose own
    symlink leads through another (/srv/x -> usb/deep/part3, /srv/usb/deep -> /opt/deep today)
    or one under another whose directories are not there yet (/srv/none/a/b) is the same;
    /srv/usb2 beside /srv/usb is no nesting."""
    put(root, "/etc/asr/job.env")
    install(root, "job.service", "User=asr", "EnvironmentFile=/etc/asr/job.env")
    install(root, "rootjob.service", "EnvironmentFile=/etc/asr/job.env")
    (root / "srv/usb").mkdir(parents=True)
    (root / "srv/usb2").mkdir(parents=True)
    (root / "opt/stick").mkdir(parents=True)
    (root / "opt/deep").mkdir(parents=True)
    link(root, "/srv/usb/deep", "/opt/deep")
    link(root, "/srv/link", "/opt/stick")
    link(root, "/srv/x", "usb/deep/part3")
    beside = "/dev/sdb1 /srv/usb auto noauto,user 0 0\n/dev/sdc1 /srv/usb2 auto noauto,user 0 0\n"
    put(root, "/etc/fstab", beside)
    assert errors(root, "job.service") == []
    for outer, inner in (
        ("/srv/usb", "/srv/usb/part2"),
        ("/srv/link", "/opt/stick/part2"),
        ("/srv/usb", "/srv/x"),
        ("/srv/none/a", "/srv/none/a/b"),
    ):
        put(
            root,
            "/etc/fstab",
            f"/dev/sdb1 {outer} auto noauto,user 0 0\n/dev/sdb2 {inner} auto noauto,users 0 0\n",
        )
        for name in ("job.service", "rootjob.service"):
            [error] = errors(root, name)
            assert (
                f"/etc/asr/job.env cannot be checked: /etc/fstab lets users mount on {inner}, "
                "where a symlink someone but root may put on its way leads as they mount: "
            ) in error, error
            assert "is where /etc/fstab lets users mount a file system of theirs" in error
            assert error.endswith(envsafety.FIX_USER_POINT), error


def test_an_fstab_mount_point_that_is_a_symlink_counts_where_it_leads(root: Path) -> None:
    """mount(2) follows the mount point's own symlink: asr's stick mounted on /srv/usb, root's
    link to /opt/job, lands on /opt/job, whose files then show whatever owner they were made
    with. /opt/job was taken for root's alone (only /srv/usb and its directory's symlinks
    counted)."""
    put(root, "/etc/fstab", "/dev/sdb1 /srv/usb auto noauto,user 0 0\n")
    put(root, "/opt/job/job.env")
    put(root, "/opt/other/job.env")
    link(root, "/srv/usb", "../opt/job")
    for name in ("job", "other"):
        install(root, f"{name}.service", "User=asr", f"EnvironmentFile=/opt/{name}/job.env")
    assert errors(root, "job.service") == [
        f"{ETC}/job.service:5: [Service] EnvironmentFile: /opt/job/job.env: its directory "
        "/opt/job is where /etc/fstab lets users mount a file system of theirs (user, users, "
        f"owner or group), whose files show whatever owner they were made with; {GATE} "
        "job.service until it names a file elsewhere, that only root can change"
    ]
    assert errors(root, "other.service") == []


def test_an_fstab_mount_point_a_user_can_redirect_refuses_every_walk(root: Path) -> None:
    """mount(8) follows the symlinks of a user's mount point as they mount, and the fstab
    entry matches where it leads then: asr, who owns /srv/asr, made /srv/asr/usb a symlink to
    /etc/job after the scan and mounted a stick of theirs on it. Where a user mount point's
    directory, or the way its root's symlink leads, is not root's alone, every path is
    refused; /media/cdrom0 (Debian's default fstab, /media root's) changes nothing."""
    put(root, "/etc/job/job.env")
    install(root, "job.service", "User=asr", "EnvironmentFile=/etc/job/job.env")
    install(root, "rootjob.service", "EnvironmentFile=/etc/job/job.env")
    (root / "srv/asr").mkdir(parents=True)
    os.chown(root / "srv/asr", ASR, ASR)
    (root / "home/asr").mkdir(parents=True)
    os.chown(root / "home/asr", ASR, ASR)
    (root / "media/cdrom0").mkdir(parents=True)
    link(root, "/mnt/stick", "/srv/asr/stick")
    fstab = "/dev/sr0 /media/cdrom0 udf,iso9660 user,noauto 0 0\n"
    put(root, "/etc/fstab", fstab)
    assert errors(root, "job.service") == []
    for point, cause in (
        ("/srv/asr/usb", "mount: /srv/asr is owned by UID 1000, who can change it;"),
        ("/home/asr/usb", "mount: /home/asr is owned by UID 1000, who can change it;"),
        ("/mnt/stick", "mount: /mnt/stick: /srv/asr, reached through the symlink /mnt/stick, is"),
    ):
        put(root, "/etc/fstab", fstab + f"/dev/sdb1 {point} auto noauto,user 0 0\n")
        for name in ("job.service", "rootjob.service"):
            [error] = errors(root, name)
            assert (
                f"/etc/job/job.env cannot be checked: /etc/fstab lets users mount on {point}, "
                "where a symlink someone but root may put on its way leads as they mount: "
            ) in error, error
            assert cause in error, error
            assert error.endswith(
                "until each mount point /etc/fstab lets users mount on is in a directory only "
                "root can change"
            )


@pytest.mark.parametrize("spot", ["_fstab_points", "_lands"])
def test_fstab_user_mount_points_that_raised_refuse_every_walk(
    root: Path, monkeypatch: pytest.MonkeyPatch, spot: str
) -> None:
    """An exception while the user mount points were worked out left them none, or some, for
    the rest of the scan: the first file was refused as not checked, the next ones walked as
    if asr's /srv/usb were root's. Now every walk is refused, saying why."""
    put(root, "/etc/fstab", "/dev/sdb1 /srv/usb auto noauto,user 0 0\n")
    put(root, "/srv/usb/job.env")
    put(root, "/etc/job/job.env")

    def broken(*args: object) -> None:
        raise RuntimeError("broken")

    if spot == "_lands":
        monkeypatch.setattr(EnvFileChecker, spot, broken)
    else:
        monkeypatch.setattr(envsafety, spot, broken)
    checker = EnvFileChecker(root)
    for value in ("/etc/job/job.env", "/srv/usb/job.env", "/etc/job/job.env"):
        run_as = RunAs(user="asr")
        run_as.env_files.append(envsafety.Assignment(f"{ETC}/x.service", 5, value))
        [finding] = checker.check("x.service", run_as)
        assert finding.message.startswith(
            f"{value} cannot be checked: /etc/fstab's user mount points cannot be worked out "
            "(RuntimeError)"
        ), finding
        assert finding.message.endswith(envsafety.FIX_FSTAB)


def test_an_fstab_entrys_last_user_option_wins() -> None:
    """libmount sets each of user, users, owner and group's flag and clears it at its `no`
    form, the last winning: `user,nouser` is no user mount (it was taken for one), while
    `nouser,user` (it is) and `nouser,users` (another flag) are; a comma in a quoted value
    splits nothing."""
    text = (
        b"/dev/sda /mnt/a auto user,nouser 0 0\n"
        b"/dev/sdb /mnt/b auto nouser,user 0 0\n"
        b"/dev/sdc /mnt/c auto users,noauto,nousers 0 0\n"
        b"/dev/sdd /mnt/d auto nouser,users 0 0\n"
        b'/dev/sde /mnt/e auto user,context="a,nouser" 0 0\n'
        b"/dev/sdf /mnt/f auto owner,nogroup 0 0\n"
        b"/dev/sdg /mnt/g auto group,nogroup,,noowner 0 0\n"
    )
    assert envsafety._fstab_points(text) == {"/mnt/b", "/mnt/d", "/mnt/e", "/mnt/f"}


def test_an_fstab_entrys_options_are_unmangled_as_libmount_does() -> None:
    """libmount undoes `\\ooo` in every field of fstab, the options too, before it splits them
    at commas: `\\165ser` is `user`, `\\054` a comma between two options, and an unmangled
    `\\000` ends the string there. Read as written, each was no user mount."""
    text = (
        b"/dev/sda /mnt/a auto \\165ser 0 0\n"
        b"/dev/sdb /mnt/b auto noauto\\054users 0 0\n"
        b"/dev/sdc /mnt/c auto user\\000,nouser 0 0\n"
        b"/dev/sdd /mnt/d auto user\\054nouser 0 0\n"
    )
    assert envsafety._fstab_points(text) == {"/mnt/a", "/mnt/b", "/mnt/c"}


def test_an_fstab_entrys_fields_are_split_at_blanks_and_tabs_alone() -> None:
    """libmount splits a line of fstab at spaces and tabs, nothing else (a `\\r` before its
    newline dropped): a form feed is part of the options `noauto\\f,user`, one user mount,
    and a vertical tab part of the mount point. Split at any whitespace, the options read
    `noauto` alone, and the point `/mnt/b`."""
    text = (
        b"/dev/sda /mnt/a auto noauto\x0c,user 0 0\n"
        b"/dev/sdb /mnt/b\x0bc auto user 0 0\n"
        b"/dev/sdc\t /mnt/d auto user\r\n"
    )
    assert envsafety._fstab_points(text) == {"/mnt/a", "/mnt/b\x0bc", "/mnt/d"}


def test_an_fstab_not_read_whole_refuses_every_walk(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fstab cut at MAX_ENV_FILE bytes hid a user mount point past the cut: /mnt/usb was
    taken for root's alone. One larger, or that cannot be read (not a regular file here),
    leaves where users may mount unknown: every path is refused; none there is no user
    mount point."""
    monkeypatch.setattr(envsafety, "MAX_ENV_FILE", 100)
    fstab = put(root, "/etc/fstab", "#" * 99 + "\n/dev/sdb1 /mnt/usb auto noauto,user 0 0\n")
    put(root, "/mnt/usb/job.env")
    install(root, "usb.service", "User=asr", "EnvironmentFile=/mnt/usb/job.env")
    assert errors(root, "usb.service") == [
        f"{ETC}/usb.service:5: [Service] EnvironmentFile: /mnt/usb/job.env cannot be checked: "
        f"/etc/fstab is larger than 100 bytes; {GATE} usb.service until /etc/fstab can be "
        "read whole"
    ]
    fstab.unlink()
    fstab.mkdir()
    [error] = errors(root, "usb.service")
    assert "/mnt/usb/job.env cannot be checked: /etc/fstab cannot be read: not a regular" in error
    fstab.rmdir()
    assert errors(root, "usb.service") == []


def test_an_fstab_not_read_whole_refuses_a_root_units_environment_file(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where users may mount is unknown, /mnt/usb/job.env may be on asr's stick, who could set
    LD_TRACE_LOADED_OBJECTS=1 there after the scan: a unit run as root was managed with that
    file neither read nor refused, its start let through ungated without a word."""
    monkeypatch.setattr(envsafety, "MAX_ENV_FILE", 100)
    put(root, "/etc/fstab", "#" * 99 + "\n/dev/sdb1 /mnt/usb auto noauto,user 0 0\n")
    put(root, "/mnt/usb/job.env")
    install(root, "usb.service", "EnvironmentFile=/mnt/usb/job.env")
    assert errors(root, "usb.service") == [
        f"{ETC}/usb.service:4: [Service] EnvironmentFile: /mnt/usb/job.env cannot be checked: "
        f"/etc/fstab is larger than 100 bytes; {GATE} usb.service until /etc/fstab can be "
        "read whole"
    ]
    (root / "etc/fstab").unlink()
    assert errors(root, "usb.service") == []


def test_the_entries_of_fstab_that_users_may_mount() -> None:
    """fstab(5): blank-separated fields, `\\ooo` escapes, `#` comments; `user`, `users`,
    `owner` or `group` among the options (not `nouser`, nor cifs's `user=NAME`), mount points
    as systemd simplifies them, and lines too short or too long are read as any."""
    long = b"x" * (1 << 20)
    text = (
        b"# /dev/sdz /mnt/comment auto user 0 0\n"
        b"/dev/sda /mnt/a auto user 0 0\n"
        b"/dev/sdb\t/mnt/b\\040c auto noauto,users\n"
        b"/dev/sdc //mnt//d/./ auto owner\n"
        b"/dev/sdd /mnt/e/../f auto rw,group,noexec\n"
        b"/dev/sde /mnt/g auto nouser\n"
        b"//nas/x /mnt/h cifs user=asr,noauto\n"
        b"/dev/sdf /mnt/i auto\n"
        b"/dev/sdg relative auto user\n"
        b"/dev/sdh /mnt/" + long + b" auto user\n"
        b"/dev/sdi /mnt/j auto " + long + b",user\n"
        # libmount's unmangled \\000 ends the C string there: mount(8) mounts on /mnt/k
        b"/dev/sdj /mnt/k\\000x auto user\n"
    )
    assert envsafety._fstab_points(text) == {
        "/mnt/a",
        "/mnt/b c",
        "/mnt/d",
        "/mnt/f",
        "/mnt/" + long.decode(),
        "/mnt/j",
        "/mnt/k",
    }


def test_the_mount_table_as_the_kernel_writes_it() -> None:
    """/proc/self/mountinfo: the mount point is the fifth field, with space, tab, newline and
    backslash written as \\ooo; only those at or under the root are kept, as system paths."""
    table = (
        b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
        b"40 22 0:50 / /r/srv/nfs\\040data rw shared:9 - nfs4 nas:/x rw\n"
        b"41 22 0:51 / /r/a\\134b\\011c\\012d rw - nfs nas:/y rw\n"
        b"42 22 0:52 / /r rw - tmpfs tmpfs rw\n"
        b"43 22 0:53 / /rx rw - tmpfs tmpfs rw\n"
        b"44 22 0:54 / /r/\\377 rw - tmpfs tmpfs rw\n"
        b"short line\n"
    )
    assert envsafety._mount_points(table, "/r") == {
        "/",
        "/srv/nfs data",
        "/a\\b\tc\nd",
        os.fsdecode(b"/\xff"),
    }
    assert "/rx" in envsafety._mount_points(table, "")


def test_a_call_that_does_not_answer_never_holds_up_the_exit(
    root: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The thread stuck in the kernel is a daemon: the generator (or the controller) that
    gave up on it still exits."""
    script = (
        "import os, sys, threading\n"
        "from gpuslice import envsafety\n"
        "envsafety.MOUNTINFO = sys.argv[2]\n"
        "real = os.lstat\n"
        "def lstat(path, *a, **k):\n"
        "    if os.fspath(path).endswith('/srv/nfs'):\n"
        "        threading.Event().wait()\n"
        "    return real(path, *a, **k)\n"
        "os.lstat = lstat\n"
        "envsafety.DEADLINE = 1.0\n"
        "checker = envsafety.EnvFileChecker(sys.argv[1])\n"
        "print(checker.refusal('x.service', '/srv/nfs/x.env').reason)\n"
    )
    (root / "srv/nfs").mkdir(parents=True)
    mountinfo = tmp_path_factory.mktemp("proc") / "mountinfo"
    mountinfo.write_text(
        f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n40 22 0:50 / {root}/srv/nfs rw - nfs4 nas:/x rw\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(root), str(mountinfo)],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (
        "/srv/nfs/x.env cannot be checked: /srv/nfs did not answer within 1 s "
        "(a network file system not answering?)\n"
    )


def test_the_worker_is_a_daemon_and_hands_back_what_its_call_raised(root: Path, hang: Hang) -> None:
    """A stuck call's thread must never hold up the exit (a daemon thread; the subprocess
    test above runs the source tree, not a mutated copy); an error of a call on the worker
    (a file not there under a mount point: only root can make it) is the call's answer, not
    a call that did not answer."""
    put(root, "/srv/nfs/a.env")
    hang.mounts(NFS)
    checker = EnvFileChecker(root)
    assert checker.refusal("x.service", f"{NFS}/missing.env") is None
    assert checker.refusal("x.service", f"{NFS}/a.env") is None
    workers = [t for t in threading.enumerate() if t.name == "gpuslice-envsafety"]
    assert workers and all(t.daemon for t in workers)


def test_the_mount_table_is_read_once_until_the_kernel_flags_it(
    root: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Polled, not read again at every call (10,000 files: a read each); its descriptor is
    not inherited by what the controller runs."""
    put(root, "/etc/asr/a.env")
    put(root, "/etc/asr/b.env")
    hang.mounts(NFS)
    reads: list[str] = []
    read = envsafety._read_mount_table

    def counted(path: str) -> bytes:
        reads.append(path)
        return read(path)

    monkeypatch.setattr(envsafety, "_read_mount_table", counted)
    checker = EnvFileChecker(root)
    for name in ("a", "b"):
        assert checker.refusal("x.service", f"/etc/asr/{name}.env") is None
    assert len(reads) == 1
    fd = checker._mounts._fd
    assert fd is not None and fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC


def test_a_mount_table_that_cannot_be_read_again_refuses_the_walk_under_way(
    root: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read at the first walk, then flagged by the kernel (a mount made) as a walk goes on,
    and not read again: the users' mounts as last read were trusted, the new one unseen.
    The walk under way is refused at the directory it polled at, and every later one."""
    put(root, "/etc/asr/a.env")
    put(root, "/etc/asr/b/c.env")
    hang.mounts()
    checker = EnvFileChecker(root)
    assert checker.refusal("x.service", "/etc/asr/a.env") is None
    flags = [False, True]  # the walk's first poll, then the one after /etc's lstat

    def failing(path: str) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(envsafety, "_read_mount_table", failing)
    monkeypatch.setattr(envsafety._MountTable, "changed", lambda self: flags and flags.pop(0))
    for path in ("/etc/asr/b/c.env", "/etc/asr/a2.env"):
        assert checker.refusal("x.service", path) == Refusal(
            f"{path} cannot be checked: {envsafety.MOUNTINFO} cannot be read (Input/output "
            "error): which file systems users mounted is not known",
            envsafety.FIX_MOUNTINFO,
        )
    assert not flags


def test_a_mount_table_that_does_not_answer_refuses_every_path(
    root: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc does not hang, but the read of the table goes through the worker too: one that
    did not answer leaves the users' mounts unknown, and every path is refused (it was
    walked as without a table, a FUSE file system a user mounted taken for root's)."""
    put(root, "/etc/asr/a.env")
    hang.mounts(NFS)
    monkeypatch.setattr(envsafety, "_read_mount_table", lambda path: hang_for(hang))
    assert EnvFileChecker(root).refusal("x.service", "/etc/asr/a.env") == table_unanswered(
        "/etc/asr/a.env"
    )


def table_unanswered(path: str) -> Refusal:
    return Refusal(
        f"{path} cannot be checked: {envsafety.MOUNTINFO} did not answer within 1 s as it was read",
        envsafety.FIX_ANSWER,
    )


def hang_for(hang: Hang) -> bytes:
    hang.block()
    return b""


def test_a_mount_point_is_a_whole_path_component() -> None:
    assert envsafety._mount_of("/srv/nfs2/a", {"/srv/nfs"}) is None
    assert envsafety._mount_of("/srv/nfs/a/b", {"/srv/nfs", "/srv"}) == "/srv/nfs"
    assert envsafety._mount_of("/srv", {"/srv/nfs"}) is None


def test_a_short_line_does_not_end_the_mount_table() -> None:
    table = b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\nshort\n40 22 0:50 / /srv/nfs rw - nfs4 x rw\n"
    assert envsafety._mount_points(table, "") == {"/", "/srv/nfs"}


def test_a_mount_that_does_not_answer_keeps_one_stuck_thread_however_many_scans(
    root: Path, hang: Hang
) -> None:
    """The controller rescans at each daemon-reload, a long-lived process: each scan asked
    the hung mount again and left one more thread stuck in the kernel, so a daemon-reload
    loop during an NFS outage grew the controller's threads without bound. While the call of
    an earlier scan has not returned, later scans refuse paths under its mount point without
    a call of their own, and at once (no deadline waited); another mount that does not
    answer gets its own one. Once the stuck call returns, the next scan asks again (the
    refusal's fix: "until that file system answers at a later scan")."""
    nas = "/srv/nas"
    for point in (NFS, nas):
        put(root, f"{point}/a.env")
    put(root, "/etc/asr/ok.env")
    hang.mounts(NFS, nas)
    hang.at = (NFS, nas)
    for _ in range(5):
        checker = EnvFileChecker(root)  # a scan's
        waited = hang.timeouts
        for point in (NFS, nas):
            path = f"{point}/a.env"
            assert checker.refusal("x.service", path) == Refusal(
                no_answer(path, point).split(";")[0], envsafety.FIX_ANSWER
            )
        assert checker.refusal("x.service", "/etc/asr/ok.env") is None
    assert hang.blocked == [NFS, nas]  # one call, and one stuck thread, per mount
    assert hang.timeouts == waited == 2  # the last scan waited no deadline
    stuck = [t for t in threading.enumerate() if t in hang.threads and t.is_alive()]
    assert len(stuck) == 2
    hang.release()  # the server is back: the stuck calls return, their threads end
    checker = EnvFileChecker(root)
    assert checker.refusal("x.service", f"{NFS}/a.env") is None
    assert checker.refusal("x.service", f"{nas}/a.env") is None
    assert {f"{NFS}/a.env", f"{nas}/a.env"} <= set(hang.blocked[2:])  # asked again, answered


def test_a_mount_table_read_that_does_not_answer_is_not_read_again_until_it_returns(
    root: Path, hang: Hang, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read of the table goes through the worker too: a later scan does not leave a
    second thread stuck on it, it refuses every path at once (the users' mounts not known);
    once it returns, the table is read again."""
    put(root, "/etc/asr/a.env")
    hang.mounts(NFS)
    reads: list[str] = []
    read = envsafety._read_mount_table

    def hung(path: str) -> bytes:
        reads.append(path)
        hang_for(hang)
        return read(path)

    monkeypatch.setattr(envsafety, "_read_mount_table", hung)
    for _ in range(3):
        checker = EnvFileChecker(root)
        assert checker.refusal("x.service", "/etc/asr/a.env") == table_unanswered("/etc/asr/a.env")
        assert checker._mounts.points() is None
    assert len(reads) == 1
    hang.release()
    checker = EnvFileChecker(root)
    assert checker.refusal("x.service", "/etc/asr/a.env") is None
    assert checker._mounts.points() == {NFS}
    assert len(reads) == 2


def test_a_mount_that_did_not_answer_stays_refused_for_the_rest_of_the_scan(
    root: Path, hang: Hang
) -> None:
    """Once a call under a mount point did not answer, every later path under it is refused
    for the rest of the scan without asking, even when the stuck call has returned since:
    the scan's units there are judged alike (not some refused, some managed, by when the
    server came back), and the refusal's fix ("at a later scan") holds. The mount point's
    own attributes answered (cached): the calls refused are those below it."""
    for d in ("d", "e"):
        put(root, f"{NFS}/{d}/x.env")
    hang.mounts(NFS)
    hang.at = (f"{NFS}/d",)
    checker = EnvFileChecker(root)
    path = f"{NFS}/d/x.env"
    assert checker.refusal("x.service", path) == Refusal(
        no_answer(path, NFS).split(";")[0], envsafety.FIX_ANSWER
    )
    hang.release()  # the server is back, the stuck call returned: its thread ended
    hang.at = ()
    for path in (f"{NFS}/d/y.env", f"{NFS}/e/x.env"):
        assert checker.refusal("x.service", path) == Refusal(
            no_answer(path, NFS).split(";")[0], envsafety.FIX_ANSWER
        )
    assert hang.blocked == [f"{NFS}/d"]
    assert EnvFileChecker(root).refusal("x.service", f"{NFS}/e/x.env") is None  # next scan


def test_a_stuck_call_refuses_the_paths_under_its_mount_point_that_another_checker_asks(
    root: Path, hang: Hang
) -> None:
    """Two checkers at once (a scan's and `checkpoint.check_tool`'s): one whose walk has the
    mount point's attributes already asks next for a path below it, not the mount point
    itself. While another checker's call there is stuck, that path is refused at once,
    without a call: a second thread stuck on the same mount, and a deadline waited, each
    time."""
    for name in ("a", "b"):
        put(root, f"{NFS}/{name}.env")
    hang.mounts(NFS)
    early = EnvFileChecker(root)
    assert early.refusal("x.service", f"{NFS}/a.env") is None  # / ... /srv/nfs remembered
    hang.at = (NFS,)
    late = EnvFileChecker(root)
    assert late.refusal("x.service", f"{NFS}/a.env") is not None
    assert hang.blocked == [NFS] and hang.timeouts == 1
    assert early.refusal("x.service", f"{NFS}/b.env") == Refusal(
        no_answer(f"{NFS}/b.env", NFS).split(";")[0], envsafety.FIX_ANSWER
    )
    assert hang.blocked == [NFS] and hang.timeouts == 1  # no call, no deadline waited
