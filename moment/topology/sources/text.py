"""What every text capture goes through before a parser reads it, and small number readers.

Users paste captures from terminals, editors and chat tools: empty files, binary dumps, CRLF
or CR line endings and byte-order marks all occur. Every text parser starts from
:func:`capture_lines` (or :func:`capture_text`) so that each one accepts and rejects the same
inputs, with the same :class:`SourceError`; only the format-specific checks stay in the parsers.
The number readers accept bounded ASCII digits only, so a stray "²" or an absurdly long number
is "unreadable" (None) instead of a ValueError from ``int()``.
"""

from __future__ import annotations

import re

from moment.errors import SourceError
from moment.topology.pci import speed_to_gen

_MAX_UNPRINTABLE = 0.05  # share of control characters above which a "text" is binary garbage
_DECIMAL_RE = re.compile(r"[0-9]{1,6}")
_SPEED_RE = re.compile(r"\s*(?P<gts>[0-9]{1,3}(?:\.[0-9]{1,3})?)\s*GT/s")  # "16.0 GT/s PCIe", "8 GT/s"


def capture_text(text: str | bytes, source: str) -> str:
    """A text capture with ``\\n`` line endings and no BOM; SourceError if it is empty or not text."""
    if isinstance(text, bytes):
        encoding = "utf-16" if text[:2] in (b"\xff\xfe", b"\xfe\xff") else "utf-8"
        text = text.decode(encoding, errors="replace")
    if not isinstance(text, str):
        raise SourceError(source, f"expected text, got {type(text).__name__}")
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise SourceError(source, "empty capture")
    nul = text.find("\x00")
    if nul >= 0:
        raise SourceError(source, "binary data (NUL byte), not a text capture", text.count("\n", 0, nul) + 1)
    unprintable = sum(1 for ch in text if ch == "\ufffd" or (not ch.isprintable() and ch not in "\t\r\n"))
    if unprintable > _MAX_UNPRINTABLE * len(text):
        share = f"{unprintable} of {len(text)} characters unprintable"
        raise SourceError(source, f"binary data ({share}), not a text capture")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def capture_lines(text: str | bytes, source: str) -> list[str]:
    """The lines of a text capture, any line ending; SourceError if it is empty or not text."""
    return capture_text(text, source).split("\n")


def note_cut_short(text: str, source: str, notes: list[str] | None, ending: str = "\n") -> None:
    """Warn in ``notes`` when a capture does not end the way its tool ends it (``head -c``, a full
    disk or a partial copy cut it short): what came before is still used, so say it is partial."""
    if notes is not None and not capture_text(text, source).rstrip(" \t").endswith(ending):
        notes.append(f"{source}: the capture ends mid-record (truncated?): only what comes before the cut is used")


def decimal(text: str | None) -> int | None:
    """A small non-negative number in ASCII digits ("16", " 0 "); None for anything else."""
    if text is None:
        return None
    text = text.strip()
    return int(text) if _DECIMAL_RE.fullmatch(text) else None


def speed_gen(text: str | None) -> int | None:
    """PCIe generation of a link speed text starting "<n> GT/s" ("16.0 GT/s PCIe" → 4); else None."""
    m = _SPEED_RE.match(text or "")
    return speed_to_gen(float(m["gts"])) if m else None
