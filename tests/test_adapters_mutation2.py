"""More boundary tests for the adapters that `make mutate MUTATE=adapters` asked for.

The inventory's handling of exited processes NVML still lists (the bound, the log lines, what
is forgotten), the unit index's aliases and issues, the defaults the host relies on, and the
generator's words for an error. Each test pins observable behaviour at an edge that the
adapters' own test files left open.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuslice import unitfiles
from gpuslice.config import Config
from gpuslice.generator import _reason
from gpuslice.unitfiles import (
    UnitIndex,
    find_dropins,
    find_fragment,
    is_instance,
    list_unit_names,
    printable,
)
from tests.test_inventory import GIB, MANAGED, UUIDS, StubNvml, make_inventory, write_proc
from tests.test_unitfiles import ETC, LIB, RUN, link, write

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


def test_without_a_root_the_hosts_own_units_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Called without a root, each of them asks a unit index of this host's root ("/") and
    gives its answer. A stand-in index records what it is asked: the units this machine
    has installed are not read, and decide nothing (with none, the test was skipped)."""
    asked: list[tuple[object, ...]] = []
    fragment, dropins, names = object(), [object()], ["a.service"]

    class Index:
        def __init__(self, root: str | os.PathLike[str]) -> None:
            asked.append((root,))

        def fragment(self, name: str) -> object:
            asked[-1] += ("fragment", name)
            return fragment

        def dropins(self, name: str) -> list[object]:
            asked[-1] += ("dropins", name)
            return dropins

        def unit_names(self) -> list[str]:
            asked[-1] += ("unit_names",)
            return names

    monkeypatch.setattr(unitfiles, "UnitIndex", Index)
    assert list_unit_names() is names
    assert find_fragment("a.service") is fragment
    assert find_dropins("b.service") is dropins
    assert asked == [
        ("/", "unit_names"),
        ("/", "fragment", "a.service"),
        ("/", "dropins", "b.service"),
    ]


# ---- generator: the words for an error -------------------------------------------------------


def test_an_error_without_a_message_is_named_by_its_type() -> None:
    """A message-less exception is named by its type; an OSError by the system's words."""
    assert _reason(RecursionError()) == "RecursionError"
    assert _reason(ValueError("bad value")) == "bad value"
    assert _reason(OSError(errno.EACCES, "Permission denied", "/x")) == "Permission denied"


# ---- unit names and their printing -----------------------------------------------------------


def test_printable_keeps_300_characters_by_default() -> None:
    """The default cut is at 300 characters: 300 are kept whole, a 301st is cut with `...`."""
    assert printable("x" * 300) == "x" * 300
    assert printable("x" * 301) == "x" * 300 + "..."


def test_printable_cuts_only_past_the_limit() -> None:
    """A text exactly `limit` long is shown whole; one character more is cut."""
    assert printable("abc", 3) == "abc"
    assert printable("abcd", 3) == "abc..."


def test_a_name_starting_with_an_at_is_no_instance() -> None:
    """`@a.service` has nothing before the `@`: no template prefix, so no instance."""
    assert is_instance("@a.service") is False
    assert is_instance("b@a.service") is True


# ---- unit index: search directories, paths, drop-in directories -----------------------------


def _listing(
    monkeypatch: pytest.MonkeyPatch, reverse: bool = False, first: object | None = None
) -> None:
    """Make os.scandir list entries sorted by name (reversed when asked), after `first` when
    given: a test then sees each order a filesystem may list a directory in."""
    real_scandir = os.scandir

    def scandir(path: Path) -> contextlib.nullcontext[Iterator[object]]:
        with real_scandir(path) as it:
            listed: list[os.DirEntry[str]] = sorted(it, key=lambda e: e.name, reverse=reverse)
        entries: list[object] = [first, *listed] if first is not None else [*listed]
        return contextlib.nullcontext(iter(entries))

    monkeypatch.setattr(os, "scandir", scandir)


class _Vanished:
    """A directory entry gone by the time it is examined (its lstat fails)."""

    name = "gone.service"

    def is_symlink(self) -> bool:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")


