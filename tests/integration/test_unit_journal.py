"""Issue 9 against a real systemd and journald: each decision about a unit shows in that unit's
own journal (`journalctl -u UNIT`, `systemctl status UNIT`) with structured fields, while
`journalctl -u gpuslice` keeps telling the same story once."""

from __future__ import annotations

from tests.bed.container import Container, wait_until
from tests.integration.jobs import reload, wait_journal, wait_state, write_job

VOICE = "voice.service"
BG = "bg.service"
PREEMPT = "preempting bg.service (priority 90) for voice.service (priority 10) on GPU 0"
WAITING = "voice.service waiting for bg.service (priority 90) to stop on GPU 0"
GRANT = "starting voice.service (priority 10) on GPU 0"
REQUEUE = "restarting preempted bg.service (priority 90) on GPU 0"


def test_a_preemption_in_the_units_own_journals(container: Container) -> None:
    write_job(container, BG, 90, "background")
    write_job(container, VOICE, 10)
    reload(container)
    wait_state(container, BG, "active")
    container.systemctl("start", "--no-block", VOICE)
    wait_state(container, VOICE, "active")

    wait_until(lambda: PREEMPT in container.journal(BG), 20, what="the preemption in bg's journal")
    voice = wait_until(
        lambda: j if GRANT in (j := container.journal(VOICE, "-o", "cat")) else None,
        20,
        what="voice's grant in its own journal",
    )
    lines = voice.splitlines()
    assert lines.index(WAITING) < lines.index(GRANT), voice
    status = container.systemctl("status", "--no-pager", "-n", "20", VOICE, check=False).stdout
    assert WAITING in status and GRANT in status, status

    # the controller's story: each line once, as before
    story = container.journal("gpuslice.service", "-o", "cat")
    for line in (PREEMPT, WAITING, GRANT):
        assert story.count(line) == 1, story

    preempts = container.journal_entries("GPUSLICE_DECISION=preempt")
    assert len(preempts) == 1, preempts
    entry = preempts[0]
    assert {k: entry.get(k) for k in _FIELDS} == {
        "MESSAGE": PREEMPT,
        "PRIORITY": "6",
        "SYSLOG_IDENTIFIER": "gpuslice",
        "OBJECT_SYSTEMD_UNIT": BG,
        "GPUSLICE_UNIT": BG,
        "GPUSLICE_FOR": VOICE,
        "GPUSLICE_PRIORITY": "90",
        "GPUSLICE_FOR_PRIORITY": "10",
        "GPUSLICE_GPUS": "0",
        "_SYSTEMD_UNIT": "gpuslice.service",
        "_UID": "0",
    }
    (grant,) = container.journal_entries("GPUSLICE_DECISION=grant", f"GPUSLICE_UNIT={VOICE}")
    assert grant["GPUSLICE_GPUS"] == "0"
    assert int(grant["GPUSLICE_WAITED_USEC"]) > 0  # it waited for bg to stop
    (waited,) = container.journal_entries("GPUSLICE_DECISION=wait", f"GPUSLICE_UNIT={VOICE}")
    assert waited["GPUSLICE_CAUSE"] == "victims-stopping"
    assert waited["GPUSLICE_UNTIL"] == "the units named have stopped"

    # stopped by hand: held; bg comes back; each says so in its own journal
    container.systemctl("stop", VOICE)
    wait_state(container, BG, "active")
    wait_journal(container, REQUEUE)
    held = "voice.service was stopped outside gpuslice: held until started again"
    wait_until(lambda: held in container.journal(VOICE), 20, what="the hold in voice's journal")
    wait_until(lambda: REQUEUE in container.journal(BG), 20, what="the requeue in bg's journal")
    held_units = [e["GPUSLICE_UNIT"] for e in container.journal_entries("GPUSLICE_DECISION=hold")]
    assert held_units == [VOICE]


_FIELDS = (
    "MESSAGE",
    "PRIORITY",
    "SYSLOG_IDENTIFIER",
    "OBJECT_SYSTEMD_UNIT",
    "GPUSLICE_UNIT",
    "GPUSLICE_FOR",
    "GPUSLICE_PRIORITY",
    "GPUSLICE_FOR_PRIORITY",
    "GPUSLICE_GPUS",
    "_SYSTEMD_UNIT",
    "_UID",
)
