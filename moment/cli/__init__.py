"""The ``moment`` command: one entry point, one verb per pipeline stage.

Tables and trees for people (rich), ``--json`` for scripts. A user mistake prints one line on
stderr naming the verb and exits 1 (bad input or state) or 2 (bad usage); a signal exits 128 +
its number (130 Ctrl-C, 143 SIGTERM) with one line; tracebacks are for bugs only.

The verbs live one module per stage (``profile``, ``plan``, ``data``, ``train``, ``demo``), each
with its parser builders (``add_*``) and its ``cmd_*`` functions; they import the stage they
drive inside the function, so ``moment --help`` and ``moment plan`` never load torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from rich.markup import escape

from moment import __version__
from moment.cli import data, demo, infer, plan, profile, train
from moment.cli.args import Parser
from moment.cli.output import err, print_error
from moment.errors import Interrupted, MomentError
from moment.procs import interruptible

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moment",
        description=(
            "Out-of-core GNN training planned around a server's PCIe topology: profile → plan → place → train."
        ),
    )
    parser.add_argument("--version", action="version", version=f"moment {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser)
    profile.add_profile(sub)
    profile.add_inspect(sub)
    plan.add_plan(sub)
    plan.add_score(sub)
    profile.add_bench(sub)
    data.add_dataset(sub)
    data.add_place(sub)
    train.add_train(sub)
    infer.add_infer(sub)
    demo.add_demo(sub)
    profile.add_profiles(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    who = " ".join(["moment", args.verb, *(v for k, v in sorted(vars(args).items()) if k.endswith("_verb") and v)])
    try:
        with interruptible():
            return func(args)
    except MomentError as exc:
        print_error(who, escape(str(exc)))
        return exc.exit_code
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (moment.procs): 128 + the signal
        err.print(f"{who}: {escape(str(exc)) if isinstance(exc, Interrupted) else 'interrupted'}")
        return getattr(exc, "exit_code", 130)
    except BrokenPipeError:
        return 0
    except OSError as exc:  # read-only file system, disk full, a directory where a file should be ...
        where = f"{exc.filename}: " if exc.filename else ""
        print_error(who, escape(where + str(exc.strerror or exc)))
        return 1
