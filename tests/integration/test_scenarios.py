"""The controller's contract, played against a real systemd, D-Bus and journald.

Every test drives only `systemctl`, `journalctl` and `gpuslice` inside a freshly booted
container, as a user would.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.bed.container import Container, wait_until
from tests.integration.jobs import (
    always_for,
    describe,
    holders,
    main_pid,
    prop,
    reload,
    reload_config,
    start_count,
    status,
    unit_states,
    wait_answer,
    wait_journal,
    wait_started,
    wait_state,
    wait_sub,
    write_job,
)

VLM = "vlm-analysis.service"
VOICE = "voice-pipeline.service"
MID = "embeddings.service"


def test_seed_timeline(container: Container) -> None:
    """Background runs; on-demand preempts it through systemd; background returns by itself."""
    write_job(container, VLM, 90, "background")
    # long enough for the checks below to read the state while it runs, on a loaded host:
    # each `gpuslice status` is a Python start (2 s was once too short on a busy CI machine)
    write_job(container, VOICE, 10, seconds=6)
    reload(container)
    wait_state(container, VLM, "active")
    assert holders(container) == {0: [VLM]}

    out = container.run(f"date +%s.%N; systemctl start {VOICE}; date +%s.%N").stdout.split()
    asked, returned = map(float, out)
    # Type=simple: `systemctl start` returns at fork; the job stamps itself just after exec
    ran = float(
        wait_until(
            lambda: container.run(f"cat /run/{VOICE}.start", check=False).stdout.strip() or None,
            30,
            what=f"{VOICE} to record its start",
        )
    )
    assert prop(container, VLM, "ActiveState") == "inactive"
    seen = status(container)  # one answer: the holder and the preempted unit of one moment
    assert {g["index"]: [h["unit"] for h in g["holders"]] for g in seen["gpus"]} == {0: [VOICE]}
    assert seen["preempted"] == [{"unit": VLM, "priority": 90, "requeue": True}]
    print(
        f"start -> main process running: {(ran - asked) * 1000:.1f} ms; "
        f"systemctl start returned after {(returned - asked) * 1000:.1f} ms"
    )
    wait_journal(
        container,
        "preempting vlm-analysis.service (priority 90) for voice-pipeline.service "
        "(priority 10) on GPU 0",
    )
    wait_state(container, VOICE, "inactive")
    wait_state(container, VLM, "active")
    assert holders(container) == {0: [VLM]}
    assert VOICE in status(container)["finished"]
    assert "Stopped vlm-analysis.service" in container.journal(VLM)  # through systemd


def test_plan_says_what_a_start_would_do_and_does_nothing(container: Container) -> None:
    """`gpuslice plan UNIT` (as root): the start's decisions in the journal's words, and no
    change: the background unit keeps running, nothing is preempted."""
    write_job(container, VLM, 90, "background")
    write_job(container, VOICE, 10)
    reload(container)
    wait_state(container, VLM, "active")
    out = container.run(["gpuslice", "plan", "voice-pipeline"]).stdout.splitlines()
    assert out == [
        f"{VOICE} (priority 10) would start on GPU 0 once {VLM} gave way",
        f"  preempting {VLM} (priority 90) for {VOICE} (priority 10) on GPU 0",
        f"  {VOICE} waiting for {VLM} (priority 90) to stop on GPU 0",
    ], out

    def nothing_moved() -> None:
        assert prop(container, VLM, "ActiveState") == "active"
        assert prop(container, VOICE, "ActiveState") == "inactive"

    always_for(nothing_moved, 1.0)
    assert "preempting" not in container.journal("gpuslice.service")
    assert status(container)["waiting"] == []
    held = json.loads(container.run(["gpuslice", "plan", "--json", VLM]).stdout)
    assert (held["verdict"], held["phase"], held["gpus"]) == ("holds", "running", [0])
    unmanaged = container.run(["gpuslice", "plan", "dbus.service"], check=False)
    assert unmanaged.returncode == 1
    assert "dbus.service is not managed by gpuslice" in unmanaged.stderr, unmanaged.stderr


def test_equal_priority_waits_then_runs(container: Container) -> None:
    write_job(container, "a.service", 20)
    write_job(container, "b.service", 20)
    reload(container)
    container.systemctl("start", "a.service")
    pid = main_pid(container, "a.service")
    container.systemctl("start", "--no-block", "b.service")
    wait_sub(container, "b.service", "start-pre")
    v1 = ("unit", "priority", "reason")  # the keys of JSON version 1; later ones are added
    expected = [
        {
            "unit": "b.service",
            "priority": 20,
            "reason": "waiting: GPU 0 held by a.service, priority 20",
        }
    ]
    # the controller decides from systemd's signals, which may reach it after `systemctl`
    # shows start-pre: one answer, once it says so, checked whole
    waiting = wait_answer(
        lambda: status(container)["waiting"],
        lambda w: [{k: x[k] for k in v1} for x in w] == expected,
        20,
        "b.service waiting behind a.service",
    )
    assert waiting[0]["position"] == 1 and waiting[0]["since"] > 0
    assert (waiting[0]["decision"]["code"], waiting[0]["decision"]["parts"][0]["unit"]) == (
        "wait",
        "a.service",
    )
    assert main_pid(container, "a.service") == pid  # never preempted
    container.systemctl("stop", "a.service")
    wait_state(container, "b.service", "active")
    assert holders(container) == {0: ["b.service"]}


def test_three_levels(container: Container) -> None:
    """50 preempts 90, yields to 10; after 10 ends 50 returns, and 90 returns last."""
    write_job(container, VLM, 90, "background")
    write_job(container, MID, 50, seconds=3)
    # voice must still run for a `systemctl show` and a `gpuslice status` (a Python start, up
    # to ~1 s on a loaded host) after its start: 1 s was not enough
    write_job(container, VOICE, 10, seconds=4)
    reload(container)
    wait_state(container, VLM, "active")
    container.systemctl("start", MID)
    assert prop(container, VLM, "ActiveState") == "inactive"
    container.systemctl("start", VOICE)
    assert prop(container, MID, "ActiveState") == "inactive"
    assert holders(container) == {0: [VOICE]}
    wait_state(container, MID, "active")  # requeued once voice is done
    assert prop(container, VLM, "ActiveState") == "inactive"
    wait_state(container, MID, "inactive")
    wait_state(container, VLM, "active")
    journal = container.journal("gpuslice.service")
    assert journal.index("restarting preempted embeddings.service") < journal.index(
        "restarting preempted vlm-analysis.service"
    )


def test_boot_fills_gpu_with_best_background_unit(bare_container: Container) -> None:
    write_job(bare_container, "low.service", 95, "background")
    write_job(bare_container, "best.service", 80, "background")
    write_job(bare_container, "demand.service", 1)
    bare_container.install_gpuslice()
    wait_state(bare_container, "best.service", "active")
    assert holders(bare_container) == {0: ["best.service"]}

    def only_best_runs() -> None:
        assert prop(bare_container, "low.service", "ActiveState") == "inactive"
        assert prop(bare_container, "demand.service", "ActiveState") == "inactive"

    always_for(only_best_runs, 1.5)  # not started: over a window, not at one instant


def test_manual_stop_holds(container: Container) -> None:
    write_job(container, VLM, 90, "background")
    write_job(container, VOICE, 10, seconds=1)
    reload(container)
    wait_state(container, VLM, "active")
    container.systemctl("stop", VLM)
    wait_journal(container, "vlm-analysis.service was stopped outside gpuslice")
    assert status(container)["held"] == [VLM]
    container.systemctl("start", VOICE)  # a full cycle of events: the GPU frees again
    wait_state(container, VOICE, "inactive")
    container.systemctl("restart", "gpuslice.service")
    assert status(container)["held"] == [VLM]
    always_for(lambda: _assert_state(container, VLM, "inactive"), 1.5)
    container.systemctl("start", VLM)  # starting it by hand lifts the hold
    assert status(container)["held"] == []
    assert holders(container) == {0: [VLM]}


def test_crashing_background_unit_does_not_storm(container: Container) -> None:
    write_job(container, "crash.service", 90, "background", exec_start="/bin/false")
    write_job(container, VOICE, 10, seconds=1)
    reload(container)
    wait_state(container, "crash.service", "failed")
    container.systemctl("start", VOICE)
    wait_state(container, VOICE, "inactive")
    wait_journal(container, "voice-pipeline.service finished")
    assert start_count(container, "crash.service") == 1
    assert status(container)["failed"] == ["crash.service"]


def test_kill_9_of_controller_mid_wait_loses_nothing(container: Container) -> None:
    write_job(container, "holder.service", 10)
    write_job(container, "waiter.service", 10)
    reload(container)
    container.systemctl("start", "holder.service")
    pid = main_pid(container, "holder.service")
    container.systemctl("start", "--no-block", "waiter.service")
    wait_sub(container, "waiter.service", "start-pre")
    controller = main_pid(container, "gpuslice.service")
    container.run(["kill", "-9", str(controller)])
    wait_until(
        lambda: main_pid(container, "gpuslice.service") not in (0, controller) or None,
        20,
        what="gpuslice.service restarted by systemd",
    )
    wait_state(container, "gpuslice.service", "active")
    assert main_pid(container, "holder.service") == pid
    assert prop(container, "waiter.service", "SubState") == "start-pre"
    assert holders(container) == {0: ["holder.service"]}
    container.systemctl("stop", "holder.service")
    wait_state(container, "waiter.service", "active")
    assert holders(container) == {0: ["waiter.service"]}


def test_bad_annotation_is_reported_and_ignored(container: Container) -> None:
    write_job(container, "bad.service", "high")
    write_job(container, "good.service", 10)
    reload(container)
    check = container.run(["gpuslice", "check"], check=False)
    assert check.returncode == 1
    assert (
        "/etc/systemd/system/bad.service:9: [X-GPUSlice] Priority: expected an integer "
        '0-999, got "high"' in check.stderr
    )
    wait_journal(container, "bad.service:9: [X-GPUSlice] Priority: expected an integer 0-999")
    assert prop(container, "gpuslice.service", "ActiveState") == "active"
    container.systemctl("start", "bad.service")  # unmanaged: starts ungated
    container.systemctl("start", "good.service")
    assert holders(container) == {0: ["good.service"]}


def test_a_running_unit_whose_annotation_goes_keeps_its_gpu_until_it_ends(
    container: Container,
) -> None:
    """Its job still runs on GPU 0: a start of the same priority waits for it instead of
    joining it there (it used to be granted at once), and runs once it has ended."""
    write_job(container, "a.service", 20)
    write_job(container, "b.service", 20)
    reload(container)
    container.systemctl("start", "a.service")
    pid = main_pid(container, "a.service")
    write_job(container, "a.service", None)  # the annotation goes
    reload(container)
    wait_journal(container, "a.service is no longer annotated: it keeps GPU 0 until it ends")
    container.systemctl("start", "--no-block", "b.service")
    wait_sub(container, "b.service", "start-pre")
    assert holders(container) == {0: ["a.service"]}
    assert main_pid(container, "a.service") == pid  # never preempted: as urgent
    container.systemctl("stop", "a.service")
    wait_state(container, "b.service", "active")
    assert holders(container) == {0: ["b.service"]}


def test_template_instances(container: Container) -> None:
    write_job(container, VLM, 90, "background")
    write_job(container, "worker@.service", 10)
    write_job(container, "gpu\\x2dworker@.service", 5)
    reload(container)
    wait_state(container, VLM, "active")
    container.systemctl("start", "worker@a.service")
    assert holders(container) == {0: ["worker@a.service"]}
    container.systemctl("start", "gpu\\x2dworker@b.service")
    assert holders(container) == {0: ["gpu\\x2dworker@b.service"]}
    assert "worker@a.service" in [p["unit"] for p in status(container)["preempted"]]


def test_enroll_existing_unit(container: Container) -> None:
    write_job(container, VLM, 90, "background")
    write_job(container, "plain.service", None)
    reload(container)
    wait_state(container, VLM, "active")
    out = container.run(["gpuslice", "enroll", "plain.service", "--priority", "5"]).stdout
    assert "enrolled plain.service (priority 5)" in out
    container.systemctl("start", "plain.service")
    assert prop(container, VLM, "ActiveState") == "inactive"
    assert holders(container) == {0: ["plain.service"]}


def test_two_gpus_and_a_two_gpu_unit(container: Container) -> None:
    container.write_file("/etc/gpuslice/config.yaml", "gpus: 2\n")
    write_job(container, "bg1.service", 90, "background")
    write_job(container, "bg2.service", 91, "background")
    # long enough for the four checks after its start (a status among them: a Python start)
    write_job(container, "big.service", 10, gpus=2, seconds=5)
    reload(container)
    container.systemctl("restart", "gpuslice.service")
    wait_state(container, "bg1.service", "active")
    wait_state(container, "bg2.service", "active")
    container.systemctl("start", "big.service")
    assert prop(container, "bg1.service", "ActiveState") == "inactive"
    assert prop(container, "bg2.service", "ActiveState") == "inactive"
    assert holders(container) == {0: ["big.service"], 1: ["big.service"]}
    env = container.run("cat /run/gpuslice/env/big.service/gpuslice.env").stdout
    assert "CUDA_VISIBLE_DEVICES=0,1" in env
    wait_state(container, "big.service", "inactive")
    wait_state(container, "bg1.service", "active")
    wait_state(container, "bg2.service", "active")


def test_cancelled_wait_leaves_no_reservation(container: Container) -> None:
    write_job(container, "holder.service", 10)
    write_job(container, "waiter.service", 10)
    write_job(container, VLM, 90, "background")
    reload(container)
    container.systemctl("start", "holder.service")
    container.systemctl("start", "--no-block", "waiter.service")
    wait_sub(container, "waiter.service", "start-pre")
    container.systemctl("stop", "waiter.service")
    # vlm may wait at its gate too (displaced by holder before its gate was answered); the
    # controller hears of the stop from systemd's signals, a moment after it is done
    wait_answer(
        lambda: [w["unit"] for w in status(container)["waiting"]],
        lambda units: "waiter.service" not in units,
        20,
        "waiter.service gone from the waiting list",
    )
    container.systemctl("stop", "holder.service")
    wait_state(container, VLM, "active")  # the free GPU was not kept for the cancelled start


def test_bad_config_on_reload_keeps_the_last_good_one(container: Container) -> None:
    """`systemctl reload gpuslice` fails on a file the controller would reject, saying why,
    and the controller is not disturbed; a SIGHUP that gets through anyway (the file changed
    after the check) keeps the last good configuration."""
    container.write_file("/etc/gpuslice/config.yaml", "gpus: 2\n")
    container.systemctl("restart", "gpuslice.service")
    assert len(status(container)["gpus"]) == 2
    pid = prop(container, "gpuslice.service", "MainPID")
    container.write_file("/etc/gpuslice/config.yaml", "gpus: 2\nlog_level: loud\n")
    said = (
        '/etc/gpuslice/config.yaml:2: log_level: invalid value "loud" '
        "(allowed: debug, info, warning, error)"
    )
    reload = container.systemctl("reload", "gpuslice.service", check=False)
    assert reload.returncode != 0, reload
    wait_journal(container, f"error: {said}")  # `journalctl -u gpuslice` says why
    assert "keeping the last good" not in container.journal("gpuslice.service")  # no SIGHUP
    assert prop(container, "gpuslice.service", "ActiveState") == "active"
    assert prop(container, "gpuslice.service", "MainPID") == pid
    container.systemctl("kill", "--signal=HUP", "gpuslice.service")
    wait_journal(container, f"keeping the last good configuration: {said}")
    assert prop(container, "gpuslice.service", "ActiveState") == "active"
    assert len(status(container)["gpus"]) == 2
    check = container.run(["gpuslice", "check"], check=False)
    assert check.returncode == 1
    assert "config.yaml:2: log_level" in check.stderr


def test_rapid_handovers_never_lose_a_start(container: Container) -> None:
    """An instant on-demand job started 25 times against a background unit: every start
    passes its gate (a stale state read once made the controller forget a waiter)."""
    # 25 preemptions in a few seconds: far beyond systemd's default start rate limit (5 in
    # 10 s), which gpuslice resets for the units it brings back itself. quick.service is
    # started by hand 25 times: its own limit is lifted, or the faster the handover the
    # likelier systemd refuses it ("start request repeated too quickly"), gpuslice or not.
    write_job(container, VLM, 90, "background")
    write_job(
        container, "quick.service", 10, exec_start="/bin/true", extra_unit="StartLimitIntervalSec=0"
    )
    reload(container)
    wait_state(container, VLM, "active")
    out = container.run(
        "for i in $(seq 25); do timeout 20 systemctl start quick.service || echo LOST $i; done",
        timeout=200,
    ).stdout
    assert "LOST" not in out
    wait_state(container, VLM, "active")
    data = status(container)
    assert (data["waiting"], data["held"], data["failed"]) == ([], [], [])
    assert "running without enough free GPUs" not in container.journal("gpuslice.service")


def test_holds_survive_a_reboot(bed_tree: Path) -> None:
    """A unit stopped by hand stays held in the next boot; a finished one runs again.

    The container's root is a throwaway overlay, so the "reboot" is a second container that
    boots with the first one's /var/lib/gpuslice."""
    with Container(bed_tree) as first:
        first.install_gpuslice()
        write_job(first, VLM, 90, "background")
        write_job(first, "done.service", 80, "background", seconds=1)
        reload(first)
        wait_started(first, "done.service")  # it runs 1 s: a poll of its state may miss it
        wait_journal(first, "done.service finished")
        wait_state(first, VLM, "active")
        first.systemctl("stop", VLM)
        wait_journal(first, "vlm-analysis.service was stopped outside gpuslice")
        state = first.run("cat /var/lib/gpuslice/state.json").stdout
    with Container(bed_tree) as second:
        write_job(second, VLM, 90, "background")
        write_job(second, "done.service", 80, "background", seconds=1)
        second.write_file("/var/lib/gpuslice/state.json", state)
        second.install_gpuslice()
        wait_journal(second, "done.service finished")  # finished last boot: runs again
        assert status(second)["held"] == [VLM]
        always_for(lambda: _assert_state(second, VLM, "inactive"), 1.5)


