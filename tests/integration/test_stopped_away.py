"""Units stopped by hand while no controller ran, against a real systemd and journald: the
next controller asks the journal (gpuslice/stopjournal.py) whether a stop job ended each
holder it finds down.

README: "A unit you stop by hand (`systemctl stop`) is held [...] also when no controller ran
at that moment". Before the journal was asked, a unit systemd unloaded once down (not enabled,
nothing wants it: its record of the main process goes with it) and a unit that traps SIGTERM
and exits 0 (its record says exited 0) were both taken for finished, and the first refill
after the next boot started them again; and a main process someone killed with no stop job
was held, where a running controller takes it for finished.
"""

from __future__ import annotations

from tests.bed.container import Container, wait_until
from tests.integration.jobs import (
    always_for,
    describe,
    holders,
    main_pid,
    prop,
    reload,
    start_count,
    status,
    wait_answer,
    wait_state,
    write_job,
)

GONE = "gone.service"  # not enabled: systemd unloads it once it is down
TRAPS = "traps.service"  # enabled (stays loaded); traps SIGTERM and exits 0
KILLED = "killed.service"  # enabled (stays loaded); its main process is killed, no stop job
SLEEPS = "/bin/sleep infinity"  # SIGTERM kills it: systemd's record says killed
ENABLED = "[Install]\nWantedBy=multi-user.target"
TIMEOUT = 20


def listed(bed: Container, unit: str) -> str:
    """What `systemctl list-units --all` shows of UNIT ("" once systemd unloaded it)."""
    cmd = ["systemctl", "list-units", "--all", "--plain", "--no-legend", unit]
    return bed.run(cmd).stdout.strip()


def run_alone(bed: Container, unit: str) -> None:
    """Wait until the refill has started background UNIT on GPU 0, the only holder."""
    wait_state(bed, unit, "active")
    wait_answer(lambda: holders(bed), lambda h: h == {0: [unit]}, TIMEOUT, f"{unit} on GPU 0")


def stopped_in_journal(bed: Container, unit: str) -> None:
    """Wait until journald has written systemd's "Stopped" of UNIT (`journal` syncs first)."""
    wait_until(
        # "Stopped UNIT - DESCRIPTION." (systemd 252's StatusUnitFormat=combined) or
        # "Stopped DESCRIPTION."
        lambda: (
            any(line.startswith("Stopped ") for line in bed.journal(unit, "-o", "cat").splitlines())
            or None
        ),
        TIMEOUT,
        what=f"the journal to hold systemd's stop of {unit}",
    )


def test_units_stopped_by_hand_while_no_controller_ran_are_held_and_a_killed_one_finished(
    container: Container,
) -> None:
    """Three holders in turn, each down while gpuslice.service is stopped: gone.service
    stopped and unloaded by systemd, traps.service stopped (its trap exits 0), both held and
    not started again; killed.service's main process killed by SIGTERM with no stop job,
    finished (as while a controller runs), though systemd's record says killed."""
    bed = container
    write_job(bed, GONE, 90, "background", exec_start=SLEEPS)
    reload(bed)
    run_alone(bed, GONE)
    bed.systemctl("stop", "gpuslice.service")
    bed.systemctl("stop", GONE)
    wait_until(lambda: not listed(bed, GONE) or None, TIMEOUT, what=f"systemd to unload {GONE}")
    stopped_in_journal(bed, GONE)
    bed.systemctl("start", "gpuslice.service")  # Type=notify: returns once it has decided
    seen = status(bed)
    assert GONE in seen["held"], describe(bed, [GONE])
    assert GONE not in seen["finished"]

    # the GPU is free: the refill starts traps.service, which no stop job can tell apart
    # from an end by itself by its main process alone
    write_job(bed, TRAPS, 90, "background", extra_service=ENABLED)
    bed.systemctl("enable", TRAPS)
    reload(bed)
    run_alone(bed, TRAPS)
    bed.systemctl("stop", "gpuslice.service")
    bed.systemctl("stop", TRAPS)
    assert listed(bed, TRAPS), "enabled: still loaded"
    assert (prop(bed, TRAPS, "ExecMainCode"), prop(bed, TRAPS, "ExecMainStatus")) == ("1", "0")
    stopped_in_journal(bed, TRAPS)
    bed.systemctl("start", "gpuslice.service")
    seen = status(bed)
    assert sorted(seen["held"]) == [GONE, TRAPS], describe(bed, [GONE, TRAPS])
    assert seen["finished"] == []

    def not_started_again() -> None:
        assert prop(bed, GONE, "ActiveState") == "inactive"
        assert prop(bed, TRAPS, "ActiveState") == "inactive"

    always_for(not_started_again, 2.0)
    assert (start_count(bed, GONE), start_count(bed, TRAPS)) == (1, 1)

    # someone's `kill` of the main process: no stop job, an end by itself
    write_job(bed, KILLED, 90, "background", exec_start=SLEEPS, extra_service=ENABLED)
    bed.systemctl("enable", KILLED)
    reload(bed)
    run_alone(bed, KILLED)
    bed.systemctl("stop", "gpuslice.service")
    bed.run(f"kill -TERM {main_pid(bed, KILLED)}")
    wait_state(bed, KILLED, "inactive")
    assert (prop(bed, KILLED, "ExecMainCode"), prop(bed, KILLED, "Result")) == ("2", "success")
    bed.run(["journalctl", "--sync"])
    bed.systemctl("start", "gpuslice.service")
    seen = status(bed)
    assert seen["finished"] == [KILLED], describe(bed, [GONE, TRAPS, KILLED])
    assert sorted(seen["held"]) == [GONE, TRAPS]
    assert "the journal cannot tell" not in bed.journal("gpuslice.service")
