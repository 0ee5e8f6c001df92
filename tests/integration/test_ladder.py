"""The Preempt= ladder against a real systemd on pure cgroup v2: suspend, freeze, and each
failure falling to stop.

Jobs are a shell loop counting in a file (the work: its progress must pause and carry on, never
start over) with a gpu-alloc child holding the simulated VRAM; the fake cuda-checkpoint moves a
checkpointed child's allocation off the simulated GPU and back (tests/fakenvml).
"""

from __future__ import annotations

import time

import pytest

from tests.bed import fakegpu
from tests.bed.container import Container, wait_until
from tests.integration.jobs import (
    always_for,
    holders,
    main_pid,
    prop,
    reload,
    status,
    wait_journal,
    wait_restarted,
    wait_state,
)

TIMEOUT = 30.0
LADDER_CONFIG = (
    fakegpu.TEST_CONFIG
    + f"cuda_checkpoint: {fakegpu.CHECKPOINT}\ncheckpoint_lock_timeout: 1\n"
    + "suspend_host_memory_margin: 0\n"
)
VLM, VOICE = "vlm.service", "voice.service"


@pytest.fixture
def bed(unified_container: Container) -> Container:
    """gpuslice on one simulated 24 GiB GPU, with the fake cuda-checkpoint configured."""
    fakegpu.install(unified_container, 1, config=LADDER_CONFIG)
    return unified_container


def write_worker(
    bed: Container,
    name: str,
    priority: int,
    kind: str = "background",
    *,
    memory: str | None = None,
    alloc: str = "10G",
    preempt: str = "suspend stop",
) -> None:
    """A unit whose main process (sh) counts in /run/progress/NAME every 50 ms while a
    gpu-alloc child holds ALLOC on its GPU."""
    annotation = f"[X-GPUSlice]\nPriority={priority}\nType={kind}\nPreempt={preempt}\n"
    if memory is not None:
        annotation += f"Memory={memory}\n"
    loop = (
        f"{fakegpu.ALLOC} --gpu $$GPUSLICE_GPUS --bytes {alloc} & "
        "n=0; while :; do n=$$((n+1)); echo $$n > /run/progress/%N; sleep 0.05; done"
    )
    bed.write_file(
        f"{fakegpu.UNIT_DIR}/{name}",
        f"[Unit]\nDescription=worker {name}\n\n[Service]\n"
        f"Environment=FAKE_NVML_DIR={fakegpu.STATE}\nExecStartPre=/bin/mkdir -p /run/progress\n"
        f"ExecStart=/bin/sh -c '{loop}'\n\n{annotation}",
    )


def write_urgent(bed: Container, name: str = VOICE, memory: str | None = None) -> None:
    fakegpu.write_alloc_job(bed, name, 10, memory=memory, alloc="10G")


def wait_line(bed: Container, text: str) -> str:
    """The first line of gpuslice's journal containing TEXT, once there is one."""
    journal = wait_journal(bed, text, TIMEOUT)
    return next(line for line in journal.splitlines() if text in line)


def progress(bed: Container, unit: str) -> int:
    text = bed.run(f"cat /run/progress/{unit.removesuffix('.service')} 2>/dev/null || echo 0")
    return int(text.stdout.strip() or 0)


def counting(bed: Container, unit: str) -> int:
    """Wait until the unit's counter moves; its value then."""
    first = progress(bed, unit)
    return wait_until(
        lambda: ((n := progress(bed, unit)) > first and n) or None, TIMEOUT, what=f"{unit} counting"
    )


def alloc_pids(bed: Container) -> set[int]:
    return set(fakegpu.allocations(bed))


def suspended(bed: Container) -> list[str]:
    return [s["unit"] for s in status(bed).get("suspended", [])]


def start_vlm_and_preempt_it(bed: Container, preempt: str = "suspend stop") -> int:
    write_worker(bed, VLM, 90, preempt=preempt)
    write_urgent(bed)
    reload(bed)
    bed.systemctl("start", VLM)
    wait_state(bed, VLM, "active")
    counting(bed, VLM)
    pid = main_pid(bed, VLM)
    bed.systemctl("start", "--no-block", VOICE)
    wait_state(bed, VOICE, "active", TIMEOUT)
    return pid


