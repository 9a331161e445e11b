"""Stage 1 verbs: ``moment profile``, ``inspect``, ``profiles`` and ``bench`` (measured figures
into a profile)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.markup import escape

from moment.cli.output import err, out
from moment.errors import UsageError


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="build a topology profile of this machine or of saved captures",
        description="Profile a server's PCIe topology, from a folder of saved captures or this machine.",
    )
    p.describe = _profile_description  # the capture files, from the sources' registry when --help is printed
    p.add_argument("--from", dest="source", metavar="DIR", help="folder of saved captures")
    p.add_argument("--out", metavar="FILE", help="write the YAML profile here (default: print it)")
    p.add_argument("--name", help="profile name (default: the folder name, or the host name)")
    p.add_argument("--picture", metavar="FILE.svg", help="also draw the topology as SVG")
    p.add_argument("--json", action="store_true", help="print the inventory as JSON")
    p.set_defaults(func=cmd_profile)


def _profile_description() -> str:
    """What ``moment profile`` reads, from the capture sources' registry (imported only for --help)."""
    from moment.topology.profiler import SOURCES

    files = ", ".join(" or ".join(s.files[:2]) for s in SOURCES.values() if s.files)
    live = ", ".join(
        (s.command[0] if s.command else s.name) + (" as root" if s.root_for else "")
        for s in SOURCES.values()
        if s.command or s.scan
    )
    return (
        f"Profile a server's PCIe topology. With --from DIR, read the saved captures found there ({files}); "
        f"without it, profile this machine ({live})."
    )


def add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a profile's inventory and PCIe tree",
        description="Inventory (sockets, switches, slots, GPUs, NVMe, NICs, NVLink) and the PCIe tree of a profile.",
    )
    p.add_argument("profile", help="a bundled profile name (see `moment profiles`) or a YAML file")
    p.add_argument("--json", action="store_true", help="machine-readable inventory")
    p.add_argument("--picture", metavar="FILE.svg", help="draw the topology as SVG")
    p.set_defaults(func=cmd_inspect)


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="measure SSD, DRAM and GPU-copy bandwidths; write them into a profile",
        description=(
            "Measure what the planner would otherwise take from tables: random reads of files on each "
            "SSD, of 4 KiB pages (its IOPS) and of 1 MiB (its read GB/s), DRAM copy GB/s, host→GPU and "
            "GPU↔GPU copy GB/s when CUDA is present. Read-only: files and devices are opened O_RDONLY, "
            "never written."
        ),
    )
    p.add_argument("--profile", help="profile to put the figures into (bundled name or file)")
    p.add_argument("--out", metavar="FILE", help="write the profile with measured figures here")
    p.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="PATH[:DEVICE]",
        help="a file (or block device) on an SSD to read; :nvme3 names the profile's SSD it sits on",
    )
    p.add_argument(
        "--read-size",
        type=int,
        default=4096,
        help="bytes per small random read (default 4096: the page the planner counts IOPS in; "
        "another size is reported, not written as iops)",
    )
    p.add_argument(
        "--large-read", type=int, default=1 << 20, help="bytes per large random read, for read_gbps (default 1 MiB)"
    )
    p.add_argument("--queue-depth", type=int, default=32, help="reads in flight (default 32)")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement (default 2)")
    p.add_argument("--no-dram", action="store_true", help="skip the DRAM copy")
    p.add_argument("--json", action="store_true", help="machine-readable figures")
    p.set_defaults(func=cmd_bench)


def add_profiles(sub: argparse._SubParsersAction) -> None:
    what = "list the bundled topology profiles"
    sub.add_parser("profiles", help=what, description=what).set_defaults(func=cmd_profiles)


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
        err.print(f"[yellow]warning:[/] {escape(w)}")
    if args.picture:
        write_picture(machine, args.picture)
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
        write_picture(machine, args.picture)
    if args.json:
        print(json.dumps(inventory(machine), indent=2))
    else:
        print_inspect(out, machine)
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.measure import Measurement
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
    # A log or a pipe has no width to fit: print whole headers there instead of cutting them at 80.
    whole = Measurement.get(out, out.options.update(width=1000), table).maximum
    wide = out if out.is_terminal else Console(file=out.file, width=max(out.width, whole), highlight=False)
    wide.print(table)
    return 0


def write_picture(machine, path: str) -> None:
    """The profile's topology as SVG at ``path`` (``--picture``)."""
    from moment.fileio import atomic_write_text
    from moment.topology.picture import render_svg

    if not path.endswith(".svg"):
        raise UsageError(f"--picture {path}: only .svg pictures are written")
    atomic_write_text(Path(path), render_svg(machine))
    err.print(f"picture written to {path}")


def cmd_bench(args: argparse.Namespace) -> int:
    from moment.topology import measure
    from moment.topology.profile_io import resolve_profile, save_profile

    if args.out and not args.profile:
        raise UsageError("--out needs --profile (the profile to put the figures into)")
    for flag, size in (("--read-size", args.read_size), ("--large-read", args.large_read)):
        if size < 512 or size % 512:
            raise UsageError(f"{flag} must be a multiple of 512 bytes")
    if args.queue_depth < 1 or args.seconds <= 0:
        raise UsageError("--queue-depth and --seconds must be positive")
    machine = resolve_profile(args.profile) if args.profile else None
    got = measure.measure(
        args.file,
        machine,
        args.read_size,
        args.queue_depth,
        args.seconds,
        dram=not args.no_dram,
        large_read=args.large_read,
    )
    if machine is not None and args.out:
        save_profile(measure.apply_measurements(machine, got.ssd, got.dram, got.h2d, got.peer), args.out)
    if args.json:
        print(json.dumps({"measurements": got.rows, "profile_out": args.out}, indent=2))
        return 0
    from rich.table import Table

    table = Table(title="moment bench (GB/s per direction)")
    for col in ("measurement", "GB/s", "IOPS", "profile device", "note"):
        table.add_column(col)
    for r in got.rows:
        note = r.get("note") or ("" if r.get("direct", True) else "page cache not bypassed (no O_DIRECT here)")
        table.add_row(
            r["what"],
            f"{r['gbps']:.3f}" if r.get("gbps") else "-",
            f"{r['iops']:,.0f}" if r.get("iops") else "",
            r.get("device") or "",
            note,
        )
    out.print(table)
    if args.out:
        out.print(f"profile with measured figures written to [bold]{args.out}[/]")
    return 0
