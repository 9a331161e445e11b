"""Errors a user can cause, and how they reach the terminal.

Every mistake a user can make (a bad file, a missing field, an unknown name) raises a
:class:`MomentError`; the CLI prints its one-line message on stderr and exits non-zero,
never with a traceback.
"""

from __future__ import annotations


class MomentError(Exception):
    """A user-facing error: one line, names the file/field, maps to an exit code."""

    exit_code = 1


class UsageError(MomentError):
    """Wrong command-line usage (unknown profile name, missing argument): exit code 2."""

    exit_code = 2


class ProfileError(MomentError):
    """A topology profile that does not validate; the message names file and field."""


class SourceError(MomentError):
    """A capture (lspci, dmidecode, ...) that cannot be read at all.

    ``moment profile`` turns it into a warning and skips that source.
    """

    def __init__(self, source: str, message: str, line: int | None = None) -> None:
        self.source = source
        self.line = line
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")


class Interrupted(KeyboardInterrupt):
    """A signal that stops a command (SIGINT, SIGTERM, SIGHUP): the CLI prints one line and exits
    128 + the signal's number (130 for Ctrl-C, 143 for ``kill``), as a shell reports it."""

    def __init__(self, signum: int, note: str = "") -> None:
        import signal

        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        self.name = signal.Signals(self.signum).name
        super().__init__(f"interrupted ({self.name}){': ' + note if note else ''}")