def test_a_suspended_job_keeps_its_process_and_carries_on_where_it_was(bed: Container) -> None:
    pid = start_vlm_and_preempt_it(bed)
    line = wait_line(
        bed, "suspending vlm.service (priority 90) for voice.service (priority 10): 10 GiB "
    )
    assert "to host memory in" in line
    assert suspended(bed) == [VLM]
    assert bed.active_state(VLM) == "active"
    assert prop(bed, VLM, "FreezerState") == "frozen"
    # the urgent unit was granted only once the VRAM had left the GPU
    journal = bed.journal("gpuslice.service")
    assert journal.index("suspending vlm.service") < journal.index("starting voice.service")
    paused = progress(bed, VLM)
    time.sleep(0.5)
    assert progress(bed, VLM) == paused  # frozen: no work done, none lost
    bed.systemctl("stop", VOICE)
    wait_journal(bed, "resuming vlm.service on GPU 0 after ")
    assert counting(bed, VLM) > paused  # carries on from where it was, not from 1
    assert main_pid(bed, VLM) == pid
    assert prop(bed, VLM, "NRestarts") == "0"
    assert prop(bed, VLM, "FreezerState") == "running"
    assert len(alloc_pids(bed)) == 1  # its VRAM is back on the GPU


def test_freeze_beside_a_more_urgent_unit_that_fits_and_thaw_after(bed: Container) -> None:
    write_worker(bed, "emb.service", 90, memory="8G", alloc="8G", preempt="freeze stop")
    write_urgent(bed, memory="8G")
    reload(bed)
    bed.systemctl("start", "emb.service")
    wait_state(bed, "emb.service", "active")
    counting(bed, "emb.service")
    bed.systemctl("start", VOICE)
    wait_journal(bed, "freezing emb.service (priority 90) on GPU 0 for voice.service")
    wait_until(
        lambda: prop(bed, "emb.service", "FreezerState") == "frozen" or None, TIMEOUT, what="frozen"
    )
    assert len(alloc_pids(bed)) == 2  # it keeps its VRAM
    bed.systemctl("stop", VOICE)
    wait_journal(bed, "thawing emb.service (priority 90) on GPU 0")
    wait_until(
        lambda: prop(bed, "emb.service", "FreezerState") == "running" or None, TIMEOUT, what="thaw"
    )
    counting(bed, "emb.service")


def test_a_unit_thawed_by_hand_runs_again_beside_the_urgent_one(bed: Container) -> None:
    write_worker(bed, "emb.service", 90, memory="8G", alloc="8G", preempt="freeze stop")
    write_urgent(bed, memory="8G")
    reload(bed)
    bed.systemctl("start", "emb.service")
    wait_state(bed, "emb.service", "active")
    bed.systemctl("start", VOICE)
    wait_journal(bed, "freezing emb.service (priority 90) on GPU 0 for voice.service")
    wait_until(
        lambda: prop(bed, "emb.service", "FreezerState") == "frozen" or None, TIMEOUT, what="frozen"
    )
    bed.systemctl("thaw", "emb.service")
    wait_journal(bed, "emb.service (priority 90) was thawed outside gpuslice: it runs beside")
    assert [
        h["state"] for h in status(bed)["gpus"][0]["holders"] if h["unit"] == "emb.service"
    ] == ["running"]
    counting(bed, "emb.service")


def test_a_unit_frozen_by_hand_chosen_for_suspend_is_stopped_not_thawed(bed: Container) -> None:
    """An admin's `systemctl freeze`: the suspend is not tried (its lock timed out in the
    frozen processes, and the undo thawed them), the next rung, a stop, follows."""
    write_worker(bed, VLM, 90)
    write_urgent(bed)
    reload(bed)
    bed.systemctl("start", VLM)
    wait_state(bed, VLM, "active")
    counting(bed, VLM)
    bed.systemctl("freeze", VLM)  # an admin's
    bed.systemctl("start", "--no-block", VOICE)
    line = wait_line(bed, "frozen already, by someone else")
    assert "theirs to thaw" in line
    wait_state(bed, VOICE, "active", TIMEOUT)
    wait_state(bed, VLM, "inactive", TIMEOUT)  # stopped (systemd thaws what it stops)
    assert "thawing vlm.service" not in bed.journal("gpuslice.service")


