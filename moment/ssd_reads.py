"""What an SSD moves for the feature rows a batch reads, and how fast it can move it.

An SSD reads whole pages: a 512-byte row read on its own moves a 4 KiB page, eight times its
bytes (DiskGNN measured this read amplification for Ginex on ogbn-papers100M). And small random
reads are bound by the drive's random-read rate, its IOPS, long before its GB/s: a P5510 serves
700,000 random 4 KiB reads a second, 2.87 GB/s of pages, against 5.15 GB/s of large reads. So
the flow models charge an SSD, and the links behind it, the bytes moved (feature bytes ×
:func:`amplification`), and cap an SSD read at random at ``min(read_gbps, iops × page)``
(:func:`random_read_gbps`). A packed read (the rows one batch needs, laid out back to back:
``Workload.ssd_pack_bytes``) moves its pack, page-rounded, and is bound by ``read_gbps`` alone.

IOPS are counted in pages, as datasheets and ``moment bench`` give them (random 4 KiB reads): a
row of two pages costs two. Larger reads in fact approach ``read_gbps`` sooner; the model stays on
the safe side.
"""

from __future__ import annotations

import math

import numpy as np

PAGE_BYTES = 4096  # what an SSD moves per random read at the least, and the unit its IOPS count


def page_counts(row_bytes: int, page: int = PAGE_BYTES) -> np.ndarray:
    """Rows touching each page over one period of the layout (rows back to back from byte 0; the
    pattern repeats every lcm(row, page) bytes)."""
    g = math.gcd(row_bytes, page)
    rows, pages = page // g, row_bytes // g  # rows and pages in one period
    first = np.arange(rows, dtype=np.int64) * row_bytes // page
    last = (np.arange(rows, dtype=np.int64) * row_bytes + row_bytes - 1) // page
    counts = np.zeros(pages + 1, dtype=np.int64)
    np.add.at(counts, first, 1)
    np.add.at(counts, last + 1, -1)
    return np.cumsum(counts)[:pages]


def amplification(row_bytes: int, density: float = 0.0, page: int = PAGE_BYTES) -> float:
    """Bytes moved per feature byte when a batch reads each row of a bin with probability
    ``density`` (independently) and every page holding a row it reads is moved once.

    With sparse reads (density → 0, every large dataset) a row moves the pages it touches:
    ``ceil(row / page) × page / row`` for rows that divide or are multiples of a page (8 for
    512-byte rows, 1 for 4 KiB rows). Dense reads share pages (a batch of a small graph reads
    neighbouring rows), down to 1 when every row is read. Per period of the layout: pages ×
    P(a page is touched) / (density × bytes)."""
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be positive, got {row_bytes}")
    counts = page_counts(row_bytes, page)
    period = counts.size * page  # bytes in one period
    f = min(max(density, 0.0), 1.0)
    if f < 1e-12:  # the limit: each row its own pages
        touched = float(counts.sum())
        return touched * page / period
    touched = float((-np.expm1(counts * math.log1p(-f))).sum()) if f < 1 else float(counts.size)
    return touched * page / (f * period)


def pack_amplification(pack_bytes: int, page: int = PAGE_BYTES) -> float:
    """A packed read moves its pack rounded up to whole pages (a ``--pack-budget`` chunk starts on
    a page, so exactly that: :mod:`placement.chunks`)."""
    return math.ceil(pack_bytes / page) * page / pack_bytes


def random_read_gbps(read_gbps: float, iops: float | None, page: int = PAGE_BYTES) -> float:
    """An SSD's rate of page-rounded bytes under random reads: its GB/s, or its IOPS × the page
    where those are fewer (an unknown IOPS caps nothing)."""
    return read_gbps if iops is None else min(read_gbps, iops * page / 1e9)


def pages_read(offsets: np.ndarray, sizes: np.ndarray, page: int = PAGE_BYTES) -> int:
    """Bytes of the distinct pages that reads of ``sizes`` bytes at ``offsets`` touch (sorted,
    non-overlapping runs, as a reader plans them): what the SSD moves for them, a page shared by
    two runs once."""
    if len(sizes) == 0:
        return 0
    offsets, sizes = np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    first, last = offsets // page, (offsets + sizes - 1) // page
    return (int((last - first + 1).sum()) - int((first[1:] == last[:-1]).sum())) * page


def span_pages(offset: np.ndarray | int, size: np.ndarray | int, page: int = PAGE_BYTES) -> np.ndarray:
    """Bytes of the pages each read of ``size`` bytes at byte ``offset`` of a file touches (0 for
    an empty one), elementwise: what a batch's slice of a mapped file (its stored sample, a chunk
    row map) moves, each read on its own (a page two batches share counts for each)."""
    offset, size = np.asarray(offset, dtype=np.int64), np.asarray(size, dtype=np.int64)
    return np.where(size > 0, (offset + size - 1) // page - offset // page + 1, 0) * page
