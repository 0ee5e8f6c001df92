"""The gate (data/gpuslice-gate) against a real systemd: stopping a waiter, a controller away.

The gate is the first `ExecStartPre=+` of every annotated unit; these tests drive only
`systemctl`, `journalctl` and `ps` inside a freshly booted container, as an admin would.
"""

from __future__ import annotations

import itertools
import time

from tests.bed.container import BedError, Container, WaitTimeout, wait_until
from tests.integration.jobs import (
    prop,
    reload,
    start_count,
    status,
    wait_state,
    wait_sub,
    write_job,
)

CONTROLLER = "gpuslice.service"
HOLDER = "holder.service"
WAITER = "waiter.service"
CAP_S = 5.0  # the gate's longest pause between asks while the controller is away
# Far longer than any stop should take: a stop that waits for it is the bug.
TIMEOUT_STOP = "TimeoutStopSec=60"
NO_RESTART = "[Service]\nRestart=no\n"

KILL_MODES = {
    "mixed.service": "KillMode=mixed",
    "process.service": "KillMode=process",
    "group.service": "KillMode=control-group",
    "sigint.service": "KillMode=mixed\nKillSignal=SIGINT",
}


def _waiting(bed: Container) -> set[str]:
    return {w["unit"] for w in status(bed)["waiting"]}


def _leftovers(bed: Container, unit: str) -> list[str]:
    """Processes still in UNIT's cgroup, or gates and dbus-sends started for it."""
    ps = bed.run(["ps", "-eo", "pid=,cgroup:512=,args="]).stdout.splitlines()
    marks = (f"/{unit}", f"gpuslice-gate {unit}", f"string:{unit}")
    return [line for line in ps if any(m in line for m in marks) and "ps -eo" not in line]


def _wait_no_leftovers(bed: Container, unit: str) -> None:
    try:
        wait_until(lambda: not _leftovers(bed, unit) or None, 30, what=f"{unit} to leave nothing")
    except WaitTimeout:
        raise AssertionError(f"left of {unit}: {_leftovers(bed, unit)}") from None


def _stop_quickly(bed: Container, unit: str) -> None:
    """`systemctl stop UNIT` (waiting at its gate) returns at once; it ends inactive, empty."""
    out = bed.run(f"date +%s.%N; systemctl stop {unit}; date +%s.%N", timeout=45).stdout.split()
    took = float(out[1]) - float(out[0])
    print(f"systemctl stop {unit} ({prop(bed, unit, 'KillMode')}) at the gate: {took:.3f} s")
    assert took < 10, f"stopping {unit} took {took:.1f} s"
    assert prop(bed, unit, "ActiveState") == "inactive"
    assert prop(bed, unit, "Result") == "success"
    _wait_no_leftovers(bed, unit)


def _lines(journal: str, text: str) -> list[str]:
    return [line for line in journal.splitlines() if text in line]


def test_waiting_unit_stops_at_once_whatever_its_kill_mode(container: Container) -> None:
    write_job(container, HOLDER, 20)
    for unit, kill in KILL_MODES.items():
        write_job(container, unit, 20, extra_service=f"{kill}\n{TIMEOUT_STOP}")
    reload(container)
    container.systemctl("start", HOLDER)
    container.systemctl("start", "--no-block", *KILL_MODES)
    for unit in KILL_MODES:
        wait_sub(container, unit, "start-pre")
    # every gate's Acquire is with the controller: its dbus-send is blocked in the call
    wait_until(lambda: _waiting(container) == set(KILL_MODES) or None, 20, what="4 waiters")
    for unit in KILL_MODES:
        _stop_quickly(container, unit)
    assert prop(container, HOLDER, "ActiveState") == "active"