@pytest.mark.parametrize(
    ("prepare", "why"),
    [
        pytest.param(
            f"touch {fakegpu.STATE}/inject/lock-timeout",
            "lock of PID",
            id="lock-timeout",
        ),
        pytest.param(
            f"touch {fakegpu.STATE}/inject/refuse",
            "refused to lock PID",
            id="tool-refuses",
        ),
        pytest.param(
            f"rm {fakegpu.CHECKPOINT}",
            "is not an executable file",
            id="no-cuda-checkpoint",
        ),
    ],
)
def test_each_failure_falls_to_stop_with_one_line_saying_why(
    bed: Container, prepare: str, why: str
) -> None:
    bed.run(f"mkdir -p {fakegpu.STATE}/inject && {prepare}")
    start_vlm_and_preempt_it(bed)
    line = wait_line(bed, "cannot suspend vlm.service (priority 90) for voice.service")
    assert why in line and line.endswith("trying stop instead"), line
    assert bed.active_state(VLM) in ("inactive", "activating")  # stopped (then waits to return)
    assert suspended(bed) == []
    bed.run(f"rm -rf {fakegpu.STATE}/inject")
    bed.systemctl("stop", VOICE)
    wait_state(bed, VLM, "active", TIMEOUT)  # requeued as before: restarted from the start


def test_a_restore_that_runs_out_of_memory_stops_the_unit_and_requeue_restarts_it(
    bed: Container,
) -> None:
    pid = start_vlm_and_preempt_it(bed)
    wait_journal(bed, "suspending vlm.service (priority 90) for voice.service (priority 10): ")
    bed.run(f"mkdir -p {fakegpu.STATE}/inject && touch {fakegpu.STATE}/inject/restore-oom")
    bed.systemctl("stop", VOICE)
    line = wait_line(bed, "vlm.service (priority 90) could not be resumed on GPU 0: ")
    assert "ran out of GPU memory" in line, line
    assert line.endswith("stopping it (Requeue= decides whether it starts again)"), line
    bed.run(f"rm -rf {fakegpu.STATE}/inject")
    wait_journal(bed, "restarting preempted vlm.service (priority 90)")
    wait_until(
        lambda: (bed.active_state(VLM) == "active" and main_pid(bed, VLM) not in (0, pid)) or None,
        TIMEOUT,
        what="vlm.service restarted with a new main process",
    )
    assert suspended(bed) == []


def test_kill_9_of_the_controller_while_a_unit_is_suspended_then_resume(bed: Container) -> None:
    pid = start_vlm_and_preempt_it(bed)
    wait_journal(bed, "suspending vlm.service (priority 90) for voice.service (priority 10): ")
    controller = main_pid(bed, "gpuslice.service")
    bed.systemctl("kill", "--signal=SIGKILL", "gpuslice.service")
    wait_restarted(bed, "gpuslice.service", controller, TIMEOUT)  # Restart=on-failure
    assert suspended(bed) == [VLM]  # found from its state file
    bed.systemctl("stop", VOICE)
    wait_journal(bed, "resuming vlm.service on GPU 0 after ")
    assert main_pid(bed, VLM) == pid
    counting(bed, VLM)


def test_a_suspended_unit_stopped_by_hand_is_held_and_not_resumed(bed: Container) -> None:
    start_vlm_and_preempt_it(bed)
    wait_journal(bed, "suspending vlm.service (priority 90) for voice.service (priority 10): ")
    bed.systemctl("stop", VLM)  # systemd thaws it first
    wait_state(bed, VLM, "inactive")
    wait_journal(bed, "vlm.service was stopped outside gpuslice: held until started again")
    bed.systemctl("stop", VOICE)
    # once the controller has taken in voice's stop (a guessed sleep once stood here), vlm
    # stays down over a window
    wait_until(lambda: VOICE not in holders(bed)[0] or None, TIMEOUT, what=f"{VOICE} gone")

    def stays_down() -> None:
        assert bed.active_state(VLM) == "inactive"
        assert suspended(bed) == []

    always_for(stays_down, 1.0)


