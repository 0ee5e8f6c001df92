"""Renumbered GPUs, three leftovers: the metrics and the status table tell a GPU lost only to
a renumbering from a broken one; a suspended unit pinned by index comes back on its own GPU
after NVML numbered it anew; one whose GPUs a restarted controller knows by UUID does not
come back blind on config.yaml's guess while NVML is not ready."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpuslice.annotations import Scan
from gpuslice.config import Config
from gpuslice.core.model import Gpu, UnitSpec
from gpuslice.core.scheduler import Outcome, Phase, Scheduler
from gpuslice.metrics import exposition
from gpuslice.nvml import NvmlUnavailableError
from gpuslice.status import render, snapshot_to_json
from tests.core_builders import BG, GIB, brief, spec, words
from tests.test_inventory import MANAGED, StubNvml, enumerate_as, make_inventory

# ---------------------------------------------------------------------------------------------
# 1. gpuslice_gpu_lost is for broken GPUs only


def gauges(data: dict[str, Any], family: str) -> dict[str, float]:
    """{gpu index label: value} of one per-GPU gauge, parsed by the client's own parser."""
    text = exposition(json.loads(json.dumps(data))).decode("utf-8")
    for parsed in text_string_to_metric_families(text):  # type: ignore[no-untyped-call, unused-ignore]
        if parsed.name == family:
            return {s.labels["gpu"]: s.value for s in parsed.samples}
    raise AssertionError(f"no {family}")


def renumbered_sample(tmp_path: Path) -> Any:
    """asr.service holds GPU 1 (GPU-B); GPU-A goes off the bus, NVML comes back numbering
    GPU-B 0 and GPU-C 1, and GPU-D (now 2) stops answering: 0 and 1 are lost only to the
    renumbering, 2 is broken."""
    nvml = StubNvml()
    enumerate_as(nvml, "GPU-A", "GPU-B", "GPU-C", "GPU-D")
    inventory, _ = make_inventory(tmp_path, nvml, Config(gpus=4))
    holding = {"asr.service": [1]}
    inventory.sample(MANAGED, holding)
    nvml.devices_error = NvmlUnavailableError("nvmlDeviceGetCount", 9, "Driver Not Loaded")
    inventory.sample(MANAGED, holding)
    nvml.devices_error = None
    enumerate_as(nvml, "GPU-B", "GPU-C", "GPU-D")
    nvml.lost = [2]
    assert inventory.retry()
    return inventory.sample(MANAGED, holding)


def test_a_gpu_lost_only_to_a_renumbering_is_not_counted_lost_but_renumbered(
    tmp_path: Path,
) -> None:
    """An admin alerting on gpuslice_gpu_lost is paged for the broken GPU 2 only; GPUs 0 and
    1 answer (their units run on) and say so in gpuslice_gpu_renumbered. The status JSON
    keeps "lost" true for them (as before the new key) and adds "renumbered"."""
    sample = renumbered_sample(tmp_path)
    assert [(g.index, g.lost, g.renumbered) for g in sample.gpus] == [
        (0, True, True),
        (1, True, True),
        (2, True, False),
    ]
    sched = Scheduler(sample.gpus, {})
    data = snapshot_to_json(sched.snapshot(), Scan(), sample)
    assert [(g["index"], g["lost"], g["renumbered"]) for g in data["gpus"]] == [
        (0, True, True),
        (1, True, True),
        (2, True, False),
    ]
    assert gauges(data, "gpuslice_gpu_lost") == {"0": 0.0, "1": 0.0, "2": 1.0}
    assert gauges(data, "gpuslice_gpu_renumbered") == {"0": 1.0, "1": 1.0, "2": 0.0}


def test_an_older_controller_s_lost_gpu_without_the_renumbered_key_counts_lost() -> None:
    """A status without "renumbered" (an older controller) or with a value that is not true
    counts "lost" as before."""
    data = {
        "gpus": [
            {"index": 0, "uuid": "GPU-A", "lost": True, "holders": []},
            {"index": 1, "uuid": "GPU-B", "lost": True, "renumbered": "yes", "holders": []},
            {"index": 2, "uuid": "GPU-C", "lost": False, "holders": []},
        ]
    }
    assert gauges(data, "gpuslice_gpu_lost") == {"0": 1.0, "1": 1.0, "2": 0.0}
    assert gauges(data, "gpuslice_gpu_renumbered") == {"0": 0.0, "1": 0.0, "2": 0.0}


