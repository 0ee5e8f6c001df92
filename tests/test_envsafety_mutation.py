"""The loader and mount checks of gpuslice/envsafety.py at their exact words and edges: what
tests/test_envsafety.py leaves to `in` (a refusal's whole message, its fix), the elements
that decide (a bind onto itself before another, a loop in a subdirectory, a name ending in
a space or `X`), and the file systems that do not answer there."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuslice import envsafety
from gpuslice.envsafety import FIX_LOADER, EnvFileChecker
from gpuslice.unitfiles import printable
from tests.test_envsafety import (
    ANYWHERE,
    ASR,
    CUDA,
    ETC,
    GATE,
    LOADER,
    MOUNTS,
    NFS,
    USES,
    Hang,
    cuda,
    errors,
    install,
    put,
)
from tests.test_envsafety import root as root  # a fixture
from tests.test_unitfiles import link

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")

ANSWER = "until that file system answers at a later scan (systemctl daemon-reload)"


@pytest.fixture(autouse=True)
def fresh_covered() -> Iterator[None]:
    """`_covered` is cached process-wide: each test works its answers out afresh (here and
    in test_envsafety_mutation2.py)."""
    envsafety._covered.cache_clear()
    yield
    envsafety._covered.cache_clear()


@pytest.fixture
def hang(
    root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hang]:
    """`Hang`, listdir too."""
    hanging = Hang(root, monkeypatch, tmp_path_factory.mktemp("proc") / "mountinfo")
    monkeypatch.setattr(os, "listdir", hanging._fake("listdir", os.listdir))
    yield hanging
    hanging.release()


def loader_error(name: str, said: str, fix: str = LOADER) -> str:
    return f"{ETC}/{name}:5: [Service] Environment: {said}; {GATE} {name} {fix}"


def test_loader_refusals_in_their_exact_words(root: Path) -> None:
    install(root, "origin.service", "User=asr", "Environment=LD_LIBRARY_PATH=$ORIGIN/../lib")
    install(root, "empty.service", "User=asr", f"Environment=LD_LIBRARY_PATH={CUDA}:")
    cuda(root)
    assert errors(root, "origin.service") == [
        loader_error(
            "origin.service",
            "LD_LIBRARY_PATH=$ORIGIN/../lib: the dynamic loader expands $ORIGIN, $LIB and "
            "$PLATFORM there, to paths gpuslice does not work out",
        )
    ]
    assert errors(root, "empty.service") == [
        loader_error(
            "empty.service",
            f"LD_LIBRARY_PATH={CUDA}:: its empty element is the current directory (the "
            "unit's WorkingDirectory=)",
        )
    ]


def test_a_long_loader_value_and_element_are_cut_at_200_characters(root: Path) -> None:
    element = "x" * 250
    install(root, "x.service", "User=asr", f"Environment=LD_LIBRARY_PATH={element}")
    cut = "x" * 200 + "..."
    assert errors(root, "x.service") == [
        loader_error(
            "x.service", f"LD_LIBRARY_PATH={cut}: {cut} is relative to the current directory"
        )
    ]


@pytest.mark.parametrize("variable", ["LD_LIBRARY_PATH", "LD_PRELOAD"])
def test_a_loader_element_of_path_max_bytes_is_refused(root: Path, variable: str) -> None:
    """PATH_MAX counts the NUL: 4095 bytes is the longest path."""
    checker = EnvFileChecker(root)
    longest = "/" + "a" * 4094
    too_long = "/" + "a" * 4095
    refusal = checker._loader_refusal(variable, too_long, "")
    said = f"{variable}={printable(too_long, 200)}"
    assert refusal is not None
    assert refusal.reason == (
        f"{said}: {printable(too_long, 200)} cannot be checked: longer than 4095 bytes"
    )
    assert refusal.fix == FIX_LOADER
    refusal = checker._loader_refusal(variable, longest, "")
    assert refusal is None or "longer than" not in refusal.reason


def test_a_preloaded_file_is_named_as_written(root: Path) -> None:
    put(root, "/opt/hook/libhook.so", "elf", uid=ASR)
    install(root, "x.service", "User=asr", "Environment=LD_PRELOAD=/opt/hook/libhook.so")
    [error] = errors(root, "x.service")
    assert error.startswith(
        f"{ETC}/x.service:5: [Service] Environment: LD_PRELOAD=/opt/hook/libhook.so: "
        "/opt/hook/libhook.so is owned by UID 1000"
    ), error


def test_a_loader_path_that_does_not_answer_waits_for_the_file_system(
    root: Path, hang: Hang
) -> None:
    (root / "srv/nfs/lib").mkdir(parents=True)
    install(root, "x.service", "User=asr", f"Environment=LD_LIBRARY_PATH={NFS}/lib")
    hang.mounts(NFS)
    hang.at = (NFS,)
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] Environment: LD_LIBRARY_PATH={NFS}/lib: {NFS}/lib "
        f"cannot be checked: {NFS} did not answer within 1 s (a network file system not "
        f"answering?); {GATE} x.service {ANSWER}"
    ]


def test_a_loader_directory_that_cannot_be_listed_in_time(root: Path, hang: Hang) -> None:
    (root / "srv/nfs/lib").mkdir(parents=True)
    install(root, "x.service", "User=asr", f"Environment=LD_LIBRARY_PATH={NFS}/lib")
    hang.mounts(NFS)
    hang.calls = ("listdir",)
    hang.at = (NFS,)
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] Environment: LD_LIBRARY_PATH={NFS}/lib: {NFS}/lib "
        f"cannot be checked: {NFS} did not answer within 1 s (a network file system not "
        f"answering?); {GATE} x.service {ANSWER}"
    ]


def test_a_loader_directory_that_cannot_be_listed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(root, "/opt/lib/sub/libx.so", "elf")
    listdir = os.listdir

    def refuse(path: str) -> list[str]:
        if os.fspath(path).endswith("/opt/lib/sub"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return listdir(path)

    monkeypatch.setattr(os, "listdir", refuse)
    install(root, "x.service", "User=asr", "Environment=LD_LIBRARY_PATH=/opt/lib")
    assert errors(root, "x.service") == [
        f"{ETC}/x.service:5: [Service] Environment: LD_LIBRARY_PATH=/opt/lib: /opt/lib cannot "
        f"be checked: /opt/lib/sub: Permission denied; {GATE} x.service {LOADER}"
    ]


def test_a_loader_directory_too_large_to_walk_in_exact_words(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda(root)
    monkeypatch.setattr(envsafety, "MAX_TREE", 3)
    install(root, "x.service", "User=asr", f"Environment=LD_LIBRARY_PATH={CUDA}")
    assert errors(root, "x.service") == [
        loader_error(
            "x.service",
            f"LD_LIBRARY_PATH={CUDA}: {CUDA} cannot be checked: more than 3 entries in it and "
            "its directories",
        )
    ]


@pytest.mark.parametrize("sub", ["sub ", "subX"])
def test_a_subdirectory_whose_name_ends_in_a_space_or_x_is_walked(root: Path, sub: str) -> None:
    put(root, f"/opt/lib/{sub}/libc.so.6", "elf", uid=ASR)
    install(root, "x.service", "User=asr", "Environment=LD_LIBRARY_PATH=/opt/lib")
    [error] = errors(root, "x.service")
    assert f"/opt/lib/{sub}/libc.so.6 is owned by UID {ASR}" in error


def test_a_link_back_to_a_subdirectory_is_walked_once(root: Path) -> None:
    put(root, "/opt/lib/sub/libx.so", "elf")
    link(root, "/opt/lib/sub/loop", ".")
    install(root, "x.service", "User=asr", "Environment=LD_LIBRARY_PATH=/opt/lib")
    assert errors(root, "x.service") == []


def mount_error(name: str, key: str, said: str, fix: str = ANYWHERE, line: int = 5) -> str:
    manage = f"{MOUNTS} gpuslice does not manage {name} {fix}"
    return f"{ETC}/{name}:{line}: [Service] {key}: {said}; {manage}"


def test_each_mount_of_an_assignment_is_checked(root: Path) -> None:
    """A bind onto itself, or a temporary file system, before the one that lands on what
    the gate uses does not let it through."""
    install(root, "same.service", "User=asr", "BindPaths=/srv/x /srv/y:/usr/local/bin")
    install(root, "tmpfs.service", "User=asr", "TemporaryFileSystem=/run/myapp /run")
    assert errors(root, "same.service") == [
        mount_error(
            "same.service",
            "BindPaths",
            "/srv/x /srv/y:/usr/local/bin: its mount at /usr/local/bin lands on, in or above "
            f"/usr/local/bin, {USES}",
        )
    ]
    assert errors(root, "tmpfs.service") == [
        mount_error(
            "tmpfs.service",
            "TemporaryFileSystem",
            f"/run/myapp /run: its mount at /run lands on, in or above /run/dbus, {USES}",
        )
    ]


def test_a_destination_with_an_unknown_specifier_in_exact_words(root: Path) -> None:
    install(root, "x.service", "BindPaths=/srv/x:%h/bin")
    assert errors(root, "x.service") == [
        mount_error(
            "x.service",
            "BindPaths",
            "/srv/x:%h/bin: a destination has a specifier gpuslice does not work out (it knows "
            "%n %N %p %P %i %I %j %J %t %S %C %L %E %T %V %%; %i %I %n %N not in a template), "
            "so where it lands cannot be checked",
            line=4,
        )
    ]


def test_a_bind_of_another_users_unit_may_land_on_a_directory_or_through_a_symlink(
    root: Path,
) -> None:
    """Where it lands is followed to the end: a symlink as the last component too; and a
    directory of root's is a fine place."""
    (root / "srv/data").mkdir(parents=True)
    link(root, "/srv/links/bin", "/usr/local/bin")
    install(root, "dir.service", "User=asr", "BindPaths=/srv/asr:/srv/data")
    install(root, "link.service", "User=asr", "BindPaths=/srv/asr:/srv/links/bin")
    assert errors(root, "dir.service") == []
    assert errors(root, "link.service") == [
        mount_error(
            "link.service",
            "BindPaths",
            "/srv/asr:/srv/links/bin: its mount at /srv/links/bin lands at /usr/local/bin "
            f"(symlinks followed), on, in or above /usr/local/bin, {USES}",
        )
    ]