def test_two_suspended_units_come_back_most_urgent_first(bed: Container) -> None:
    write_worker(bed, "a.service", 80, memory="10G")
    write_worker(bed, "b.service", 90, memory="10G")
    fakegpu.write_alloc_job(bed, "u1.service", 10, memory="12G")
    fakegpu.write_alloc_job(bed, "u2.service", 20, memory="12G")
    reload(bed)
    for unit in ("a.service", "b.service"):
        bed.systemctl("start", unit)
        wait_state(bed, unit, "active")
    bed.systemctl("start", "u1.service")
    wait_state(bed, "u1.service", "active", TIMEOUT)
    bed.systemctl("start", "u2.service")
    wait_state(bed, "u2.service", "active", TIMEOUT)
    assert sorted(suspended(bed)) == ["a.service", "b.service"]
    bed.systemctl("stop", "u1.service")  # 12 GiB free: room for one, the more urgent
    wait_journal(bed, "resuming a.service on GPU 0 after ")
    assert suspended(bed) == ["b.service"]
    bed.systemctl("stop", "u2.service")
    wait_journal(bed, "resuming b.service on GPU 0 after ")
    counting(bed, "b.service")


def test_on_cgroup_v1_suspend_falls_to_stop(container: Container) -> None:
    """The hybrid hierarchy (this host's default): systemd cannot freeze, so no suspend."""
    fakegpu.install(container, 1, config=LADDER_CONFIG)
    start_vlm_and_preempt_it(container)
    line = wait_line(container, "cannot suspend vlm.service (priority 90) for voice.service")
    assert "cgroup v1" in line


# what a controller killed between saving a thaw and sending its ThawUnit leaves behind: the
# unit saved running (its freeze forgotten), and owed a thaw
LOSE_THE_THAW = r"""
import json, sys
path, unit = "/var/lib/gpuslice/state.json", sys.argv[1]
state = json.load(open(path))
state["holders"][unit][1] = "running"
state["frozen_for"].pop(unit, None)
state["thaw_owed"] = [unit]
json.dump(state, open(path, "w"))
"""


def test_a_thaw_the_last_controller_saved_but_never_sent_is_sent_by_the_next(
    bed: Container,
) -> None:
    """Killed between saving its decision to thaw a unit and sending the ThawUnit, the
    controller leaves a state that says the unit runs while systemd shows it frozen: the next
    controller thaws it at start-up, saying why. A unit an admin froze by hand meanwhile is
    left frozen."""
    write_urgent(bed, memory="8G")
    fakegpu.write_alloc_job(bed, "other.service", 50, memory="2G", alloc="2G")
    reload(bed)
    bed.systemctl("start", "other.service")  # first: emb is not frozen beside it
    write_worker(bed, "emb.service", 90, memory="8G", alloc="8G", preempt="freeze stop")
    reload(bed)
    wait_state(bed, "emb.service", "active")
    bed.systemctl("start", VOICE)
    wait_journal(bed, "freezing emb.service (priority 90) on GPU 0 for voice.service")
    wait_until(
        lambda: prop(bed, "emb.service", "FreezerState") == "frozen" or None, TIMEOUT, what="frozen"
    )
    bed.systemctl("stop", "gpuslice.service")
    bed.run(["python3", "-c", LOSE_THE_THAW, "emb.service"])
    bed.systemctl("freeze", "other.service")  # an admin's
    bed.systemctl("start", "gpuslice.service")
    wait_journal(
        bed,
        "thawed emb.service: systemd showed it frozen, and gpuslice, which froze it, no longer "
        "holds it frozen",
    )
    assert prop(bed, "emb.service", "FreezerState") == "running"
    counting(bed, "emb.service")
    time.sleep(1)  # a sample or two later
    assert prop(bed, "other.service", "FreezerState") == "frozen"