def test_the_status_table_does_not_call_a_renumbered_gpu_one_that_stopped_answering(
    tmp_path: Path,
) -> None:
    sample = renumbered_sample(tmp_path)
    data = snapshot_to_json(Scheduler(sample.gpus, {}).snapshot(), Scan(), sample)
    lines = render(data).splitlines()
    said = [line for line in lines if line.startswith("GPU ") and ":" in line]
    assert said == [
        "GPU 0: RENUMBERED (NVML numbered the GPUs anew: no new work here until its units "
        "release it)",
        "GPU 1: RENUMBERED (NVML numbered the GPUs anew: no new work here until its units "
        "release it)",
        "GPU 2: LOST (stopped answering NVML)",
    ]


# ---------------------------------------------------------------------------------------------
# 2. a suspended unit pinned by index (Devices=1) after a renumbering


def numbered(*uuids: str) -> list[Gpu]:
    """The GPUs as NVML numbers them once opened afresh: 0, 1, ... in this order."""
    return [Gpu(i, u, "Fake", 24 * GIB) for i, u in enumerate(uuids)]


def suspended_pinned(pin: str = "") -> tuple[Scheduler, UnitSpec, UnitSpec]:
    """vlm.service (`Devices=` pin, or none) runs on GPU 1, GPU-B, and is suspended there for
    voice.service, which runs there until it ends."""
    vlm = spec("vlm", 90, BG, preempt="suspend stop", devices=(pin,) if pin else ())
    voice = spec("voice", 10, devices=("GPU-B",))
    first = spec("first", 50)
    s = Scheduler(numbered("GPU-A", "GPU-B", "GPU-C"), {u.name: u for u in (vlm, voice, first)})
    if not pin:  # it goes where it is free: GPU 0 is taken first, until it ends
        assert brief(s.request(first))[0] == "grant first.service 0"  # (vlm refilled)
    assert brief(s.request(vlm)) == ["grant vlm.service 1"]
    if not pin:
        s.inactive(first.name, Outcome.EXITED)
    assert brief(s.request(voice)) == ["suspend vlm.service 1"]
    assert brief(s.suspended_done(vlm.name, "")) == ["grant voice.service 1"]
    return s, vlm, voice


def test_a_unit_pinned_by_index_comes_back_on_its_own_gpu_at_its_new_index() -> None:
    """`Devices=1` chose GPU-B when it was granted. GPU-A goes off the bus while it is
    suspended and NVML numbers GPU-B 0: its memory can only go back on GPU-B (its processes
    wake there, by UUID), as a running unit pinned by index stays on its GPU. It waited for
    ever (GPU 0 is not "1"), silently, and kept GPU 0's room from less urgent units."""
    s, vlm, voice = suspended_pinned("1")
    with s.deferred():
        s.inactive(voice.name, Outcome.EXITED)
        s.set_gpus(numbered("GPU-B", "GPU-C"))
    acts = s.schedule()
    assert brief(acts) == ["resume vlm.service 0"]
    assert words(acts) == [
        "restoring the VRAM of vlm.service (priority 90) on GPU 0 (GPU-B was GPU 1 when it was "
        "suspended: NVML numbered the GPUs anew)"
    ]
    assert s.grants() == {vlm.name: frozenset({0})}
    assert brief(s.request(spec("other", 95))) == ["grant other.service 1"]
    # a new start of it is placed by its pin as written (GPU 1, GPU-C now), GPU 0 free
    s.inactive(vlm.name, Outcome.EXITED)
    assert brief(s.request(vlm)) == ["stop other.service"]
    back = brief(s.inactive("other.service", Outcome.STOPPED))
    assert back[0] == "grant vlm.service 1"  # (and other.service, preempted, requeued)


def test_a_unit_pinned_by_uuid_comes_back_on_its_gpu_at_its_new_index() -> None:
    s, _vlm, voice = suspended_pinned("GPU-B")
    with s.deferred():
        s.inactive(voice.name, Outcome.EXITED)
        s.set_gpus(numbered("GPU-B", "GPU-C"))
    assert brief(s.schedule()) == ["resume vlm.service 0"]


