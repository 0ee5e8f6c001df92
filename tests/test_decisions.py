"""Decisions as data: every action the core returns carries its Decision, and the words are
that decision rendered in one place (gpuslice/core/decisions.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from gpuslice.core import decisions as decisions_module
from gpuslice.core.decisions import (
    Blocker,
    Cause,
    Code,
    Decision,
    Part,
    level,
    reason,
    render,
    until,
)
from gpuslice.core.scheduler import Action, Grant, Log, Outcome, Scheduler, Start, Stop
from tests.core_builders import BG, GIB, Sim, sized, spec

V = "vlm.service"
VOICE = "voice.service"


def decisions(actions: list[Action]) -> list[Decision]:
    out = []
    for action in actions:
        assert action.decision is not None, action
        out.append(action.decision)
    return out


def said(action: Action) -> str:
    return action.message if isinstance(action, Log) else action.reason


def check_rendered(actions: list[Action]) -> None:
    """Each action's words are its decision rendered; a Log's level is the decision's."""
    for action in actions:
        assert action.decision is not None, action
        assert said(action) == render(action.decision)
        if isinstance(action, Log):
            assert action.level == level(action.decision)
        else:
            assert action.unit == action.decision.unit


# -- rendering: every code, word for word ----------------------------------------------------


@pytest.mark.parametrize(
    ("decision", "sentence"),
    [
        (
            Decision(Code.GRANT, "a.service", 10, gpus=(0, 1)),
            "starting a.service (priority 10) on GPUs 0,1",
        ),
        (
            Decision(Code.PREEMPT, V, 90, for_unit=VOICE, for_priority=10, gpus=(0,)),
            "preempting vlm.service (priority 90) for voice.service (priority 10) on GPU 0",
        ),
        (
            Decision(Code.YIELD, V, 90, gpus=(1,), pids=(7, 8)),
            "yielding GPU 1: stopping background vlm.service (priority 90) while a process "
            "gpuslice does not manage uses it (PID 7, 8)",
        ),
        (
            Decision(Code.YIELD, V, 90, gpus=(1,), pids=(7, 8), owners=("Slurm job 881",)),
            "yielding GPU 1: stopping background vlm.service (priority 90) while a process "
            "gpuslice does not manage uses it (PID 7, 8; Slurm job 881)",
        ),
        (  # eight are all named
            Decision(Code.YIELD, V, 90, gpus=(1,), pids=tuple(range(1, 9))),
            "yielding GPU 1: stopping background vlm.service (priority 90) while a process "
            "gpuslice does not manage uses it (PID 1, 2, 3, 4, 5, 6, 7, 8)",
        ),
        (  # a user can start thousands of processes: the line names eight of each
            Decision(
                Code.YIELD,
                V,
                90,
                gpus=(1,),
                pids=tuple(range(100, 109)),
                owners=tuple(f"UID {n}" for n in range(1000, 1010)),
            ),
            "yielding GPU 1: stopping background vlm.service (priority 90) while a process "
            "gpuslice does not manage uses it (PID 100, 101, 102, 103, 104, 105, 106, 107 "
            "and 1 more; UID 1000, UID 1001, UID 1002, UID 1003, UID 1004, UID 1005, UID 1006, "
            "UID 1007 and 2 more)",
        ),
        (
            Decision(Code.REQUEUE, V, 90, gpus=(0,), cause=Cause.FREE),
            "restarting preempted vlm.service (priority 90) on GPU 0",
        ),
        (
            Decision(Code.REQUEUE, V, 90, gpus=(0,), cause=Cause.PREEMPTS),
            "restarting preempted vlm.service (priority 90) on GPUs held by less urgent units",
        ),
        (
            Decision(Code.REQUEUE, V, 90, cause=Cause.QUEUES),
            "restarting preempted vlm.service (priority 90): it waits at its gate for more "
            "urgent units",
        ),
        (
            Decision(Code.REQUEUE_FAILED, V, 90),
            "vlm.service (priority 90) failed while it waited at its gate to come back from a "
            "preemption: it is restarted when its GPUs are free",
        ),
        (
            Decision(Code.RESUME, V, 90, gpus=(0,)),
            "restoring the VRAM of vlm.service (priority 90) on GPU 0",
        ),
        (
            Decision(Code.RUNG_FAILED, V, 90, gpus=(0,), rung="suspend", detail="no tool"),
            "cannot suspend vlm.service (priority 90): no tool; it keeps GPU 0 (Preempt= names "
            "no other way)",
        ),
        (
            Decision(Code.REFILL, V, 90, gpus=(2,)),
            "starting background vlm.service (priority 90) on free GPU 2",
        ),
        (
            Decision(Code.HOLD, V),
            "vlm.service was stopped outside gpuslice: held until started again",
        ),
        (Decision(Code.FINISHED, V, gpus=(0,)), "vlm.service finished: released GPU 0"),
        (
            Decision(Code.FAILED, V),
            "vlm.service failed: gpuslice will not start it by itself (its own Restart= policy "
            "applies)",
        ),
        (Decision(Code.SHUTDOWN, V, gpus=()), "vlm.service stopped for shutdown: released no GPU"),
        (
            Decision(Code.CANCELLED, V),
            "vlm.service: start cancelled while waiting; nothing reserved",
        ),
        (
            Decision(Code.NOT_REQUEUED, V, 90),
            "vlm.service (priority 90) preempted; Requeue=no, not restarting",
        ),
        (
            Decision(Code.STOP_FAILED, V, 90, gpus=(0,), detail="job cancelled"),
            "vlm.service (priority 90) did not stop: job cancelled; it keeps GPU 0",
        ),
        (
            Decision(
                Code.STOP_REFUSED, V, 90, for_unit=VOICE, for_priority=10, gpus=(0,), detail="no"
            ),
            "vlm.service (priority 90) did not stop for voice.service (priority 10): no; it keeps "
            "GPU 0; gpuslice will not try to stop it again while it runs",
        ),
        (
            Decision(Code.START_RETRY, V, 90, gpus=(0,), detail="no reply (NoReply)"),
            "starting vlm.service (priority 90) did not reach systemd: no reply (NoReply); it "
            "is started again in a moment, until systemd takes the start; GPU 0 released "
            "meanwhile",
        ),
        (
            Decision(Code.STOP_OVERDUE, V, 90, for_unit=VOICE, detail="90 s"),
            "vlm.service (priority 90) has not stopped 90 s after gpuslice asked (voice.service "
            "waits for it): see its TimeoutStopSec= and ExecStop=",
        ),
        (
            Decision(Code.LOST_GPU, gpus=(1,), units=("a.service", "b.service")),
            "GPU 1 is lost; it was held by a.service, b.service",
        ),
        (Decision(Code.LOST_GPU, gpus=(1,)), "GPU 1 is lost; it was held by no unit"),
        (  # units sharing it by Memory=: a user's Accept=yes instances may be thousands
            Decision(Code.LOST_GPU, gpus=(1,), units=tuple(f"u{i}.service" for i in range(10))),
            "GPU 1 is lost; it was held by u0.service, u1.service, u2.service, u3.service, "
            "u4.service, u5.service, u6.service, u7.service and 2 more",
        ),
        (
            Decision(Code.EXCEEDS_HOST, V, 5, need_gpus=4, available=2),
            "vlm.service (priority 5) needs 4 GPUs but this host has 2: it waits until the "
            "configuration changes",
        ),
        (
            Decision(Code.UNACCOUNTED, V, 5),
            "vlm.service (priority 5) is running without enough free GPUs to account for it; "
            "counting it on none",
        ),
        (Decision(Code.UNMANAGED, V), "vlm.service is no longer annotated: released its GPUs"),
        (
            Decision(Code.UNMANAGED, V, gpus=(0,), cause=Cause.RUNS),
            "vlm.service is no longer annotated: it keeps GPU 0 until it ends, "
            "then gpuslice forgets it",
        ),
        (
            Decision(Code.UNMANAGED, V, gpus=(0, 1), cause=Cause.WITHDRAWN),
            "vlm.service is no longer annotated: stopping the start gpuslice gave it; "
            "it keeps GPUs 0,1 until it is down",
        ),
        (  # a requeue waiting at its gate keeps no GPU
            Decision(Code.UNMANAGED, V, cause=Cause.WITHDRAWN),
            "vlm.service is no longer annotated: stopping the start gpuslice gave it",
        ),
        (
            Decision(Code.UNMANAGED, V, cause=Cause.RESTARTED),
            "vlm.service is no longer annotated: its start, which waited at the gate a "
            "daemon-reload took out, is restarted unless it was stopped meanwhile (then it "
            "stays stopped); let through, it would skip its own ExecStartPre= lines",
        ),
    ],
)
def test_render_every_code(decision: Decision, sentence: str) -> None:
    assert render(decision) == sentence


