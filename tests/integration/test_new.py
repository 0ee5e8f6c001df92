"""`gpuslice new` against a real systemd: the unit it writes is gated and preempted like a
hand-written one, and `enroll --memory` round-trips through `gpuslice check`."""

from __future__ import annotations

import base64

from tests.bed.container import Container, WaitTimeout, wait_until
from tests.integration.jobs import (
    UNIT_DIR,
    reload,
    wait_journal,
    wait_started,
    wait_state,
    write_job,
)

BG = "bg.service"


def test_a_unit_from_gpuslice_new_preempts_and_is_preempted_like_a_hand_written_one(
    container: Container,
) -> None:
    write_job(container, BG, 90, "background")
    reload(container)
    wait_state(container, BG, "active")
    container.run(["gpuslice", "new", "voice", "--priority", "10", "--now", "--", "sleep", "3"])
    wait_journal(container, "preempting bg.service (priority 90) for voice.service (priority 10)")
    wait_started(container, "voice.service")  # it runs 3 s: a poll of its state may miss it
    wait_state(container, BG, "active", timeout=30)  # voice finished: bg is back
    assert container.run(["systemctl", "show", "-P", "Result", "voice.service"]).stdout.strip() == (
        "success"
    )
    # a background job from `new` yields to an urgent hand-written one
    container.systemctl("stop", BG)
    container.run(
        ["gpuslice", "new", "vlm", "--priority", "80", "--type", "background", "--", "sleep", "600"]
    )
    container.systemctl("start", "vlm.service")
    write_job(container, "urgent.service", 5, seconds=1)
    reload(container)
    container.systemctl("start", "--no-block", "urgent.service")
    wait_journal(container, "preempting vlm.service (priority 80) for urgent.service (priority 5)")
    wait_state(container, "vlm.service", "active", timeout=30)


def test_enroll_memory_round_trips_through_check(container: Container) -> None:
    write_job(container, "plain.service", None)
    out = container.run(
        ["gpuslice", "enroll", "plain", "--priority", "20", "--memory", "12G", "--devices", "0"]
    ).stdout
    assert "enrolled plain.service (priority 20)" in out
    dropin = container.run(["cat", f"{UNIT_DIR}/plain.service.d/gpuslice.conf"]).stdout
    assert "Memory=12G\nDevices=0\n" in dropin
    check = container.run(["gpuslice", "check"])
    assert check.stdout.startswith("ok: ")


def test_an_annotated_user_unit_says_in_its_journal_that_it_is_not_scheduled(
    container: Container,
) -> None:
    """gpuslice schedules system units only: a `systemctl --user` unit with an [X-GPUSlice]
    section starts at once, and its own journal says why (data/gpuslice-user-generator, run
    by the user's real manager)."""
    container.run(["useradd", "--create-home", "--uid", "1500", "ann"])
    # what pam_systemd (not in the bed's tree) would give the user's manager
    container.write_file(
        "/etc/systemd/system/user@1500.service.d/runtime.conf",
        "[Service]\nEnvironment=XDG_RUNTIME_DIR=/run/user/1500\n",
    )
    units = "/home/ann/.config/systemd/user"
    container.run(["runuser", "-u", "ann", "--", "mkdir", "-p", units])
    container.write_file(
        f"{units}/asr.service",
        "[Service]\nType=oneshot\nExecStart=/bin/true\n\n[X-GPUSlice]\nPriority=5\n",
    )
    container.run(["chown", "-R", "ann:ann", "/home/ann/.config"])
    reload(container)
    container.systemctl("start", "user@1500.service")
    user = ["runuser", "-u", "ann", "--", "env", "XDG_RUNTIME_DIR=/run/user/1500", "systemctl"]
    container.run([*user, "--user", "start", "asr.service"])  # not held: it has no gate
    said = (
        "gpuslice does not schedule user units: the [X-GPUSlice] section of asr.service is "
        "ignored and it starts without waiting for GPUs"
    )

    def in_its_journal() -> str | None:  # journald writes a moment after the unit ran
        container.run(["journalctl", "--sync"])
        query = ["journalctl", "--no-pager", "-o", "cat", "_SYSTEMD_USER_UNIT=asr.service"]
        out = container.run(query, check=False).stdout
        return out if said in out else None

    try:
        wait_until(in_its_journal, 20, what="the unit's journal line")
    except WaitTimeout:  # say which fields journald gave the line, if it has it at all
        lines = ["journalctl", "--no-pager", "-o", "verbose", "_UID=1500"]
        print(container.run(lines, check=False).stdout)
        raise
    status = [*user, "--user", "status", "--no-pager", "-n", "20", "asr.service"]
    out = container.run(status, check=False).stdout
    assert said in out and "gpuslice-not-scheduled.conf" in out, out  # status shows both
    assert "asr.service" not in container.journal("gpuslice.service")
    container.systemctl("stop", "user@1500.service")