HANGING_LOCK = "/usr/local/lib/fakenvml/cuda-checkpoint-hanging-lock"


def test_a_lock_whose_client_times_out_has_its_service_stopped_before_the_undo(
    bed: Container,
) -> None:
    """The lock hangs: systemd-run is killed at the client's deadline (lock timeout + grace),
    which does not end its transient service. The named service is stopped before the undo,
    so no lock can land after it: nothing of it is left running."""
    bed.write_file(
        HANGING_LOCK,
        '#!/bin/sh\ncase "$*" in --action\\ lock*) exec sleep 600 ;; esac\n'
        f'exec {fakegpu.CHECKPOINT} "$@"\n',
    )
    bed.run(["chmod", "755", HANGING_LOCK])
    bed.write_file(fakegpu.CONFIG, LADDER_CONFIG.replace(fakegpu.CHECKPOINT, HANGING_LOCK))
    fakegpu.restart_gpuslice(bed)
    start_vlm_and_preempt_it(bed)
    line = wait_line(bed, "cannot suspend vlm.service (priority 90) for voice.service")
    assert "lock of PID" in line and line.endswith("trying stop instead"), line
    journal = bed.run("journalctl --no-pager -o cat -u 'gpuslice-checkpoint-lock-*'").stdout
    assert "gpuslice: cuda-checkpoint --action lock" in journal, journal
    units = bed.run(
        "systemctl list-units --all --plain --no-legend 'gpuslice-checkpoint-*' --state=active"
    ).stdout
    assert units.strip() == "", units
    assert bed.run("pgrep -x sleep -a | grep -c 'sleep 600' || true").stdout.strip() == "0"


def test_a_frozen_unit_restarted_by_hand_starts_again(bed: Container) -> None:
    """`systemctl restart` of a unit frozen beside a more urgent one: systemd thaws it, stops
    it and starts it again in one job, with no moment down and jobless between, so only the
    new start at its gate tells that the frozen run ended. Taken for the frozen unit, that
    gate was never answered: the restart waited in start-pre for ever. It is granted (beside
    voice.service, where it fits, and frozen there again)."""
    write_worker(bed, "emb.service", 90, memory="8G", alloc="8G", preempt="freeze stop")
    write_urgent(bed, memory="8G")
    reload(bed)
    bed.systemctl("start", "emb.service")
    wait_state(bed, "emb.service", "active")
    old = main_pid(bed, "emb.service")
    bed.systemctl("start", VOICE)
    wait_journal(bed, "freezing emb.service (priority 90) on GPU 0 for voice.service")
    wait_until(
        lambda: prop(bed, "emb.service", "FreezerState") == "frozen" or None, TIMEOUT, what="frozen"
    )
    bed.systemctl("restart", "--no-block", "emb.service")
    wait_until(
        lambda: prop(bed, "emb.service", "SubState") == "running" or None,
        TIMEOUT,
        what="emb.service past its gate again",
    )
    assert main_pid(bed, "emb.service") != old
    bed.systemctl("stop", VOICE)
    wait_until(
        lambda: prop(bed, "emb.service", "FreezerState") == "running" or None, TIMEOUT, what="thaw"
    )
    counting(bed, "emb.service")


def test_a_suspended_unit_restarted_by_hand_is_a_new_start_not_resumed(bed: Container) -> None:
    """`systemctl restart` of a suspended unit ends the suspended run (systemd thaws it to
    stop it): its new start waits at its gate for GPU 0 like any start and is granted once
    voice.service leaves, with nothing "resumed" (no restore of the ended run's PIDs)."""
    old = start_vlm_and_preempt_it(bed)
    wait_journal(bed, "suspending vlm.service (priority 90) for voice.service (priority 10): ")
    bed.systemctl("restart", "--no-block", VLM)
    wait_until(
        lambda: prop(bed, VLM, "SubState") == "start-pre" or None, TIMEOUT, what="vlm at its gate"
    )
    wait_until(lambda: suspended(bed) == [] or None, TIMEOUT, what="vlm no longer suspended")
    bed.systemctl("stop", VOICE)
    wait_state(bed, VLM, "active", TIMEOUT)
    wait_until(lambda: prop(bed, VLM, "SubState") == "running" or None, TIMEOUT, what="running")
    assert main_pid(bed, VLM) != old
    counting(bed, VLM)
    assert "resuming vlm.service" not in bed.journal("gpuslice.service")


