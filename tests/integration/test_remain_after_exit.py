"""A unit that systemd keeps active after its job ended (`RemainAfterExit=yes`) against a real
systemd: its GPU goes to the unit waiting for it once no process is left in it, and a restart
of it waits at its gate again like any start."""

from __future__ import annotations

from tests.bed.container import Container
from tests.integration.jobs import (
    holders,
    reload,
    status,
    wait_answer,
    wait_journal,
    wait_state,
    wait_sub,
    write_job,
)

SETUP = "setup.service"
NEXT = "next.service"


def test_a_unit_kept_active_after_its_job_gives_its_gpu_to_the_next_and_waits_again_at_restart(
    container: Container,
) -> None:
    write_job(
        container,
        SETUP,
        20,
        seconds=2,
        extra_service=(
            "Type=oneshot\nRemainAfterExit=yes\n"
            "ExecReload=/bin/sh -c 'echo \"[$CUDA_VISIBLE_DEVICES]\" > /run/reloaded'"
        ),
    )
    write_job(container, NEXT, 20)  # equal priority: it never preempts, it waits
    reload(container)
    container.systemctl("start", "--no-block", SETUP)
    wait_sub(container, SETUP, "start")  # past its gate, its job running
    container.systemctl("start", "--no-block", NEXT)
    wait_sub(container, NEXT, "start-pre")  # waiting at its gate behind setup
    # setup's job ends; systemd keeps it active (exited), and its GPU goes to next
    wait_sub(container, SETUP, "exited", timeout=30)
    wait_state(container, NEXT, "active", timeout=30)
    wait_journal(container, f"{SETUP} finished: released")
    assert holders(container) == {0: [NEXT]}
    wait_answer(
        lambda: status(container).get("remained", []),
        lambda r: r == [SETUP],
        20,
        f"{SETUP} shown as finished and still active",
    )
    # its later commands see no GPU (systemd reads the env file anew for each), and a
    # reload is no new run: nothing booked, nothing said again
    container.systemctl("reload", SETUP)
    assert container.run(["cat", "/run/reloaded"]).stdout == "[]\n"
    assert holders(container) == {0: [NEXT]}
    assert container.journal("gpuslice.service").count(f"{SETUP} finished: released") == 1
    # a restart is a new start: it waits at its gate behind next, which keeps the GPU
    container.systemctl("restart", "--no-block", SETUP)
    wait_sub(container, SETUP, "start-pre")
    assert holders(container) == {0: [NEXT]}
    container.systemctl("stop", NEXT)
    wait_sub(container, SETUP, "exited", timeout=30)  # ran its job again, and ended it


def test_a_unit_kept_active_with_a_process_left_keeps_its_gpu_until_none_is_left(
    container: Container,
) -> None:
    """A leftover (KillMode=process) keeps the GPU: systemd counts it in the unit's cgroup.
    Systemd signals nothing when it ends; the controller's 30 s audit asks again."""
    write_job(
        container,
        SETUP,
        20,
        exec_start="/bin/sh -c 'sleep 6 & exit 0'",
        extra_service="Type=oneshot\nRemainAfterExit=yes\nKillMode=process",
    )
    write_job(container, NEXT, 20)
    reload(container)
    container.systemctl("start", SETUP)  # returns once its main process exited
    container.systemctl("start", "--no-block", NEXT)
    wait_sub(container, NEXT, "start-pre")
    # counted (TasksCurrent) where the pids controller is on; listed here, in the bed
    wait_journal(container, f"{SETUP} stays active after its job ended")
    assert holders(container) == {0: [SETUP]}
    wait_state(container, NEXT, "active", timeout=50)  # the leftover ended, an audit saw it
    assert holders(container) == {0: [NEXT]}
