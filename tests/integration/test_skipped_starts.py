"""Starts that systemd itself skips, refuses or cuts short, against a real systemd 252:
`ExecCondition=`, `Condition*=`, `JobTimeoutSec=`, a failing `ExecStartPre=` of the unit's own
(README, "Starts systemd skips or refuses")."""

from __future__ import annotations

import pytest

from tests.bed.container import Container, wait_until
from tests.integration.jobs import (
    always_for,
    holders,
    main_pid,
    prop,
    reload,
    status,
    wait_journal,
    wait_started,
    wait_state,
    wait_sub,
    write_job,
)

A = "a.service"
B = "b.service"
CONTROLLER = "gpuslice.service"
SAYS_NO = "/bin/sh -c 'sleep 3; exit 1'"  # an ExecCondition= that skips the start, in 3 s


def test_a_start_its_exec_condition_skips_preempts_nothing(container: Container) -> None:
    """A (10) has an `ExecCondition=` that takes 3 s and says no (exit 1); B (50,
    `Requeue=no`) holds the only GPU. The condition runs before the gate: A's start was
    taken in at `condition`, B was preempted, and A's start skipped. B, with `Requeue=no`,
    never came back: its run lost for a start that never ran. B runs on throughout; the
    start goes down unseen by the scheduler, and the GPU stays B's. A is not held: its start
    job ended `done`, taken for someone's stop (`a.service was stopped outside gpuslice`)."""
    write_job(container, B, 50, annotation="[X-GPUSlice]\nPriority=50\nRequeue=no\n")
    write_job(container, A, 10, extra_service=f"ExecCondition={SAYS_NO}")
    reload(container)
    container.systemctl("start", B)
    wait_state(container, B, "active")
    pid = main_pid(container, B)
    container.systemctl("start", "--no-block", A)
    wait_sub(container, A, "condition")

    def b_runs() -> None:
        assert holders(container) == {0: [B]}
        assert main_pid(container, B) == pid

    def skipped() -> bool:
        b_runs()
        return container.active_state(A) == "inactive"

    wait_until(skipped, 20, what=f"{A}'s ExecCondition= to skip it, {B} running on")
    assert "being skipped" in container.journal(A, "-o", "cat")
    always_for(b_runs, 1)
    journal = container.journal(CONTROLLER)
    assert f"preempting {B}" not in journal
    assert f"starting {A}" not in journal
    assert f"{A} was stopped outside gpuslice" not in journal
    assert A not in status(container)["held"]


def test_a_comeback_its_condition_skips_is_said_skipped_not_tried_again(
    container: Container,
) -> None:
    """B (50) preempted by A (10); when A is stopped, B's comeback is skipped by systemd (its
    `ConditionPathExists=` false by then): nothing of it ran. It was said `finished` (the
    journal's word for work done); it is said skipped, recorded with the failed units,
    never started again (no StartUnit at every pass), also once the path is back."""
    container.run(["touch", "/run/flag"])
    write_job(container, B, 50, extra_unit="ConditionPathExists=/run/flag")
    write_job(container, A, 10)
    reload(container)
    container.systemctl("start", B)
    wait_state(container, B, "active")
    container.systemctl("start", "--no-block", A)
    wait_state(container, A, "active")
    container.run(["rm", "/run/flag"])
    container.systemctl("stop", A)
    journal = wait_journal(container, f"{B} skipped: its Condition*= or ExecCondition= said no")
    assert f"{B} finished" not in journal
    container.run(["touch", "/run/flag"])

    def once() -> None:
        assert container.journal(B, "-o", "cat").count("was skipped") == 1
        assert container.active_state(B) == "inactive"

    always_for(once, 2, interval=0.5)
    snapshot = status(container)
    assert snapshot["preempted"] == [] and holders(container) == {0: []}
    assert snapshot["failed"] == [B]


def test_a_start_whose_job_timed_out_at_its_gate_waits_on_and_runs_in_turn(
    container: Container,
) -> None:
    """`JobTimeoutSec=2` on B (50), waiting at its gate behind A (10): systemd cancels the
    start job (`systemctl start` fails: result 'timeout') but not the start, whose gate
    still runs: B waits on (activating, start-pre, no job), before C (60), which came
    later, and runs when A ends. `TimeoutStartSec=` bounds the wait itself (README)."""
    c = "c.service"
    write_job(container, A, 10)
    write_job(container, B, 50, extra_unit="JobTimeoutSec=2")
    write_job(container, c, 60)
    reload(container)
    container.systemctl("start", A)
    wait_state(container, A, "active")
    failed = container.systemctl("start", B, check=False)
    assert failed.returncode != 0
    assert "Job b.service/start timed out" in container.journal(B, "-o", "cat")
    assert container.active_state(B) == "activating" and prop(container, B, "Job") == ""
    container.systemctl("start", "--no-block", c)
    wait_journal(container, f"{c} waiting: GPU 0 held by {A}")
    container.systemctl("stop", A)
    wait_state(container, B, "active")
    assert holders(container) == {0: [B]}
    assert container.active_state(c) == "activating"


