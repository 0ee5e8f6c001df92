"""Tiny builders for the scenarios: annotated test units and the questions asked of them."""

from __future__ import annotations

import json
from typing import Any

from tests.bed.container import Container, wait_until

UNIT_DIR = "/etc/systemd/system"

# A job that records when its main process started, runs SECONDS (0: until stopped) and
# ends gracefully on SIGTERM, as a GPU job that checkpoints would.
JOB = (
    '/bin/sh -c \'date +%%s.%%N > /run/%n.start; trap "exit 0" TERM; '
    "i=0; while [ {seconds} -eq 0 ] || [ $i -lt {seconds} ]; do "
    "i=$((i+1)); sleep 1 & wait $!; done'"
)


def write_job(
    bed: Container,
    name: str,
    priority: int | str | None,
    kind: str = "on-demand",
    *,
    seconds: int = 0,
    gpus: int = 1,
    extra_service: str = "",
    extra_unit: str = "",
    exec_start: str | None = None,
    annotation: str | None = None,
) -> None:
    """Write /etc/systemd/system/NAME with an [X-GPUSlice] section (none if priority is None)."""
    section = annotation
    if section is None and priority is not None:
        section = f"[X-GPUSlice]\nPriority={priority}\nType={kind}\nGPUs={gpus}\n"
    bed.write_file(
        f"{UNIT_DIR}/{name}",
        f"[Unit]\nDescription=test job {name}\n{extra_unit}\n[Service]\n"
        f"ExecStart={exec_start or JOB.format(seconds=seconds)}\n{extra_service}\n"
        + (f"\n{section}" if section else ""),
    )


def status(bed: Container) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(bed.run(["gpuslice", "status", "--json"]).stdout)
    return data


def holders(bed: Container) -> dict[int, list[str]]:
    return {g["index"]: [h["unit"] for h in g["holders"]] for g in status(bed)["gpus"]}


def prop(bed: Container, unit: str, name: str) -> str:
    return bed.systemctl("show", "-P", name, unit).stdout.strip()


def main_pid(bed: Container, unit: str) -> int:
    return int(prop(bed, unit, "MainPID"))


def wait_state(bed: Container, unit: str, state: str, timeout: float = 20) -> None:
    wait_until(
        lambda: prop(bed, unit, "ActiveState") == state or None,
        timeout,
        what=f"{unit} {state} (now {prop(bed, unit, 'ActiveState')}/{prop(bed, unit, 'SubState')})",
    )


def wait_sub(bed: Container, unit: str, sub: str, timeout: float = 20) -> None:
    wait_until(
        lambda: prop(bed, unit, "SubState") == sub or None,
        timeout,
        what=f"{unit} in {sub} (now {prop(bed, unit, 'SubState')})",
    )


def wait_journal(bed: Container, text: str, timeout: float = 20) -> str:
    """Wait for a line of `journalctl -u gpuslice` containing TEXT; returns the journal."""
    return wait_until(
        lambda: j if text in (j := bed.journal("gpuslice.service")) else None,
        timeout,
        what=f"journal line {text!r}",
    )


def reload(bed: Container) -> None:
    bed.systemctl("daemon-reload")


def start_count(bed: Container, unit: str) -> int:
    """How many times systemd began starting UNIT in this boot (its "Starting" lines)."""
    out = bed.run(["journalctl", "-b", "--no-pager", "-o", "cat", "-u", unit]).stdout
    return sum(1 for line in out.splitlines() if line.startswith("Starting "))
