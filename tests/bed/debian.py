"""Test-bed helpers for the Debian package (tests/integration/test_debian.py).

Builds the .deb with `make deb` (version N from the checkout, N+1 from a bumped copy of it) and
drives dpkg/apt inside a booted `Container`. The container's tree already holds every runtime
dependency of the package (tests.bed.container.PACKAGES): it has no network.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

from tests.bed.container import REPO, BedError, Container, wait_until

# What `make deb` copies into its build tree (Makefile: DEB_SOURCES); newer than the .deb = stale.
DEB_SOURCES: tuple[str, ...] = (
    "Makefile",
    "pyproject.toml",
    "config.yaml",
    "gpuslice",
    "data",
    "units",
    "debian",
)
DEB_DIR = REPO / "build" / "deb"
WHEEL_DIR = DEB_DIR / "wheels"
BUILD_TIMEOUT = 600.0
# Paths that change on their own or belong to dpkg/apt bookkeeping: not "files of ours".
IGNORED_PREFIXES: tuple[str, ...] = (
    "/var/log/",
    "/var/cache/apt/",
    "/var/cache/debconf/",
    "/var/lib/apt/",
    "/var/lib/dpkg/",
    "/run/",
    "/proc/",
    "/sys/",
    "/dev/",
    "/tmp/",
    "/var/tmp/",
    "/src/",
)
_CHANGELOG_HEAD = re.compile(r"^(?P<name>\S+) \((?P<version>[^)]+)\)")


def changelog_version(root: Path = REPO) -> str:
    """The version in the first entry of ROOT/debian/changelog."""
    first = (root / "debian" / "changelog").read_text().splitlines()[0]
    match = _CHANGELOG_HEAD.match(first)
    if match is None:
        raise BedError(f"{root}/debian/changelog:1: cannot read the version from {first!r}")
    return match["version"]


def deb_path(deb_dir: Path, version: str) -> Path:
    return deb_dir / f"gpuslice_{version}_all.deb"


def _newest_source(root: Path) -> float:
    newest = 0.0
    for name in DEB_SOURCES:
        top = root / name
        if not top.exists():
            continue
        paths = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]
        newest = max([newest, *(p.stat().st_mtime for p in paths if "__pycache__" not in p.parts)])
    return newest


def build_deb(
    root: Path = REPO, deb_dir: Path = DEB_DIR, wheel_dir: Path = WHEEL_DIR, force: bool = False
) -> Path:
    """`make -C ROOT deb` unless the .deb exists and is newer than every source; the .deb path.

    A failed build raises with make's output: a package that cannot be built fails the tests.
    """
    deb = deb_path(deb_dir, changelog_version(root))
    if not force and deb.exists() and deb.stat().st_mtime >= _newest_source(root):
        return deb
    cmd = ["make", "--no-print-directory", "-C", str(root), "deb",
           f"DEB_DIR={deb_dir}", f"PYNVML_WHEEL_DIR={wheel_dir}"]  # fmt: skip
    result = subprocess.run(
        cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=BUILD_TIMEOUT
    )
    if result.returncode != 0 or not deb.exists():
        raise BedError(
            f"`{' '.join(cmd)}` failed (exit {result.returncode}), no {deb}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}--- stderr ---\n{result.stderr[-6000:]}"
        )
    return deb


def bumped_copy(dest: Path, version: str, root: Path = REPO) -> Path:
    """Copy the package's sources to DEST with VERSION in changelog, pyproject and __init__."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in DEB_SOURCES:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, dest / name)
    old = changelog_version(root)
    changelog = dest / "debian" / "changelog"
    entry = (
        f"gpuslice ({version}) unstable; urgency=medium\n\n"
        f"  * Test upgrade from {old}.\n\n"
        " -- gpuslice developers <gpuslice@example.org>  Mon, 30 Nov 2026 07:00:00 +0000\n\n"
    )
    changelog.write_text(entry + changelog.read_text())
    for rel, pattern in (
        ("pyproject.toml", r'^version = "[^"]*"'),
        ("gpuslice/__init__.py", r'^__version__ = "[^"]*"'),
    ):
        path = dest / rel
        key = pattern.split(" ")[0].lstrip("^")
        text, count = re.subn(pattern, f'{key} = "{version}"', path.read_text(), flags=re.M)
        if count != 1:
            raise BedError(f"{path}: no version line to bump")
        path.write_text(text)
    return dest


def copy_in(container: Container, src: Path, dest: str) -> None:
    """Copy a host file into the running container (through its PID 1's root: no bind needed)."""
    if container.leader is None:
        raise BedError(f"{container.name}: not running")
    target = Path(f"/proc/{container.leader}/root") / dest.lstrip("/")
    shutil.copyfile(src, target)
    target.chmod(0o644)


def install_deb(container: Container, deb: Path, timeout: float = 120) -> float:
    """Copy DEB to /var/tmp inside and `apt-get install -y` it; returns the seconds apt took."""
    inside = f"/var/tmp/{deb.name}"
    copy_in(container, deb, inside)
    started = time.monotonic()
    container.run(["apt-get", "install", "-y", inside], timeout=timeout)
    return time.monotonic() - started


def file_list(container: Container) -> set[str]:
    """Every path on the container's root file system but those in IGNORED_PREFIXES."""
    out = container.run(["find", "/", "-xdev"], timeout=60).stdout.splitlines()
    return {
        p
        for p in out
        if not any(p.startswith(x) or p + "/" == x for x in IGNORED_PREFIXES)
        and "/journal/" not in p
    }


def main_pid(container: Container, unit: str) -> int:
    return int(container.systemctl("show", "-P", "MainPID", unit).stdout.strip())


def wait_settled(container: Container, unit: str, timeout: float = 30) -> str:
    """Wait until UNIT is active or failed and return which."""

    def settled() -> str | None:
        state = container.active_state(unit)
        return state if state in ("active", "failed") else None

    return wait_until(settled, timeout, what=f"{unit} to be active or failed")
