"""The `gpuslice` command: run the controller, show status, check and enroll units."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import click

from gpuslice import __version__
from gpuslice.annotations import check_file, load_spec, scan
from gpuslice.config import ConfigError, load_config_with_warnings
from gpuslice.core.model import UnitKind
from gpuslice.paths import CONFIG_PATH

ENROLL_DROPIN = "gpuslice.conf"

config_option = click.option(
    "--config",
    "config_path",
    default=CONFIG_PATH,
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The gpuslice configuration file.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuslice")
def main() -> None:
    """Priority scheduling of GPU jobs that are ordinary systemd units.

    Annotate a unit with an [X-GPUSlice] section (Priority=0-999, lower is more urgent;
    Type=on-demand|background; GPUs=N; Requeue=yes|no), run `systemctl daemon-reload`,
    and start it with `systemctl start`. Decisions are logged to `journalctl -u gpuslice`.
    """


@main.command()
@config_option
def controller(config_path: str) -> None:
    """Run the controller daemon (started by gpuslice.service)."""
    from gpuslice.controller import run

    sys.exit(asyncio.run(run(Path(config_path), os.environ.get("GPUSLICE_BUS_ADDRESS"))))


async def _call_status(address: str | None) -> str:
    from dbus_next import BusType, Message, MessageType
    from dbus_next.aio import MessageBus

    from gpuslice.service import BUS_NAME, INTERFACE, OBJECT_PATH

    bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
    try:
        reply = await bus.call(
            Message(destination=BUS_NAME, path=OBJECT_PATH, interface=INTERFACE, member="Status")
        )
    finally:
        bus.disconnect()
    if reply is None or reply.message_type == MessageType.ERROR:
        detail = reply.body[0] if reply is not None and reply.body else "no reply"
        raise click.ClickException(
            f"the gpuslice controller did not answer ({detail}); "
            "is it running? Try: systemctl status gpuslice"
        )
    return str(reply.body[0])


@main.command()
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the stable JSON form (version 1; see gpuslice/status.py).",
)
def status(as_json: bool) -> None:
    """Show each GPU's holder, waiting units with their reasons, preempted, held,
    finished and failed units."""
    from gpuslice.status import render

    text = asyncio.run(_call_status(os.environ.get("GPUSLICE_BUS_ADDRESS")))
    if as_json:
        click.echo(json.dumps(json.loads(text), indent=2, sort_keys=True))
    else:
        click.echo(render(json.loads(text)))


@main.command()
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@config_option
@click.option("--root", default="/", show_default=True, hidden=True)
def check(files: tuple[str, ...], config_path: str, root: str) -> None:
    """Validate config.yaml and unit annotations; exit 1 on any error.

    Without FILES, checks the configuration and every installed unit. With FILES, checks
    those unit files (and any .yaml file as a gpuslice configuration).
    """
    errors = 0
    messages: list[str] = []
    yaml_files = [f for f in files if f.endswith((".yaml", ".yml"))]
    unit_files = [f for f in files if f not in yaml_files]
    for path in yaml_files or ([] if files else [config_path]):
        try:
            _, warnings = load_config_with_warnings(Path(path))
            messages += [f"warning: {w}" for w in warnings]
        except ConfigError as e:
            errors += 1
            messages.append(f"error: {e}")
    if unit_files:
        problems = [p for f in unit_files for p in check_file(f)]
        checked = len(unit_files)
    else:
        result = scan(root) if not files else None
        problems = result.problems if result is not None else []
        checked = len(result.specs) if result is not None else 0
    for problem in problems:
        messages.append(f"{problem.severity}: {problem}")
        errors += problem.severity == "error"
    for message in messages:
        click.echo(message, err=True)
    if errors:
        raise SystemExit(1)
    click.echo(f"ok: {checked} annotated unit(s) checked, {len(messages)} warning(s)")


@main.command()
@click.argument("unit")
@click.option(
    "--priority", type=click.IntRange(0, 999), required=True, help="0-999, lower is more urgent."
)
@click.option(
    "--type",
    "kind",
    type=click.Choice([k.value for k in UnitKind]),
    default=UnitKind.ON_DEMAND.value,
    show_default=True,
)
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--requeue/--no-requeue",
    default=True,
    show_default=True,
    help="Restart the unit when capacity returns after it was preempted.",
)
@click.option("--no-reload", is_flag=True, help="Do not run systemctl daemon-reload.")
@click.option("--root", default="/", show_default=True, hidden=True)
def enroll(
    unit: str, priority: int, kind: str, gpus: int, requeue: bool, no_reload: bool, root: str
) -> None:
    """Annotate UNIT through a drop-in (for units you cannot edit), validate it, reload."""
    if "." not in unit:
        unit += ".service"
    dropin_dir = Path(root) / "etc/systemd/system" / f"{unit}.d"
    dropin = dropin_dir / ENROLL_DROPIN
    dropin_dir.mkdir(parents=True, exist_ok=True)
    text = (
        "# Written by `gpuslice enroll`; edit or remove it with systemctl edit.\n"
        "[X-GPUSlice]\n"
        f"Priority={priority}\nType={kind}\nGPUs={gpus}\nRequeue={'yes' if requeue else 'no'}\n"
    )
    tmp = dropin.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, dropin)
    spec, problems = load_spec(unit, root)
    for problem in problems:
        click.echo(f"{problem.severity}: {problem}", err=True)
    if spec is None or any(p.severity == "error" for p in problems):
        dropin.unlink()
        raise click.ClickException(f"{unit}: annotation rejected; removed {dropin}")
    if spec.priority != priority:
        click.echo(
            f"warning: a later drop-in overrides this one: {unit} has priority {spec.priority}",
            err=True,
        )
    click.echo(f"enrolled {spec.describe()} via {dropin}")
    if not no_reload:
        subprocess.run(["systemctl", "daemon-reload"], check=True)


if __name__ == "__main__":
    main()
