"""The bed itself: a unit written inside starts under the container's systemd and logs."""

from __future__ import annotations

from tests.bed.container import Container, wait_until

UNIT = """\
[Unit]
Description=bed smoke test

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/echo hello from the bed
"""


def test_unit_starts_and_logs(bare_container: Container) -> None:
    bare_container.write_file("/etc/systemd/system/bed-smoke.service", UNIT)
    bare_container.systemctl("daemon-reload")
    bare_container.systemctl("start", "bed-smoke.service")

    result = bare_container.systemctl("is-active", "bed-smoke.service", check=False)
    assert result.stdout.strip() == "active"
    wait_until(
        lambda: "hello from the bed" in bare_container.journal("bed-smoke.service"),
        timeout=10,
        what="bed-smoke.service's output in the journal",
    )
