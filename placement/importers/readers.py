"""Arrays as users have them on disk, read in chunks with plain reads: never memory-mapped, never whole.

Three kinds: a real .npy file; a *headerless* raw file (IGB large/full name theirs ``.npy`` although
they are bare float32: the row count comes from the file size); and a member of an .npz archive,
which may be DEFLATE-compressed (ogbn-papers100M's ``data.npz``) and is then inflated as a stream,
one chunk at a time. Plain reads rather than memory maps keep resident memory at one chunk however
large the file (pages of a map count as resident while they stay mapped). Errors are one line
naming the file (and the member).
"""

from __future__ import annotations

import gzip
import itertools
import math
import os
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from moment.contracts.dataset import DatasetError
from placement.dataset import read_npy_header

SKIP = 1 << 24  # bytes inflated and dropped at once when a compressed member is read from an offset
CSV_LINES = 1 << 15  # lines of a CSV parsed at once
TAIL = 1 << 16  # a member read up to this close to its end is read to the end (its CRC checked)


class _Sized:
    """Element and byte counts from ``shape`` and ``dtype`` (every array description has both)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class ArrayFile(_Sized):
    """Where an array's bytes are: a file (or an .npz member), its shape, dtype and data offset."""

    path: Path
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int
    fortran: bool = False
    member: str | None = None  # the .npz member ("edge_index.npy"), None for a file of its own
    raw: bool = False  # headerless: shape and dtype inferred, not read

    @property
    def label(self) -> str:
        """How errors name it: ``data.npz:edge_index`` or the file's path."""
        return f"{self.path}:{self.member.removesuffix('.npy')}" if self.member else str(self.path)

    def describe(self) -> str:
        kind = "raw (no .npy header)" if self.raw else ".npz member" if self.member else ".npy"
        order = ", Fortran order" if self.fortran else ""
        return f"{self.label}: {kind}, {self.dtype.name} {' × '.join(f'{s:,}' for s in self.shape)}{order}"

    @contextmanager
    def stream(self, start: int = 0) -> Iterator[IO[bytes]]:
        """A binary stream positioned at item ``start`` (a compressed member inflates up to it)."""
        skip = self.offset + start * self.dtype.itemsize
        if self.member is None:
            with open(self.path, "rb") as fh:
                fh.seek(skip)
                yield fh
            return
        with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as fh:
            try:
                while skip > 0:
                    got = len(fh.read(min(SKIP, skip)))
                    if not got:
                        raise DatasetError(f"{self.label}: truncated member (ends before item {start})")
                    skip -= got
                yield fh
                if zf.getinfo(self.member).file_size - fh.tell() <= TAIL:
                    while fh.read(SKIP):  # to the member's end, where zipfile checks its CRC-32
                        pass
            except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
                raise DatasetError(f"{self.label}: damaged ({exc}): download it again") from None

    def read(self, fh: IO[bytes], count: int) -> np.ndarray:
        """The next ``count`` items of a stream, in native byte order."""
        if self.member is None:
            out = np.fromfile(fh, dtype=self.dtype, count=count)
        else:
            out = np.frombuffer(fh.read(count * self.dtype.itemsize), dtype=self.dtype)
        if out.size != count:
            raise DatasetError(f"{self.label}: truncated: ended {count - out.size} values early")
        return out if self.dtype.isnative else out.astype(self.dtype.newbyteorder("="))

    def read_at(self, start: int, count: int) -> np.ndarray:
        """``count`` items from item ``start`` (files only: random access into a member would re-inflate)."""
        assert self.member is None
        with open(self.path, "rb") as fh:
            data = os.pread(fh.fileno(), count * self.dtype.itemsize, self.offset + start * self.dtype.itemsize)
        out = np.frombuffer(data, dtype=self.dtype)
        return out if self.dtype.isnative else out.astype(self.dtype.newbyteorder("="))


def npy(path: str | Path, what: str) -> ArrayFile:
    """A real .npy file (header checked: missing, not .npy, pickled and truncated files are named)."""
    h = read_npy_header(path, what)
    return ArrayFile(Path(path), h.shape, h.dtype, h.offset, h.fortran)