def _assert_state(bed: Container, unit: str, state: str) -> None:
    assert prop(bed, unit, "ActiveState") == state


def test_a_start_job_queued_behind_another_unit_preempts_before_its_gate_runs(
    container: Container,
) -> None:
    """voice-pipeline's start job waits for a slow unit it is ordered after (After=): systemd
    announces the job at once, and the controller stops the background unit then, not when
    the gate runs 10 s later; a `systemctl stop` of an inactive urgent unit stops nothing."""
    write_job(container, VLM, 90, "background")
    container.write_file(
        "/etc/systemd/system/slow-prep.service",
        "[Service]\nType=oneshot\nExecStart=/bin/sleep 10\n",
    )
    write_job(container, VOICE, 10, extra_unit="Wants=slow-prep.service\nAfter=slow-prep.service")
    reload(container)
    wait_state(container, VLM, "active")

    def vlm_runs() -> None:
        assert prop(container, VLM, "ActiveState") == "active"

    container.systemctl("stop", VOICE)  # a stop job for an inactive unit: nothing moves
    always_for(vlm_runs, 1.0)
    container.systemctl("start", "--no-block", VOICE)
    # the first instant of systemd's state (one call) that shows vlm down must show the prep
    # still running and voice's start job still waiting: read apart, the prep's 10 s could
    # run out between the questions on a loaded host
    units = [VLM, "slow-prep.service", VOICE]
    seen = wait_answer(
        lambda: unit_states(container, units),
        lambda t: t[VLM]["ActiveState"] == "inactive",
        20,
        f"{VLM} inactive",
    )
    assert seen["slow-prep.service"]["ActiveState"] == "activating", seen  # the prep still runs
    assert seen[VOICE]["SubState"] == "dead", seen  # its start job still waits
    # slow-prep sleeps 10 s before voice's start goes on: 15 s left 5 s for the rest
    wait_state(container, VOICE, "active", timeout=40)
    assert holders(container) == {0: [VOICE]}