def wait(cause: Cause, *parts: Part, **kw: object) -> Decision:
    return Decision(Code.WAIT, "w.service", 20, cause=cause, parts=parts, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("decision", "words"),
    [
        (wait(Cause.PAUSED, detail="NVML is not ready"), "waiting: NVML is not ready"),
        (
            wait(
                Cause.STOPPING,
                Part(Blocker.VICTIM, (0,), "a.service", 90),
                Part(Blocker.VICTIM, (1, 2), "b.service", 80, overdue="90 s"),
            ),
            "waiting for a.service (priority 90) to stop on GPU 0, b.service (priority 80) to "
            "stop on GPUs 1,2 (still running 90 s after the stop)",
        ),
        (
            wait(Cause.UNUSABLE, need_gpus=2, available=1),
            "waiting: needs 2 GPUs; only 1 of this host's GPUs may run it (Devices=, lost GPUs, "
            "or processes gpuslice does not manage)",
        ),
        (wait(Cause.HOST, need_gpus=3, available=2), "waiting: needs 3 GPUs, this host has 2"),
        (
            wait(
                Cause.BUSY,
                Part(Blocker.HELD, (0,), "a.service", 5, refused=True),
                Part(Blocker.STOPPING, (1,), "b.service", 90),
                Part(Blocker.KEPT, (2,), priority=20),
            ),
            "waiting: GPU 0 held by a.service, priority 5 (refused to stop); GPU 1 being freed "
            "by b.service (stopping); GPU 2 kept for an earlier unit of priority 20",
        ),
        (
            wait(
                Cause.BUSY,
                Part(Blocker.MEMORY, (0,), "a.service", 5, free=3 * GIB),
                Part(Blocker.MEMORY, (1,), free=-1),
                need_memory=20 * GIB,
            ),
            "waiting: needs 20 GiB on one GPU; GPU 0 has 3 GiB free after the reserve, held by "
            "a.service, priority 5; GPU 1 has 0 B free after the reserve",
        ),
        (  # memory of no holder: how much, and whose when known
            wait(
                Cause.BUSY,
                Part(Blocker.MEMORY, (0,), "a.service", 5, free=3 * GIB, others=GIB),
                Part(Blocker.MEMORY, (1,), free=0, others=24 * GIB, owners=("Slurm job 881",)),
                need_memory=20 * GIB,
            ),
            "waiting: needs 20 GiB on one GPU; GPU 0 has 3 GiB free after the reserve, held by "
            "a.service, priority 5, 1 GiB used by processes of no holder; GPU 1 has 0 B free "
            "after the reserve, 24 GiB used by processes of no holder (Slurm job 881)",
        ),
    ],
)
def test_render_waiting_reasons(decision: Decision, words: str) -> None:
    assert reason(decision) == words
    assert render(decision) == f"w.service {words}"
    assert until(decision)  # every wait says what would end it


