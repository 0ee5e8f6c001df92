"""Systemd's own features around GPU units, against a real systemd 252: dependencies between
annotated units (a stop of a unit that another one needs stops that one too)."""

from __future__ import annotations

import pytest

from tests.bed.container import Container, WaitTimeout, wait_until
from tests.integration.jobs import (
    UNIT_DIR,
    always_for,
    describe,
    holders,
    main_pid,
    prop,
    reload,
    start_count,
    status,
    wait_answer,
    wait_journal,
    wait_restarted,
    wait_started,
    wait_state,
    wait_sub,
    write_job,
)

A = "a.service"
B = "b.service"
C = "c.service"
CONTROLLER = "gpuslice.service"
HELD = f"{A} was stopped outside gpuslice"


@pytest.mark.parametrize("needs", [f"Requires={B}", f"BindsTo={B}", f"Wants={B}\nPartOf={B}"])
def test_a_start_never_preempts_a_unit_it_needs(container: Container, needs: str) -> None:
    """A (priority 10) needs B (50) (`Requires=`, `BindsTo=` or `PartOf=`, and `After=`), one
    GPU: B runs first (After=), then A's gate asks. Stopping B would stop A too: gpuslice's
    stop is refused by systemd rather than cancelling the very start it was for, which was
    once taken for someone's stop (A held), and B, preempted, came back at once. A waits at
    its gate while B runs."""
    write_job(container, B, 50)
    write_job(container, A, 10, extra_unit=f"{needs}\nAfter={B}")
    reload(container)
    container.systemctl("start", "--no-block", A)
    refused = f"{A} waiting: GPU 0 held by {B}, priority 50 (refused to stop)"
    journal = wait_until(
        lambda: j if refused in (j := container.journal(CONTROLLER)) or HELD in j else None,
        30,
        what="gpuslice to preempt B, or to find it cannot",
    )
    assert HELD not in journal  # A's start cancelled by the stop of B meant for it
    # A's start, queued behind B's, kept no GPU from B's gate (the two waited for each other)
    assert f"{B} waiting: GPU 0 held by {A}" not in journal
    # systemd names the first conflicting job it finds: A's start, or B's own if still under way
    assert f"Transaction for {B}/stop is destructive ({A} has 'start' job queued" in journal or (
        f"Transaction for {B}/stop is destructive ({B} has 'start' job queued" in journal
    )
    wait_sub(container, A, "start-pre")
    started = start_count(container, B)

    def b_runs_and_a_waits() -> None:
        assert holders(container) == {0: [B]}
        assert container.active_state(A) == "activating"

    always_for(b_runs_and_a_waits, 2)
    assert start_count(container, B) == started == 1  # never stopped, never restarted
    assert A not in status(container)["held"]
    container.systemctl("stop", B)  # stops A too: the admin's stop, A held
    wait_state(container, A, "inactive")
    wait_answer(lambda: status(container)["held"], lambda h: sorted(h) == [A, B], 20, "holds")
    assert holders(container) == {0: []}


def test_a_start_queued_behind_a_gpu_units_start_keeps_no_gpu_from_it(
    container: Container,
) -> None:
    """A (10) `Requires=`+`After=` B (50), one GPU; B's start waits 3 s for a plain unit's
    (`After=`), so A's start, queued behind B's, is seen waiting in systemd's queue well
    before B's gate asks. Announced then, A kept GPU 0 from B, whose gate waited for it
    while A's start waited for B's: neither ever ran. A waits for a GPU unit's start
    (Job.GetBefore), so it is known at its gate: B runs first, then A waits at its gate."""
    container.write_file(
        f"{UNIT_DIR}/slow.service",
        "[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/sleep 3\n",
    )
    write_job(container, B, 50, extra_unit="Requires=slow.service\nAfter=slow.service")
    write_job(container, A, 10, extra_unit=f"Requires={B}\nAfter={B}")
    reload(container)
    container.systemctl("start", "--no-block", A)
    wait_answer(lambda: holders(container), lambda h: h == {0: [B]}, 30, "B to run")
    wait_sub(container, A, "start-pre")
    assert f"{B} waiting: GPU 0 held by {A}" not in container.journal(CONTROLLER)


