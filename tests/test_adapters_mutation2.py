"""More boundary tests for the adapters that `make mutate MUTATE=adapters` asked for.

The inventory's handling of exited processes NVML still lists (the bound, the log lines, what
is forgotten), the unit index's aliases and issues, the defaults the host relies on, and the
generator's words for an error. Each test pins observable behaviour at an edge that the
adapters' own test files left open.
"""

from __future__ import annotations

import errno
import inspect
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice.config import Config
from gpuslice.generator import _reason
from gpuslice.unitfiles import UnitIndex, find_dropins, find_fragment, list_unit_names
from tests.test_inventory import GIB, MANAGED, UUIDS, StubNvml, make_inventory, write_proc
from tests.test_unitfiles import ETC, LIB, link, write

FOREIGN = "0::/user.slice/user-1000.slice/session-2.scope\n"

# ---- inventory: exited processes NVML still lists -------------------------------------------


def test_a_live_process_counts_however_long_it_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a process gone from /proc is bounded by vram_release_timeout: one still running
    counts past it, and is never announced as exited."""
    nvml = StubNvml()
    write_proc(tmp_path, 200, FOREIGN, "python3")
    nvml.add(0, 200, 2 * GIB)
    inventory, clock = make_inventory(tmp_path, nvml, Config(vram_release_timeout=5))
    with caplog.at_level(logging.INFO, logger="gpuslice"):
        first = inventory.sample(MANAGED)
        clock.now += 5 + 1
        later = inventory.sample(MANAGED)
    for sample in (first, later):
        assert (sample.gpus[0].foreign, sample.gpus[0].foreign_pids) == (2 * GIB, (200,))
        assert [(p.pid, p.command) for p in sample.processes] == [(200, "python3")]
    assert [r.getMessage() for r in caplog.records] == []


def test_an_exited_process_past_its_bound_hides_no_live_one_after_it(tmp_path: Path) -> None:
    """Once an exited process no longer counts, the processes listed after it on the same GPU
    are still attributed: a live foreign one stays foreign."""
    nvml = StubNvml()
    nvml.add(0, 499, GIB)  # no /proc/499: exited
    write_proc(tmp_path, 200, FOREIGN, "python3")
    nvml.add(0, 200, 4 * GIB)
    inventory, clock = make_inventory(tmp_path, nvml, Config(vram_release_timeout=5))
    first = inventory.sample(MANAGED)
    assert (first.gpus[0].foreign, first.gpus[0].foreign_pids) == (5 * GIB, (499, 200))
    clock.now += 5 + 1
    late = inventory.sample(MANAGED)
    assert (late.gpus[0].foreign, late.gpus[0].foreign_pids) == (4 * GIB, (200,))
    assert [p.pid for p in late.processes] == [200]


def test_a_reserve_keyed_by_uuid_reaches_the_gpu(tmp_path: Path) -> None:
    """`reserve:` may name a GPU by its UUID: the sampled GPU carries that reserve, and only
    that GPU."""
    config = Config(reserve=((UUIDS[1], 2 * GIB),))
    sample = make_inventory(tmp_path, StubNvml(), config)[0].sample(MANAGED)
    assert [(g.index, g.reserve) for g in sample.gpus] == [(0, 0), (1, 2 * GIB)]


def test_a_reused_pid_that_overruns_again_is_warned_about_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """When NVML stops listing an exited PID, its overrun warning is forgotten with it: the
    same number, reused by a later process that also outstays the bound, is warned about
    again."""
    nvml = StubNvml()
    nvml.add(0, 500, 6 * GIB)  # no /proc/500: exited
    inventory, clock = make_inventory(tmp_path, nvml, Config(vram_release_timeout=5))
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        inventory.sample(MANAGED)
        clock.now += 6
        inventory.sample(MANAGED)
        nvml.procs[0] = []  # released at last
        clock.now += 1
        inventory.sample(MANAGED)
        nvml.add(0, 500, 6 * GIB)  # the number again, another process, exited too
        clock.now += 1
        assert inventory.sample(MANAGED).gpus[0].foreign == 6 * GIB
        clock.now += 6
        assert inventory.sample(MANAGED).gpus[0].foreign == 0
    warning = (
        "GPU 0 still shows 6 GiB for exited PID 500 after 5 s (vram_release_timeout): "
        "no longer counting it"
    )
    assert [r.getMessage() for r in caplog.records] == [warning, warning]


def test_an_exited_process_stops_counting_exactly_at_its_bound(tmp_path: Path) -> None:
    """vram_release_timeout is how long the memory counts: first seen at 100.0 with a bound of
    5 s, it counts at 104.5 and no longer at 105.0."""
    nvml = StubNvml()
    nvml.add(0, 500, 6 * GIB)  # no /proc/500: exited
    inventory, clock = make_inventory(tmp_path, nvml, Config(vram_release_timeout=5))
    assert clock.now == 100.0
    assert inventory.sample(MANAGED).gpus[0].foreign == 6 * GIB
    clock.now = 104.5
    assert inventory.sample(MANAGED).gpus[0].foreign == 6 * GIB
    clock.now = 105.0
    at_bound = inventory.sample(MANAGED)
    assert (at_bound.gpus[0].foreign, at_bound.gpus[0].foreign_pids) == (0, ())
    assert at_bound.processes == []


def test_the_overrun_warning_of_a_process_of_unknown_size_says_0_b(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NVML may give no memory figure for a process: the warning then says 0 B, as the
    announcement does."""
    nvml = StubNvml()
    nvml.add(0, 501, None)  # no /proc/501: exited
    inventory, clock = make_inventory(tmp_path, nvml, Config(vram_release_timeout=5))
    with caplog.at_level(logging.WARNING, logger="gpuslice"):
        inventory.sample(MANAGED)
        clock.now += 6
        inventory.sample(MANAGED)
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 0 still shows 0 B for exited PID 501 after 5 s (vram_release_timeout): "
        "no longer counting it"
    ]


