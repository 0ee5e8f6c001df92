"""The Debian package: build it, then install, upgrade, remove and purge it in a booted Debian 12.

The .deb is built once per session by `make deb` (rebuilt when a source is newer); version N+1
is built from a copy of the sources with the version bumped. Facts about the bed:
/work/shared/notes/systemd-in-a-container.md.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.bed.container import Container, wait_until
from tests.bed.debian import (
    WHEEL_DIR,
    build_deb,
    bumped_copy,
    changelog_version,
    file_list,
    install_deb,
    main_pid,
    wait_settled,
)

pytestmark = pytest.mark.timeout(600)

EXAMPLES = "/usr/share/doc/gpuslice/examples"
BACKGROUND = "vlm-analysis.service"  # priority 90, background, runs until stopped
ON_DEMAND = "voice-pipeline.service"  # priority 10, on demand, ends after ~5 s
STEP = 30.0
# An annotated unit that needs nothing from the package (its examples' program is
# documentation, gone after remove).
PLAIN_JOB = """[Unit]
Description=annotated test job
[Service]
ExecStart=/bin/sleep infinity
[X-GPUSlice]
Priority=50
Type=on-demand
"""


@pytest.fixture(scope="session")
def deb() -> Path:
    """gpuslice_N_all.deb from the checkout (built by `make deb` if missing or stale)."""
    return build_deb()


@pytest.fixture(scope="session")
def deb_next(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpuslice_N+1_all.deb: the same sources with a newer version."""
    version = changelog_version() + "+upgradetest1"
    src = bumped_copy(tmp_path_factory.mktemp("deb-next") / "src", version)
    return build_deb(src, src.parent / "out", WHEEL_DIR, force=True)


def _install(container: Container, deb: Path) -> None:
    seconds = install_deb(container, deb)
    print(f"apt-get install {deb.name}: {seconds:.2f} s")
    state = wait_settled(container, "gpuslice.service")
    if state != "active":
        status = container.systemctl("status", "--no-pager", "gpuslice.service", check=False)
        pytest.fail(f"gpuslice.service is {state} after install\n{status.stdout}")


def _copy_example(container: Container, unit: str) -> None:
    container.run(["cp", f"{EXAMPLES}/{unit}", f"/etc/systemd/system/{unit}"])


def test_maintainer_scripts_touch_only_the_controller(deb: Path, tmp_path: Path) -> None:
    """Upgrade and remove must never stop a GPU job: every unit the scripts stop is ours
    (the controller, the metrics exporter's socket)."""
    subprocess.run(["dpkg-deb", "-e", str(deb), str(tmp_path)], check=True)
    scripts = [tmp_path / s for s in ("preinst", "postinst", "prerm", "postrm")]
    present = [p for p in scripts if p.exists()]
    # debhelper writes postinst/prerm/postrm for the service: none at all means this test
    # would check nothing (a packaging change, or dpkg-deb -e extracting elsewhere)
    assert {p.name for p in present} >= {"postinst", "prerm", "postrm"}, present
    lines = 0
    for path in present:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            lines += 1
            if re.search(r"\b(systemctl|deb-systemd-invoke)\b.*\b(stop|restart|kill)\b", line):
                named = re.findall(r"[\w@.-]+\.(?:service|socket)", line)
                ours = {"gpuslice.service", "gpuslice-metrics.socket"}
                assert named and set(named) <= ours, f"{path.name}:{number}: {line.strip()}"
    assert lines > 0