def test_with_requeue_at_gate_a_preempted_unit_waits_at_its_gate_in_systemds_job_queue(
    container: Container,
) -> None:
    """config.yaml `requeue_at_gate: true` (read at `systemctl reload gpuslice`): the
    preempted unit is restarted at once and waits at its gate, where `systemctl` shows it,
    then comes back by a grant alone; a TimeoutStartSec= that ends its wait brings it back
    once the GPU is free."""
    config = "/etc/gpuslice/config.yaml"
    container.run(f"sed -i 's/^requeue_at_gate: false$/requeue_at_gate: true/' {config}")
    reload_config(container)
    write_job(container, VLM, 90, "background")
    # an admin's drop-in: after the generator's gpuslice-gate.conf, so it overrides
    container.write_file(
        f"/etc/systemd/system/{VLM}.d/timeout.conf", "[Service]\nTimeoutStartSec=3\n"
    )
    write_job(container, VOICE, 10, seconds=5)
    reload(container)
    wait_state(container, VLM, "active")
    container.systemctl("start", VOICE)
    # one instant of systemd's state: TimeoutStartSec=3 ends vlm's wait at its gate, which
    # three questions in a row could outlast on a loaded host; its Job is the start job in
    # systemd's queue that `systemctl list-jobs` lists
    seen = wait_answer(
        lambda: unit_states(container, [VLM])[VLM],
        lambda u: u["SubState"] == "start-pre",
        20,
        f"{VLM} in start-pre",
    )
    assert seen["ActiveState"] == "activating", seen
    assert seen["Job"], seen  # waiting in systemd's job queue
    assert holders(container) == {0: [VOICE]}
    wait_journal(container, "restarting preempted vlm-analysis.service (priority 90): it waits")
    # TimeoutStartSec=3 ends the wait (voice runs 5 s): it comes back once voice is done
    wait_journal(container, "vlm-analysis.service (priority 90) failed while it waited at its")
    wait_state(container, VOICE, "inactive", timeout=30)
    wait_state(container, VLM, "active")
    assert holders(container) == {0: [VLM]}
    journal = container.journal("gpuslice.service")
    assert "restarting preempted vlm-analysis.service (priority 90) on GPU 0" in journal


