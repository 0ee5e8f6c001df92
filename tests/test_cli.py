"""`gpuslice check`, `gpuslice enroll` and the status table, without a running systemd."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from gpuslice.annotations import Scan
from gpuslice.cli import main
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Scheduler
from gpuslice.inventory import GpuUse, Sample
from gpuslice.status import render, snapshot_to_json

GIB = 1 << 30
UNIT = "[Unit]\nDescription=x\n[Service]\nExecStart=/bin/true\n[X-GPUSlice]\n"


def test_check_files_reports_file_line_key_and_exits_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.service"
    bad.write_text(UNIT + "Priority=high\nType=sometimes\n")
    config = tmp_path / "config.yaml"
    config.write_text("gpus: 0\n")
    result = CliRunner().invoke(main, ["check", str(bad), str(config)])
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        f'error: {config}:1: gpus: invalid value "0" (allowed: an integer >= 1)',
        f'error: {bad}:6: [X-GPUSlice] Priority: expected an integer 0-999, got "high"',
        f"error: {bad}:7: [X-GPUSlice] Type: expected one of on-demand, background, "
        'got "sometimes"',
    ]


def test_check_good_file(tmp_path: Path) -> None:
    good = tmp_path / "good.service"
    good.write_text(UNIT + "Priority=10\nMemory=20G\n")
    result = CliRunner().invoke(main, ["check", str(good)])
    assert (result.exit_code, result.output) == (
        0,
        "ok: 1 annotated unit(s) checked, 0 warning(s)\n",
    )


def test_enroll_writes_a_validated_dropin(tmp_path: Path) -> None:
    unit_dir = tmp_path / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    (unit_dir / "plain.service").write_text("[Service]\nExecStart=/bin/true\n")
    args = ["enroll", "plain", "--priority", "5", "--type", "background", "--no-reload"]
    result = CliRunner().invoke(main, [*args, "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    dropin = unit_dir / "plain.service.d/gpuslice.conf"
    assert "Priority=5\nType=background\nGPUs=1\nRequeue=yes\n" in dropin.read_text()
    assert f"enrolled plain.service (priority 5) via {tmp_path}" in result.output


def test_status_table_shows_memory_foreign_processes_and_reasons() -> None:
    voice = UnitSpec("voice.service", 10, memory=10 * GIB)
    big = UnitSpec("big.service", 20, memory=20 * GIB)
    gpu = Gpu(0, "GPU-0", "Fake 24GB", 24 * GIB, 0, 2 * GIB, (77,), used=13 * GIB)
    sched = Scheduler([gpu], {})
    sched.request(voice)
    sched.request(big)
    sample = Sample(
        [gpu],
        [GpuUse(10, 0, 11 * GIB, "voice.service", "python3"), GpuUse(77, 0, 2 * GIB, None, "Xorg")],
    )
    scan = Scan(specs={s.name: s for s in (voice, big)})
    data = snapshot_to_json(sched.snapshot(), scan, sample)
    assert data["gpus"][0]["holders"] == [
        {
            "unit": "voice.service",
            "priority": 10,
            "state": "running",
            "memory_declared": 10 * GIB,
            "memory_used": 11 * GIB,
        }
    ]
    text = render(data)
    assert "GPU 0: Fake 24GB, 13 GiB / 24 GiB used" in text
    assert "10 GiB declared, 11 GiB used (MORE THAN DECLARED)" in text
    assert "foreign: PID 77 Xorg" in text
    assert (
        "big.service (priority 20): waiting: needs 20 GiB on one GPU; GPU 0 has 12 GiB free "
        "after the reserve, held by voice.service, priority 10"
    ) in text