def npy_or_raw(path: str | Path, what: str, dtype: str, row: int = 1) -> ArrayFile:
    """An .npy file, or else a headerless raw file of ``dtype`` with ``row`` values per row (its row
    count from its size, which must be a whole number of rows)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(len(np.lib.format.MAGIC_PREFIX))
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing ({what})") from None
    except OSError as exc:
        raise DatasetError(f"{path}: unreadable ({what}: {exc.strerror})") from None
    if magic == np.lib.format.MAGIC_PREFIX:
        return npy(path, what)
    step = np.dtype(dtype).itemsize * row
    if size == 0 or size % step:
        raise DatasetError(
            f"{path}: {what} has no .npy header, and its {size:,} bytes are not a whole number "
            f"of rows of {row} {dtype} values ({step} bytes): not an IGB raw file"
        )
    shape = (size // step, row) if row > 1 else (size // step,)
    return ArrayFile(path, shape, np.dtype(dtype), 0, raw=True)


def npz_member(path: str | Path, key: str, what: str, required: bool = True) -> ArrayFile | None:
    """Member ``key`` of an .npz archive, its header read from the (possibly compressed) stream.

    Nothing is unpickled: an object array is refused by its header."""
    path = Path(path)
    name = f"{key}.npy"
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            if name not in names:
                if not required:
                    return None
                have = ", ".join(n.removesuffix(".npy") for n in names) or "nothing"
                raise DatasetError(f"{path}: no member {key!r} ({what}); it holds {have}")
            info = zf.getinfo(name)
            with zf.open(name) as fh:
                version = np.lib.format.read_magic(fh)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read(fh)
                offset = fh.tell()
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing ({what})") from None
    except zipfile.BadZipFile as exc:
        raise DatasetError(f"{path}: not an .npz archive ({what}: {exc})") from None
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}:{key}: not a readable .npy member ({what}: {str(exc).splitlines()[0]})") from None
    if dtype.hasobject:
        raise DatasetError(f"{path}:{key}: {what} holds Python objects (pickled data), not numbers")
    arr = ArrayFile(path, tuple(shape), dtype, offset, fortran, member=name)
    if info.file_size < offset + arr.nbytes:
        raise DatasetError(f"{arr.label}: truncated: {info.file_size} bytes, expected {offset + arr.nbytes}")
    return arr


class EdgeArray:
    """An edge list as E×2 (pairs, IGB) or 2×E (a row of sources, a row of destinations, OGB), read
    in chunks as (src, dst) int32 or int64 arrays; the CSR build checks every id against N."""

    def __init__(self, arr: ArrayFile, num_nodes: int, what: str = "edges", pairs: bool = True) -> None:
        if len(arr.shape) != 2 or 2 not in arr.shape or arr.dtype.kind not in "iu":
            raise DatasetError(
                f"{arr.label}: {what} must be an E×2 or 2×E integer array, got {arr.dtype.name} of shape {arr.shape}"
            )
        self.arr, self.n, self.what = arr, num_nodes, what
        e2 = arr.shape[1] == 2 if arr.shape != (2, 2) else pairs
        self.size = arr.shape[0] if e2 else arr.shape[1]
        self.interleaved = e2 != arr.fortran  # (E, 2) in C order or (2, E) in Fortran order: src, dst, src, ...

    def chunks(self, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        e = self.size
        if self.interleaved:
            with self.arr.stream() as fh:
                for a in range(0, e, chunk):
                    pairs = _ids(self.arr.read(fh, 2 * min(chunk, e - a))).reshape(-1, 2)
                    yield pairs[:, 0], pairs[:, 1]
            return
        with self.arr.stream() as fs, self.arr.stream(e) as fd:
            for a in range(0, e, chunk):
                m = min(chunk, e - a)
                yield _ids(self.arr.read(fs, m)), _ids(self.arr.read(fd, m))

    def check(self, src: np.ndarray, dst: np.ndarray, at: int) -> tuple[np.ndarray, np.ndarray]:
        """Every id of the chunk starting at edge ``at`` in [0, N), or one line naming the first
        that is not (the CSR build checks ids as it counts, and calls this for the message)."""
        for ids in (src, dst):
            if ids.size and (ids.min() < 0 or ids.max() >= self.n):
                i = int(np.argmax((ids < 0) | (ids >= self.n)))
                raise DatasetError(
                    f"{self.arr.label}: edge {at + i} ({int(src[i])} → {int(dst[i])}) names vertex "
                    f"{int(ids[i])}, not a vertex id (N = {self.n:,} from the features)"
                )
        return src, dst


def _ids(a: np.ndarray) -> np.ndarray:
    """Vertex ids as read (int32 or int64: no copy), other integer types widened to int64."""
    return a if a.dtype in (np.dtype(np.int32), np.dtype(np.int64)) else a.astype(np.int64)


def rows(arr: ArrayFile, count: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, block) of an N×d (or N) array, ``count`` rows at a time, front to back."""
    width = math.prod(arr.shape[1:])
    with arr.stream() as fh:
        for a in range(0, arr.shape[0], count):
            m = min(count, arr.shape[0] - a)
            yield a, arr.read(fh, m * width).reshape((m, *arr.shape[1:]))