def test_package_contents(deb: Path) -> None:
    listing = subprocess.run(
        ["dpkg-deb", "-c", str(deb)], check=True, capture_output=True, text=True
    ).stdout
    paths = {line.split()[-1].lstrip(".") for line in listing.splitlines()}
    for expected in (
        "/usr/bin/gpuslice",
        "/lib/systemd/system/gpuslice.service",
        "/lib/systemd/system/gpuslice-claim@.service",
        "/lib/systemd/system-generators/gpuslice-generator",
        "/usr/lib/systemd/user-generators/gpuslice-user-generator",
        "/usr/lib/gpuslice/gpuslice-gate",
        "/usr/lib/gpuslice/python/gpuslice/cli.py",
        "/usr/lib/gpuslice/python/pynvml.py",
        "/usr/share/dbus-1/system.d/org.gpuslice.Scheduler1.conf",
        "/etc/gpuslice/config.yaml",
        "/usr/share/man/man1/gpuslice.1.gz",
        "/usr/share/bash-completion/completions/gpuslice",
        f"{EXAMPLES}/{BACKGROUND}",
        f"{EXAMPLES}/gpu-job",
        f"{EXAMPLES}/grafana/gpuslice.json",  # uncompressed: dh_compress skips examples/
        "/usr/share/doc/gpuslice/copyright",
    ):
        assert expected in paths, f"{expected} not in {deb.name}"
    version = subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert version == changelog_version()


def test_install_starts_controller_and_examples_preempt(
    bare_container: Container, deb: Path
) -> None:
    c = bare_container
    _install(c, deb)
    assert c.systemctl("is-active", "gpuslice").stdout.strip() == "active"
    assert c.systemctl("is-enabled", "gpuslice").stdout.strip() == "enabled"
    assert c.run(["gpuslice", "--version"]).stdout.strip().endswith(changelog_version())
    conffiles = c.run(["dpkg-query", "-W", "-f=${Conffiles}", "gpuslice"]).stdout
    assert "/etc/gpuslice/config.yaml" in conffiles
    # Examples are documentation: nothing of them is enabled or running.
    assert c.active_state(BACKGROUND) == "inactive"

    for unit in (BACKGROUND, ON_DEMAND):
        _copy_example(c, unit)
    c.systemctl("daemon-reload")
    c.systemctl("start", "--no-block", BACKGROUND)
    c.wait_active_state(BACKGROUND, "active", STEP)
    c.systemctl("start", "--no-block", ON_DEMAND)
    c.wait_active_state(ON_DEMAND, "active", STEP)
    c.wait_active_state(BACKGROUND, "inactive", STEP)
    c.wait_active_state(ON_DEMAND, "inactive", STEP)
    c.wait_active_state(BACKGROUND, "active", STEP)

    decision = re.compile(r"preempting .*vlm-analysis.* for .*voice-pipeline.* on GPU 0")
    wait_until(
        lambda: decision.search(c.journal("gpuslice.service")),
        STEP,
        what="the preemption decision in `journalctl -u gpuslice`",
    )


def test_upgrade_restarts_controller_not_jobs(
    bare_container: Container, deb: Path, deb_next: Path
) -> None:
    c = bare_container
    _install(c, deb)
    c.run("echo '# kept across upgrades' >> /etc/gpuslice/config.yaml")
    _copy_example(c, BACKGROUND)
    c.systemctl("daemon-reload")
    c.systemctl("start", "--no-block", BACKGROUND)
    c.wait_active_state(BACKGROUND, "active", STEP)
    job_pid = main_pid(c, BACKGROUND)
    controller_pid = main_pid(c, "gpuslice.service")

    _install(c, deb_next)

    version = c.run(["dpkg-query", "-W", "-f=${Version}", "gpuslice"]).stdout
    assert version == changelog_version() + "+upgradetest1"
    wait_until(
        lambda: main_pid(c, "gpuslice.service") not in (0, controller_pid),
        STEP,
        what="a restarted controller",
    )
    assert c.active_state(BACKGROUND) == "active"
    assert main_pid(c, BACKGROUND) == job_pid
    assert "# kept across upgrades" in c.run(["cat", "/etc/gpuslice/config.yaml"]).stdout


