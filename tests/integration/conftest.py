"""Fixtures that boot a real systemd (tests/bed); every test here is marked `integration`.

A bed that cannot be built or booted raises: a broken environment must fail the run, not skip.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.bed.container import Container, collect_journal, ensure_tree

_HERE = Path(__file__).parent
_BED_FIXTURES = ("container", "bare_container", "unified_container")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """On failure, attach the container's journal while the container is still up."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed:
        return
    funcargs = getattr(item, "funcargs", {})
    beds = {id(b): b for b in (funcargs.get(n) for n in _BED_FIXTURES) if isinstance(b, Container)}
    for bed in beds.values():
        report.sections.append((f"journal of {bed.name} ({report.when})", collect_journal(bed)))


@pytest.fixture(scope="session")
def bed_tree() -> Path:
    """The minimal Debian 12 tree, built and unpacked once (cached across runs)."""
    tree, _ = ensure_tree()
    return tree


@pytest.fixture
def bare_container(bed_tree: Path) -> Iterator[Container]:
    """A freshly booted container without gpuslice."""
    with Container(bed_tree) as container:
        yield container


@pytest.fixture
def container(bare_container: Container) -> Container:
    """A freshly booted container with gpuslice installed and gpuslice.service active."""
    bare_container.install_gpuslice()
    return bare_container


@pytest.fixture
def unified_container(bed_tree: Path) -> Iterator[Container]:
    """A freshly booted container on pure cgroup v2 (systemd's freezer works), with gpuslice
    installed and gpuslice.service active."""
    with Container(bed_tree, unified=True) as container:
        container.install_gpuslice()
        yield container
