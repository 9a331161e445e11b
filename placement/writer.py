"""Write every bin's feature rows in one sequential pass over the source, resumably.

The source features are read front to back in chunks; each chunk's rows are grouped by bin
(original order kept inside a bin, which is the relabelled order) and appended to that bin's
file. Every few hundred MB the bin files are fsync'ed and the progress recorded, so a killed
run resumes from the last checkpoint instead of starting over. Checksums (SHA-256: hardware
accelerated on current CPUs, ~1 GB/s) are computed on the way; on resume the already-written
part is re-read to rebuild them. Reading the next chunk, hashing and the checkpoint's fsync run
in threads beside the writes (numpy, hashlib and fsync release the GIL), which is what brings
the pass to the speed of a plain copy of the same bytes (scripts/bench_place.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from moment.fileio import atomic_write_text
from moment.progress import Update

STATE = "write-state.json"
CHECKPOINT_BYTES = 512 << 20
CHUNK_BYTES = 64 << 20  # source rows read per step


def new_hasher() -> hashlib._Hash:
    return hashlib.sha256()


def file_digest(path: Path, block: int = 8 << 20) -> str:
    """Checksum of a whole file (what the manifest records and ``moment verify`` re-checks)."""
    h = new_hasher()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class BinFile:
    name: str
    path: Path  # the file being written (a .partial name until the placement is committed)
    rows: int  # rows it must end up with


@dataclass
class Written:
    name: str
    path: Path
    bytes: int
    digest: str


def _load_state(work: Path, key: str) -> dict | None:
    try:
        state = json.loads((work / STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if state.get("key") == key else None


def _save_state(work: Path, key: str, next_row: int, sizes: dict[str, int]) -> None:
    atomic_write_text(work / STATE, json.dumps({"key": key, "next_row": next_row, "bytes": sizes}))


def _hash_parts(hashers: list, parts: list[tuple[int, memoryview]]) -> None:
    for b, part in parts:
        hashers[b].update(part)


def _checkpoint(handles: list, work: Path, key: str, row: int, sizes: dict[str, int]) -> None:
    """Make the bytes written so far durable, then record how far the run got. Runs beside the
    writes: fsync flushes at least ``sizes`` bytes of each file, which is all the state claims."""
    for fh in handles:
        os.fsync(fh.fileno())
    _save_state(work, key, row, sizes)


def _read_chunk(
    features: np.ndarray, bin_of: np.ndarray, row: int, end: int, nbins: int
) -> tuple[np.ndarray, np.ndarray]:
    """A chunk of source rows (as whole-row records) and their bins. Runs ahead in a thread:
    numpy copies with the GIL released, so the page faults of the next chunk's read overlap the
    grouping and writing of this one."""
    rows = np.ascontiguousarray(features[row:end])
    records = rows.reshape(rows.shape[0], -1).view(np.uint8)
    records = records.view(np.dtype((np.void, records.shape[1])))[:, 0]
    small = np.uint8 if nbins <= 1 << 8 else np.uint16 if nbins <= 1 << 16 else np.int64
    return records, np.asarray(bin_of[row:end]).astype(small)  # small ints: numpy's stable sort is a radix sort


def write_bins(
    features: np.ndarray,
    bin_of: np.ndarray,
    files: list[BinFile],
    work: Path,
    key: str,
    chunk_rows: int | None = None,
    progress: Update | None = None,
) -> list[Written]:
    """Append each vertex's feature row to its bin's file, in original id order.

    ``files[b]`` receives the rows of vertices with ``bin_of == b``; ``key`` identifies the inputs
    (a resumed run must be writing the same placement, or it starts over). Four things overlap:
    reading the next source chunk, grouping and writing this one (the caller's thread), hashing
    it, and the last checkpoint's fsync.
    """
    n, row_bytes = features.shape[0], features.shape[1] * features.dtype.itemsize
    chunk_rows = chunk_rows or max(1, CHUNK_BYTES // row_bytes)
    state = _load_state(work, key)
    start = state["next_row"] if state else 0
    hashers = [new_hasher() for _ in files]
    handles = []
    for f, h in zip(files, hashers):
        done = state["bytes"].get(f.name, 0) if state else 0
        f.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(f.path, "r+b" if done and f.path.exists() else "wb", buffering=0)  # noqa: SIM115 - closed below
        fh.truncate(done)
        fh.seek(0)
        remaining = done
        while remaining:  # rebuild the checksum of what a killed run already wrote
            block = fh.read(min(remaining, 8 << 20))
            h.update(block)
            remaining -= len(block)
        fh.seek(done)
        handles.append(fh)
    if progress and start:
        progress(start, n)  # resuming: the bar (and a test) sees where the killed run got to
    sizes = [fh.tell() for fh in handles]
    threads = ThreadPoolExecutor(max_workers=3, thread_name_prefix="moment-write")
    hashed = synced = None
    try:
        since = 0
        ahead = (
            threads.submit(_read_chunk, features, bin_of, start, min(n, start + chunk_rows), len(files))
            if start < n
            else None
        )
        row = start
        while ahead is not None:
            records, bins = ahead.result()
            end = row + records.shape[0]
            ahead = (
                threads.submit(_read_chunk, features, bin_of, end, min(n, end + chunk_rows), len(files))
                if end < n
                else None
            )
            grouped = np.take(records, np.argsort(bins, kind="stable"))
            counts = np.bincount(bins, minlength=len(files))
            edges = np.concatenate(([0], np.cumsum(counts))) * row_bytes
            raw = memoryview(grouped.view(np.uint8))
            parts = [(b, raw[edges[b] : edges[b + 1]]) for b in np.flatnonzero(counts)]
            if hashed is not None:
                hashed.result()  # one chunk hashed at a time, in order
            hashed = threads.submit(_hash_parts, hashers, parts)
            for b, part in parts:
                _write_full(handles[b], part)
                sizes[b] += len(part)
            since += raw.nbytes
            row = end
            if since >= CHECKPOINT_BYTES or row == n:
                if synced is not None:
                    synced.result()  # one checkpoint in flight
                synced = threads.submit(
                    _checkpoint, handles, work, key, row, {f.name: size for f, size in zip(files, sizes)}
                )
                since = 0
            if progress:
                progress(row, n)
        for job in (hashed, synced):
            if job is not None:
                job.result()
    finally:
        threads.shutdown(wait=True, cancel_futures=True)
        for fh in handles:
            fh.close()
    out = []
    for f, h in zip(files, hashers):
        size = f.path.stat().st_size
        if size != f.rows * row_bytes:
            raise RuntimeError(f"{f.path}: wrote {size} bytes, expected {f.rows * row_bytes}")
        out.append(Written(f.name, f.path, size, h.hexdigest()))
    return out


def _write_full(fh: BinaryIO, data: memoryview) -> None:
    """An unbuffered file's write may take part of the data; write the rest."""
    while len(data):
        data = data[fh.write(data) :]