def test_a_lock_left_running_by_a_killed_controller_is_stopped_before_the_resume(
    bed: Container,
) -> None:
    """The controller is killed (kill -9) while a lock of vlm.service's process runs as a
    transient service: systemd-run died with it, the service did not. The next controller
    resumes vlm.service (recover) and first stops that service, well before its
    RuntimeMaxSec= (35 s here) would: a lock landing after the resume read the process left
    the job locked, its CUDA calls blocked, while it counted as resumed."""
    bed.write_file(
        HANGING_LOCK,
        "#!/bin/sh\n"
        'case "$*" in --action\\ lock*) [ -e /run/hung-once ] || { touch /run/hung-once; '
        "exec sleep 600; } ;; esac\n"
        f'exec {fakegpu.CHECKPOINT} "$@"\n',
    )
    bed.run(["chmod", "755", HANGING_LOCK])
    config = LADDER_CONFIG.replace(fakegpu.CHECKPOINT, HANGING_LOCK)
    bed.write_file(fakegpu.CONFIG, config.replace("lock_timeout: 1", "lock_timeout: 30"))
    fakegpu.restart_gpuslice(bed)
    write_worker(bed, VLM, 90)
    write_urgent(bed)
    reload(bed)
    bed.systemctl("start", VLM)
    wait_state(bed, VLM, "active")
    pid = main_pid(bed, VLM)
    bed.systemctl("start", "--no-block", VOICE)  # waits while the lock hangs
    listed = "systemctl list-units --all --plain --no-legend 'gpuslice-checkpoint-lock-*'"
    lock = wait_until(
        lambda: bed.run(f"{listed} --state=active").stdout.split()[:1] or None,
        TIMEOUT,
        what="the lock running",
    )[0]
    controller = main_pid(bed, "gpuslice.service")
    bed.systemctl("kill", "--signal=SIGKILL", "gpuslice.service")
    wait_restarted(bed, "gpuslice.service", controller, TIMEOUT)  # Restart=on-failure
    wait_until(
        lambda: bed.active_state(lock) != "active" or None, 15, what=f"{lock} stopped by then"
    )
    wait_journal(bed, "resuming vlm.service on GPU 0 after a controller restart", TIMEOUT)
    assert main_pid(bed, VLM) == pid
    wait_state(bed, VOICE, "active", TIMEOUT)  # vlm.service suspended again, this time whole


def test_release_jobs_in_a_container_thaws_what_the_controller_froze(bed: Container) -> None:
    """`gpuslice release-jobs` (the Debian prerm's, unsandboxed) judges this boot as the
    controller did: inside a container, sandboxed gpuslice.service reads the host kernel's
    boot id and the prerm the container's own, so it took the saved state for another boot's
    and left the unit frozen for good after `apt remove` (the boot record fixes that)."""
    write_worker(bed, "emb.service", 90, memory="8G", alloc="8G", preempt="freeze stop")
    write_urgent(bed, memory="8G")
    reload(bed)
    bed.systemctl("start", "emb.service")
    wait_state(bed, "emb.service", "active")
    bed.systemctl("start", VOICE)
    wait_until(
        lambda: prop(bed, "emb.service", "FreezerState") == "frozen" or None, TIMEOUT, what="frozen"
    )
    bed.systemctl("stop", "gpuslice.service")  # running jobs are left alone: still frozen
    assert prop(bed, "emb.service", "FreezerState") == "frozen"
    released = bed.run(["gpuslice", "release-jobs"], check=False)
    said = released.stdout + released.stderr
    wait_until(
        lambda: prop(bed, "emb.service", "FreezerState") == "running" or None,
        TIMEOUT,
        what=f"emb.service thawed by release-jobs (it said: {said!r})",
    )
    counting(bed, "emb.service")
