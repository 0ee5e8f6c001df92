"""A unit that runs as another user is not managed while someone but root can change one of
its EnvironmentFile=s: gpuslice's gate (`ExecStartPre=+`) runs as root with its environment.

Each test scans a root under tmp_path whose files are made root's or another UID's with
os.chown (the tests run as root), and pairs what is refused with what is not.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

import pytest

from gpuslice import envsafety
from gpuslice.annotations import Problem, load_spec, scan
from gpuslice.envsafety import EnvFileChecker, RunAs
from gpuslice.unitfiles import Entry

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

ETC = "/etc/systemd/system"
ASR = 1000  # a user's UID and GID
ANNOTATION = "\n[X-GPUSlice]\nPriority=10\n"
GATE = "gpuslice's gate runs as root with this unit's environment, so gpuslice does not manage"


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


def link(root: Path, path: str, target: str) -> None:
    real = root / path.lstrip("/")
    real.parent.mkdir(parents=True, exist_ok=True)
    real.symlink_to(target)


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


def test_group_writable_by_a_users_group_is_refused_by_gid_0_is_not(root: Path) -> None:
    put(root, "/etc/asr/group.env", mode=0o664)
    os.chown(root / "etc/asr/group.env", 0, ASR)
    put(root, "/etc/asr/root-group.env", mode=0o664)
    install(root, "group.service", "User=asr", "EnvironmentFile=/etc/asr/group.env")
    install(root, "root-group.service", "User=asr", "EnvironmentFile=/etc/asr/root-group.env")
    assert errors(root, "root-group.service") == []
    [error] = errors(root, "group.service")
    assert f"/etc/asr/group.env is writable by group GID {ASR} (mode 0664); {GATE}" in error


def _acl(path: Path, user: int) -> None:
    """An access ACL that lets `user` write, as `setfacl -m u:USER:rw` makes it."""

    def entry(tag: int, perm: int, ident: int = 0xFFFFFFFF) -> bytes:
        return struct.pack("<HHI", tag, perm, ident)

    blob = struct.pack("<I", 2) + b"".join(
        [entry(0x01, 6), entry(0x02, 6, user), entry(0x04, 4), entry(0x10, 6), entry(0x20, 4)]
    )
    try:
        os.setxattr(path, "system.posix_acl_access", blob)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            pytest.skip("no POSIX ACLs on this file system")
        raise


def test_an_acl_that_lets_a_user_write_is_refused(root: Path) -> None:
    real = put(root, "/etc/asr/acl.env", mode=0o644)
    _acl(real, ASR)
    assert stat.S_IMODE(real.stat().st_mode) == 0o664 and real.stat().st_gid == 0
    put(root, "/etc/asr/plain.env", mode=0o664)
    install(root, "acl.service", "User=asr", "EnvironmentFile=/etc/asr/acl.env")
    install(root, "plain.service", "User=asr", "EnvironmentFile=/etc/asr/plain.env")
    assert errors(root, "plain.service") == []
    [error] = errors(root, "acl.service")
    assert "/etc/asr/acl.env is group-writable with an access ACL" in error


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
    assert f"/etc/job/bad.env is owned by UID {ASR}" in by_unit["job@bad.service"]
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


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/a/%n/%N/%p/%P/%i/%I/%j/%J", "/a/x-y@a-b.service/x-y@a-b/x-y/x/y/a-b/a/b/y/y"),
        ("%t %S %C %L %E %T %V %% %", "/run /var/lib /var/cache /var/log /etc /tmp /var/tmp % %"),
        ("/e/%I", "/e/a/b"),
    ],
)
def test_specifier_values(value: str, expected: str) -> None:
    assert envsafety.expand("x-y@a-b.service", value) == (expected, None)


def test_an_unescaped_instance_is_walked_as_systemd_would_name_it(root: Path) -> None:
    put(root, "/srv/asr/asr.env", uid=ASR)
    install(root, "job@.service", "User=asr", "EnvironmentFile=-/%I")
    name = "job@srv-asr-asr.env.service"  # %I is srv/asr/asr.env
    put(root, f"{ETC}/{name}.d/x.conf", "[Unit]\n")
    [error] = errors(root, name)
    assert f"EnvironmentFile: /srv/asr/asr.env is owned by UID {ASR}" in error


def test_dynamic_user_is_another_user(root: Path) -> None:
    put(root, "/var/lib/private/asr/asr.env", uid=61000)
    for value, refused in (("yes", True), ("no", False), ("bogus", True)):
        install(
            root,
            f"dyn-{value}.service",
            f"DynamicUser={value}",
            "EnvironmentFile=/var/lib/private/asr/asr.env",
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
    """Root already gave the file's writers root before gpuslice: such a unit is not
    checked. Only the last User= counts, and the list of files restarts at an empty one."""
    put(root, "/etc/asr/theirs.env", uid=ASR)
    for name, (before, after) in RUNS_AS.items():
        install(root, name, *before, "EnvironmentFile=/etc/asr/theirs.env", *after)
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


@pytest.mark.parametrize(
    ("make", "value", "why"),
    [
        ("fifo", "/etc/asr/fifo.env", "/etc/asr/fifo.env is a FIFO, not a regular file"),
        ("dir", "/etc/asr", "/etc/asr is a directory, not a regular file"),
        ("loop", "/etc/asr/loop1", "more than 32 symlinks (a loop?)"),
        (None, "/a" * 10_000, "longer than 4095 bytes"),
        (None, "asr.env", "asr.env is not an absolute path"),
        (None, "-", "- is not an absolute path"),
        (None, "/etc/asr/*.env", "systemd reads it as a wildcard pattern"),
        (None, "/etc/asr/%I", "cannot be checked: it holds a NUL"),
        (None, "/etc/%Z", "the specifier %Z has a value gpuslice does not work out"),
    ],
)
def test_hostile_paths_are_located_refusals(
    root: Path, make: str | None, value: str, why: str
) -> None:
    asr = root / "etc/asr"
    asr.mkdir(parents=True)
    if make == "fifo":
        os.mkfifo(asr / "fifo.env")
    elif make == "loop":
        (asr / "loop1").symlink_to("loop2")
        (asr / "loop2").symlink_to("loop1")
    # an instance whose %I holds a NUL: \x00 is valid in a unit name
    name = "x@a\\x00b.service"
    install(root, "x@.service", "User=asr", f"EnvironmentFile={value}")
    put(root, f"{ETC}/{name}.d/x.conf", "[Unit]\n")
    result = scan(root)  # never raises
    found = [str(p) for p in result.problems if p.unit == name and p.severity == "error"]
    [error] = found
    assert error.startswith(f"{ETC}/x@.service:5: [Service] EnvironmentFile: ")
    assert why in error and GATE in error


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

    put(root, "/etc/asr/ours.env")
    install(root, "x.service", "User=asr", "EnvironmentFile=/etc/asr/ours.env")
    monkeypatch.setattr(EnvFileChecker, "_walk", boom)
    [error] = errors(root, "x.service")
    assert "/etc/asr/ours.env cannot be checked (RecursionError)" in error


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
    # /, /etc, /etc/asr once; ours.env once; each k*.env once
    assert sorted(calls) == sorted(
        [str(root), str(root / "etc"), str(root / "etc/asr"), str(root / "etc/asr/ours.env")]
        + [str(root / f"etc/asr/k{i}.env") for i in range(50)]
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
    assert run_as.env_files == [envsafety.EnvFile("/f", 1, "-/b")]
    assert not run_as.other_user()