def test_gate_reports_absent_controller_once_and_backs_off(container: Container) -> None:
    write_job(container, WAITER, 20)
    reload(container)
    # Count the gate's asks: systemd's default PATH puts /usr/local/bin before /usr/bin.
    container.write_file(
        "/usr/local/bin/dbus-send",
        '#!/bin/sh\ndate +%s.%N >> /run/gate-asks\nexec /usr/bin/dbus-send "$@"\n',
        0o755,
    )
    container.systemctl("stop", CONTROLLER)
    container.systemctl("mask", "--runtime", CONTROLLER)  # so the waiter's Wants= cannot start it
    container.systemctl("start", "--no-block", WAITER)
    wait_sub(container, WAITER, "start-pre")

    def asks() -> list[float]:
        out = container.run("cat /run/gate-asks", check=False).stdout
        return [float(t) for t in out.split()]

    # retry 0.5 s doubling to 5 s: asks at 0, 0.5, 1.5, 3.5, 7.5, 12.5 s (later when loaded)
    times = wait_until(lambda: t if len(t := asks()) >= 6 else None, 60, what="6 asks")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    print("gaps between the gate's asks (s):", " ".join(f"{g:.2f}" for g in gaps))
    assert sum(1 for t in times if t - times[0] <= 6) <= 5
    assert gaps[2] >= 1.5 and gaps[3] >= 3.5, gaps  # it backs off
    assert gaps[4] < CAP_S + 5, gaps  # up to a cap
    journal = container.journal(WAITER)
    waiting = _lines(journal, "waiting for gpuslice.service")
    assert len(waiting) == 1, journal  # once over ~12 s, not at every ask
    expected = "waiting for gpuslice.service, which is inactive: see 'systemctl status gpuslice'"
    assert expected in waiting[0]
    assert prop(container, WAITER, "SubState") == "start-pre"

    # a unit stopped while its gate pauses between asks: at once, nothing left (its sleep)
    write_job(container, "paused.service", 20, extra_service=f"KillMode=process\n{TIMEOUT_STOP}")
    reload(container)
    container.systemctl("start", "--no-block", "paused.service")
    wait_until(
        lambda: _lines(container.journal("paused.service"), "waiting for gpuslice.service"),
        30,
        what="paused.service to wait for the controller",
    )
    _stop_quickly(container, "paused.service")

    container.systemctl("unmask", "--runtime", CONTROLLER)
    container.systemctl("start", CONTROLLER)
    back = time.monotonic()
    wait_state(container, WAITER, "active", timeout=CAP_S + 25)
    print(f"controller active -> waiter active: {time.monotonic() - back:.2f} s")
    assert time.monotonic() - back < CAP_S + 10  # within one pause (wide margin for load)
    journal = container.journal(WAITER)
    assert len(_lines(journal, "gpuslice.service is back: asking for GPUs")) == 1, journal
    assert len(_lines(journal, "waiting for gpuslice.service")) == 1, journal


def test_controller_that_cannot_run_keeps_waiters_waiting(container: Container) -> None:
    """Config rejected: no job runs ungated; the waiter says why and runs once it is fixed."""
    write_job(container, HOLDER, 20)
    write_job(container, WAITER, 20)
    reload(container)
    container.systemctl("start", HOLDER)
    container.systemctl("start", "--no-block", WAITER)
    wait_until(lambda: _waiting(container) == {WAITER} or None, 20, what=f"{WAITER} waiting")
    config = "/etc/gpuslice/config.yaml"
    container.run(f"cp {config} /run/config.good && echo 'gpus: banana' > {config}")
    broke = time.monotonic()
    container.systemctl("restart", CONTROLLER, check=False)  # fails: exit 78, not retried
    # Failed at once, not after systemd's start limit: that takes 5 tries within 10 s, which a
    # slow machine (over 2 s to start Python twice) never reaches (CI once saw 35 tries).
    wait_until(
        lambda: prop(container, CONTROLLER, "ActiveState") == "failed",
        30,
        what=f"{CONTROLLER} to fail",
    )
    print(f"bad config -> failed: {time.monotonic() - broke:.1f} s")
    assert prop(container, CONTROLLER, "ExecMainStatus") == "78"
    assert prop(container, CONTROLLER, "NRestarts") == "0"
    assert 'gpus: invalid value "banana"' in container.journal(CONTROLLER)
    wait_until(
        lambda: _lines(container.journal(WAITER), "waiting for gpuslice.service, which is failed"),
        30,
        what=f"{WAITER} to say the controller failed",
    )
    assert prop(container, WAITER, "SubState") == "start-pre"  # never ungated
    assert prop(container, HOLDER, "ActiveState") == "active"

    container.run(f"cp /run/config.good {config}")
    container.systemctl("reset-failed", CONTROLLER)
    container.systemctl("start", CONTROLLER)
    back = time.monotonic()
    # The controller queues the waiter as it starts (a unit at its gate is part of systemd's
    # state it takes in); the gate notices within one pause and says so.
    wait_until(lambda: _waiting(container) == {WAITER} or None, CAP_S + 25, what="queued again")
    print(f"controller active -> waiter queued again: {time.monotonic() - back:.2f} s")
    said = wait_until(
        lambda: (
            s
            if "is back" in (s := _lines(container.journal(WAITER), "gpuslice.service"))[-1]
            else None
        ),
        CAP_S + 25,
        what=f"{WAITER}'s gate to say the controller is back",
    )
    print(f"controller active -> the gate says so: {time.monotonic() - back:.2f} s")
    print("the waiter's journal:", *said, sep="\n  ")
    assert "gpuslice.service is back: asking for GPUs" in said[-1]
    assert prop(container, WAITER, "SubState") == "start-pre"  # still behind the holder
    container.systemctl("stop", HOLDER)
    wait_state(container, WAITER, "active")


