"""[X-GPUSlice] parsing, merging over drop-ins, validation messages word for word, scanning."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpuslice.annotations import KEYS, NEVER_GATED, Loader, Problem, load_spec, scan
from gpuslice.core.model import Restart, Rung, UnitKind, UnitSpec
from gpuslice.paths import GATE_DROPIN_NAME
from gpuslice.unitfiles import MAX_FILE_SIZE, UNIT_NAME_MAX, Fragment, UnitIndex
from tests.test_unitfiles import link
from tests.test_unitfiles import write as write  # re-exported: tests import it from here

ETC = "/etc/systemd/system"
LIB = "/usr/lib/systemd/system"

SERVICE = "[Unit]\nDescription=job\n\n[Service]\nExecStart=/bin/true\n"


def unit(section: str) -> str:
    """A unit whose [X-GPUSlice] header is on line 7 and its first key on line 8."""
    return SERVICE + "\n[X-GPUSlice]\n" + section


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        pytest.param(
            "Priority=90\n", UnitSpec("x.service", 90, source=f"{ETC}/x.service"), id="defaults"
        ),
        pytest.param(
            "Priority=0\nType=background\nGPUs=2\nRequeue=no\n",
            UnitSpec("x.service", 0, UnitKind.BACKGROUND, 2, False, f"{ETC}/x.service"),
            id="all-keys",
        ),
        pytest.param(
            "Priority=999\nType=on-demand\n",
            UnitSpec("x.service", 999, source=f"{ETC}/x.service"),
            id="max",
        ),
        pytest.param(
            "Priority=5\nPriority=7\n",
            UnitSpec("x.service", 7, source=f"{ETC}/x.service"),
            id="repeated-key-last-wins",
        ),
        pytest.param(
            "Priority=\\\n 42\n",
            UnitSpec("x.service", 42, source=f"{ETC}/x.service"),
            id="continuation",
        ),
        pytest.param(
            "Priority=20\nMemory=20GiB\nDevices=0, GPU-8f6c-aa\n",
            UnitSpec(
                "x.service",
                20,
                source=f"{ETC}/x.service",
                memory=20 << 30,
                devices=("0", "GPU-8f6c-aa"),
            ),
            id="memory-and-devices",
        ),
        pytest.param(
            "Priority=20\nPreempt=freeze, suspend stop\n",
            UnitSpec(
                "x.service",
                20,
                source=f"{ETC}/x.service",
                preempt=(Rung.FREEZE, Rung.SUSPEND, Rung.STOP),
            ),
            id="preempt-ladder",
        ),
        pytest.param(
            "Priority=20\nPreempt=suspend\nPreempt=\n",
            UnitSpec("x.service", 20, source=f"{ETC}/x.service"),
            id="preempt-reset-to-stop",
        ),
        pytest.param(
            "Priority=20\nMemory=512M\n",
            UnitSpec("x.service", 20, source=f"{ETC}/x.service", memory=512 << 20),
            id="memory-megabytes",
        ),
        pytest.param(
            "# Priority=1\n; GPUs=3\nPriority=8\n",
            UnitSpec("x.service", 8, source=f"{ETC}/x.service"),
            id="comments",
        ),
    ],
)
def test_valid(tmp_path: Path, section: str, expected: UnitSpec) -> None:
    write(tmp_path, f"{ETC}/x.service", unit(section))
    assert load_spec("x.service", tmp_path) == (expected, [])


@pytest.mark.parametrize(
    ("value", "requeue"),
    [(v, True) for v in ("yes", "true", "on", "1", "YES", "y", "t")]
    + [(v, False) for v in ("no", "false", "off", "0", "Off", "n", "f")],
)
def test_requeue_accepts_systemd_booleans(tmp_path: Path, value: str, requeue: bool) -> None:
    write(tmp_path, f"{ETC}/x.service", unit(f"Priority=1\nRequeue={value}\n"))
    spec, problems = load_spec("x.service", tmp_path)
    assert problems == []
    assert spec is not None
    assert spec.requeue is requeue


X = f"{ETC}/x.service"
HIDES = "; it hides the drop-ins of its name in the directories after it"


@pytest.mark.parametrize(
    ("section", "messages"),
    [
        pytest.param(
            "Priority=high\n",
            [f'{X}:8: [X-GPUSlice] Priority: expected an integer 0-999, got "high"'],
            id="priority-high",
        ),
        pytest.param(
            "Priority=1000\n",
            [f'{X}:8: [X-GPUSlice] Priority: expected an integer 0-999, got "1000"'],
            id="priority-too-big",
        ),
        pytest.param(
            "Priority=-1\n",
            [f'{X}:8: [X-GPUSlice] Priority: expected an integer 0-999, got "-1"'],
            id="priority-negative",
        ),
        pytest.param(
            "Priority=1\nType=sometimes\n",
            [f'{X}:9: [X-GPUSlice] Type: expected one of on-demand, background, got "sometimes"'],
            id="type-sometimes",
        ),
        pytest.param(
            "Priority=1\nMemory=lots\n",
            [
                f"{X}:9: [X-GPUSlice] Memory: expected a size such as 512M, 20G or 20GiB "
                '(binary units, at most 1P), got "lots"'
            ],
            id="memory-lots",
        ),
        pytest.param(
            "Priority=1\nDevices=first\n",
            [
                f"{X}:9: [X-GPUSlice] Devices: expected up to 64 GPU indices or UUIDs separated "
                "by commas or spaces (e.g. 0,1 or GPU-8f6c...), or %i in a template (each "
                'instance names its GPU), got "first"'
            ],
            id="devices-first",
        ),
        pytest.param(
            "Priority=1\nGPUs=0\n",
            [f'{X}:9: [X-GPUSlice] GPUs: expected an integer 1-64, got "0"'],
            id="gpus-0",
        ),
        pytest.param(
            "Priority=1\nRequeue=maybe\n",
            [
                f"{X}:9: [X-GPUSlice] Requeue: expected a boolean (yes/no, true/false, on/off, "
                f'1/0), got "maybe"'
            ],
            id="requeue-maybe",
        ),
        pytest.param(
            "Type=background\n",
            [f"{X}:7: [X-GPUSlice] Priority: missing, expected an integer 0-999"],
            id="missing-priority",
        ),
        pytest.param(
            "",
            [f"{X}:7: [X-GPUSlice] Priority: missing, expected an integer 0-999"],
            id="empty-section",
        ),
        pytest.param(
            "Priority=high\nType=sometimes\nGPUs=0\nRequeue=maybe\n",
            [
                f'{X}:8: [X-GPUSlice] Priority: expected an integer 0-999, got "high"',
                f'{X}:9: [X-GPUSlice] Type: expected one of on-demand, background, got "sometimes"',
                f'{X}:10: [X-GPUSlice] GPUs: expected an integer 1-64, got "0"',
                f"{X}:11: [X-GPUSlice] Requeue: expected a boolean (yes/no, true/false, on/off, "
                f'1/0), got "maybe"',
            ],
            id="every-problem-collected",
        ),
        pytest.param(
            "Priority=1\nPriority=\n",
            [f"{X}:7: [X-GPUSlice] Priority: missing, expected an integer 0-999"],
            id="empty-assignment-resets",
        ),
    ],
)
def test_errors(tmp_path: Path, section: str, messages: list[str]) -> None:
    write(tmp_path, X, unit(section))
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is None
    assert [str(p) for p in problems] == messages
    assert {p.severity for p in problems} == {"error"}
    assert {p.unit for p in problems} == {"x.service"}


def test_problem_fields(tmp_path: Path) -> None:
    write(tmp_path, X, unit("Priority=high\n"))
    _spec, problems = load_spec("x.service", tmp_path)
    assert problems == [
        Problem(X, 8, "Priority", 'expected an integer 0-999, got "high"', "error", "x.service")
    ]


@pytest.mark.parametrize("name", sorted(NEVER_GATED))
def test_the_controller_and_what_it_starts_after_are_never_managed(
    tmp_path: Path, name: str
) -> None:
    """Gated, each would wait for the controller that waits for it (or is it): an error at
    the annotation's header, so the unit is left unmanaged and ungated."""
    path = f"{ETC}/{name}"
    write(tmp_path, path, unit("Priority=1\n"))
    assert load_spec(name, tmp_path) == (
        None,
        [
            Problem(
                path,
                7,
                "",
                "gpuslice.service starts after this unit, or is it: a gate here would wait "
                "for the controller that waits for it (left unmanaged, ungated)",
                "error",
                name,
            )
        ],
    )


