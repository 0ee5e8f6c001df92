"""Issue 9's metrics against a real systemd: `gpuslice metrics` after a preemption, parsed by
the Prometheus client's own parser, and the socket-activated exporter serving /metrics."""

from __future__ import annotations

import shlex
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.bed.container import Container, wait_until
from tests.integration.jobs import reload, wait_journal, wait_state, write_job

VOICE = "voice.service"
BG = "bg.service"
PORT = 9848
# python3 in the container (it has no curl): GET a path, print the status, type and body
FETCH = (
    "import sys, urllib.request, urllib.error\n"
    "try:\n"
    "    r = urllib.request.urlopen(f'http://127.0.0.1:{PORT}' + sys.argv[1], timeout=20)\n"
    "except urllib.error.HTTPError as e:\n"
    "    r = e\n"
    "print(r.status)\n"
    "print(r.headers['Content-Type'])\n"
    "sys.stdout.write(r.read().decode())\n"
).replace("{PORT}", str(PORT))

# python3 as nobody: connect and close at once, as fast as it can; prints how many were
# refused (the socket failed, or systemd dropped them past MaxConnections=)
FLOOD = (
    "import socket, sys\n"
    "refused = 0\n"
    "for _ in range(int(sys.argv[1])):\n"
    "    try:\n"
    "        socket.create_connection(('127.0.0.1', {PORT}), timeout=5).close()\n"
    "    except OSError:\n"
    "        refused += 1\n"
    "print(refused)\n"
).replace("{PORT}", str(PORT))
NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")


def samples(text: str) -> dict[tuple[Any, ...], float]:
    parsed = text_string_to_metric_families(text)  # type: ignore[no-untyped-call, unused-ignore]
    return {
        (s.name, *sorted(s.labels.items())): s.value for family in parsed for s in family.samples
    }


def fetch(bed: Container, path: str) -> tuple[int, str, str]:
    out = bed.run(["python3", "-c", FETCH, path], timeout=60).stdout
    code, content_type, body = out.split("\n", 2)
    return int(code), content_type, body


def test_metrics_after_a_preemption_and_the_exporter(container: Container) -> None:
    write_job(container, BG, 90, "background")
    write_job(container, VOICE, 10)
    reload(container)
    wait_state(container, BG, "active")
    container.systemctl("start", "--no-block", VOICE)
    wait_state(container, VOICE, "active")
    wait_journal(container, "starting voice.service (priority 10) on GPU 0")

    text = container.run(["gpuslice", "metrics"]).stdout
    got = samples(text)
    assert got[("gpuslice_up",)] == 1
    assert got[("gpuslice_preemptions_total", ("reason", "waiter"))] >= 1
    assert got[("gpuslice_refills_total",)] >= 1  # bg started on the free GPU
    assert got[("gpuslice_jobs", ("priority", "10"), ("state", "running"))] == 1
    assert got[("gpuslice_jobs", ("priority", "90"), ("state", "preempted"))] == 1
    assert got[("gpuslice_decisions_total", ("decision", "grant"))] >= 2
    assert got[("gpuslice_admission_wait_time_seconds_count",)] >= 2
    # voice waited for bg to stop (bg was granted at once)
    assert got[("gpuslice_admission_wait_time_seconds_sum",)] > 0
    assert got[("gpuslice_build_info", ("version", "0.1.0"))] == 1
    assert got[("gpuslice_dbus_call_errors_total",)] == 0

    # the exporter: installed, not enabled; started by hand, it answers over its socket
    enabled = container.systemctl("is-enabled", "gpuslice-metrics.socket", check=False)
    assert enabled.stdout.strip() == "disabled", enabled
    container.systemctl("start", "gpuslice-metrics.socket")
    code, content_type, body = fetch(container, "/metrics")
    assert (code, content_type) == (200, "text/plain; version=0.0.4; charset=utf-8"), body
    served = samples(body)
    assert served[("gpuslice_up",)] == 1
    assert served[("gpuslice_preemptions_total", ("reason", "waiter"))] >= 1
    assert fetch(container, "/")[0] == 404
    # unprivileged: the service runs as a user of its own; the controller keeps its sandbox
    assert "PrivateNetwork=yes" in container.run(
        ["systemctl", "cat", "gpuslice.service"]
    ).stdout.replace(" ", "")
    unit = container.run(["systemctl", "cat", "gpuslice-metrics@.service"]).stdout
    assert "\nUser=gpuslice-metrics\n" in unit, unit
    container.run(["getent", "passwd", "gpuslice-metrics"])  # made by systemd-sysusers
    failed = container.systemctl("list-units", "--failed", "--plain", "--no-legend").stdout
    assert "gpuslice-metrics" not in failed, failed

    # with the controller stopped: up 0, and the command says so with exit 1
    container.systemctl("stop", "gpuslice.service")
    down = container.run(["gpuslice", "metrics"], check=False)
    assert down.returncode == 1
    assert samples(down.stdout) == {("gpuslice_up",): 0}
    assert "no status from the controller" in down.stderr
    code, _, body = fetch(container, "/metrics")
    assert code == 200 and samples(body) == {("gpuslice_up",): 0}


def test_a_connection_flood_leaves_the_exporter_serving(container: Container) -> None:
    """Any local user may connect. Systemd counts each connection it accepts against the
    socket's trigger limit (by default 200 in 2 s with Accept=yes), those it drops past
    MaxConnections= too, and one over it fails the socket for good: with that limit, 1,800
    connections from nobody (in under a second here) end the exporter until an admin
    restarts it. Once the flood stops, Prometheus is answered again."""
    container.systemctl("start", "gpuslice-metrics.socket")
    # six loops at once: one alone, a connection at a time, stays under 200 in 2 s here
    one = " ".join(shlex.quote(a) for a in [*NOBODY, "python3", "-c", FLOOD, "300"])
    flood = container.run(["sh", "-c", " & ".join([one] * 6) + " & wait"], timeout=300)
    print(f"of 6 x 300 connections refused: {flood.stdout.split()}")
    failed = container.systemctl("show", "-P", "Result", "gpuslice-metrics.socket").stdout
    assert container.active_state("gpuslice-metrics.socket") == "active", failed

    def served() -> bool:
        res = container.run(["python3", "-c", FETCH, "/metrics"], check=False, timeout=60)
        return res.returncode == 0 and res.stdout.startswith("200\n")

    wait_until(served, 60, interval=0.5, what="GET /metrics answered after the flood")