def test_a_pin_edited_while_suspended_applies_from_its_next_start() -> None:
    """Devices= edited from 1 to 2 while it is suspended from GPU 1: its memory is on GPU 1,
    and it comes back there (as a running unit is not moved by an edit; systemd's unit files
    apply from the next start too), where it waited for ever."""
    s, vlm, voice = suspended_pinned("1")
    moved = UnitSpec(vlm.name, vlm.priority, vlm.kind, preempt=vlm.preempt, devices=("2",))
    s.set_specs({u.name: u for u in (moved, voice)})
    assert brief(s.inactive(voice.name, Outcome.EXITED)) == ["resume vlm.service 1"]


# ---------------------------------------------------------------------------------------------
# 3. GPUs without UUIDs: config.yaml's guess while NVML is not ready


def restarted_while_nvml_is_not_ready() -> tuple[Scheduler, UnitSpec, UnitSpec]:
    """vlm.service was suspended from GPU 1 (GPU-B), and the controller restarted before
    NVML answered: the GPUs are config.yaml's guess (gpus: 3, no UUIDs), background units
    wait for NVML, and vlm.service's env file says GPU-B."""
    s, vlm, voice = suspended_pinned()
    other = spec("other", 50)
    after = Scheduler([Gpu(0), Gpu(1), Gpu(2)], {u.name: u for u in (vlm, voice, other)})
    after.pause_refill("NVML is not ready yet")
    after.load(s.save())
    after.remember_uuids(vlm.name, {1: "GPU-B"})
    return after, vlm, other


def test_a_unit_known_by_uuid_waits_for_nvml_rather_than_resuming_on_the_guess() -> None:
    """Resumed by index onto the guess's GPU 1, it was booked on whatever NVML then calls 1
    (GPU-C, once GPU-A is gone) while its processes woke on GPU-B, now GPU 0, which the books
    said was free: the next unit granted GPU 0 ran beside it. It waits for NVML (as it does
    when the guess does not list its index) and comes back on GPU-B."""
    s, vlm, other = restarted_while_nvml_is_not_ready()
    assert brief(s.inactive("voice.service", Outcome.EXITED)) == []
    assert s.phase(vlm.name) is Phase.SUSPENDED
    s.pause_refill("")  # NVML answers (as gpuwatch says so, then samples)
    assert brief(s.set_gpus(numbered("GPU-B", "GPU-C"))) == ["resume vlm.service 0"]
    assert brief(s.request(other)) == ["grant other.service 1"]


def test_after_driver_wait_a_unit_known_by_uuid_comes_back_by_index_on_the_guess() -> None:
    """NVML may never come (fallback, driver_wait ran out: refill no longer paused): then by
    index, as every grant on the guess is, rather than suspended for ever."""
    s, _vlm, _other = restarted_while_nvml_is_not_ready()
    assert brief(s.inactive("voice.service", Outcome.EXITED)) == []
    s.pause_refill("")
    assert brief(s.schedule()) == ["resume vlm.service 1"]


def test_a_unit_never_known_by_uuid_comes_back_by_index_on_the_guess() -> None:
    """No env file names its GPU (or NVML never gave UUIDs): nothing tells a renumbering,
    and it comes back by index even while NVML is not ready, as before."""
    s, vlm, voice = suspended_pinned()
    after = Scheduler([Gpu(0), Gpu(1), Gpu(2)], {u.name: u for u in (vlm, voice)})
    after.pause_refill("NVML is not ready yet")
    after.load(s.save())
    assert brief(after.inactive(voice.name, Outcome.EXITED)) == ["resume vlm.service 1"]


def test_a_unit_waiting_for_nvml_does_not_hold_back_a_less_urgent_one_never_known_by_uuid() -> None:
    """vlm.service waits for NVML (its GPU known by UUID); bulk.service, less urgent and
    suspended from GPU 2 before NVML named it, comes back by index as before: the wait of one
    is its own, not the end of the resumes of those after it."""
    s, vlm, voice = suspended_pinned()
    bulk = spec("bulk", 95, BG, preempt="suspend stop")
    saved = s.save()
    saved = dataclasses.replace(saved, suspended={**saved.suspended, bulk.name: ((2,), 1000)})
    after = Scheduler([Gpu(0), Gpu(1), Gpu(2)], {u.name: u for u in (vlm, voice, bulk)})
    after.pause_refill("NVML is not ready yet")
    after.load(saved)
    after.remember_uuids(vlm.name, {1: "GPU-B"})
    assert brief(after.inactive(voice.name, Outcome.EXITED)) == ["resume bulk.service 2"]
    assert after.phase(vlm.name) is Phase.SUSPENDED
