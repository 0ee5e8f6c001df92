"""The example Grafana dashboard (units/examples/grafana/gpuslice.json): its panels, and every
metric its queries name is one `gpuslice metrics` emits (sample names: _total, _bucket, ...)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpuslice.metrics import exposition
from tests.test_metrics import status

DASHBOARD = Path(__file__).resolve().parent.parent / "units/examples/grafana/gpuslice.json"
METRIC = re.compile(r"\bgpuslice_[A-Za-z0-9_]+")
TITLES = {
    "Controller up",
    "Version",
    "Controller uptime",
    "NVML",
    "GPUs lost",
    "Annotation problems",
    "Queue length (pending jobs by reason)",
    "Jobs by state",
    "Admission wait (p50, p95, mean)",
    "Admission wait distribution",
    "Grants per second",
    "Preemptions by reason",
    "Refills, holds and requeues",
    "Decisions by code",
    "GPU memory per GPU",
    "GPU memory by unit: used",
    "GPU memory by unit: declared (Memory=)",
    "Errors",
}


def load() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those of collapsed rows included; rows themselves left out."""
    for panel in items:
        if panel["type"] == "row":
            yield from panels(panel.get("panels", []))
        else:
            yield panel


def queries(data: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables."""
    out = [t["expr"] for p in panels(data["panels"]) for t in p["targets"]]
    for variable in data["templating"]["list"]:
        if variable["type"] == "query":
            out.append(variable["query"]["query"])
    return out


def emitted() -> set[str]:
    """Sample names of the exposition of a representative status."""
    text = exposition(status()).decode("utf-8")
    parsed = text_string_to_metric_families(text)  # type: ignore[no-untyped-call, unused-ignore]
    return {sample.name for family in parsed for sample in family.samples}


def test_a_dashboard_with_its_panels() -> None:
    data = load()
    assert data["uid"] == "gpuslice"
    assert data["title"] == "gpuslice"
    assert data["schemaVersion"] >= 38
    (source,) = [v for v in data["templating"]["list"] if v["name"] == "datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    found = list(panels(data["panels"]))
    assert {p["title"] for p in found} == TITLES
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    for panel in found:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]


def test_every_query_names_only_emitted_metrics() -> None:
    names = emitted()
    used = set()
    for expr in queries(load()):
        found = set(METRIC.findall(expr))
        assert found, expr
        assert found <= names, f"{expr}: {sorted(found - names)} not emitted"
        used |= found
    # the contract's panels: queue length, waits, preemptions, GPU memory by GPU and by unit
    assert {
        "gpuslice_pending_jobs",
        "gpuslice_admission_wait_time_seconds_bucket",
        "gpuslice_preemptions_total",
        "gpuslice_refills_total",
        "gpuslice_holds_total",
        "gpuslice_gpu_memory_used_bytes",
        "gpuslice_job_memory_used_bytes",
        "gpuslice_job_memory_declared_bytes",
        "gpuslice_up",
        "gpuslice_build_info",
    } <= used
