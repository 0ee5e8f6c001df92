"""Tiny builders for the scenarios: annotated test units and the questions asked of them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tests.bed.container import BedError, Container, WaitTimeout, wait_until

UNIT_DIR = "/etc/systemd/system"
T = TypeVar("T")

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


def _now(bed: Container, unit: str) -> str:
    """UNIT's ActiveState/SubState at this moment, for a failure message."""
    try:
        out = bed.systemctl("show", "-pActiveState", "-pSubState", unit).stdout.split()
    except BedError as e:
        return f"unknown ({e})"
    return " ".join(out)


def _wait_unit(bed: Container, unit: str, name: str, value: str, timeout: float) -> None:
    """Wait until UNIT's property NAME is VALUE. A timeout says the state it ended in (asking
    for it up front, as the message once did, cost a command before the first look and
    showed the state at the start)."""
    try:
        wait_until(lambda: prop(bed, unit, name) == value or None, timeout, what=f"{unit} {value}")
    except WaitTimeout as e:
        raise WaitTimeout(f"{e}; now {_now(bed, unit)}") from None


def wait_state(bed: Container, unit: str, state: str, timeout: float = 20) -> None:
    _wait_unit(bed, unit, "ActiveState", state, timeout)


def wait_sub(bed: Container, unit: str, sub: str, timeout: float = 20) -> None:
    _wait_unit(bed, unit, "SubState", sub, timeout)


def wait_answer(ask: Callable[[], T], good: Callable[[T], bool], timeout: float, what: str) -> T:
    """Ask again and again until GOOD(answer); that answer, so that the checks after it are
    of one moment. For what the controller learns from systemd's signals, which may reach it
    after `systemctl` already shows the change. A timeout fails with the last answer."""
    last: list[T] = []

    def once() -> tuple[T] | None:
        last[:] = [ask()]
        return (last[0],) if good(last[0]) else None

    try:
        return wait_until(once, timeout, what=what)[0]
    except WaitTimeout as e:
        raise AssertionError(f"{e}; last answer: {last[0] if last else '-'!r}") from None


def wait_started(bed: Container, unit: str, timeout: float = 20) -> None:
    """Wait for systemd's record that UNIT became active (its "Started" line): a job of a few
    seconds may have ended before a poll of its state, on a loaded host, saw it running."""
    wait_until(
        lambda: (
            any(line.startswith("Started ") for line in bed.journal(unit, "-o", "cat").splitlines())
            or None
        ),
        timeout,
        what=f"systemd to say {unit} started",
    )


def wait_restarted(bed: Container, unit: str, old_pid: int, timeout: float = 30) -> int:
    """Wait until systemd runs UNIT again, active, with a main process other than OLD_PID
    (killed); returns the new one. Right after a kill, systemd may not have seen the death
    yet: "active" alone can still be the killed process's."""

    def back() -> int | None:
        out = bed.systemctl("show", "-pMainPID", "-pActiveState", unit).stdout
        fields = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        pid = int(fields.get("MainPID") or 0)
        return pid if fields.get("ActiveState") == "active" and pid not in (0, old_pid) else None

    return wait_until(back, timeout, what=f"{unit} active again, main process not {old_pid}")


def wait_journal(bed: Container, text: str, timeout: float = 20) -> str:
    """Wait for a line of `journalctl -u gpuslice` containing TEXT; returns the journal."""
    return wait_until(
        lambda: j if text in (j := bed.journal("gpuslice.service")) else None,
        timeout,
        what=f"journal line {text!r}",
    )


def reload(bed: Container) -> None:
    bed.systemctl("daemon-reload")


RELOADED = "configuration reloaded from /etc/gpuslice/config.yaml"


def reload_config(bed: Container, timeout: float = 20) -> None:
    """`systemctl reload gpuslice`, and wait until the controller has applied the file: it
    reads a file changed less than a second ago only once it has been left alone that long
    (gpuslice/config.py, SETTLE_SECONDS)."""
    before = bed.journal("gpuslice.service").count(RELOADED)
    bed.systemctl("reload", "gpuslice.service")
    wait_until(
        lambda: bed.journal("gpuslice.service").count(RELOADED) > before or None,
        timeout,
        what="the controller to apply config.yaml",
    )