@dataclass(frozen=True)
class CsvArray(_Sized):
    """A gzip-compressed CSV array (OGB's CSV raw layout: ``edge.csv.gz``, ``node-feat.csv.gz``): one
    row per line, read a batch of lines at a time. Its shape comes from OGB's count files, not a scan."""

    path: Path
    shape: tuple[int, ...]
    dtype: np.dtype
    counted_in: Path | None = None  # the OGB count file its number of lines comes from
    fortran: bool = False
    member: None = None
    raw: bool = False

    @property
    def label(self) -> str:
        return str(self.path)

    def _counted(self) -> str:
        return f" ({self.counted_in} says {self.shape[0]:,})" if self.counted_in else ""

    def describe(self) -> str:
        return f"{self.label}: gzip CSV, {self.dtype.name} {' × '.join(f'{s:,}' for s in self.shape)}"

    @contextmanager
    def stream(self, start: int = 0) -> Iterator[_Lines]:
        assert start == 0  # read front to back only (edges are pairs on one line)
        try:
            fh = gzip.open(self.path, "rt")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise DatasetError(f"{self.path}: missing") from None
        with fh:
            lines = _Lines(_guarded(fh, self.path))
            yield lines
            if lines.done == self.shape[0]:  # read whole: the rest must be blank, and gzip checks its CRC at the end
                extra = sum(1 for line in lines.lines if line.strip())
                if extra:
                    raise DatasetError(
                        f"{self.path}: {extra:,} more line(s) than the {self.shape[0]:,} expected{self._counted()}: "
                        "the count file and the data disagree"
                    )

    def read(self, fh: _Lines, count: int) -> np.ndarray:
        """The next ``count`` values (count / row width lines), parsed."""
        width = math.prod(self.shape[1:])
        out = np.empty(count, dtype=self.dtype)
        for at in range(0, count, CSV_LINES * width):  # a few MB of Python strings at a time
            lines = list(itertools.islice(fh.lines, min(CSV_LINES, (count - at) // width)))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # "input contained no data": named below
                    part = np.loadtxt(lines, dtype=self.dtype, delimiter=",", ndmin=2) if lines else out[:0]
            except ValueError:
                part = None
            if part is None or part.size != min(CSV_LINES * width, count - at) or part.shape[-1] != width:
                i, why = _bad_line(lines, width, self.dtype)
                raise DatasetError(
                    f"{self.path}: line {fh.done + i + 1}: {why} (expected {width} value(s) a line, "
                    f"{self.shape[0]:,} lines{self._counted()})"
                )
            part = part.reshape(-1)
            out[at : at + part.size] = part
            fh.done += len(lines)
        return out


def _bad_line(lines: list[str], width: int, dtype: np.dtype) -> tuple[int, str]:
    """The first line of a batch that does not parse as ``width`` values (or the end of the file)."""
    for i, line in enumerate(lines):
        if not line.strip():
            return i, "an empty line"
        try:
            values = np.loadtxt([line], dtype=dtype, delimiter=",", ndmin=2)
        except ValueError as exc:
            return i, str(exc).splitlines()[0]
        if values.shape[1] != width:
            return i, f"{values.shape[1]} value(s)"
    return len(lines), "the file ends early"


def _guarded(lines: Iterator[str], path: Path) -> Iterator[str]:
    """Lines of a gzip stream; a damaged stream is one line naming the file (not a zlib traceback)."""
    try:
        yield from lines
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: damaged or not a gzip text file ({exc}): download it again") from None


class _Lines:
    """A text stream and how many lines were parsed from it (for errors naming the line)."""

    def __init__(self, lines: Iterator[str]) -> None:
        self.lines, self.done = lines, 0


def gzip_ints(path: Path, missing: str, expected: str) -> np.ndarray:
    """The integers of a small .csv.gz (a count file, a split's ids), or one line naming the file."""
    try:
        with gzip.open(path, "rt") as fh, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data": an empty list is fine here
            return np.loadtxt(fh, dtype=np.int64, delimiter=",", ndmin=1)
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing{missing}") from None
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        raise DatasetError(f"{path}: not a gzip-compressed {expected} ({str(exc).splitlines()[0]})") from None


def csv_count(path: Path) -> int:
    """The single number of an OGB count file (``num-node-list.csv.gz``: one graph, one line)."""
    values = gzip_ints(path, "", "count")
    if values.size != 1:
        raise DatasetError(f"{path}: holds {values.size} graphs' counts; only single-graph datasets are imported")
    return int(values[0])


def csv_width(path: Path) -> int:
    """Values on the first line of a gzip CSV."""
    try:
        with gzip.open(path, "rt") as fh:
            first = fh.readline()
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"{path}: not a readable gzip file ({exc})") from None
    if not first.strip():
        raise DatasetError(f"{path}: empty")
    return first.count(",") + 1
