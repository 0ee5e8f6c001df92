"""Behaviours that mutation testing of gpuslice/core/scheduler.py (let_through),
gpuslice/controller.py (_record_boot) and gpuslice/unitfiles.py (_instance_part) showed kept
by no test: the journal entry of a held unit let go at its gate names the GPUs it released,
and the waiters' next pass sees the holders as they are now; a boot that cannot be recorded
is said with the system's words for why; an alias between instances of `@` in theirs is
judged by all of the instance."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from gpuslice.core.model import Gpu
from gpuslice.core.scheduler import Log, Scheduler
from gpuslice.journal import decision_fields
from gpuslice.unitfiles import UnitIndex
from tests.core_builders import brief, spec, words
from tests.test_controller import Bed

# -- Scheduler.let_through ---------------------------------------------------------------------


def holding() -> Scheduler:
    """a.service holds GPUs 0 and 1 (1 known by no UUID), b.service GPUs 2 and 3, and
    wide.service (3 GPUs, less urgent than b) waits; a's annotation goes and GPU 1 is lost:
    a's gate will let it go (test_core_edges has the rule)."""
    a, b, wide = spec("a", 50, gpus=2), spec("b", 50, gpus=2), spec("wide", 90, gpus=3)
    gpus = [Gpu(0, "GPU-A"), Gpu(1), Gpu(2, "GPU-C"), Gpu(3, "GPU-D")]
    s = Scheduler(gpus, {u.name: u for u in (a, b, wide)})
    assert brief(s.request(a)) == ["grant a.service 0,1"]
    assert brief(s.request(b)) == ["grant b.service 2,3"]
    assert brief(s.request(wide)) == []
    s.set_specs({b.name: b, wide.name: wide})
    s.set_gpus([gpus[0], Gpu(1, lost=True), gpus[2], gpus[3]])
    return s


def waits_for(s: Scheduler, name: str) -> str:
    """Why `name` waits, as `gpuslice status` shows it."""
    [why] = [why for unit, _, why in s.snapshot().waiting if unit == name]
    return why


def test_the_journal_entry_of_a_unit_let_go_at_its_gate_names_the_gpus_it_released() -> None:
    """GPUSLICE_GPUS= of the entry: what `journalctl GPUSLICE_GPUS=1` finds, and how the
    GPUs a unit no longer annotated left are told from the unit's other entries."""
    s = holding()
    actions = s.let_through("a.service")
    assert brief(actions) == []
    [gone] = [a for a in actions if isinstance(a, Log)]
    assert gone.message == "a.service is no longer annotated: released its GPUs"
    assert gone.decision is not None and gone.decision.gpus == (0, 1)
    fields = decision_fields(gone.decision, gone.message, gone.level)
    assert ("GPUSLICE_GPUS", "0,1") in fields
    assert ("GPUSLICE_UNIT", "a.service") in fields


def test_status_while_deciding_is_deferred_names_the_holders_left_after_a_let_go() -> None:
    """A gate let through while the controller defers its decisions (its rebuild awaits the
    journal): no pass follows at once, and `status` meanwhile tells wide.service's wait by
    the holders there are now, b.service alone: a.service's GPUs went with it."""
    s = holding()
    assert "a.service" in waits_for(s, "wide.service")
    with s.deferred():
        assert words(s.let_through("a.service")) == [
            "a.service is no longer annotated: released its GPUs"
        ]
        why = waits_for(s, "wide.service")
    assert "b.service" in why and "a.service" not in why
    assert s.grants() == {"b.service": {2, 3}}


# -- Controller._record_boot -------------------------------------------------------------------


def test_a_boot_that_cannot_be_recorded_is_said_with_the_systems_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The journal line says why (here: a directory stands at the record's path), as the
    OSError's text puts it, not "None"."""
    bed = Bed(tmp_path, {"a.service": "Priority=50\n"}, [])
    record = tmp_path / "runtime-dir.boot"
    record.mkdir()  # what no file replaces
    bed.controller.boot_record = record
    with caplog.at_level(logging.ERROR, logger="gpuslice"):
        bed.controller._record_boot()
    [said] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert said.startswith(f"cannot record this boot in {record} ([Errno 21] Is a directory")
    assert "(None)" not in said


# -- unitfiles._instance_part ------------------------------------------------------------------

LIB = "/usr/lib/systemd/system"
ETC = "/etc/systemd/system"
RUN = "/run/systemd/system"


def test_an_alias_to_another_instance_that_ends_alike_after_an_at_sign_is_refused(
    tmp_path: Path,
) -> None:
    """An instance is all between the first `@` and the type's dot (systemd's
    unit_name_to_instance): `u@x@y.service -> b@z@y.service` links two instances, `x@y` and
    `z@y`, and systemd 252 ignores it. Taken for an alias, its name was b's and hid the
    lower directory's u@x@y.service, which then ran ungated."""
    for path in (f"{LIB}/b@z@y.service", f"{RUN}/u@x@y.service", f"{ETC}/zz.service"):
        (tmp_path / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path.lstrip("/")).write_text("[Service]\nExecStart=/bin/true\n")
    os.symlink(f"{LIB}/b@z@y.service", tmp_path / ETC.lstrip("/") / "u@x@y.service")
    index = UnitIndex(str(tmp_path))
    assert {"u@x@y.service", "zz.service"} <= set(index.unit_names())
    fragment = index.fragment("u@x@y.service")
    assert fragment is not None and fragment.path == f"{RUN}/u@x@y.service"
    assert index.primary_name("u@x@y.service") == "u@x@y.service"
    assert [i.message for i in index.issues if i.path == f"{ETC}/u@x@y.service"] == [
        f"a symlink to {LIB}/b@z@y.service, which systemd refuses as an alias"
        " (another instance) and ignores: a lower directory's file of this name is the unit's"
    ]