def test_every_argument_reaches_the_job_as_given(container: Container) -> None:
    """What `gpuslice new` escapes (quotes, backslashes, `$`, `%`, line ends, other control
    characters as `\\xNN`) systemd decodes back: the job gets each argument byte for byte."""
    arg = 'a "b" \\c $HOME %n\r\nd\te\x01\x1b[31mf\x7f g'
    container.run(
        [
            "gpuslice",
            "new",
            "echoer",
            "--priority",
            "50",
            "--now",
            "--",
            "/bin/sh",
            "-c",
            'printf %s "$1" > /run/echoed',
            "sh",
            arg,
        ]
    )
    wait_journal(container, "echoer.service finished")  # not `inactive`: its job may be queued
    echoed = base64.b64decode(container.run(["base64", "-w0", "/run/echoed"]).stdout).decode()
    assert echoed == arg, (echoed, container.run(["cat", f"{UNIT_DIR}/echoer.service"]).stdout)


def test_two_new_of_one_name_at_once_leave_one_whole_unit(container: Container) -> None:
    """Two `gpuslice new racer` at once, again and again (two admins, a script in a loop):
    they take turns on /etc/systemd/system/.gpuslice.lock, so each one reads, writes and
    reads back alone. Every one says it wrote, and the unit left is whole and one of the
    two, never a mix nor one that neither asked for; systemd loads it."""
    container.run(
        "for i in $(seq 20); do "
        "gpuslice new racer --priority 10 --no-reload -- /bin/sleep 10 >/run/race-a.$i 2>&1 & "
        "gpuslice new racer --priority 20 --no-reload -- /bin/sleep 20 >/run/race-b.$i 2>&1 & "
        "wait; done",
        timeout=300,
    )
    said = container.run("cat /run/race-*").stdout
    assert said.count("wrote ") == 40 and "Error" not in said, said
    text = container.run(["cat", f"{UNIT_DIR}/racer.service"]).stdout
    assert text.count("[X-GPUSlice]") == 1 and text.count("ExecStart=") == 1, text
    assert ('"/bin/sleep" "10"\n' in text and "Priority=10\n" in text) or (
        '"/bin/sleep" "20"\n' in text and "Priority=20\n" in text
    ), text
    reload(container)
    assert container.run(["systemctl", "show", "-P", "LoadState", "racer.service"]).stdout == (
        "loaded\n"
    )
    lock = container.run(["stat", "-c", "%a %U", f"{UNIT_DIR}/.gpuslice.lock"]).stdout
    assert lock == "600 root\n"  # no other user can open it, and so hold it


def test_a_program_path_systemd_would_refuse_for_its_length_is_refused(
    container: Container,
) -> None:
    """systemd takes an ExecStart= program path of at most 4095 bytes (PATH_MAX with the NUL):
    a longer one is a fatal error of the unit (bad-setting). `gpuslice new` writes the longest
    and refuses the next, which it had reported written."""
    head = ("/" + "d" * 200) * 20

    def path_of(size: int) -> str:
        return head + "/" + "r" * (size - len(head) - 1)

    written = container.run(
        ["gpuslice", "new", "longest", "--priority", "50", "--no-reload", "--", path_of(4095)]
    ).stdout
    assert "wrote " in written, written
    refused = container.run(
        ["gpuslice", "new", "longer", "--priority", "50", "--no-reload", "--", path_of(4096)],
        check=False,
    )
    assert refused.returncode == 2 and "a path of 4096 bytes or more" in refused.stderr
    # what systemd makes of the longer path, written by hand
    container.write_file(f"{UNIT_DIR}/byhand.service", f'[Service]\nExecStart="{path_of(4096)}"\n')
    reload(container)
    state = ["systemctl", "show", "-P", "LoadState"]
    assert container.run([*state, "longest.service"]).stdout == "loaded\n"
    assert container.run([*state, "byhand.service"]).stdout == "bad-setting\n"
    container.run(["rm", f"{UNIT_DIR}/byhand.service", f"{UNIT_DIR}/longest.service"])
    reload(container)
