"""The controller's own unit (units/gpuslice.service): what its sandbox must let it read.

The generator runs unsandboxed, as root, and gates every annotated unit it can read; the
controller reads the same files from inside gpuslice.service's sandbox. A file the generator
reads and the controller cannot leaves a gated unit unmanaged, and the controller lets an
unmanaged unit's gate through without GPUs: it then runs on any GPU. tests/integration boots
the unit itself.
"""

from __future__ import annotations

from pathlib import Path

from gpuslice.annotations import NEVER_GATED

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