@pytest.mark.parametrize(
    "target", ["gpuslice.service", "dbus.service", "basic.target", "sysinit.target"]
)
def test_a_unit_ordered_before_the_controller_is_never_managed(tmp_path: Path, target: str) -> None:
    """An admin's GPU set-up unit ordered `Before=gpuslice.service`, or an early-boot unit
    before a target gpuslice.service starts after (its default dependencies), then annotated
    (`gpuslice enroll`): gated, it was ordered after the controller it is before, a cycle
    systemd breaks at boot by dropping a start job, perhaps the controller's. Named in a
    drop-in too, among other names."""
    write(tmp_path, X, unit("Priority=1\n"))
    dropin = f"{ETC}/x.service.d/order.conf"
    write(tmp_path, dropin, f"[Unit]\nBefore=shutdown.target {target}\n")
    assert load_spec("x.service", tmp_path) == (
        None,
        [
            Problem(
                dropin,
                2,
                "Before",
                f"{target}: this unit is ordered before gpuslice.service, which its gate would "
                "wait for (left unmanaged, ungated)",
                "error",
                "x.service",
                "Unit",
            )
        ],
    )


def test_a_unit_ordered_before_other_units_is_managed(tmp_path: Path) -> None:
    """`Before=shutdown.target` (a job's usual ordering) or another job orders nothing
    before the controller; `Before=` outside [Unit] is no ordering of systemd's."""
    text = unit("Priority=1\n").replace("[Unit]\n", "[Unit]\nBefore=shutdown.target y.service\n")
    write(tmp_path, X, text.replace("[Service]\n", "[Service]\nBefore=basic.target\n"))
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is not None and problems == []


def test_a_control_character_the_gate_would_copy_leaves_the_unit_unmanaged(
    tmp_path: Path,
) -> None:
    """The gate's drop-in copies the ExecStartPre= lines of the files applied before it, and
    gpuslice-generator writes no line with a control character: it left such a unit ungated
    while the scan took it as managed (`gpuslice check` said ok, the controller booked GPUs
    for a job that ran ungated, every GPU visible). The scan says so where the line is. A
    line reset by an empty ExecStartPre= before the gate, or in a drop-in applied after it,
    is not copied: fine; a tab is whitespace to systemd. Nor is one in a drop-in named as the
    gate's (`gpuslice-gate.conf` in /etc hides the gate file; it sorts at the gate's place, not
    before it, and the generator copies nothing from it either)."""
    text = SERVICE.replace("[Service]\n", "[Service]\nExecStartPre=/bin/a\x1bb\n")
    write(tmp_path, X, text + "\n[X-GPUSlice]\nPriority=1\n")
    assert load_spec("x.service", tmp_path) == (
        None,
        [
            Problem(
                X,
                5,
                "ExecStartPre",
                "/bin/a\\x1bb: a control character in a line the gate's drop-in would copy, "
                "which gpuslice-generator does not write (left unmanaged, ungated)",
                "error",
                "x.service",
                "Service",
            )
        ],
    )
    write(
        tmp_path, f"{ETC}/x.service.d/a.conf", "[Service]\nExecStartPre=\nExecStartPre=/bin/\tc\n"
    )
    write(tmp_path, f"{ETC}/x.service.d/z.conf", "[Service]\nExecStartPre=/bin/z\x7fz\n")
    write(tmp_path, f"{ETC}/x.service.d/{GATE_DROPIN_NAME}", "[Service]\nExecStartPre=/bin/\x1b\n")
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is not None and problems == []


def test_a_control_character_the_gate_would_copy_is_quoted_cut_short(tmp_path: Path) -> None:
    """The finding quotes at most 100 characters of the line, as every quoted value: a long
    command line is not repeated whole in the journal and Status."""
    text = SERVICE.replace("[Service]\n", "[Service]\nExecStartPre=/bin/a\x1b" + "b" * 200 + "\n")
    write(tmp_path, X, text + "\n[X-GPUSlice]\nPriority=1\n")
    spec, problems = load_spec("x.service", tmp_path)
    quoted = ("/bin/a\\x1b" + "b" * 200)[:100] + "..."
    assert spec is None
    assert [p.message.split(": ", 1)[0] for p in problems] == [quoted]


@pytest.mark.parametrize("length", [253, 254, 255])
def test_a_name_too_long_for_its_gates_drop_in_directory_leaves_the_unit_unmanaged(
    tmp_path: Path, length: int
) -> None:
    """systemd takes unit names of 254 and 255 characters, but `UNIT.d` must fit in a file
    name: gpuslice-generator cannot gate such a unit, or template, which the scan took as
    managed (`gpuslice check` said ok, the controller booked GPUs for a job that ran ungated,
    every GPU visible)."""
    name = "x" * (length - len(".service")) + ".service"
    template = "t" * (length - len("@.service")) + "@.service"
    write(tmp_path, f"{ETC}/{name}", "[X-GPUSlice]\nPriority=1\n")
    write(tmp_path, f"{ETC}/{template}", "[X-GPUSlice]\nPriority=1\n")
    result = scan(tmp_path)
    if length == 253:
        assert sorted(result.specs) == sorted([name, template])
        assert result.problems == []
        return
    assert result.specs == {}
    assert result.problems == [
        Problem(
            f"{ETC}/{n}",
            1,
            "",
            f"the unit's name is too long for its gate's drop-in directory UNIT.d ({length} "
            "characters; at most 253): gpuslice-generator cannot gate it (left unmanaged, "
            "ungated)",
            "error",
            n,
        )
        for n in sorted([name, template])
    ]


@pytest.mark.parametrize("length", [253, 254, 255])
def test_an_instance_too_long_for_a_drop_in_directory_is_managed_under_its_template_only(
    tmp_path: Path, length: int
) -> None:
    """An instance of a managed template is gated by the template's `t@.service.d/` (the
    generator says when that gate is not right for it); one annotated in its own file whose
    template is not managed needs a directory of its own, which a name of 254 or 255
    characters cannot have: unmanaged, as the generator leaves it."""
    covered = "t@" + "i" * (length - len("t@.service")) + ".service"
    alone = "u@" + "i" * (length - len("u@.service")) + ".service"
    write(tmp_path, f"{ETC}/t@.service", "[X-GPUSlice]\nPriority=1\n")
    write(tmp_path, f"{ETC}/{covered}", "[X-GPUSlice]\nPriority=2\n")
    write(tmp_path, f"{ETC}/u@.service", "[Service]\nExecStart=/bin/u\n")
    write(tmp_path, f"{ETC}/{alone}", "[X-GPUSlice]\nPriority=3\n")
    result = scan(tmp_path)
    managed = ["t@.service", covered] + ([alone] if length == 253 else [])
    assert sorted(result.specs) == sorted(managed)
    assert result.problems == (
        []
        if length == 253
        else [
            Problem(
                f"{ETC}/{alone}",
                0,
                "",
                f"the unit's name is too long for its gate's drop-in directory UNIT.d "
                f"({length} characters; at most 253): gpuslice-generator cannot gate it (left "
                "unmanaged, ungated)",
                "error",
                alone,
            )
        ]
    )
    assert result.invalid == ({alone} if length > 253 else set())
    assert result.spec_for(alone) is None or length == 253


