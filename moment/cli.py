"""The ``moment`` command: one entry point, one verb per pipeline stage.

Tables and trees for people (rich), ``--json`` for scripts. A user mistake prints one line on
stderr and exits 1 (bad input) or 2 (bad usage); tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from moment import __version__
from moment.errors import MomentError, UsageError

out = Console()
err = Console(stderr=True, soft_wrap=True)  # one message, one line: never wrapped


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors in one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        err.print(f"[red]moment: error:[/] {message} (see `{self.prog} --help`)", highlight=False)
        raise SystemExit(2)


def _add_profile_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="build a topology profile of this machine or of saved captures",
        description=(
            "Profile a server's PCIe topology. With --from DIR, read the saved captures found there "
            "(lspci-tv.txt, lspci-vvv.txt or lspci-vvnn.txt, dmidecode.txt, nvidia-smi-topo-m.txt, "
            "nccl-topo.xml); without it, profile this machine (sysfs, lspci, dmidecode as root, nvidia-smi)."
        ),
    )
    p.add_argument("--from", dest="source", metavar="DIR", help="folder of saved captures")
    p.add_argument("--out", metavar="FILE", help="write the YAML profile here (default: print it)")
    p.add_argument("--name", help="profile name (default: the folder name, or the host name)")
    p.add_argument("--picture", metavar="FILE.svg", help="also draw the topology as SVG")
    p.add_argument("--json", action="store_true", help="print the inventory as JSON")
    p.set_defaults(func=cmd_profile)


def _add_inspect_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a profile's inventory and PCIe tree",
        description="Inventory (sockets, switches, slots, GPUs, NVMe, NICs, NVLink) and the PCIe tree of a profile.",
    )
    p.add_argument("profile", help="a bundled profile name (see `moment inspect --list`) or a YAML file")
    p.add_argument("--json", action="store_true", help="machine-readable inventory")
    p.add_argument("--picture", metavar="FILE.svg", help="draw the topology as SVG")
    p.set_defaults(func=cmd_inspect)


def _add_demo_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the pipeline on a bundled profile (what the README's first command does)")
    p.add_argument("--profile", default="moment-machine-b", help="bundled profile to use (default: moment-machine-b)")
    p.add_argument("--workdir", default="moment-demo", help="where the demo writes its files (default: ./moment-demo)")
    p.set_defaults(func=cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moment",
        description=(
            "Out-of-core GNN training planned around a server's PCIe topology: "
            "profile → plan → place → train."
        ),
    )
    parser.add_argument("--version", action="version", version=f"moment {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    _add_profile_args(sub)
    _add_inspect_args(sub)
    _add_demo_args(sub)
    sub.add_parser("profiles", help="list the bundled topology profiles").set_defaults(func=cmd_profiles)
    return parser


# --- verbs ---------------------------------------------------------------------------------


def cmd_profile(args: argparse.Namespace) -> int:
    from moment.topology import profiler
    from moment.topology.profile_io import dump_profile, save_profile

    if args.source:
        caps = profiler.read_capture_dir(args.source)
        name = args.name or Path(args.source).resolve().name
    else:
        import socket

        caps = profiler.capture_live()
        name = args.name or socket.gethostname()
    machine, warnings = profiler.build_profile(caps, name)
    for w in warnings:
        err.print(f"[yellow]warning:[/] {w}", highlight=False)
    if args.picture:
        _write_picture(machine, args.picture)
    if args.out:
        save_profile(machine, args.out)
    if args.json:
        from moment.topology.inventory import inventory

        print(json.dumps(inventory(machine), indent=2))
    elif args.out:
        from moment.topology.render import print_summary

        print_summary(out, machine)
        out.print(f"profile written to [bold]{args.out}[/]")
    else:
        sys.stdout.write(dump_profile(machine))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from moment.topology.inventory import inventory
    from moment.topology.profile_io import resolve_profile
    from moment.topology.render import print_inspect

    machine = resolve_profile(args.profile)
    if args.picture:
        _write_picture(machine, args.picture)
    if args.json:
        print(json.dumps(inventory(machine), indent=2))
    else:
        print_inspect(out, machine)
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    from rich.table import Table

    from moment.topology.inventory import counts
    from moment.topology.profile_io import bundled_profiles, load_profile

    keys = ("sockets", "switches", "slots", "gpus", "nvme", "nics", "nvlinks")
    table = Table(title="bundled topology profiles (moment inspect NAME for details)")
    table.add_column("name", no_wrap=True)
    for key in keys:
        table.add_column(key, justify="right")
    for name, path in sorted(bundled_profiles().items()):
        c = counts(load_profile(path))
        table.add_row(name, *(str(c[k]) for k in keys))
    out.print(table)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from moment.topology import profiler
    from moment.topology.profile_io import resolve_profile, save_profile
    from moment.topology.render import print_inspect, print_summary

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out.rule(f"[bold]1. topology profile: {args.profile} (bundled)")
    machine = resolve_profile(args.profile)
    print_inspect(out, machine)
    picture = work / f"{args.profile}.svg"
    _write_picture(machine, str(picture))
    out.rule("[bold]2. live profile of this machine")
    caps = profiler.capture_live()
    live, warnings = profiler.build_profile(caps, "this-machine")
    for w in warnings:
        out.print(f"[yellow]note:[/] {w}", highlight=False)
    print_summary(out, live)
    save_profile(live, work / "this-machine.yaml")
    out.print(f"\nwrote {picture} and {work / 'this-machine.yaml'}")
    out.print("[dim]plan, place and train arrive with their stages (issues #3-#5).[/]")
    return 0


def _write_picture(machine, path: str) -> None:
    from moment.topology.picture import render_svg
    from moment.topology.profile_io import atomic_write_text

    if not path.endswith(".svg"):
        raise UsageError(f"--picture {path}: only .svg pictures are written")
    atomic_write_text(Path(path), render_svg(machine))
    err.print(f"picture written to {path}", highlight=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return func(args)
    except MomentError as exc:
        err.print(f"[red]moment {args.verb}: error:[/] {exc}", highlight=False)
        return exc.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