def test_a_unit_that_ended_by_itself_is_finished_though_a_stop_of_ours_came_after(
    container: Container,
) -> None:
    """A unit whose main process ended by itself has done its work, even while its
    ExecStopPost= still runs when a more urgent start preempts it: systemd lets the stop-post
    finish (the stop job only waits for it), the urgent unit runs after it, and the unit
    counts as finished, never restarted later as a preempted unit would be."""
    post = "upload-results.service"
    write_job(container, post, 50, seconds=1, extra_service="ExecStopPost=/bin/sleep 4")
    write_job(container, VOICE, 10, seconds=1)
    reload(container)
    container.systemctl("start", post)
    wait_sub(container, post, "stop-post")  # its work is done; it uploads
    container.systemctl("start", "--no-block", VOICE)
    wait_journal(container, f"preempting {post} (priority 50) for {VOICE}")
    wait_started(container, VOICE, timeout=30)  # it runs 1 s: a poll of its state may miss it
    wait_journal(container, f"{post} finished: released GPU 0")
    wait_state(container, VOICE, "inactive")

    def not_restarted() -> None:
        assert prop(container, post, "ActiveState") == "inactive", describe(container, [post])

    always_for(not_restarted, 3.0)
    assert start_count(container, post) == 1
    assert post in status(container)["finished"]
    assert status(container)["preempted"] == []