def test_remove_keeps_jobs_and_purge_leaves_nothing(bare_container: Container, deb: Path) -> None:
    c = bare_container
    before = file_list(c)
    _install(c, deb)
    _copy_example(c, BACKGROUND)
    c.write_file("/etc/systemd/system/plain-job.service", PLAIN_JOB)
    c.systemctl("daemon-reload")
    c.systemctl("start", "--no-block", BACKGROUND)
    c.wait_active_state(BACKGROUND, "active", STEP)
    job_pid = main_pid(c, BACKGROUND)

    c.run(["apt-get", "remove", "-y", "gpuslice"], timeout=120)
    assert c.active_state("gpuslice.service") in ("inactive", "failed")
    assert c.active_state(BACKGROUND) == "active"
    assert main_pid(c, BACKGROUND) == job_pid
    # The generator is gone and postrm ran daemon-reload: annotated units start ungated.
    dropins = c.systemctl("show", "-P", "DropInPaths", "plain-job.service").stdout
    assert "gpuslice" not in dropins
    c.systemctl("start", "plain-job.service", timeout=30)
    assert c.active_state("plain-job.service") == "active"

    c.run(["apt-get", "purge", "-y", "gpuslice"], timeout=120)
    for unit in (BACKGROUND, "plain-job.service"):
        c.systemctl("stop", unit)
        c.run(["rm", f"/etc/systemd/system/{unit}"])
    c.systemctl("daemon-reload")
    after = file_list(c)
    assert sorted(after - before) == []
    assert sorted(before - after) == []


def test_a_start_waiting_at_its_gate_during_remove_runs_once_gpuslice_is_gone(
    bare_container: Container, deb: Path
) -> None:
    """`apt remove` while a start waits for its GPUs: no controller will answer it again, and
    the daemon-reload of postrm took every gate away, so it runs ungated like every later
    start (its unit has no ExecStartPre= of its own), instead of waiting at its gate for ever
    (TimeoutStartSec=infinity)."""
    c = bare_container
    _install(c, deb)
    for unit in ("holder.service", "waiter.service"):
        c.write_file(f"/etc/systemd/system/{unit}", PLAIN_JOB)  # priority 50 both: no preempt
    c.systemctl("daemon-reload")
    c.systemctl("start", "--no-block", "holder.service")
    c.wait_active_state("holder.service", "active", STEP)
    c.systemctl("start", "--no-block", "waiter.service")
    c.wait_active_state("waiter.service", "activating", STEP)

    c.run(["apt-get", "remove", "-y", "gpuslice"], timeout=120)
    c.wait_active_state("waiter.service", "active", STEP)
    assert "gpuslice.service is not installed any more" in c.journal("waiter.service")
    assert c.active_state("holder.service") == "active"


def test_a_start_waiting_while_gpuslice_is_failed_runs_once_gpuslice_is_removed(
    bare_container: Container, deb: Path
) -> None:
    """`apt remove` of a controller that had failed (here a config.yaml it rejects, exit 78):
    prerm's stop and postrm's reload leave gpuslice.service failed, its record kept by
    systemd though its file is gone, and a start waiting at its gate must still go on."""
    c = bare_container
    _install(c, deb)
    c.write_file("/etc/systemd/system/waiter.service", PLAIN_JOB)
    c.systemctl("daemon-reload")
    c.run(["sed", "-i", "s/^log_level: .*/log_level: loud/", "/etc/gpuslice/config.yaml"])
    c.systemctl("restart", "gpuslice.service", check=False)
    c.wait_active_state("gpuslice.service", "failed", STEP)
    c.systemctl("start", "--no-block", "waiter.service")
    c.wait_active_state("waiter.service", "activating", STEP)

    c.run(["apt-get", "remove", "-y", "gpuslice"], timeout=120)
    assert c.active_state("gpuslice.service") == "failed"
    c.wait_active_state("waiter.service", "active", STEP)
    assert "gpuslice.service is not installed any more" in c.journal("waiter.service")


def test_a_unit_linked_from_roots_home_is_scheduled(bare_container: Container, deb: Path) -> None:
    """`systemctl link /root/linked.service`: the generator (unsandboxed) gates it, so the
    controller must read it too (ProtectHome=read-only, not yes): hidden from it, the unit
    was unmanaged and its gate let through beside the holder of the only GPU."""
    c = bare_container
    _install(c, deb)
    c.write_file("/etc/systemd/system/holder.service", PLAIN_JOB)  # priority 50 both
    c.write_file("/root/linked.service", PLAIN_JOB)
    c.systemctl("link", "/root/linked.service")
    c.systemctl("daemon-reload")
    c.systemctl("start", "--no-block", "holder.service")
    c.wait_active_state("holder.service", "active", STEP)
    c.systemctl("start", "--no-block", "linked.service")

    def waiting() -> bool:
        out = c.run(["gpuslice", "status", "--json"]).stdout
        return any(w["unit"] == "linked.service" for w in json.loads(out)["waiting"])

    wait_until(waiting, STEP, what="linked.service waiting for the GPU held by holder.service")
    assert c.active_state("linked.service") == "activating"
    assert "linked.service: cannot read" not in c.journal("gpuslice.service")