def test_an_entry_that_vanishes_while_listed_hides_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry that cannot be examined is left out; the entries listed after it are kept."""
    write(tmp_path, f"{ETC}/a.service")
    write(tmp_path, f"{ETC}/b.service")
    _listing(monkeypatch, first=_Vanished())
    assert UnitIndex(tmp_path, [ETC]).unit_names() == ["a.service", "b.service"]


def test_a_search_directory_named_twice_ends_no_search(tmp_path: Path) -> None:
    """A directory met a second time is skipped; the directories after it are still searched."""
    write(tmp_path, f"{ETC}/a.service")
    write(tmp_path, f"{RUN}/b.service")
    assert UnitIndex(tmp_path, [ETC, ETC, RUN]).unit_names() == ["a.service", "b.service"]


def test_an_unreadable_search_directory_ends_no_search(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search directory that cannot be listed (EACCES for a non-root run; faked here, as the
    tests may run as root) is skipped; the directories after it are still searched."""
    write(tmp_path, f"{ETC}/a.service")
    write(tmp_path, f"{RUN}/b.service")
    real_scandir = os.scandir
    etc = tmp_path / ETC.lstrip("/")

    def scandir(path: Path) -> Iterator[os.DirEntry[str]]:
        if Path(path) == etc:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert UnitIndex(tmp_path, [ETC, RUN]).unit_names() == ["b.service"]


def test_the_index_root_defaults_to_the_host_root() -> None:
    """UnitIndex() reads the host's own files: its root is `/`."""
    index = UnitIndex(search_path=())
    assert index.root == Path("/")
    assert index.real_path("/etc/x.service") == "/etc/x.service"


def test_real_path_strips_only_the_leading_slash(tmp_path: Path) -> None:
    """Only the leading `/` of a system path goes: a first component starting with `X` stays."""
    index = UnitIndex(tmp_path, ())
    assert index.real_path("/XX/x.service") == str(tmp_path / "XX" / "x.service")


def test_a_link_to_dev_dot_null_masks_a_dropin(tmp_path: Path) -> None:
    """`.` in a link target names the same directory: a drop-in linked to `/dev/./null` is
    masked like one linked to `/dev/null`, and hides the same name in lower directories."""
    link(tmp_path, f"{ETC}/foo.service.d/a.conf", "/dev/./null")
    write(tmp_path, f"{LIB}/foo.service.d/a.conf")
    write(tmp_path, f"{LIB}/foo.service.d/b.conf")
    assert [f.path for f in find_dropins("foo.service", tmp_path)] == [
        f"{LIB}/foo.service.d/b.conf"
    ]


def test_every_dash_prefix_has_its_dropin_dir(tmp_path: Path) -> None:
    """`a-b-c-d.service` reads the drop-ins of `a-b-c-.service`, `a-b-.service` and
    `a-.service`, longest prefix first (systemd's prefix drop-ins)."""
    for prefix in ("a-", "a-b-", "a-b-c-"):
        (tmp_path / LIB.lstrip("/") / f"{prefix}.service.d").mkdir(parents=True)
    assert [d for d, _ in UnitIndex(tmp_path).dropin_dirs("a-b-c-d.service")] == [
        f"{LIB}/a-b-c-.service.d",
        f"{LIB}/a-b-.service.d",
        f"{LIB}/a-.service.d",
    ]


def test_a_dropin_dir_is_listed_only_where_it_is(tmp_path: Path) -> None:
    """`foo.service.d` in /etc only: the other search directories (here /lib, which holds
    another unit's drop-ins) add no entry for it."""
    write(tmp_path, f"{ETC}/foo.service.d/a.conf")
    write(tmp_path, f"{LIB}/bar.service.d/b.conf")
    write(tmp_path, f"{LIB}/other.service")
    assert UnitIndex(tmp_path).dropin_dirs("foo.service") == [
        (f"{ETC}/foo.service.d", str(tmp_path / ETC.lstrip("/") / "foo.service.d"))
    ]


def test_a_root_whose_name_ends_in_a_letter_like_x_is_kept_whole(tmp_path: Path) -> None:
    """The root loses its trailing slashes only: `/tmp/rootX/` is `/tmp/rootX`."""
    root = tmp_path / "rootX"
    write(root, f"{ETC}/a.service")
    index = UnitIndex(f"{root}/")
    fragment = index.fragment("a.service")
    assert fragment is not None and fragment.real == f"{root}{ETC}/a.service"


def test_the_type_dropin_dir_is_named_by_the_last_suffix(tmp_path: Path) -> None:
    """The type-level drop-in directory of `a.b.service` is `service.d`, not `b.service.d`."""
    for d in ("service.d", "b.service.d"):
        (tmp_path / ETC.lstrip("/") / d).mkdir(parents=True)
    assert UnitIndex(tmp_path).dropin_dirs("a.b.service") == [
        (f"{ETC}/service.d", str(tmp_path / ETC.lstrip("/") / "service.d"))
    ]