def test_levels() -> None:
    assert level(Decision(Code.GRANT)) == "info"
    assert level(Decision(Code.LOST_GPU)) == "error"
    assert level(Decision(Code.STOP_REFUSED)) == "warning"


def held_wait_json(unit: str, priority: int, gpus: list[int], held_priority: int) -> dict[str, Any]:
    """Every key of a wait for GPU 0, which a.service holds, as to_json writes it (the status
    JSON of tests/test_cli.py too)."""
    return {
        "code": "wait",
        "unit": unit,
        "priority": priority,
        "for": None,
        "for_priority": None,
        "gpus": gpus,
        "cause": "gpus-busy",
        "parts": [
            {
                "kind": "held",
                "gpus": [0],
                "unit": "a.service",
                "priority": held_priority,
                "free": None,
                "refused": False,
                "granted_after": False,
                "overdue": None,
                "rung": None,
                "others": 0,
                "beyond": 0,
                "owners": [],
                "owners_left_out": 0,
            }
        ],
        "need_gpus": 1,
        "need_memory": None,
        "available": None,
        "detail": None,
        "rung": None,
        "fallback": None,
    }


def test_to_json_has_every_key() -> None:
    d = wait(Cause.BUSY, Part(Blocker.HELD, (0,), "a.service", 5), gpus=(0,))
    assert d.to_json() == held_wait_json("w.service", 20, [0], 5)