# ---- the gate's pipe (gpuslice/gatepipes.py): the fast way, and every way out of it ----


def _answers(bed: Container) -> dict[str, int]:
    answers: dict[str, int] = status(bed)["counters"]["gate_answers"]
    return answers


def _waiting_now(bed: Container) -> set[str]:
    """Units waiting, or none while the controller does not answer."""
    try:
        return _waiting(bed)
    except BedError:
        return set()


def _make_pipe(bed: Container, unit: str) -> None:
    """Start and stop the unit until its pipe exists: the controller makes it when it sees a
    start at the gate, which its first start after a daemon-reload may reach before the
    controller's rescan knows the unit (that start asks over D-Bus). Returns once the
    controller has taken in the last stop (the unit is held)."""
    for _ in range(3):
        bed.systemctl("start", unit)
        bed.systemctl("stop", unit)
        wait_until(lambda: unit in status(bed)["held"] or None, 20, what=f"{unit} held")
        if bed.run(f"test -p /run/gpuslice/gate/{unit}", check=False).returncode == 0:
            return
    raise AssertionError(f"no pipe for {unit} after 3 starts: {bed.journal(CONTROLLER)}")


def _slow_unit(bed: Container) -> None:
    """slow.service: a unit to order a start behind, so that its JobNew comes a second
    before its gate runs."""
    bed.write_file(
        "/etc/systemd/system/slow.service", "[Service]\nType=oneshot\nExecStart=/bin/sleep 1\n"
    )


def _start_counting_answers(bed: Container, unit: str) -> tuple[int, int]:
    """Start the unit (it must run); how its gate was let through: (pipe, D-Bus) answers."""
    before = _answers(bed)
    bed.systemctl("start", unit)
    assert prop(bed, unit, "ActiveState") == "active"
    after = _answers(bed)
    return after["pipe"] - before["pipe"], after["dbus"] - before["dbus"]


def test_a_start_is_let_through_its_pipe_and_every_start_of_it_runs(container: Container) -> None:
    write_job(container, WAITER, 20, seconds=0)
    reload(container)
    _make_pipe(container, WAITER)
    before = _answers(container)
    for _ in range(3):
        container.systemctl("start", WAITER)
        assert prop(container, WAITER, "ActiveState") == "active"
        container.systemctl("stop", WAITER)
    after = _answers(container)
    assert after["pipe"] - before["pipe"] == 3, (before, after)
    assert after["dbus"] == before["dbus"], (before, after)
    mode = container.run(f"stat -c %a:%F /run/gpuslice/gate /run/gpuslice/gate/{WAITER}").stdout
    assert mode.split() == ["700:directory", "600:fifo"], mode