def test_a_bind_destination_that_does_not_answer_waits_for_the_file_system(
    root: Path, hang: Hang
) -> None:
    (root / "srv/nfs/data").mkdir(parents=True)
    install(root, "x.service", "User=asr", f"BindPaths=/srv/asr:{NFS}/data")
    hang.mounts(NFS)
    hang.at = (NFS,)
    assert errors(root, "x.service") == [
        mount_error(
            "x.service",
            "BindPaths",
            f"/srv/asr:{NFS}/data: systemd follows symlinks where a mount lands, and "
            f"{NFS}/data cannot be checked: {NFS} did not answer within 1 s (a network file "
            "system not answering?)",
            ANSWER,
        )
    ]


@pytest.mark.parametrize(
    ("destination", "covered"),
    [
        ("/usr/bin", "/usr/bin"),
        ("/lib64", "/lib*"),
        ("/lib", "/lib*"),
        ("/usr/lib32/x", "/usr/lib*"),
        ("/", "/usr/local/sbin"),
        ("/usr/bin2", None),
        ("/lol", None),
        ("/lix", None),
        ("/data", None),
        ("/usr/share/x", None),
    ],
)
def test_which_gate_path_a_mount_lands_on(
    root: Path, destination: str, covered: str | None
) -> None:
    """A component ending in `*` matches each name starting with what is before it; any
    other, that very name."""
    install(root, "x.service", f"TemporaryFileSystem={destination}")
    if covered is None:
        assert errors(root, "x.service") == []
    else:
        assert errors(root, "x.service") == [
            mount_error(
                "x.service",
                "TemporaryFileSystem",
                f"{destination}: its mount at {destination} lands on, in or above {covered}, "
                f"{USES}",
                line=4,
            )
        ]