def test_run_as_keys_count_in_service_only(tmp_path: Path) -> None:
    """`User=` outside [Service] is no setting of systemd's: the unit runs as root, and its
    environment file, which only root can change here, is not refused either way."""
    write(tmp_path, "/etc/env", "A=1\n")
    os.chmod(tmp_path / "etc", 0o755)
    text = unit("Priority=1\n").replace("[Unit]\n", "[Unit]\nUser=nobody\nEnvironmentFile=/tmp/x\n")
    write(tmp_path, X, text.replace("[Service]\n", "[Service]\nEnvironmentFile=/etc/env\n"))
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is not None and problems == []


@pytest.mark.parametrize(
    ("section", "messages"),
    [
        pytest.param(
            "Priority=1\nColour=blue\n",
            [
                f"{X}:9: [X-GPUSlice] Colour: unknown key, ignored "
                "(known keys: Priority, Type, GPUs, Requeue, Memory, Devices, Preempt)"
            ],
            id="unknown-key",
        ),
        pytest.param(
            "Priority=1\njunk line\n",
            [f"{X}:9: [X-GPUSlice] missing '=', line ignored"],
            id="line-without-equals",
        ),
        pytest.param(
            "Priority=high\nPriority=3\n",
            [
                f'{X}:8: [X-GPUSlice] Priority: expected an integer 0-999, got "high" '
                f"(overridden at {X}:9)"
            ],
            id="bad-value-overridden",
        ),
    ],
)
def test_warnings_keep_the_unit_managed(tmp_path: Path, section: str, messages: list[str]) -> None:
    write(tmp_path, X, unit(section))
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is not None
    assert [str(p) for p in problems] == messages
    assert {p.severity for p in problems} == {"warning"}


def test_not_annotated_masked_or_missing(tmp_path: Path) -> None:
    write(tmp_path, f"{ETC}/plain.service", SERVICE + "[X-Other]\nPriority=1\n")
    write(tmp_path, f"{LIB}/masked.service", unit("Priority=1\n"))
    link(tmp_path, f"{ETC}/masked.service", "/dev/null")
    for name in ("plain.service", "masked.service", "absent.service"):
        assert load_spec(name, tmp_path) == (None, [])


def test_key_table_matches_unit_spec() -> None:
    # `restart` is [Service] Restart=, read as systemd reads it, not an [X-GPUSlice] key
    fields = set(UnitSpec.__dataclass_fields__) - {"name", "source", "restart"}
    assert {k.field for k in KEYS} == fields


# ---------------------------------------------------------------------------------------------
# drop-ins