def test_the_first_start_of_a_unit_after_a_controller_start_goes_through_its_pipe(
    container: Container,
) -> None:
    """No start has left a pipe since the controller started, yet the gate waits on one:
    the controller makes it when systemd queues the start (JobNew), before the gate runs.
    The start job here waits behind a slow unit ordered before it, so JobNew comes a second
    before the gate (without the pipe made ahead, the gate asks over D-Bus)."""
    _slow_unit(container)
    write_job(container, WAITER, 20, extra_unit="Wants=slow.service\nAfter=slow.service")
    reload(container)
    container.systemctl("restart", CONTROLLER)  # its start-up removes every pipe
    pipe = f"/run/gpuslice/gate/{WAITER}"
    assert container.run(f"test -e {pipe}", check=False).returncode != 0
    assert _start_counting_answers(container, WAITER) == (1, 0), container.journal(CONTROLLER)


def test_an_instances_pipe_goes_when_it_is_down_and_its_next_start_has_one_again(
    container: Container,
) -> None:
    """Instances' names are many (`transcribe@RECORDING`): each one's pipe is removed once it
    is down, and made again when systemd queues its next start. A new instance is heard from
    its first JobNew on, too late for a pipe then, unless every unit's signals still were
    (the controller's first match rules on their way): its gate asks over D-Bus or its pipe."""
    _slow_unit(container)
    write_job(container, "tx@.service", 20, extra_unit="Wants=slow.service\nAfter=slow.service")
    reload(container)
    unit, pipe = "tx@a.service", "/run/gpuslice/gate/tx@a.service"
    for first in (True, False, False):
        answers = _start_counting_answers(container, unit)
        assert answers in ((0, 1), (1, 0)) if first else answers == (1, 0), answers
        container.systemctl("stop", unit)
        wait_until(
            lambda: container.run(f"test -e '{pipe}'", check=False).returncode != 0 or None,
            20,
            what=f"{pipe} removed",
        )


def test_a_gate_on_its_pipe_when_the_controller_is_killed_starts_after_it_is_back(
    container: Container,
) -> None:
    """The kernel closes a killed controller's end of the pipe: the gate reads end of file
    and asks over D-Bus, and the controller that Restart= brings back serves it in order."""
    write_job(container, HOLDER, 10)
    write_job(container, WAITER, 20)
    reload(container)
    _make_pipe(container, WAITER)
    container.systemctl("start", HOLDER)
    container.systemctl("start", "--no-block", WAITER)
    wait_until(lambda: _waiting(container) == {WAITER} or None, 20, what=f"{WAITER} waiting")
    container.systemctl("kill", "-s", "SIGKILL", CONTROLLER)
    wait_until(
        lambda: _waiting_now(container) == {WAITER} or None, 30, what=f"{WAITER} waiting again"
    )
    assert prop(container, WAITER, "SubState") == "start-pre"  # not let through meanwhile
    container.systemctl("stop", HOLDER)
    wait_state(container, WAITER, "active")


def test_a_gate_blocked_before_the_controller_opened_its_pipe_is_woken_when_it_dies(
    container: Container,
) -> None:
    """A gate that opened its pipe before the controller did (it reads systemd's signal a few
    ms later) is woken by ExecStopPost= (`gpuslice release-gates`) when the controller dies
    in between: it asks over D-Bus and says that it waits for gpuslice.service."""
    write_job(container, WAITER, 20)
    # no restart: only ExecStopPost= runs (a masked unit would lose it too)
    container.write_file(f"/run/systemd/system/{CONTROLLER}.d/no-restart.conf", NO_RESTART)
    reload(container)
    _make_pipe(container, WAITER)
    container.systemctl("kill", "-s", "SIGSTOP", CONTROLLER)  # alive, deaf: opens nothing
    container.systemctl("start", "--no-block", WAITER)
    wait_sub(container, WAITER, "start-pre")
    gate = wait_until(
        lambda: (
            container.run(f"pgrep -f 'gpuslice-gate {WAITER}'", check=False).stdout.strip() or None
        ),
        20,
        what="the gate to run",
    )
    # blocked in open() (wait_for_partner), not in dash's wait for a dbus-send (sigsuspend)
    wait_until(
        lambda: (
            "partner" in container.run(f"cat /proc/{gate.split()[0]}/wchan", check=False).stdout
            or None
        ),
        30,
        what="the gate to wait for the controller to open its pipe",
    )
    container.systemctl("kill", "-s", "SIGKILL", CONTROLLER)
    wait_until(
        lambda: _lines(container.journal(WAITER), "waiting for gpuslice.service") or None,
        30,
        what=f"{WAITER} to say it waits for the controller",
    )
    assert prop(container, WAITER, "SubState") == "start-pre"
    assert container.run("ls /run/gpuslice/gate", check=False).returncode != 0
    container.systemctl("start", CONTROLLER)
    wait_state(container, WAITER, "active", timeout=CAP_S + 25)
    assert "Traceback" not in container.journal(CONTROLLER)