def test_upgrade_keeps_an_enabled_metrics_socket_listening(
    bare_container: Container, deb: Path, deb_next: Path
) -> None:
    """`systemctl enable --now gpuslice-metrics.socket`, then an upgrade: debhelper's
    --no-start alone stopped the socket in preinst and started it nowhere, so the exporter
    stopped answering at every upgrade until the next boot (debian/rules)."""
    c = bare_container
    _install(c, deb)
    c.systemctl("enable", "--now", "gpuslice-metrics.socket")
    assert c.active_state("gpuslice-metrics.socket") == "active"
    _install(c, deb_next)
    assert c.active_state("gpuslice-metrics.socket") == "active"
    assert c.systemctl("is-enabled", "gpuslice-metrics.socket").stdout.strip() == "enabled"


def test_remove_names_a_unit_it_preempted_and_leaves_it_to_the_admin(
    bare_container: Container, deb: Path
) -> None:
    """`apt remove` while a unit is preempted: no controller will ever start it again, so the
    removal says so (gpuslice release-jobs, from prerm) instead of leaving it silently."""
    c = bare_container
    _install(c, deb)
    _copy_example(c, BACKGROUND)  # priority 90, background
    c.write_file("/etc/systemd/system/urgent.service", PLAIN_JOB.replace("=50", "=10"))
    c.systemctl("daemon-reload")
    c.systemctl("start", "--no-block", BACKGROUND)
    c.wait_active_state(BACKGROUND, "active", STEP)
    c.systemctl("start", "--no-block", "urgent.service")
    c.wait_active_state("urgent.service", "active", STEP)
    c.wait_active_state(BACKGROUND, "inactive", STEP)

    removed = c.run(["apt-get", "remove", "-y", "gpuslice"], timeout=120)
    said = removed.stdout + removed.stderr
    assert f"{BACKGROUND} was preempted and nothing will start it again" in said
    assert c.active_state(BACKGROUND) == "inactive"
    assert c.active_state("urgent.service") == "active"


def test_a_gated_start_during_removal_does_not_start_the_controller_again(
    bare_container: Container, deb: Path
) -> None:
    """Between prerm's stop of the controller and postrm's daemon-reload, every gated unit
    still Wants= gpuslice.service (its gate's drop-in): a gated start then (a Restart=, a
    timer, by hand) started the controller again, release-jobs left every unit to it, and
    it ran on from the files dpkg removed. prerm's runtime drop-in makes that start a
    skipped one; the gate waits, and goes on once the removal is done."""
    c = bare_container
    _install(c, deb)
    c.write_file("/etc/systemd/system/plain-job.service", PLAIN_JOB)
    c.systemctl("daemon-reload")
    # prerm alone, as dpkg runs it before it removes the files
    c.run(["/var/lib/dpkg/info/gpuslice.prerm", "remove"], timeout=120)
    assert c.active_state("gpuslice.service") == "inactive"
    c.systemctl("start", "--no-block", "plain-job.service")
    c.wait_active_state("plain-job.service", "activating", STEP)
    wait_until(
        lambda: (
            c.systemctl("show", "-P", "ConditionResult", "gpuslice.service").stdout.strip() == "no"
        ),
        STEP,
        what="the start of gpuslice.service that plain-job.service wants, skipped",
    )
    assert c.active_state("gpuslice.service") == "inactive"
    assert c.active_state("plain-job.service") == "activating"

    c.run(["apt-get", "remove", "-y", "gpuslice"], timeout=120)
    c.wait_active_state("plain-job.service", "active", STEP)
    dropin = "/run/systemd/system/gpuslice.service.d/gpuslice-removal.conf"
    assert c.run(["test", "-e", dropin], check=False).returncode != 0
