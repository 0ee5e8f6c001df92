"""The controller's own unit (units/gpuslice.service): what its sandbox must let it read.

The generator runs unsandboxed, as root, and gates every annotated unit it can read; the
controller reads the same files from inside gpuslice.service's sandbox. A file the generator
reads and the controller cannot leaves a gated unit unmanaged, and the controller lets an
unmanaged unit's gate through without GPUs: it then runs on any GPU. tests/integration boots
the unit itself.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from gpuslice.annotations import NEVER_GATED
from gpuslice.controller import run

UNIT = Path(__file__).resolve().parent.parent / "units" / "gpuslice.service"


def _service_settings(wanted: str = "[Service]") -> dict[str, list[str]]:
    """KEY=VALUE lines of one section of the unit, every value of each key in order."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == wanted:
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_the_controller_can_read_a_unit_linked_from_a_home_directory() -> None:
    """`systemctl link /root/job.service`: ProtectHome=yes (or tmpfs) hides /root and /home
    from the controller, while the generator reads and gates the unit. Read-only lets uid 0
    read them as far as file modes allow (no CAP_DAC_*), and write none of them."""
    settings = _service_settings()
    assert settings["ProtectHome"] == ["read-only"]
    assert settings["ProtectSystem"] == ["strict"]
    assert settings["CapabilityBoundingSet"] == [""]


def test_no_unit_the_controller_starts_after_may_be_gated() -> None:
    """A gate orders its unit after gpuslice.service: gated, a unit gpuslice.service starts
    after is an ordering cycle, which systemd breaks by dropping a start job (perhaps the
    controller's). The loader refuses an annotation on each of them (NEVER_GATED)."""
    after = {u for v in _service_settings("[Unit]")["After"] for u in v.split()}
    assert after <= NEVER_GATED
    assert "gpuslice.service" in NEVER_GATED


def test_a_config_it_rejects_fails_the_controller_for_good_and_a_crash_restarts_it(
    tmp_path: Path,
) -> None:
    """README, "While the controller is down": a crashed controller is started again (every
    gate waits for it), but one that rejects config.yaml fails at once with status=78/CONFIG,
    which no restart can fix: restarted, it would spend systemd's start limit every time."""
    settings = _service_settings()
    assert settings["Restart"] == ["on-failure"]
    assert settings["RestartPreventExitStatus"] == ["78"]
    config = tmp_path / "config.yaml"
    config.write_text("gpus: two\n")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        assert asyncio.run(run(config)) == 78
    finally:  # run() sets up its own logging (basicConfig(force=True)): put the tests' back
        root.handlers[:], root.level = handlers, level


def test_a_stopped_controller_leaves_its_runtime_directory_and_wakes_the_gates() -> None:
    """README, "Faults" and "The gate's pipes": a state that could not reach the state
    directory is kept in runtime_dir/state.json, which a restarted controller reads, so
    systemd must not empty /run/gpuslice when the controller stops (nor the gate pipes and
    environment files in it); and `gpuslice release-gates` wakes a gate that waits on a
    pipe the controller never opened. Its watchdog is the 30 s README's bounds are sized by."""
    settings = _service_settings()
    assert settings["RuntimeDirectory"] == ["gpuslice"]
    assert settings["RuntimeDirectoryPreserve"] == ["yes"]
    assert [v.split()[1:] for v in settings["ExecStopPost"]] == [["release-gates"]]
    assert settings["WatchdogSec"] == ["30"]