def test_a_start_that_fails_in_its_own_exec_start_pre_gives_its_victim_back(
    container: Container,
) -> None:
    """A's (10) own `ExecStartPre=/bin/false` runs after the gate (the gate is always the
    first): B (50) is preempted for A, whose start then fails; B comes back (Requeue=)."""
    write_job(container, B, 50)
    write_job(container, A, 10, extra_service="ExecStartPre=/bin/false")
    reload(container)
    container.systemctl("start", B)
    wait_state(container, B, "active")
    container.systemctl("start", "--no-block", A)
    wait_journal(container, f"restarting preempted {B}")
    wait_state(container, B, "active")
    assert container.active_state(A) == "failed"
    assert holders(container) == {0: [B]}


@pytest.mark.parametrize(
    ("check", "said"),
    [
        ("ConditionPathExists=/nowhere", "was skipped"),
        ("AssertPathExists=/nowhere", "Assertion failed"),
        ("Requires=broken.service\nAfter=broken.service", "Dependency failed"),
    ],
)
def test_a_start_systemd_runs_nothing_of_preempts_nothing_and_is_no_stop(
    container: Container, check: str, said: str
) -> None:
    """A (10) whose start systemd ends before anything of it runs: a false `Condition*=`
    or `Assert*=`, a `Requires=` unit that fails to start (job results `done`, `assert`,
    `dependency`), while B (50) holds the GPU. B runs on; nobody stopped A, which is not
    held: it was, and the journal said `a.service was stopped outside gpuslice: held until
    started again`, its start job taken for someone's stop."""
    write_job(container, B, 50)
    write_job(container, A, 10, extra_unit=check)
    oneshot = "[Service]\nType=oneshot\nExecStart=/bin/false\n"
    container.write_file("/etc/systemd/system/broken.service", oneshot)
    reload(container)
    container.systemctl("start", B)
    wait_state(container, B, "active")
    pid = main_pid(container, B)
    container.systemctl("start", A, check=False)
    wait_until(lambda: said in container.journal(A, "-o", "cat"), 20, what=said)

    def b_runs_a_not_held() -> None:  # over a window: A is read after its job's end
        assert holders(container) == {0: [B]} and main_pid(container, B) == pid
        assert f"{A} was stopped outside gpuslice" not in container.journal(CONTROLLER)

    always_for(b_runs_a_not_held, 1.5, interval=0.3)
    assert A not in status(container)["held"]


def test_a_comeback_whose_start_job_times_out_queued_is_said_failed(container: Container) -> None:
    """B (50) `Wants=`+`After=` slow.service (8 s to start) and has `JobTimeoutSec=2`; A
    (10) preempts B, and slow was stopped meanwhile. B's comeback waits in systemd's queue
    behind slow's start and its job times out: nothing of B ran. It was said `finished`
    (the journal's word for work done), its preemption forgotten; it is said failed."""
    slow = "slow.service"
    container.run(["touch", "/run/fast"])
    oneshot = "[Service]\nType=oneshot\nRemainAfterExit=yes\n"
    oneshot += "ExecStart=/bin/sh -c 'test -e /run/fast || sleep 8'\n"
    container.write_file(f"/etc/systemd/system/{slow}", oneshot)
    write_job(container, B, 50, extra_unit=f"Wants={slow}\nAfter={slow}\nJobTimeoutSec=2")
    write_job(container, A, 10, seconds=2)
    reload(container)
    container.systemctl("start", B)
    wait_state(container, B, "active")
    container.systemctl("stop", slow)
    container.run(["rm", "/run/fast"])
    container.systemctl("start", "--no-block", A)
    wait_started(container, A)
    journal = wait_journal(container, f"{B} failed", timeout=30)
    assert "Job b.service/start failed with result 'timeout'" in container.journal(B, "-o", "cat")
    assert f"{B} finished" not in journal
    assert holders(container) == {0: []}
