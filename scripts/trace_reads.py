"""What the kernel read for a command, per file: which reads moved the bytes that /proc/self/io counts.

Runs the command under ``perf record`` with the page-cache and block tracepoints and prints, per
file under the given directories, the bytes added to the page cache (buffered reads, mmap faults
and their read-around, read-ahead), with its mmap faults and read-ahead calls; and the block reads
the command issued, by kind (``RA``: read-ahead and mmap read-around; ``RS``: synchronous, e.g.
O_DIRECT, which adds nothing to the page cache). A file read several times over (its pages
evicted, in a memory cgroup, and read again) shows more bytes than it holds. Needs ``perf`` and
access to the tracepoints (root, or ``perf_event_paranoid`` ≤ -1). Block requests are counted in
the context that issued them: another process's reads can be dispatched from this one's, so with
other disk traffic the page-cache figures are the ones to trust.

    python scripts/trace_reads.py --dir /tmp/placed -- python -m trainer --data /tmp/placed ...
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

EVENTS = (
    "filemap:mm_filemap_add_to_page_cache",
    "filemap:mm_filemap_fault",
    "readahead:page_cache_sync_ra",
    "readahead:page_cache_async_ra",
    "block:block_rq_issue",
)
LINE = re.compile(r"\s*.+?\s+\d+\s+(\S+):\s+(.*)")


def inodes(dirs: list[Path]) -> dict[int, str]:
    """Inode number → path of every file under ``dirs`` (tracepoints name files by inode)."""
    return {p.stat().st_ino: str(p) for d in dirs for p in d.rglob("*") if p.is_file()}


def tally(script: str, names: dict[int, str]) -> tuple[Counter, Counter, Counter, Counter, Counter]:
    """Per file: bytes added to the page cache, mmap faults, read-ahead calls; per block request
    kind: bytes and requests."""
    added, faults, ra, blocks, requests = Counter(), Counter(), Counter(), Counter(), Counter()
    for line in script.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        event, trace = m.groups()
        if event.endswith("block_rq_issue"):
            kind, nbytes = trace.split()[1:3]
            if "R" in kind:
                blocks[kind] += int(nbytes)
                requests[kind] += 1
            continue
        ino = re.search(r"ino[ =](\w+)", trace)
        if ino is None:
            continue
        name = names.get(int(ino.group(1), 16), f"inode {int(ino.group(1), 16)} (not under --dir)")
        if event.endswith("add_to_page_cache"):
            order = re.search(r"order=(\d+)", trace)
            added[name] += 4096 << int(order.group(1) if order else 0)
        elif event.endswith("fault"):
            faults[name] += 1
        else:
            ra[name] += 1
    return added, faults, ra, blocks, requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", action="append", required=True, help="name the files under this directory (repeatable)")
    ap.add_argument("--top", type=int, default=20, help="files to list")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command: give it after --")
    if shutil.which("perf") is None:
        sys.exit("trace_reads: perf is not installed (linux-tools / linux-perf)")
    with tempfile.TemporaryDirectory(prefix="trace-reads-") as tmp:
        data = str(Path(tmp) / "perf.data")
        record = ["perf", "record", "-q", "-m", "16M", "-o", data, *(a for e in EVENTS for a in ("-e", e))]
        start = time.perf_counter()
        rc = subprocess.call([*record, "--", *command])
        wall = time.perf_counter() - start
        if not os.path.exists(data):
            sys.exit(f"trace_reads: perf recorded nothing (exit {rc}): tracepoints need root or perf_event_paranoid -1")
        script = subprocess.run(
            ["perf", "script", "-i", data, "-F", "comm,tid,event,trace"], capture_output=True, text=True, check=False
        ).stdout
    added, faults, ra, blocks, requests = tally(script, inodes([Path(d) for d in args.dir]))
    print(f"{' '.join(command)}: exit {rc}, {wall:.1f} s")
    print("block reads issued: " + ", ".join(
        f"{k} {blocks[k] / 1e6:,.1f} MB in {requests[k]:,} requests ({blocks[k] / requests[k] / 1024:.1f} KiB each)"
        for k in sorted(blocks, key=blocks.__getitem__, reverse=True)
    ))  # fmt: skip
    print(f"added to the page cache: {sum(added.values()) / 1e6:,.1f} MB")
    for name, n in added.most_common(args.top):
        size = os.path.getsize(name) if os.path.exists(name) else 0
        times = f" ({n / size:.2f}x its size)" if size else ""
        print(f"  {n / 1e6:10,.1f} MB{times:22} faults {faults[name]:7,} read-ahead calls {ra[name]:7,}  {name}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
