"""``moment infer``: a trained checkpoint over every vertex, layer by layer, out of core
(``trainer.infer`` does the work; one or several ranks)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moment.cli.output import err, out
from moment.options import add_arguments, values
from moment.progress import Reporter
from trainer.infer_options import InferOptions


def add_infer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "infer",
        help="embeddings and predictions for every vertex: layer-wise, full-neighbourhood, out of core",
        description=(
            "Run a trained checkpoint over the full in-neighbourhood of every vertex, one layer at a time: each "
            "layer's output for all vertices goes to disk and is read back as the next layer's input, features come "
            "from the placed dataset's tiers. Writes embeddings.npy, predictions.npy (original vertex ids) and "
            "inference.json; a killed run continues from its last finished chunk when run again."
        ),
    )
    add_arguments(p, InferOptions)
    p.set_defaults(func=cmd_infer)


def cmd_infer(args: argparse.Namespace) -> int:
    from trainer import infer, launch

    opts = InferOptions(**values(InferOptions, args))

    def run_ranks(cmd: list[str]) -> int:
        err.print(f"running: {launch.format_command(cmd)}")
        return launch.run(cmd)

    with Reporter(err) as bars:
        manifest = infer.infer(opts, progress=bars, log=err.print, launch=run_ranks)
    print_inference(args.out, manifest)
    return 0


def print_inference(out_dir: str | Path, manifest) -> None:
    """What ``moment infer`` (and the demo) wrote: the summary lines, then the files."""
    from trainer.infer import summary

    for line in summary(manifest):
        out.print(line)
    files = ", ".join(f"{e.path} {'×'.join(map(str, e.shape))} {e.dtype}" for e in manifest.arrays.values())
    out.print(f"inference written to [bold]{out_dir}[/]: {files}, inference.json (original vertex ids)")
