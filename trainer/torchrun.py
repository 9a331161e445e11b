"""``python -m trainer.torchrun``: torchrun (``torch.distributed.run``, same arguments) as moment
runs it, whose stop and whose failures are one line each instead of tracebacks.

* A signal (forwarded by the launcher, :mod:`moment.procs`): torchrun sends it to the ranks and
  waits for them, as always; then this exits 128 + signal, without torchrun's SignalException
  traceback.
* Failed ranks: a rank reports its own error in one line (``trainer.loop.main``), so torchrun's
  ChildFailedError box is replaced by one line per rank that could not say anything itself
  (killed by a signal: out of memory, say); the exit status is the first failure's.
* A lost rendezvous store (several nodes): node 0's torchrun hosts it and exits when its ranks
  end; another node's torchrun still watching its own ranks then fails to reach it, a race seen
  when node 0 refuses another node's data. One line saying so, exit 1; the cause is in node 0's
  log (and usually in this node's ranks' own line just before).

torchrun's own log defaults to CRITICAL here (``LOGLEVEL``; its warnings about OMP_NUM_THREADS and
closing workers, and its report of a rank that reported itself, are noise in a batch job's log),
ERROR with ``--max-restarts`` (each restart's cause stays in the log). On several nodes its C++
warnings too (``TORCH_CPP_LOG_LEVEL=ERROR``): a node whose peer stopped first (node 0 refusing
another node's data, say) would print a TCPStore warning with a C++ stack trace after the one line.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence


def exit_status(exitcode: int) -> int:
    """A rank's exit code as a shell reports it (a negative one: killed by that signal)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def main(argv: Sequence[str] | None = None) -> int:
    args = list(argv) if argv is not None else sys.argv[1:]
    os.environ.setdefault("LOGLEVEL", "ERROR" if _restarts(args) else "CRITICAL")
    if "--standalone" not in args:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch loads
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing import api  # noqa: F401  (its logger, below)

    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(os.environ["LOGLEVEL"])
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    try:
        run.main(args)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except (RendezvousConnectionError, DistNetworkError):
        where = _option(args, "--rdzv-endpoint") or _option(args, "--rdzv_endpoint") or "?"
        print(
            f"torchrun: lost the rendezvous store at {where}: the torchrun hosting it (the node at that address; "
            "on one machine, the first to start) has stopped (its log says why)",
            file=sys.stderr,
        )
        return 1
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        if first.exitcode < 0:  # nothing said: killed (out of memory, say); torchrun stopped the others
            name = signal.Signals(-first.exitcode).name
            print(f"torchrun: rank {rank} (pid {first.pid}) was killed by {name}", file=sys.stderr)
        return exit_status(first.exitcode)
    return 0


def _option(args: list[str], name: str) -> str | None:
    """The value of torchrun option ``name`` (``--name VALUE`` or ``--name=VALUE``), or None."""
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def _restarts(args: list[str]) -> bool:
    """Whether torchrun may restart failed ranks (then its log of each failure stays: ERROR)."""
    for i, a in enumerate(args):
        if a.startswith("--max-restarts="):
            return a.split("=", 1)[1] not in ("", "0")
        if a in ("--max-restarts", "--max_restarts") and i + 1 < len(args):
            return args[i + 1] != "0"
    return False


if __name__ == "__main__":
    sys.exit(main())