# ---- unit index: linked units, issues, defaults ---------------------------------------------


def test_a_linked_unit_is_no_alias(tmp_path: Path) -> None:
    """`systemctl link` puts a symlink to a file outside the search path, of the same name,
    into /etc/systemd/system: a unit in its own right. A link to another name is an alias,
    listed under its target's name."""
    write(tmp_path, "/opt/units/linked.service")
    link(tmp_path, f"{ETC}/linked.service", "/opt/units/linked.service")
    write(tmp_path, f"{LIB}/a.service")
    link(tmp_path, f"{ETC}/alias.service", f"{LIB}/a.service")
    assert list_unit_names(tmp_path) == ["a.service", "linked.service"]


def test_an_issue_is_reported_once_however_often_it_is_met(tmp_path: Path) -> None:
    """One UnitIndex asked twice meets the same bad file twice: the issue is listed once."""
    write(tmp_path, f"{ETC}/good.service")
    write(tmp_path, f"{ETC}/bad+name.service")
    index = UnitIndex(tmp_path)
    assert index.unit_names() == ["good.service"]
    assert index.unit_names() == ["good.service"]
    assert [i.path for i in index.issues] == [f"{ETC}/bad+name.service"]


@pytest.mark.parametrize("function", [find_fragment, find_dropins, list_unit_names])
def test_the_host_root_is_the_default(function: Callable[..., object]) -> None:
    """The real host's root is the default the CLI and generator rely on."""
    assert inspect.signature(function).parameters["root"].default == "/"


def test_without_a_root_the_hosts_own_units_are_read() -> None:
    """Called without a root, the unit index reads this host's unit directories (read only)."""
    names = list_unit_names("/")
    if not names:
        pytest.skip("no unit files on this host")
    assert list_unit_names() == names
    assert find_fragment(names[0]) == find_fragment(names[0], "/") is not None
    with_dropins = [n for n in names if find_dropins(n, "/")]
    if with_dropins:
        assert find_dropins(with_dropins[0]) == find_dropins(with_dropins[0], "/")


# ---- generator: the words for an error -------------------------------------------------------


def test_an_error_without_a_message_is_named_by_its_type() -> None:
    """A message-less exception is named by its type; an OSError by the system's words."""
    assert _reason(RecursionError()) == "RecursionError"
    assert _reason(ValueError("bad value")) == "bad value"
    assert _reason(OSError(errno.EACCES, "Permission denied", "/x")) == "Permission denied"