@pytest.mark.parametrize("target", ["/opt/dropins", "../../../opt/dropins"])
def test_a_symlinked_dropin_dir_resolves_inside_the_root(tmp_path: Path, target: str) -> None:
    """A drop-in directory that is a symlink (absolute or relative) is found where its target
    lies inside the root, and its drop-ins are read from there, not through the link."""
    link(tmp_path, f"{ETC}/foo.service.d", target)
    write(tmp_path, "/opt/dropins/a.conf")
    index = UnitIndex(tmp_path)
    assert index.dropin_dirs("foo.service") == [
        (f"{ETC}/foo.service.d", str(tmp_path / "opt" / "dropins"))
    ]
    assert [(f.path, f.real) for f in index.dropins("foo.service")] == [
        (f"{ETC}/foo.service.d/a.conf", str(tmp_path / "opt" / "dropins" / "a.conf"))
    ]


def test_a_dropin_dir_link_to_no_directory_is_no_dropin_dir(tmp_path: Path) -> None:
    """A `.d` symlink that dangles or leads to a file is no drop-in directory."""
    link(tmp_path, f"{ETC}/foo.service.d", "/nowhere")
    write(tmp_path, "/opt/file")
    link(tmp_path, f"{ETC}/bar.service.d", "/opt/file")
    index = UnitIndex(tmp_path)
    assert index.dropin_dirs("foo.service") == []
    assert index.dropin_dirs("bar.service") == []


def test_a_dropin_dir_made_after_the_index_is_not_seen(tmp_path: Path) -> None:
    """The index answers from its own listing (one per daemon-reload): a drop-in directory
    made after it was built is not seen."""
    write(tmp_path, f"{ETC}/foo.service")
    index = UnitIndex(tmp_path)
    write(tmp_path, f"{ETC}/foo.service.d/a.conf")
    assert index.dropin_dirs("foo.service") == []
    assert index.dropins("foo.service") == []


# ---- unit index: drop-in files --------------------------------------------------------------


def test_a_dropin_dir_gone_since_the_index_hides_no_lower_one(tmp_path: Path) -> None:
    """A drop-in directory removed after the index was built cannot be listed: it is skipped,
    and the lower directories still give their drop-ins."""
    write(tmp_path, f"{ETC}/foo.service.d/a.conf")
    write(tmp_path, f"{LIB}/foo.service.d/b.conf")
    index = UnitIndex(tmp_path)
    shutil.rmtree(tmp_path / ETC.lstrip("/") / "foo.service.d")
    assert [f.path for f in index.dropins("foo.service")] == [f"{LIB}/foo.service.d/b.conf"]


@pytest.mark.parametrize("reverse", [False, True])
def test_a_conf_directory_hides_no_dropin_listed_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reverse: bool
) -> None:
    """A directory named `*.conf` is no drop-in; the files listed before or after it are, in
    either listing order."""
    write(tmp_path, f"{ETC}/foo.service.d/a.conf")
    (tmp_path / ETC.lstrip("/") / "foo.service.d" / "b.conf").mkdir()
    write(tmp_path, f"{ETC}/foo.service.d/c.conf")
    _listing(monkeypatch, reverse=reverse)
    assert [f.path for f in find_dropins("foo.service", tmp_path)] == [
        f"{ETC}/foo.service.d/a.conf",
        f"{ETC}/foo.service.d/c.conf",
    ]


@pytest.mark.parametrize("reverse", [False, True])
def test_a_looping_dropin_link_hides_no_dropin_listed_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reverse: bool
) -> None:
    """A drop-in symlink that loops is ignored with an issue; the files listed before or after
    it are still drop-ins, in either listing order."""
    write(tmp_path, f"{ETC}/foo.service.d/a.conf")
    link(tmp_path, f"{ETC}/foo.service.d/b.conf", "b.conf")
    write(tmp_path, f"{ETC}/foo.service.d/c.conf")
    _listing(monkeypatch, reverse=reverse)
    index = UnitIndex(tmp_path)
    assert [f.path for f in index.dropins("foo.service")] == [
        f"{ETC}/foo.service.d/a.conf",
        f"{ETC}/foo.service.d/c.conf",
    ]
    assert [i.path for i in index.issues] == [f"{ETC}/foo.service.d/b.conf"]