def test_dropins_override_key_by_key_in_systemd_order(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/x.service", unit("Priority=50\nType=background\nGPUs=2\n"))
    write(tmp_path, f"{LIB}/x.service.d/10-vendor.conf", "[X-GPUSlice]\nGPUs=4\nPriority=40\n")
    # override.conf sorts after 10-vendor.conf: it wins for Priority; GPUs stays 4
    write(tmp_path, f"{ETC}/x.service.d/override.conf", "[X-GPUSlice]\nPriority=10\n")
    spec, problems = load_spec("x.service", tmp_path)
    assert problems == []
    assert spec == UnitSpec(
        "x.service", 10, UnitKind.BACKGROUND, 4, True, f"{ETC}/x.service.d/override.conf"
    )


def test_annotation_only_in_dropin(tmp_path: Path) -> None:
    # what `systemctl edit x.service` produces
    write(tmp_path, f"{LIB}/x.service", SERVICE)
    write(tmp_path, f"{ETC}/x.service.d/override.conf", "[X-GPUSlice]\nPriority=5\n")
    spec, _ = load_spec("x.service", tmp_path)
    assert spec == UnitSpec("x.service", 5, source=f"{ETC}/x.service.d/override.conf")


def test_masked_dropin_contributes_nothing(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/x.service", unit("Priority=50\n"))
    write(tmp_path, f"{LIB}/x.service.d/gpus.conf", "[X-GPUSlice]\nGPUs=8\n")
    link(tmp_path, f"{ETC}/x.service.d/gpus.conf", "/dev/null")
    spec, _ = load_spec("x.service", tmp_path)
    assert spec is not None
    assert spec.gpus == 1


def test_error_in_dropin_names_the_dropin(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/x.service", unit("Priority=50\n"))
    write(tmp_path, f"{ETC}/x.service.d/override.conf", "# mine\n[X-GPUSlice]\nType=sometimes\n")
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is None
    assert [str(p) for p in problems] == [
        f"{ETC}/x.service.d/override.conf:3: [X-GPUSlice] Type: expected one of on-demand, "
        'background, got "sometimes"'
    ]


def test_missing_priority_points_at_first_section(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/x.service", SERVICE)
    write(tmp_path, f"{ETC}/x.service.d/a.conf", "\n[X-GPUSlice]\nGPUs=2\n")
    write(tmp_path, f"{ETC}/x.service.d/b.conf", "[X-GPUSlice]\nType=background\n")
    _spec, problems = load_spec("x.service", tmp_path)
    assert [str(p) for p in problems] == [
        f"{ETC}/x.service.d/a.conf:2: [X-GPUSlice] Priority: missing, expected an integer 0-999"
    ]


# ---------------------------------------------------------------------------------------------
# templates, instances, escaped names, scan


def test_templates_and_instances(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/train@.service", unit("Priority=70\nType=background\n"))
    write(tmp_path, f"{ETC}/train@big.service.d/gpus.conf", "[X-GPUSlice]\nGPUs=4\n")
    write(tmp_path, f"{ETC}/train@.service.d/p.conf", "[X-GPUSlice]\nPriority=60\n")
    template, _ = load_spec("train@.service", tmp_path)
    assert template == UnitSpec(
        "train@.service", 60, UnitKind.BACKGROUND, source=f"{ETC}/train@.service.d/p.conf"
    )
    big, _ = load_spec("train@big.service", tmp_path)
    assert big is not None
    assert (big.name, big.priority, big.gpus) == ("train@big.service", 60, 4)

    result = scan(tmp_path)
    assert set(result.specs) == {"train@.service", "train@big.service"}
    assert template is not None
    assert result.spec_for("train@small.service") == template.for_instance("train@small.service")
    assert result.spec_for("train@big.service") == big
    assert result.spec_for("train@.service") == template
    assert result.spec_for("other@x.service") is None


def test_devices_from_the_instance_name(tmp_path: Path) -> None:
    """`Devices=%i`: a template whose every instance is pinned to the GPU it names (one
    worker per GPU; gpuslice-claim@.service). A name that is no GPU is kept as it is: such
    an instance waits, as a unit whose Devices= names no GPU of the host does."""
    write(tmp_path, f"{LIB}/w@.service", unit("Priority=30\nDevices=%i\n"))
    write(tmp_path, f"{ETC}/w@2.service.d/m.conf", "[X-GPUSlice]\nMemory=8G\n")
    write(tmp_path, f"{ETC}/w@3.service", unit("Priority=40\nDevices=\t%i \n"))
    result = scan(tmp_path)
    assert result.problems == []
    assert result.specs["w@.service"].devices == ("%i",)

    def devices(unit: str) -> tuple[str, ...] | None:
        found = result.spec_for(unit)
        return found.devices if found is not None else None

    assert devices("w@0.service") == ("0",)
    assert devices("w@GPU-8f6c-aa.service") == ("GPU-8f6c-aa",)
    assert devices("w@x.service") == ("x",)
    assert devices("w@2.service") == ("2",)  # an instance's own drop-in
    assert result.specs["w@2.service"].memory == 8 << 30
    assert devices("w@3.service") == ("3",)  # an instance's own file
    # the instance is what lies between the first "@" and the type's "." (as systemd reads it)
    assert devices("w@a@b.service") == ("a@b",)
    assert devices("w@a.b.service") == ("a.b",)
    assert UnitSpec("a@.service", 1, devices=("0",)).for_instance("a@1.service").devices == ("0",)


@pytest.mark.parametrize(
    ("name", "section", "message"),
    [
        pytest.param(
            "x.service",
            "Priority=1\nDevices=%i\n",
            "%i names the GPU by the unit's instance: only a template (NAME@.service) and its "
            "instances may say it",
            id="not-a-template",
        ),
        pytest.param(
            "x@.service",
            "Priority=1\nDevices=%i,1\n",
            '%i stands alone: an instance\'s name is the one GPU it may use, got "%i,1"',
            id="with-another",
        ),
        pytest.param(
            "x@.service",
            "Priority=1\nDevices=%I\n",
            "expected up to 64 GPU indices",
            id="unescaped-specifier",
        ),
    ],
)
def test_devices_from_the_instance_name_refused(
    tmp_path: Path, name: str, section: str, message: str
) -> None:
    write(tmp_path, f"{ETC}/{name}", unit(section))
    spec, problems = load_spec(name, tmp_path)
    assert spec is None
    (problem,) = problems
    assert (problem.path, problem.line, problem.key) == (f"{ETC}/{name}", 9, "Devices")
    assert (problem.unit, problem.severity) == (name, "error")
    assert problem.message.startswith(message)


def test_instance_dropin_without_annotation_is_not_listed(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/t@.service", unit("Priority=70\n"))
    write(tmp_path, f"{ETC}/t@a.service.d/env.conf", "[Service]\nEnvironment=A=1\n")
    result = scan(tmp_path)
    assert set(result.specs) == {"t@.service"}
    assert result.spec_for("t@a.service") == UnitSpec("t@a.service", 70, source=f"{LIB}/t@.service")


def test_instance_made_invalid_by_its_dropin(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/t@.service", unit("Priority=70\n"))
    write(tmp_path, f"{ETC}/t@bad.service.d/x.conf", "[X-GPUSlice]\nGPUs=0\n")
    result = scan(tmp_path)
    assert result.invalid == {"t@bad.service"}
    assert result.spec_for("t@bad.service") is None
    assert result.spec_for("t@good.service") is not None
    assert [str(p) for p in result.problems] == [
        f'{ETC}/t@bad.service.d/x.conf:2: [X-GPUSlice] GPUs: expected an integer 1-64, got "0"'
    ]


def test_escaped_names(tmp_path: Path) -> None:
    name = "foo\\x2dbar@.service"
    write(tmp_path, f"{LIB}/{name}", unit("Priority=3\n"))
    write(tmp_path, f"{ETC}/foo\\x2dbar@a\\x2db.service.d/o.conf", "[X-GPUSlice]\nPriority=2\n")
    result = scan(tmp_path)
    assert result.spec_for("foo\\x2dbar@z.service") == UnitSpec(
        "foo\\x2dbar@z.service", 3, source=f"{LIB}/{name}"
    )
    spec = result.spec_for("foo\\x2dbar@a\\x2db.service")
    assert spec is not None
    assert spec.priority == 2


def test_scan_collects_every_unit_and_problem(tmp_path: Path) -> None:
    write(tmp_path, f"{ETC}/good.service", unit("Priority=1\n"))
    write(tmp_path, f"{ETC}/bad.service", unit("Priority=high\nGPUs=0\n"))
    write(tmp_path, f"{ETC}/warn.service", unit("Priority=2\nColour=red\n"))
    write(tmp_path, f"{ETC}/plain.service", SERVICE)
    write(tmp_path, f"{ETC}/other.socket", unit("Priority=1\n"))
    result = scan(tmp_path)
    assert sorted(result.specs) == ["good.service", "warn.service"]
    assert result.invalid == {"bad.service"}
    assert [(p.path, p.line, p.key, p.severity) for p in result.problems] == [
        (f"{ETC}/bad.service", 8, "Priority", "error"),
        (f"{ETC}/bad.service", 9, "GPUs", "error"),
        (f"{ETC}/warn.service", 9, "Colour", "warning"),
    ]
    assert result.spec_for("bad.service") is None


@pytest.mark.parametrize("enabled_before", [True, False])
def test_a_scan_runs_without_the_cycle_collector_and_puts_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled_before: bool
) -> None:
    """Python's cycle collector is off while a scan reads (its passes were a fifth of a scan
    of 10,000 units) and as it was afterwards, also when the scan fails."""
    write(tmp_path, X, unit("Priority=1\n"))
    seen: list[bool] = []
    real_load = Loader.load

    def load(self: Loader, name: str) -> tuple[UnitSpec | None, list[Problem]]:
        seen.append(gc.isenabled())
        return real_load(self, name)

    monkeypatch.setattr(Loader, "load", load)
    try:
        gc.enable() if enabled_before else gc.disable()
        assert sorted(scan(tmp_path).specs) == ["x.service"]
        assert (seen, gc.isenabled()) == ([False], enabled_before)

        def fail(self: Loader, name: str) -> None:
            raise RuntimeError("boom")

        monkeypatch.setattr(Loader, "load", fail)
        with pytest.raises(RuntimeError):
            scan(tmp_path)
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable()


def test_repeated_keys_in_other_sections_are_fine(tmp_path: Path) -> None:
    text = (
        '[Service]\nExecStart=/bin/a\nExecStart=/bin/b\nEnvironment="A=1 2" B=%n\n'
        "ExecStartPre=/bin/sh -c 'echo \\\n  hi'\n[X-GPUSlice]\nPriority=4\n"
    )
    write(tmp_path, X, text)
    spec, problems = load_spec("x.service", tmp_path)
    assert problems == []
    assert spec is not None
    assert spec.priority == 4


def test_importable_without_optional_dependencies() -> None:
    code = (
        "import sys\n"
        "for m in ('dbus_next', 'pynvml', 'yaml', 'click'):\n    sys.modules[m] = None\n"
        "import gpuslice.annotations, gpuslice.unitfiles\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_instance_file_of_its_own_does_not_inherit_the_template(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/t@.service", unit("Priority=70\n"))
    write(tmp_path, f"{LIB}/t@own.service", SERVICE)
    write(tmp_path, f"{LIB}/t@ann.service", unit("Priority=3\n"))
    result = scan(tmp_path)
    assert result.unannotated_instances == {"t@own.service"}
    assert result.spec_for("t@own.service") is None
    assert result.spec_for("t@ann.service") == UnitSpec(
        "t@ann.service", 3, source=f"{LIB}/t@ann.service"
    )
    assert result.spec_for("t@other.service") is not None


# ---------------------------------------------------------------------------------------------
# hostile values (issue 8): a located error, the unit unmanaged, never an exception


@pytest.mark.parametrize(
    ("section", "message"),
    [
        pytest.param(
            "Priority=\u0665\n",
            'Priority: expected an integer 0-999, got "\\u0665"',
            id="priority-arabic-indic-digit",
        ),
        pytest.param(
            "Priority=\u00b9\n",
            'Priority: expected an integer 0-999, got "\\xb9"',
            id="priority-superscript",
        ),
        pytest.param(
            "Priority=" + "9" * 5000 + "\n",
            'Priority: expected an integer 0-999, got "' + "9" * 100 + '..."',
            id="priority-5000-digits",
        ),
        pytest.param(
            "Priority=+1\n", 'Priority: expected an integer 0-999, got "+1"', id="priority-plus"
        ),
        pytest.param(
            "Priority=1\nGPUs=65\n", 'GPUs: expected an integer 1-64, got "65"', id="gpus-65"
        ),
        pytest.param(
            "Priority=1\nGPUs=" + "9" * 400 + "\n",
            'GPUs: expected an integer 1-64, got "' + "9" * 100 + '..."',
            id="gpus-huge",
        ),
        pytest.param(
            "Priority=1\nGPUs=\u0662\n",
            'GPUs: expected an integer 1-64, got "\\u0662"',
            id="gpus-arabic-indic",
        ),
        pytest.param(
            "Priority=1\nMemory=" + "9" * 400 + "\n",
            "Memory: expected a size such as 512M, 20G or 20GiB (binary units, at most 1P), "
            'got "' + "9" * 100 + '..."',
            id="memory-400-nines",
        ),
        pytest.param(
            "Priority=1\nMemory=\u0663G\n",
            "Memory: expected a size such as 512M, 20G or 20GiB (binary units, at most 1P), "
            'got "\\u0663G"',
            id="memory-arabic-indic",
        ),
        pytest.param(
            "Priority=1\nMemory=0\n",
            "Memory: expected a size such as 512M, 20G or 20GiB (binary units, at most 1P), "
            'got "0"',
            id="memory-0",
        ),
        pytest.param(
            "Priority=1\nDevices=MIG-4f1c-aa/1/0\n",
            "Devices: MIG devices are not supported (name the whole GPU by its index or GPU- "
            'UUID), got "MIG-4f1c-aa/1/0"',
            id="devices-mig",
        ),
        pytest.param(
            "Priority=1\nDevices=0, MIG-GPU-8f6c/1/0\n",
            "Devices: MIG devices are not supported (name the whole GPU by its index or GPU- "
            'UUID), got "0, MIG-GPU-8f6c/1/0"',
            id="devices-mig-after-index",
        ),
        pytest.param(
            "Priority=1\nPreempt=suspend kill\n",
            "Preempt: expected stop, freeze and suspend, in the order to try them, each once "
            '(e.g. suspend stop), got "suspend kill"',
            id="preempt-unknown-way",
        ),
        pytest.param(
            "Priority=1\nPreempt=stop suspend stop\n",
            "Preempt: each of stop, freeze and suspend may appear once, got",
            id="preempt-twice",
        ),
        pytest.param(
            "Priority=1\nPreempt=Suspend\n",
            "Preempt: expected stop, freeze and suspend, in the order to try them, each once "
            '(e.g. suspend stop), got "Suspend"',
            id="preempt-case",
        ),
        pytest.param(
            "Priority=1\nPreempt= , \n",
            'Preempt: expected stop, freeze or suspend, found only separators, got ","',
            id="preempt-only-separators",
        ),
        pytest.param(
            "Priority=1\nDevices=,\n",
            'Devices: expected GPU indices or UUIDs, found only separators, got ","',
            id="devices-comma",
        ),
        pytest.param(
            "Priority=1\nDevices= , ,\n",
            'Devices: expected GPU indices or UUIDs, found only separators, got ", ,"',
            id="devices-separators",
        ),
        pytest.param(
            "Priority=1\nDevices=" + ",".join(str(i) for i in range(65)) + "\n",
            'Devices: expected at most 64 GPUs, found 65, got "0,1,2,',
            id="devices-too-many",
        ),
        pytest.param(
            "Priority=1\nDevices=\u0660\n",
            "Devices: expected up to 64 GPU indices or UUIDs",
            id="devices-arabic-indic",
        ),
        pytest.param(
            "Priority=1\nDevices=12345\n",
            "Devices: expected up to 64 GPU indices or UUIDs",
            id="devices-index-5-digits",
        ),
        pytest.param(
            "Priority=1\nDevices=GPU-" + "a" * 81 + "\n",
            "Devices: expected up to 64 GPU indices or UUIDs",
            id="devices-uuid-too-long",
        ),
        pytest.param(
            "Priority=1\nType=Background\n",
            'Type: expected one of on-demand, background, got "Background"',
            id="type-case",
        ),
        pytest.param(
            "Priority=1\nType=background \\\n x\n",
            'Type: expected one of on-demand, background, got "background   x"',
            id="type-continued",
        ),
        pytest.param(
            "Priority=1\nRequeue=2\n",
            'Requeue: expected a boolean (yes/no, true/false, on/off, 1/0), got "2"',
            id="requeue-2",
        ),
    ],
)
def test_hostile_values_are_located_errors(tmp_path: Path, section: str, message: str) -> None:
    write(tmp_path, X, unit(section))
    write(tmp_path, f"{ETC}/good.service", unit("Priority=1\n"))
    result = scan(tmp_path)
    assert "x.service" in result.invalid
    assert "good.service" in result.specs
    errors = [p for p in result.problems if p.severity == "error"]
    assert len(errors) == 1
    assert errors[0].path == X
    assert errors[0].line >= 8
    assert f"{errors[0].key}: {errors[0].message}".startswith(message)
    assert len(str(errors[0])) < 400  # a huge value is quoted, not copied


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("Priority=0\n", "priority", 0),
        ("Priority=999\n", "priority", 999),
        ("Priority=007\n", "priority", 7),
        ("Priority=1\nGPUs=1\n", "gpus", 1),
        ("Priority=1\nGPUs=64\n", "gpus", 64),
        ("Priority=1\nType=background\n", "kind", UnitKind.BACKGROUND),
        ("Priority=1\nType=background\nType=\n", "kind", UnitKind.ON_DEMAND),
        ("Priority=1\nRequeue=on\nRequeue=\n", "requeue", True),
        ("Priority=1\nMemory=1\n", "memory", 1),
        ("Priority=1\nMemory=1P\n", "memory", 1 << 50),
        ("Priority=1\nMemory=1.5K\n", "memory", 1536),
        ("Priority=1\nDevices=9999\n", "devices", ("9999",)),
        ("Priority=1\nDevices=0 1\t2\n", "devices", ("0", "1", "2")),
        ("Priority=1\nDevices=1,0,1\n", "devices", ("1", "0")),
        ("Priority=1\nDevices=" + ",".join(map(str, range(64))) + "\n", "devices", None),
        ("Priority=1\nDevices=0\nDevices=\n", "devices", ()),
        ("Priority=1\nDevices=GPU-" + "a" * 80 + "\n", "devices", ("GPU-" + "a" * 80,)),
    ],
)
def test_boundary_values_are_accepted(
    tmp_path: Path, section: str, field: str, value: object
) -> None:
    write(tmp_path, X, unit(section))
    spec, problems = load_spec("x.service", tmp_path)
    assert problems == []
    assert spec is not None
    if value is not None:
        assert getattr(spec, field) == value


def test_repeated_section_and_keys_merge_last_wins(tmp_path: Path) -> None:
    text = unit("Priority=5\nGPUs=2\n") + "[Service]\nX=1\n[X-GPUSlice]\nPriority=6\n"
    write(tmp_path, X, text)
    spec, problems = load_spec("x.service", tmp_path)
    assert problems == []
    assert spec is not None
    assert (spec.priority, spec.gpus) == (6, 2)


def test_a_flood_of_problems_is_capped_per_file(tmp_path: Path) -> None:
    write(tmp_path, X, unit("Priority=1\n" + "Colour=red\n" * 5000 + "GPUs=0\n"))
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is None  # the error past the cap still counts
    assert len(problems) == 51
    assert str(problems[-1]) == f"{X}:0: [X-GPUSlice] 4951 more problems in this file not shown"
    assert problems[-1].severity == "error"


def test_odd_key_names_are_quoted_safely(tmp_path: Path) -> None:
    write(tmp_path, X, unit("Priority=1\n" + "K\u202eey\x1b[31m" * 50 + "=1\n"))
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is not None
    assert len(problems) == 1
    assert str(problems[0]).isascii()
    assert str(problems[0]).isprintable()


# ---------------------------------------------------------------------------------------------
# hostile files (issue 8): read nothing that is not a regular file, never block, never raise


def _hostile_root(tmp_path: Path) -> Path:
    etc = tmp_path / ETC.lstrip("/")
    etc.mkdir(parents=True)
    (etc / "good.service").write_text(unit("Priority=1\n"))
    return etc


def _problems_beside_good(tmp_path: Path) -> list[str]:
    """Scan the hostile root: good.service alone is managed; what the scan says."""
    result = scan(tmp_path)
    assert set(result.specs) == {"good.service"}
    return [str(p) for p in result.problems]


def test_fifo_fragment_is_ignored_and_never_opened(tmp_path: Path) -> None:
    etc = _hostile_root(tmp_path)
    os.mkfifo(etc / "fifo.service")
    # opening the FIFO would block forever
    assert _problems_beside_good(tmp_path) == [
        f"{ETC}/fifo.service:0: not a regular file or a symlink, ignored"
    ]


def test_symlink_to_fifo_is_an_error_on_that_unit(tmp_path: Path) -> None:
    etc = _hostile_root(tmp_path)
    os.mkfifo(etc / "pipe")
    os.mkfifo(etc.parent / "pipe")
    # out of the search path: the unit's file (a link into it is an alias, and `pipe` no
    # unit name: systemd refuses that link and ignores it)
    (etc / "fifo.service").symlink_to("../pipe")
    (etc / "refused.service").symlink_to("pipe")
    (etc / "good.service.d").mkdir()
    os.mkfifo(etc / "good.service.d" / "pipe.conf")
    (etc / "good.service.d" / "link.conf").symlink_to("../pipe")
    result = scan(tmp_path)
    assert set(result.specs) == {"good.service"}
    assert result.invalid == {"fifo.service"}
    assert [(str(p), p.severity) for p in result.problems] == [
        (f"{ETC}/fifo.service:0: [X-GPUSlice] cannot read: a FIFO, not a regular file", "error"),
        (
            f"{ETC}/good.service.d/link.conf:0: links to something that is not a regular file, "
            f"ignored{HIDES}",
            "warning",
        ),
        (
            f"{ETC}/good.service.d/pipe.conf:0: not a regular file or a symlink, ignored{HIDES}",
            "warning",
        ),
        (
            f"{ETC}/refused.service:0: a symlink to {ETC}/pipe, which systemd refuses as an alias"
            " (not a valid unit name) and ignores: a lower directory's file of this name is the"
            " unit's",
            "warning",
        ),
    ]


def test_fifo_swapped_in_after_the_listing_is_still_not_blocking(tmp_path: Path) -> None:
    etc = _hostile_root(tmp_path)
    (etc / "x.service").write_text(unit("Priority=1\n"))
    loader = Loader(UnitIndex(tmp_path))
    assert loader.index.unit_names() == ["good.service", "x.service"]
    (etc / "x.service").unlink()
    os.mkfifo(etc / "x.service")
    spec, problems = loader.load("x.service")
    assert spec is None
    assert [str(p) for p in problems] == [
        f"{ETC}/x.service:0: [X-GPUSlice] cannot read: a FIFO, not a regular file"
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_device_node_named_like_a_unit(tmp_path: Path) -> None:
    etc = _hostile_root(tmp_path)
    os.mknod(etc / "blk.service", 0o600 | stat.S_IFBLK, os.makedev(7, 0))
    (etc / "chr.service").symlink_to("../chr")  # out of the search path: the unit's file
    os.mknod(etc.parent / "chr", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: masked
    assert _problems_beside_good(tmp_path) == [
        f"{ETC}/blk.service:0: not a regular file or a symlink, ignored"
    ]


def test_directory_named_like_a_unit_or_dropin(tmp_path: Path) -> None:
    etc = _hostile_root(tmp_path)
    (etc / "dir.service").mkdir()
    (etc / "good.service.d" / "d.conf").mkdir(parents=True)
    assert _problems_beside_good(tmp_path) == [
        f"{ETC}/good.service.d/d.conf:0: a directory, ignored{HIDES}"
    ]


def test_huge_file_is_an_error_not_a_partial_parse(tmp_path: Path) -> None:
    etc = _hostile_root(tmp_path)
    (etc / "huge.service").write_text(unit("Priority=1\n") + "#" * MAX_FILE_SIZE)
    (etc / "good.service.d").mkdir()
    (etc / "good.service.d" / "big.conf").write_text("[X-GPUSlice]\nGPUs=2\n" + "\n" * (2 << 20))
    (etc / "long.service").write_text(unit("Priority=1\nX=" + "y" * MAX_FILE_SIZE + "\n"))
    (etc / "edge.service").write_text(unit("Priority=1\n").ljust(MAX_FILE_SIZE, "\n"))
    result = scan(tmp_path)
    assert set(result.specs) == {"edge.service"}
    assert result.invalid == {"good.service", "huge.service", "long.service"}
    assert [str(p) for p in result.problems] == [
        f"{ETC}/good.service.d/big.conf:0: [X-GPUSlice] cannot read: larger than 1 MiB, which "
        "no unit file needs",
        f"{ETC}/huge.service:0: [X-GPUSlice] cannot read: larger than 1 MiB, which no unit file "
        "needs",
        f"{ETC}/long.service:0: [X-GPUSlice] cannot read: larger than 1 MiB, which no unit file "
        "needs",
    ]


def test_invalid_utf8_and_nul_are_located_warnings(tmp_path: Path) -> None:
    etc = _hostile_root(tmp_path)
    text = unit("Priority=1\nType=background\x00Requeue=no\nGPUs=2\xff\n").encode("latin-1")
    (etc / "x.service").write_bytes(text + b"GPUs=3\n")
    spec, problems = load_spec("x.service", tmp_path)  # never UnicodeDecodeError
    assert [str(p) for p in problems] == [
        f"{X}:11: [X-GPUSlice] line is not valid UTF-8: systemd ignores the rest of the file"
    ]
    assert spec is not None
    # systemd ends a line at a NUL, as at a newline, and reads nothing after the bad line
    assert (spec.gpus, spec.kind, spec.requeue) == (1, UnitKind.BACKGROUND, False)


def test_symlink_loops_and_long_chains(tmp_path: Path) -> None:
    etc = _hostile_root(tmp_path)
    (etc / "a.service").symlink_to("b.service")
    (etc / "b.service").symlink_to("a.service")
    (etc / "self.service").symlink_to("self.service")
    (etc / "deep.service").symlink_to("/" + "x/../" * 600 + "etc/systemd/system/good.service")
    for i in range(40):
        (etc / f"chain{i}").symlink_to(f"chain{i + 1}" if i < 39 else "good.service")
    (etc / "chain.service").symlink_to("chain0")
    (etc / "good.service.d").mkdir()
    (etc / "good.service.d" / "loop.conf").symlink_to("loop.conf")
    (etc / "good.service.d" / "gone.conf").symlink_to("nowhere.conf")  # dangling: hides
    (etc / "loop.service.d").symlink_to("loop.service.d")
    result = scan(tmp_path)
    assert set(result.specs) == {"good.service"}  # deep.service is an alias of it
    nowhere = "a symlink that leads nowhere"
    assert [str(p) for p in result.problems] == [
        f"{ETC}/a.service:0: {nowhere} (dangling, a loop, too long), ignored",
        f"{ETC}/b.service:0: {nowhere} (dangling, a loop, too long), ignored",
        f"{ETC}/chain.service:0: {nowhere} (dangling, a loop, too long), ignored",
        f"{ETC}/good.service.d/gone.conf:0: {nowhere} (dangling), ignored{HIDES}",
        f"{ETC}/good.service.d/loop.conf:0: {nowhere} (a loop, too long), ignored{HIDES}",
        f"{ETC}/self.service:0: {nowhere} (dangling, a loop, too long), ignored",
    ]


def test_invalid_unit_names_are_ignored(tmp_path: Path) -> None:
    etc = _hostile_root(tmp_path)
    long_name = "a" * (UNIT_NAME_MAX - len(".service")) + "b.service"  # 256 characters
    names = ["bad name.service", "caf\u00e9.service", "@x.service", long_name, "\n.service"]
    for name in list(names):
        try:
            (etc / name).write_text(unit("Priority=1\n"))
        except OSError:  # a file system that refuses the name
            names.remove(name)
    (etc / "bad@ name.service.d").mkdir()
    (etc / "bad@ name.service.d" / "x.conf").write_text("[X-GPUSlice]\nPriority=1\n")
    result = scan(tmp_path)
    assert set(result.specs) == {"good.service"}
    assert all(p.severity == "warning" and p.line == 0 for p in result.problems)
    assert all("not a valid unit name" in p.message for p in result.problems)
    assert all(str(p).isascii() and str(p).isprintable() for p in result.problems)
    assert len(result.problems) == len(names)


def test_a_reset_of_exec_start_pre_after_the_gate_is_reported(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/x.service", unit("Priority=1\n"))
    gen = "/run/systemd/generator/x.service.d"
    write(tmp_path, f"{gen}/{GATE_DROPIN_NAME}", "[Service]\nExecStartPre=\nExecStartPre=+g %n\n")
    write(tmp_path, f"{ETC}/x.service.d/00-early.conf", "[Service]\nExecStartPre=\n")
    write(tmp_path, f"{ETC}/x.service.d/override.conf", "# mine\n[Service]\nExecStartPre=\n")
    write(tmp_path, f"{ETC}/x.service.d/zz.conf", "[Unit]\nExecStartPre=\n")  # not [Service]
    result = scan(tmp_path)
    assert set(result.specs) == {"x.service"}  # a warning: the unit stays managed
    assert [(str(p), p.severity) for p in result.problems] == [
        (
            f"{ETC}/x.service.d/override.conf:3: [Service] ExecStartPre: an empty ExecStartPre= "
            "after gpuslice-gate.conf removes the GPU gate: x.service starts without waiting "
            "for its GPUs; put your ExecStartPre= lines in a drop-in named before "
            "gpuslice-gate.conf",
            "warning",
        )
    ]


def test_the_generators_own_gate_dropin_is_not_read_for_annotations(tmp_path: Path) -> None:
    """It holds none (the generator writes only the gate); at 10,000 units it is half the
    files a scan would read. The same name elsewhere is read as any drop-in."""
    write(tmp_path, f"{LIB}/x.service", unit("Priority=1\n"))
    gen = "/run/systemd/generator/x.service.d"
    write(tmp_path, f"{gen}/{GATE_DROPIN_NAME}", "[X-GPUSlice]\nPriority=5\n")
    write(tmp_path, f"{gen}/other.conf", "[X-GPUSlice]\nGPUs=2\n")
    spec = scan(tmp_path).specs["x.service"]
    assert (spec.priority, spec.gpus) == (1, 2)
    write(tmp_path, f"{ETC}/x.service.d/{GATE_DROPIN_NAME}", "[X-GPUSlice]\nPriority=7\n")
    assert scan(tmp_path).specs["x.service"].priority == 7


def test_a_reset_in_a_template_or_instance_dropin_counts_for_it(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/t@.service", unit("Priority=1\n"))
    write(tmp_path, f"{ETC}/t@.service.d/override.conf", "[Service]\nExecStartPre=\n")
    write(tmp_path, f"{ETC}/t@a.service.d/zz.conf", "[Service]\nExecStartPre=\n")
    write(tmp_path, f"{LIB}/u@.service", unit("Priority=1\n"))
    write(tmp_path, f"{ETC}/u@b.service.d/zz.conf", "[Service]\nExecStartPre=\n")
    result = scan(tmp_path)
    found = {(p.path, p.unit) for p in result.problems if p.key == "ExecStartPre"}
    assert found == {
        (f"{ETC}/t@.service.d/override.conf", "t@.service"),  # once, not again for t@a
        (f"{ETC}/t@a.service.d/zz.conf", "t@a.service"),
        (f"{ETC}/u@b.service.d/zz.conf", "u@b.service"),
    }


def test_an_unmanaged_unit_gets_no_gate_warning(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/plain.service", SERVICE)
    write(tmp_path, f"{ETC}/plain.service.d/zz.conf", "[Service]\nExecStartPre=\n")
    write(tmp_path, f"{LIB}/bad.service", unit("Priority=x\n"))
    write(tmp_path, f"{ETC}/bad.service.d/zz.conf", "[Service]\nExecStartPre=\n")
    result = scan(tmp_path)
    assert [p.key for p in result.problems] == ["Priority"]


def test_a_dropin_named_like_the_gate_hides_it(tmp_path: Path) -> None:
    write(tmp_path, f"{LIB}/x.service", unit("Priority=1\n"))
    write(tmp_path, f"{ETC}/x.service.d/{GATE_DROPIN_NAME}", "[Service]\n")
    result = scan(tmp_path)
    assert [str(p) for p in result.problems] == [
        f"{ETC}/x.service.d/{GATE_DROPIN_NAME}:0: [Service] this file hides the GPU gate's "
        "gpuslice-gate.conf: x.service starts without waiting for its GPUs; give it another name"
    ]


@pytest.mark.parametrize("kind", ["mask", "directory", "dangling"])
def test_a_mask_or_other_entry_named_like_the_gate_hides_it(tmp_path: Path, kind: str) -> None:
    """`ln -s /dev/null /etc/.../x.service.d/gpuslice-gate.conf` hides the generator's gate
    as a file of that name does (systemd lists drop-ins by name): the unit, managed, starts
    without its gate. It was said of a file, not of a mask, a directory or a dangling link."""
    write(tmp_path, f"{LIB}/x.service", unit("Priority=1\n"))
    write(tmp_path, f"/run/systemd/generator/x.service.d/{GATE_DROPIN_NAME}", "[Service]\n")
    hider = tmp_path / ETC.lstrip("/") / "x.service.d" / GATE_DROPIN_NAME
    hider.parent.mkdir(parents=True)
    if kind == "mask":
        hider.symlink_to("/dev/null")
    elif kind == "directory":
        hider.mkdir()
    else:
        hider.symlink_to("/opt/gone.conf")
    result = scan(tmp_path)
    assert set(result.specs) == {"x.service"}
    gate = [p for p in result.problems if p.unit == "x.service"]
    assert [str(p) for p in gate] == [
        f"{ETC}/x.service.d/{GATE_DROPIN_NAME}:0: [Service] this mask hides the GPU gate's "
        "gpuslice-gate.conf: x.service starts without waiting for its GPUs; remove it"
    ]
    assert (gate[0].key, gate[0].severity) == ("", "warning")


def test_scan_and_load_never_raise_for_index_failures(tmp_path: Path) -> None:
    class Broken(UnitIndex):
        def fragment(self, name: str) -> Fragment | None:
            raise RecursionError("deep")

    write(tmp_path, X, unit("Priority=1\n"))
    spec, problems = Loader(Broken(tmp_path)).load("x.service")
    assert spec is None
    assert [str(p) for p in problems] == ["x.service:0: [X-GPUSlice] cannot be read: deep"]


def test_files_of_the_same_text_are_parsed_once(tmp_path: Path) -> None:
    """At 10,000 units the generator's gate drop-ins are one text: one parse for all."""
    for name in ("a.service", "b.service"):
        write(tmp_path, f"{ETC}/{name}", unit("Priority=5\n"))
    loader = Loader(UnitIndex(tmp_path))
    files_a, files_b = loader.files("a.service"), loader.files("b.service")
    assert files_a is not None and files_b is not None
    assert loader.parsed(files_a[0]) is loader.parsed(files_b[0])


REMAINS = (
    "{}: the unit stays active after its main process exits: gpuslice releases its GPUs once "
    "no process is left in it, its ExecReload= and ExecStop= run later with no GPU visible, "
    "and `systemctl start` does nothing until it is stopped (`systemctl restart` runs it "
    "again, on a GPU)"
)


@pytest.mark.parametrize("value", ["yes", "true", "on", "1", "YES", "y", "t"])
def test_a_unit_that_remains_after_exit_is_warned_where_it_says_so(
    tmp_path: Path, value: str
) -> None:
    """`RemainAfterExit=yes` (a Type=oneshot batch job's usual line): systemd keeps the unit
    active (exited) once its job ended. Its GPUs are released then (Scheduler.exited), but
    its ExecStop= runs at its stop, and a start of it does nothing until then. Managed
    still, with a warning at the line in force, in any spelling systemd takes for true."""
    text = SERVICE.replace("[Service]\n", f"[Service]\nType=oneshot\nRemainAfterExit={value}\n")
    write(tmp_path, X, text + "\n[X-GPUSlice]\nPriority=1\n")
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is not None
    assert problems == [
        Problem(X, 6, "RemainAfterExit", REMAINS.format(value), "warning", "x.service", "Service")
    ]


def test_remain_after_exit_is_read_as_systemd_merges_it(tmp_path: Path) -> None:
    """The last boolean wins over the fragment and its drop-ins: a drop-in's `no` undoes the
    fragment's `yes`, one's `on` after it is the line named; what is no boolean (or outside
    [Service], or of a unit without [X-GPUSlice]) is not."""
    text = SERVICE.replace("[Service]\n", "[Service]\nRemainAfterExit=yes\n")
    write(tmp_path, X, text + "\n[X-GPUSlice]\nPriority=1\n")
    write(
        tmp_path,
        f"{ETC}/x.service.d/10-no.conf",
        "[Service]\nRemainAfterExit=no\n[Unit]\nRemainAfterExit=yes\n",
    )
    assert load_spec("x.service", tmp_path)[1] == []
    later = f"{ETC}/x.service.d/20-on.conf"
    write(tmp_path, later, "[Service]\nRemainAfterExit=on\nRemainAfterExit=maybe\n")
    problem = Problem(
        later, 2, "RemainAfterExit", REMAINS.format("on"), "warning", "x.service", "Service"
    )
    assert load_spec("x.service", tmp_path)[1] == [problem]
    result = scan(tmp_path)  # `gpuslice check` and the journal at each scan
    assert "x.service" in result.specs and result.problems == [problem]
    write(tmp_path, f"{ETC}/y.service", text)
    assert load_spec("y.service", tmp_path) == (None, [])


def test_restart_is_read_as_systemd_merges_it(tmp_path: Path) -> None:
    """The unit's Restart= is in its spec (the core keeps a clean exit's GPUs for the restart
    of `always` and `on-success`): the last valid value wins over the fragment and its
    drop-ins, an invalid one (or one outside [Service]) is ignored, as systemd does; none
    is `no`. An instance has its template's."""
    write(tmp_path, X, unit("Priority=1\n"))
    assert load_spec("x.service", tmp_path)[0] == UnitSpec("x.service", 1, source=X)
    text = SERVICE.replace("[Service]\n", "[Service]\nRestart=always\n")
    write(tmp_path, X, text + "\n[X-GPUSlice]\nPriority=1\n")
    spec, problems = load_spec("x.service", tmp_path)
    assert spec is not None and spec.restart is Restart.ALWAYS and problems == []
    write(
        tmp_path,
        f"{ETC}/x.service.d/10-success.conf",
        "[Service]\nRestart=on-success\nRestart=sometimes\nRestart=\n[Unit]\nRestart=no\n",
    )
    spec = load_spec("x.service", tmp_path)[0]
    assert spec is not None and spec.restart is Restart.ON_SUCCESS
    write(tmp_path, f"{ETC}/x.service.d/20-failure.conf", "[Service]\nRestart=on-failure\n")
    spec = load_spec("x.service", tmp_path)[0]
    assert spec is not None and spec.restart is Restart.ON_FAILURE
    assert not spec.restart.restarts_clean_exit()
    write(tmp_path, f"{ETC}/t@.service", text + "\n[X-GPUSlice]\nPriority=1\n")
    spec = load_spec("t@a.service", tmp_path)[0]
    assert spec is not None and spec.restart is Restart.ALWAYS


@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_a_problem_in_a_file_others_cannot_read_is_shown_to_them_by_its_place(
    tmp_path: Path, mode: int
) -> None:
    """Root sees what the file says; anyone else (`public`) its file, line and the key when
    gpuslice names it (of its table, or of systemd's), not a key the file made up. A file
    anyone may read is quoted to all."""
    write(tmp_path, f"{ETC}/a.service", unit("Priority=10\nMemory=open1\n"))
    private = write(
        tmp_path,
        f"{ETC}/a.service.d/10-p.conf",
        "[X-GPUSlice]\nMemory=s3cret\nT0ken=1\n[Service]\nExecStartPre=/bin/x \x1b\n",
    )
    private.chmod(mode)
    spec, problems = load_spec("a.service", tmp_path)
    assert spec is None
    said = "not shown: the file is not everyone's to read (`gpuslice check` as root says what)"
    assert [p.public() for p in problems] == [
        f"{ETC}/a.service:9: [X-GPUSlice] Memory: expected a size such as 512M, 20G or 20GiB "
        f'(binary units, at most 1P), got "open1" (overridden at {ETC}/a.service.d/10-p.conf:2)',
        f"{ETC}/a.service.d/10-p.conf:3: [X-GPUSlice] {said}",
        f"{ETC}/a.service.d/10-p.conf:5: [Service] ExecStartPre: {said}",
        f"{ETC}/a.service.d/10-p.conf:2: [X-GPUSlice] Memory: {said}",
    ]
    assert [str(p) for p in problems][1:] == [
        f"{ETC}/a.service.d/10-p.conf:3: [X-GPUSlice] T0ken: unknown key, ignored (known keys: "
        + ", ".join(k.name for k in KEYS)
        + ")",
        f"{ETC}/a.service.d/10-p.conf:5: [Service] ExecStartPre: /bin/x \\x1b: a control "
        "character in a line the gate's drop-in would copy, which gpuslice-generator does not "
        "write (left unmanaged, ungated)",
        f"{ETC}/a.service.d/10-p.conf:2: [X-GPUSlice] Memory: expected a size such as 512M, 20G "
        'or 20GiB (binary units, at most 1P), got "s3cret"',
    ]
    private.chmod(0o644)
    assert [p.public() for p in load_spec("a.service", tmp_path)[1]] == [str(p) for p in problems]