def test_the_controller_holds_enough_descriptors_for_every_gate_pipe(container: Container) -> None:
    """systemd starts a service with 1024 descriptors (soft): 512 pipes, and every gate past
    them held one of root's 256 connections to the bus. The controller raises its own."""
    from gpuslice.gatepipes import MAX_OPEN, RESERVED_FDS

    pid = prop(container, CONTROLLER, "MainPID")
    limits = container.run(["cat", f"/proc/{pid}/limits"]).stdout
    soft, hard = next(line.split()[3:5] for line in limits.splitlines() if "Max open files" in line)
    wanted = MAX_OPEN + RESERVED_FDS
    assert int(soft) == (wanted if hard == "unlimited" else min(wanted, int(hard))), limits


# ---- the runtime_dir: the gates' EnvironmentFile= and the controller never disagree ----


def test_a_runtime_dir_edited_while_gpuslice_runs_never_starts_a_job_without_its_gpus(
    container: Container,
) -> None:
    """runtime_dir changed in config.yaml, then `systemctl daemon-reload`, then a restart of
    gpuslice.service: a job started after each still reads its env file (its
    CUDA_VISIBLE_DEVICES). Before, the daemon-reload pointed the gates' EnvironmentFile= at
    the new directory while the running controller wrote in the old one (and a restart
    alone did the reverse): the job started with no CUDA_VISIBLE_DEVICES, every GPU in
    view. The new one takes effect at the next boot, as the journal says."""
    job = "env-job.service"
    write_job(
        container,
        job,
        20,
        exec_start='/bin/sh -c \'echo "x$CUDA_VISIBLE_DEVICES" > /run/env-job.cvd; '
        "sleep infinity'",
    )
    reload(container)
    config = "/etc/gpuslice/config.yaml"
    container.run(
        f"sed -i '/^runtime_dir:/d' {config} && echo 'runtime_dir: /run/gpuslice/moved' >> {config}"
    )
    for step in ("daemon-reload", "restart"):
        if step == "daemon-reload":
            reload(container)
        else:
            container.systemctl("restart", CONTROLLER)
        container.run("rm -f /run/env-job.cvd")
        container.systemctl("start", job)
        seen = wait_until(
            lambda: container.run("cat /run/env-job.cvd", check=False).stdout.strip() or None,
            20,
            what=f"{job} to write its CUDA_VISIBLE_DEVICES after the {step}",
        )
        env = container.run(f"cat /run/gpuslice/env/{job}/gpuslice.env").stdout
        assert seen != "x" and f"CUDA_VISIBLE_DEVICES={seen[1:]}\n" in env, (step, seen, env)
        container.systemctl("stop", job)
    assert "runtime_dir: /run/gpuslice/moved takes effect at the next boot" in (
        container.journal(CONTROLLER)
    )
    assert container.run("cat /run/gpuslice/runtime-dir").stdout == "/run/gpuslice\n"


# ---- a daemon-reload while a start waits at its gate: the unit's own ExecStartPre= runs ----

VANISHED = "Current command vanished from the unit file"