def test_a_start_queued_behind_a_gpu_units_start_at_a_controller_restart_keeps_nothing(
    container: Container,
) -> None:
    """X (5) holds GPU 0, B (50) waits at its gate for it, and A (10) `Requires=`+`After=` B
    waits in systemd's queue for B's start when gpuslice restarts. Its start-up queued A at
    once: once X was stopped, A got GPU 0, B's gate waited for it while A's start waited
    for B's, and neither ever ran. Read waiting for a GPU unit's start (Job.GetBefore), A
    is known at its gate: B runs first, then A's gate asks."""
    x = "x.service"
    write_job(container, x, 5)
    write_job(container, B, 50)
    write_job(container, A, 10, extra_unit=f"Requires={B}\nAfter={B}")
    reload(container)
    container.systemctl("start", "--no-block", x)
    wait_answer(lambda: holders(container), lambda h: h == {0: [x]}, 30, "X to run")
    container.systemctl("start", "--no-block", A)
    wait_sub(container, B, "start-pre", 30)
    container.systemctl("restart", CONTROLLER)
    assert prop(container, A, "SubState") == "dead"  # still queued behind B's start
    container.systemctl("stop", x)
    wait_answer(lambda: holders(container), lambda h: h == {0: [B]}, 60, "B to run")
    wait_sub(container, A, "start-pre", 30)


def test_a_refill_whose_start_waits_for_a_gpu_units_start_keeps_no_gpu_from_it(
    container: Container,
) -> None:
    """C (background, 40) `Requires=`+`After=` B (50), one GPU: gpuslice refills C on free
    GPU 0, and C's start pulls in B's, which it waits for. GPU 0 kept for C kept B's gate
    waiting while C's start waited for B's: neither ever ran. Found waiting for a GPU unit's
    start, C keeps nothing: B runs, and C's gate asks (C needs B: B is not stopped for it)."""
    write_job(container, B, 50)
    write_job(container, C, 40, "background", extra_unit=f"Requires={B}\nAfter={B}")
    reload(container)
    wait_answer(lambda: holders(container), lambda h: h == {0: [B]}, 60, "B to run")
    wait_sub(container, C, "start-pre", 30)
    said = f"{C} waits in systemd's queue for the start of a GPU unit: GPU 0 no longer kept"
    assert said in container.journal(CONTROLLER)


def test_a_unit_still_starting_past_its_gate_is_preempted(container: Container) -> None:
    """B (50) past its gate but still starting (its own start job under way: a model loaded
    in `ExecStartPost=`): systemd refuses a stop in mode "fail" for B's own job; A needs
    nothing of B (`Requires=`, `BindsTo=`, `PartOf=`, read from systemd), so gpuslice's stop
    is sent again in mode "replace", which preempts B as before."""
    write_job(container, B, 50, extra_service="ExecStartPost=/bin/sleep 600")
    write_job(container, A, 10, seconds=600)
    reload(container)
    container.systemctl("start", "--no-block", B)
    wait_sub(container, B, "start-post")
    container.systemctl("start", "--no-block", A)
    wait_state(container, A, "active")
    assert holders(container) == {0: [A]}
    journal = container.journal(CONTROLLER)
    assert f"Transaction for {B}/stop is destructive" not in journal  # not said: no refusal
    assert B in [p["unit"] for p in status(container)["preempted"]]