def start_count(bed: Container, unit: str) -> int:
    """How many times systemd began starting UNIT in this boot (its "Starting" lines)."""
    out = bed.run(["journalctl", "-b", "--no-pager", "-o", "cat", "-u", unit]).stdout
    return sum(1 for line in out.splitlines() if line.startswith("Starting "))


# -- checks over a window, and what a failing check prints --------------------------------------

# A unit past its gate holds its GPUs until it is inactive again (a victim that is still
# deactivating has not given its GPU back).
HOLDING = frozenset({"active", "reloading", "deactivating"})


def unit_states(bed: Container, units: Sequence[str]) -> dict[str, dict[str, str]]:
    """ActiveState, SubState and Job of each unit as one instant of systemd's state: one
    ListUnitsByNames call (`systemctl show` asks unit by unit, and a handover can happen
    between two of its questions)."""
    call = ["busctl", "--json=short", "call", "org.freedesktop.systemd1"]
    call += ["/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager"]
    call += ["ListUnitsByNames", "as", str(len(units)), *units]
    table: dict[str, dict[str, str]] = {}
    for row in json.loads(bed.run(call).stdout)["data"][0]:
        name, active, sub, job = row[0], row[3], row[4], row[7]
        table[name] = {"ActiveState": active, "SubState": sub, "Job": str(job) if job else ""}
    return table


def unit_table(bed: Container, units: Sequence[str]) -> dict[str, dict[str, str]]:
    """`unit_states` plus each unit's MainPID and NRestarts (from `systemctl show`)."""
    out = bed.systemctl("show", "-pMainPID", "-pNRestarts", "--", *units).stdout
    table: dict[str, dict[str, str]] = {}
    for unit, block in zip(units, out.strip().split("\n\n"), strict=False):
        table[unit] = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
    for unit, fields in unit_states(bed, units).items():
        table.setdefault(unit, {}).update(fields)
    return table


def holding(table: dict[str, dict[str, str]]) -> list[str]:
    """Units past their gate: active, or activating beyond start-pre/condition, or stopping."""
    out = []
    for unit, f in table.items():
        active, sub = f.get("ActiveState", ""), f.get("SubState", "")
        if active in HOLDING or (active == "activating" and sub not in ("start-pre", "condition")):
            out.append(unit)
    return out


def describe(bed: Container, units: Sequence[str]) -> str:
    """Every unit's state, the controller's and `gpuslice status --json`: for failure messages."""
    lines = []
    try:
        for unit, f in unit_table(bed, [*units, "gpuslice.service"]).items():
            lines.append(
                f"  {unit}: {f.get('ActiveState')}/{f.get('SubState')} pid={f.get('MainPID')} "
                f"job={f.get('Job') or '-'} restarts={f.get('NRestarts')}"
            )
    except Exception as e:  # a report must not hide the failure it reports
        lines.append(f"  (systemctl show failed: {e})")
    res = bed.run(["timeout", "10", "gpuslice", "status", "--json"], check=False, timeout=30)
    lines.append(f"gpuslice status --json (exit {res.returncode}): {res.stdout.strip()}")
    if res.stderr.strip():
        lines.append(res.stderr.strip())
    jobs = bed.systemctl("list-jobs", "--no-pager", "--no-legend", check=False).stdout.strip()
    lines.append(f"systemctl list-jobs: {jobs or '(none)'}")
    return "units:\n" + "\n".join(lines)


def always_for(check: Callable[[], None], seconds: float, interval: float = 0.1) -> int:
    """Call CHECK again and again for SECONDS: "never happens" over a window, not at one
    instant. Its first AssertionError fails at once. Returns how many checks ran."""
    deadline = time.monotonic() + seconds
    count = 0
    while True:
        check()
        count += 1
        if time.monotonic() >= deadline:
            return count
        time.sleep(interval)