def _waits_with_a_line_of_its_own(bed: Container, unit: str, mark: str) -> None:
    """HOLDER (20) runs on the GPU; UNIT (20, equal: it waits, nothing is preempted), whose
    own `ExecStartPre=/bin/touch MARK` comes after the gate, is started by a transient
    unit's blocking `systemctl start` (its exit status in /run/UNIT.rc) and waits at its
    gate."""
    bed.run(f"rm -f {mark} /run/{unit}.rc")
    write_job(bed, HOLDER, 20)
    write_job(bed, unit, 20, extra_service=f"ExecStartPre=/bin/touch {mark}")
    reload(bed)
    bed.systemctl("start", HOLDER)
    waits = f"systemctl start {unit}; echo $? > /run/{unit}.rc"
    bed.run(["systemd-run", "--no-block", "--collect", "/bin/sh", "-c", waits])
    wait_sub(bed, unit, "start-pre")
    wait_until(lambda: _waiting(bed) == {unit} or None, 20, what=f"{unit} waiting")


def _started_whole(bed: Container, unit: str, mark: str) -> None:
    """UNIT runs, its own ExecStartPre= line run, and the `systemctl start` that waited for
    it ended 0."""
    wait_state(bed, unit, "active", timeout=30)
    assert bed.run(f"test -e {mark}", check=False).returncode == 0, bed.journal(unit)
    rc = wait_until(
        lambda: bed.run(f"cat /run/{unit}.rc", check=False).stdout.strip() or None,
        20,
        what=f"`systemctl start {unit}` to return",
    )
    assert rc == "0", bed.journal(unit)


def test_a_retry_changed_while_a_start_waits_keeps_the_units_own_exec_start_pre(
    container: Container,
) -> None:
    """gate_retry_seconds edited in config.yaml and `systemctl daemon-reload` while
    WAITER waits at its gate. The retry was part of the gate's command line: systemd, at
    the reload, no longer found the running gate in the new ExecStartPre= list ("Current
    command vanished from the unit file, execution of the command list won't be resumed"),
    and once the gate was granted the start went on to ExecStart= without `/bin/touch
    /tmp/x`. The retry now reaches the gate in the drop-in's Environment=, the line stays."""
    mark = "/tmp/x"
    _waits_with_a_line_of_its_own(container, WAITER, mark)
    config = "/etc/gpuslice/config.yaml"
    container.run(
        f"sed -i '/^gate_retry_seconds:/d' {config} && echo 'gate_retry_seconds: 2' >> {config}"
    )
    reload(container)
    assert "GPUSLICE_GATE_RETRY=2" in prop(container, WAITER, "Environment")
    assert prop(container, WAITER, "SubState") == "start-pre"
    assert container.run(f"test -e {mark}", check=False).returncode != 0  # not yet
    container.systemctl("stop", HOLDER)  # its GPU goes to WAITER: its gate passes
    _started_whole(container, WAITER, mark)
    assert VANISHED not in container.journal(WAITER)


def test_a_start_whose_annotation_went_while_it_waited_runs_its_own_exec_start_pre(
    container: Container,
) -> None:
    """WAITER's annotation is taken out and `systemctl daemon-reload` run while it waits at
    its gate: the reload takes the gate out of its ExecStartPre= list, and systemd does not
    go on with a list whose running command vanished. Let through, the start skipped
    `/bin/touch /tmp/y`. The controller restarts it instead: the `systemctl start` waiting
    for it is told it started, nothing failed, the unit ran its own line, ungated."""
    mark = "/tmp/y"
    _waits_with_a_line_of_its_own(container, WAITER, mark)
    write_job(container, WAITER, None, extra_service=f"ExecStartPre=/bin/touch {mark}")
    reload(container)
    # systemd says so: the restart, not the list it would not resume, runs the line
    wait_until(lambda: VANISHED in container.journal(WAITER), 30, what="the reload")
    _started_whole(container, WAITER, mark)
    assert prop(container, WAITER, "Result") == "success"
    assert "gpuslice-gate" not in prop(container, WAITER, "ExecStartPre")
    said = (
        f"{WAITER} is no longer annotated: its start, which waited at the gate a "
        "daemon-reload took out, is restarted unless it was stopped meanwhile"
    )
    assert said in container.journal(CONTROLLER)
    assert said in container.journal(WAITER)  # its own journal too
    assert start_count(container, WAITER) == 2  # the start, and its restart
    assert prop(container, HOLDER, "ActiveState") == "active"  # ungated: nobody stopped