@pytest.mark.parametrize("d_priority", [None, 20], ids=["plain", "gpu-unit"])
def test_a_unit_still_starting_is_not_preempted_over_a_start_queued_that_needs_it(
    container: Container, d_priority: int | None
) -> None:
    """B (50) past its gate but still starting (`ExecStartPost=`); D `Requires=`+`After=` B,
    its start queued behind B's (`systemctl start d`); A (10) needs nothing of B. The stop of
    B in mode "fail" conflicts with B's own start and with D's, and systemd names the first
    it finds: sent again in mode "replace" over B's own, it cancelled D's start too (a
    user's start silently undone: "d.service/start finished, result=canceled" in systemd's
    debug log; gpuslice said nothing of D). D a plain unit or a GPU unit (20), whose start
    gpuslice does not know before its gate (it waits for B's). Gpuslice reads the jobs of the
    units that need B: D has one, so the refusal holds while those jobs are under way (B's
    start, D's), as one naming D's start: B keeps GPU 0 and D's start stays queued.
    Systemd's pick follows its hash of the units, so a fresh D is tried until it names B's
    own job (at most four tries)."""
    write_job(container, B, 50, extra_service="ExecStartPost=/bin/sleep 600")
    write_job(container, A, 10, seconds=600)
    own = f"Transaction for {B}/stop is destructive ({B} has 'start' job queued"
    for attempt in range(4):
        d = f"d{attempt}.service"
        journal = _refused_with_a_start_queued_behind_b(container, d, d_priority, attempt)
        named_own = own in journal
        if named_own:
            assert f"stopping {B} would cancel the jobs of {d}, which need it" in journal
            assert f"will try to stop it again once a job of {B}, {d} ends" in journal
        # (else systemd named D's start: another D.) One command: A's stop, seen at its
        # gate, holds A at once (Tracker.stopped_at_gate), so D's stop, which cancels D's
        # start and ends the refusal held for it, preempts nothing for A. Held only at its
        # down, A waited meanwhile: B was preempted for it while `systemctl stop a d b` ran,
        # and D came back with B, "stopped with" it (the fresh-clone CI, once)
        container.systemctl("stop", A, d, B)
        container.systemctl("reset-failed", B)  # stopped in ExecStartPost=: failed
        wait_state(container, B, "inactive")
        wait_answer(lambda: holders(container), lambda h: h == {0: []}, 20, "GPU 0 free")
        assert status(container)["preempted"] == [], describe(container, [A, B, d])
        if named_own:
            return
    pytest.skip("systemd named D's start each time, never B's own")


def _refused_with_a_start_queued_behind_b(
    container: Container, d: str, priority: int | None, seen: int
) -> str:
    """D's start queued behind B's (still under way), then A's: gpuslice's stop of B for A is
    refused (the `seen`+1st time), B keeps GPU 0 and D's start its job. The journal."""
    write_job(container, d, priority, seconds=600, extra_unit=f"Requires={B}\nAfter={B}")
    reload(container)
    container.systemctl("start", "--no-block", B)
    wait_sub(container, B, "start-post")
    container.systemctl("start", "--no-block", d)
    d_job = wait_answer(lambda: prop(container, d, "Job"), lambda j: j not in ("", "0"), 20, "job")
    container.systemctl("start", "--no-block", A)
    wait_sub(container, A, "start-pre")
    refused = f"{B} (priority 50) did not stop for {A}"
    try:
        journal = wait_until(
            lambda: j if (j := container.journal(CONTROLLER)).count(refused) > seen else None,
            30,
            what=f"the refusal for {A}",
        )
    except WaitTimeout as e:
        raise WaitTimeout(f"{e}; {describe(container, [A, B, d])}") from None

    def b_runs_and_d_waits() -> None:
        assert holders(container) == {0: [B]}
        assert prop(container, d, "Job") == d_job, describe(container, [A, B, d])
        assert container.active_state(A) == "activating"

    always_for(b_runs_and_d_waits, 2)
    return journal


def test_a_refusal_for_jobs_under_way_ends_when_they_do(container: Container) -> None:
    """As above, but B's `ExecStartPost=` lasts 3 s: the refusal stood only for B's start
    and D's, queued behind it. A waited for B's whole run (hours for a background batch);
    once B's start is done (D's start then runs), A's preemption is decided again: B is
    stopped (D with it, Requires=) and A runs within seconds."""
    d = "d.service"
    write_job(container, B, 50, seconds=600, extra_service="ExecStartPost=/bin/sleep 3")
    write_job(container, A, 10, seconds=600)
    write_job(container, d, None, seconds=600, extra_unit=f"Requires={B}\nAfter={B}")
    reload(container)
    container.systemctl("start", "--no-block", B)
    wait_sub(container, B, "start-post")
    container.systemctl("start", "--no-block", d)
    wait_answer(lambda: prop(container, d, "Job"), lambda j: j not in ("", "0"), 20, "job")
    container.systemctl("start", "--no-block", A)
    try:
        wait_journal(container, f"{B} (priority 50) did not stop for {A}", 10)
        # within a second of B's start done, its ExecStartPost= over
        wait_journal(container, f"for which stopping {B} was refused: it may be stopped", 20)
        wait_sub(container, A, "running", 20)
    except WaitTimeout as e:
        raise WaitTimeout(f"{e}; {describe(container, [A, B, d])}") from None
    assert holders(container) == {0: [A]}