def test_subjects() -> None:
    assert Decision(Code.GRANT, "a.service").subjects() == ("a.service",)
    assert Decision(Code.LOST_GPU, units=("a.service", "b.service")).subjects() == (
        "a.service",
        "b.service",
    )
    assert Decision(Code.LOST_GPU).subjects() == ()


# -- the core returns the data --------------------------------------------------------------


def test_preemption_timeline_as_data() -> None:
    sim = Sim(1, [spec("vlm", 90, BG), spec("voice", 10)])
    boot = sim.boot()
    assert [(d.code, d.unit, d.gpus) for d in decisions(boot)] == [(Code.REFILL, V, (0,))]
    check_rendered(boot)
    sim.settle()
    asked = sim.start(VOICE)
    check_rendered(asked)
    stop = next(a for a in asked if isinstance(a, Stop))
    assert stop.decision == Decision(
        Code.PREEMPT, V, 90, for_unit=VOICE, for_priority=10, gpus=(0,)
    )
    waiting = next(a for a in asked if isinstance(a, Log))
    assert waiting.decision is not None
    assert (waiting.decision.code, waiting.decision.cause) == (Code.WAIT, Cause.STOPPING)
    assert waiting.decision.parts == (Part(Blocker.VICTIM, (0,), V, 90),)
    assert waiting.decision.gpus == (0,)
    granted = sim.finish_stop(V)
    check_rendered(granted)
    grant = next(a for a in granted if isinstance(a, Grant))
    assert grant.decision == Decision(Code.GRANT, VOICE, 10, gpus=(0,))
    done = sim.exit(VOICE)
    check_rendered(done)
    codes = [d.code for d in decisions(done)]
    assert codes == [Code.FINISHED, Code.REQUEUE]
    assert isinstance(done[1], Start)
    assert decisions(done)[1].cause is Cause.FREE


def test_waiter_reason_is_kept_as_data_in_the_snapshot() -> None:
    s = Scheduler([0], {})
    s.request(spec("a", 20))
    actions = s.request(spec("b", 20))
    check_rendered(actions)
    snap = s.snapshot()
    assert snap.waiting == [("b.service", 20, "waiting: GPU 0 held by a.service, priority 20")]
    d = snap.reasons["b.service"]
    assert (d.code, d.cause, d.parts) == (
        Code.WAIT,
        Cause.BUSY,
        (Part(Blocker.HELD, (0,), "a.service", 20),),
    )
    assert reason(d) == snap.waiting[0][2]