def test_a_unit_stopped_along_with_its_preempted_requirement_comes_back(
    container: Container,
) -> None:
    """Two GPUs: B (50) and C (40), which `Requires=`+`After=` B, each on one. A (10) needs
    one: gpuslice preempts B, the least urgent, and systemd stops C with it (Requires=).
    C was taken for stopped by someone (held) and never came back, while B, preempted,
    came back on C's GPU: the more urgent unit lost its run to the less urgent one. C is
    preempted with B (systemd says it needs B), said so, and comes back first: its start
    pulls B's along (Requires=), which waits at its gate while A runs; both run once A ends."""
    container.write_file("/etc/gpuslice/config.yaml", "gpus: 2\n")
    container.systemctl("restart", CONTROLLER)
    write_job(container, B, 50)
    write_job(container, C, 40, extra_unit=f"Requires={B}\nAfter={B}")
    write_job(container, A, 10, seconds=3)
    reload(container)
    container.systemctl("start", C)
    wait_state(container, C, "active")
    container.systemctl("start", "--no-block", A)
    wait_started(container, A)
    wait_state(container, A, "inactive", timeout=30)  # finished
    wait_state(container, B, "active")
    assert C not in status(container)["held"]
    wait_state(container, C, "active")
    journal = container.journal(CONTROLLER)
    assert f"{C} (priority 40) was stopped with {B} (its Requires=)" in journal


def test_a_unit_someone_stops_before_its_requirement_is_preempted_stays_held(
    container: Container,
) -> None:
    """As above, but a person's `systemctl stop C` is under way (its `ExecStop=` takes 3 s)
    when A preempts B: systemd merges the stop of C that gpuslice's stop of B makes into
    the person's, made before it (a lower job id). C was stopped by the person: held, not
    brought back with B."""
    container.write_file("/etc/gpuslice/config.yaml", "gpus: 2\n")
    container.systemctl("restart", CONTROLLER)
    write_job(container, B, 50)
    write_job(
        container,
        C,
        40,
        extra_unit=f"Requires={B}\nAfter={B}",
        extra_service="ExecStop=/bin/sleep 3",
    )
    write_job(container, A, 10, seconds=3)
    reload(container)
    container.systemctl("start", C)
    wait_state(container, C, "active")
    container.systemctl("stop", "--no-block", C)
    wait_state(container, C, "deactivating")
    container.systemctl("start", "--no-block", A)
    wait_journal(container, f"{C} was stopped outside gpuslice: held until started again")
    wait_started(container, A)
    wait_state(container, A, "inactive", timeout=30)  # finished
    wait_state(container, B, "active")
    assert C in status(container)["held"]
    assert container.active_state(C) == "inactive"
    assert f"{C} (priority 40) was stopped with" not in container.journal(CONTROLLER)


def together(bed: Container) -> str:
    """A target that wants A and B, written (made known by the next daemon-reload): starting
    it queues both starts in one transaction."""
    bed.write_file(f"{UNIT_DIR}/ab.target", f"[Unit]\nWants={A} {B}\n")
    return "ab.target"


def test_units_started_together_right_after_their_reload_are_served_in_priority_order(
    container: Container,
) -> None:
    """Two units enrolled, then `systemctl daemon-reload && systemctl start AB.target` at
    once (one transaction: `systemctl start A B` queues one job after the other, and on a
    loaded host A's gate may ask before B's job exists), one GPU: the first gate to ask, over
    D-Bus (no pipe yet), while the rescan of that reload may still be read and no signal of
    either unit is matched, known by nothing but its own call, was granted the GPU; A (50)
    then was preempted by B (10) a moment later. A call waits for systemd's queued jobs
    (gpuslice/queued.py): B runs, and A's own ExecStart= never ran."""
    write_job(container, A, 50, seconds=600)
    write_job(container, B, 10, seconds=600)
    container.run(f"systemctl daemon-reload && systemctl start --no-block {together(container)}")
    wait_state(container, B, "active")

    def a_waits_and_never_ran() -> None:
        assert container.active_state(A) == "activating"
        assert prop(container, A, "ExecMainStartTimestampMonotonic") == "0"

    always_for(a_waits_and_never_ran, 2)
    assert holders(container) == {0: [B]}


def test_a_known_unit_and_a_new_one_started_together_after_a_reload_are_served_in_order(
    container: Container,
) -> None:
    """A (50) enrolled, run once and stopped (its signals followed, its gate answered at its
    pipe); then B (10) enrolled and `systemctl daemon-reload && systemctl start AB.target` at
    once (one transaction), one GPU. B's JobNew came while the rescan read the new file, or
    before B's signals were matched; A's gate was seen at its pipe and granted before B's
    start was known, and B preempted it a moment later. A's start waits for a read of
    systemd's queued jobs (gpuslice/queued.py): B runs, and A's new run never began."""
    write_job(container, A, 50, seconds=600)
    reload(container)
    container.systemctl("start", A)
    wait_state(container, A, "active")
    container.systemctl("stop", A)
    ran = prop(container, A, "ExecMainStartTimestampMonotonic")
    write_job(container, B, 10, seconds=600)
    container.run(f"systemctl daemon-reload && systemctl start --no-block {together(container)}")
    wait_state(container, B, "active")

    def a_waits_and_never_ran() -> None:
        assert container.active_state(A) == "activating"
        # reset at the start (systemd 252), or still its first run's: its ExecStart= never ran
        assert prop(container, A, "ExecMainStartTimestampMonotonic") in ("0", ran)

    always_for(a_waits_and_never_ran, 2)
    assert holders(container) == {0: [B]}
    started = [
        x for x in container.journal(A, "-o", "cat").splitlines() if x.startswith("Started ")
    ]
    assert len(started) == 1  # its first run's


def test_a_restart_of_a_unit_on_a_gpu_lets_no_waiter_in(container: Container) -> None:
    """`systemctl restart` of A (10) on the GPU while B (50) waits: the restart is one job,
    its start keeps A's place and its GPU; B never runs in between (README, "Dependencies
    between GPU units")."""
    write_job(container, A, 10)
    write_job(container, B, 50)
    reload(container)
    container.systemctl("start", A)
    container.systemctl("start", "--no-block", B)
    wait_journal(container, f"{B} waiting: GPU 0 held by {A}, priority 10")
    old = main_pid(container, A)
    container.systemctl("restart", A)
    wait_restarted(container, A, old)

    def b_waits() -> None:
        assert holders(container) == {0: [A]}
        assert container.active_state(B) == "activating"

    always_for(b_waits, 1.5)
    assert start_count(container, B) == 1


def test_a_unit_needed_by_a_start_is_preempted_again_once_that_start_is_gone(
    container: Container,
) -> None:
    """B's stop was refused for A's start (A `Requires=` B); `systemctl stop A` ends that
    start. X (5), which needs nothing of B's, then preempts B: the refusal held only while
    A waited. B's start job runs on for 5 s past its gate (ExecStartPost=) when A's start is
    queued, and known: systemd's refusal may name B's own start, and the stop, once sent
    again in mode `replace` over it, cancelled A's start too (A then taken for stopped by
    someone: held). B is started first: A's start, queued with B's and known before B's gate
    asked, was given GPU 0 while B waited for it, and A waited for B (After=), a deadlock
    that is not this test's."""
    x = "x.service"
    write_job(container, B, 50, extra_service="ExecStartPost=/bin/sleep 5")
    write_job(container, A, 10, extra_unit=f"Requires={B}\nAfter={B}")
    write_job(container, x, 5, seconds=600)
    reload(container)
    container.systemctl("start", "--no-block", B)
    wait_sub(container, B, "start-post")
    container.systemctl("start", "--no-block", A)
    journal = wait_journal(container, f"will not try to stop it again while {A} waits")
    assert f"Transaction for {B}/stop is destructive (" in journal
    wait_state(container, B, "active")
    wait_sub(container, A, "start-pre")  # at its gate: its start was not cancelled
    assert HELD not in container.journal(CONTROLLER)
    container.systemctl("stop", A)
    wait_state(container, A, "inactive")
    container.systemctl("start", "--no-block", x)
    wait_state(container, x, "active")
    assert holders(container) == {0: [x]}
    assert B in [p["unit"] for p in status(container)["preempted"]]