def test_memory_wait_stop_failures_and_lost_gpu_as_data() -> None:
    s = Scheduler([sized(0), sized(1)], {})
    big = spec("big", 5, mem_gib=20)
    check_rendered(s.request(spec("small", 50, mem_gib=10)))
    check_rendered(s.request(spec("other", 50, mem_gib=10)))
    asked = s.request(spec("urgent", 1, gpus=2, mem_gib=20))
    check_rendered(asked)
    stops = [a for a in asked if isinstance(a, Stop)]
    assert {a.unit for a in stops} == {"small.service", "other.service"}
    failed = s.stop_failed("small.service", "refused by policy", refused=True)
    check_rendered(failed)
    assert failed[0].decision is not None
    assert failed[0].decision.code is Code.STOP_REFUSED
    assert failed[0].decision.for_unit == "urgent.service"
    assert failed[0].decision.detail == "refused by policy"
    overdue = s.stop_overdue("other.service", "90 s")
    check_rendered(overdue)
    on_gpu0 = tuple(sorted(n for n, gpus in s.grants().items() if 0 in gpus))
    assert on_gpu0
    lost = s.set_gpus([sized(0, lost=True), sized(1)])
    check_rendered(lost)
    assert decisions(lost)[0] == Decision(Code.LOST_GPU, gpus=(0,), units=on_gpu0)
    check_rendered(s.request(big))


def test_outcomes_as_data() -> None:
    s = Scheduler([0], {})
    s.request(spec("a", 20))
    s.request(spec("b", 30))
    check_rendered(s.inactive("b.service", Outcome.STOPPED))  # cancelled while waiting
    for outcome in Outcome:
        s.request(spec("a", 20))
        check_rendered(s.inactive("a.service", outcome))
    check_rendered(s.request(spec("huge", 1, gpus=4)))
    check_rendered(s.running("a.service"))
    check_rendered(s.set_specs({}))


def test_the_core_still_imports_nothing_outside() -> None:
    """decisions.py is part of the pure core: stdlib, core and sizes only. The file imported
    (not one the current directory names: run from elsewhere, that was missing)."""
    text = Path(decisions_module.__file__).read_text()
    if "mutmut" in text:
        pytest.skip("mutmut's instrumented copy imports its own trampolines")
    tree = ast.parse(text)
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert imported <= {
        "__future__",
        "enum",
        "dataclasses",
        "typing",
        "gpuslice.core.placement",
        "gpuslice.sizes",
    }


@pytest.mark.parametrize(
    ("cause", "words"),
    [
        (Cause.PAUSED, "NVML answers, or driver_wait runs out"),
        (Cause.STOPPING, "the units named have stopped"),
        (
            Cause.UNUSABLE,
            "enough of the GPUs it may use are usable (Devices=, a lost GPU, foreign processes)",
        ),
        (Cause.HOST, "the host has enough GPUs (config.yaml gpus:, or NVML)"),
        (Cause.BUSY, "the GPUs named free up, or their holders become less urgent than it"),
    ],
)
def test_until_says_what_would_end_each_kind_of_wait(cause: Cause, words: str) -> None:
    """GPUSLICE_UNTIL= in the waiting unit's journal."""
    assert until(wait(cause)) == words


def test_to_json_of_a_decision_without_a_cause() -> None:
    d = Decision(Code.GRANT, "g.service", 10, gpus=(1,))
    assert d.to_json()["cause"] is None
    assert d.to_json()["code"] == "grant"


def test_an_overdue_stop_whose_waiter_is_gone_names_no_waiter() -> None:
    """The waiter may have been stopped meanwhile: the warning then says only who is late."""
    d = Decision(Code.STOP_OVERDUE, "v.service", 50, detail="30 s")
    assert render(d) == (
        "v.service (priority 50) has not stopped 30 s after gpuslice asked: "
        "see its TimeoutStopSec= and ExecStop="
    )


def test_a_wait_for_many_victims_names_the_first_and_how_many_more() -> None:
    """One part per victim, and a user who may start a Memory= template's instances makes
    as many victims as fit a GPU: the reason (a journal line, status) names the first
    LISTED_MAX and how many more, as every line naming what a user can make many of."""
    victims = [Part(Blocker.VICTIM, (0,), f"w@{i}.service", 90) for i in range(300)]
    words = reason(wait(Cause.STOPPING, *victims))
    assert words.startswith("waiting for w@0.service (priority 90) to stop on GPU 0, ")
    assert words.endswith("w@7.service (priority 90) to stop on GPU 0 and 292 more")
