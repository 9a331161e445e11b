"""Files written around the page cache (O_DIRECT) hold exactly the bytes appended: across buffer
switches, flushes at unaligned sizes, resumes from an unaligned size, and where the file system
refuses O_DIRECT at open or at the first write; the placed files go that way where it can."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest

from placement import direct_io
from placement.direct_io import ALIGN, AppendFile
from placement.writer import BinFile, NpyWriter, write_bins


def _takes_direct(d: Path) -> bool:
    probe = d / "probe"
    probe.touch()
    fd = direct_io._open_direct(probe)
    if fd is not None:
        os.close(fd)
    probe.unlink()
    return fd is not None


def _append(path: Path, pieces: list[bytes], flush_at: set[int], start: int = 0) -> AppendFile:
    f = AppendFile(path, start, buffer_bytes=2 * ALIGN)  # small buffers: many switches
    for i, piece in enumerate(pieces):
        f.write(piece)
        if i in flush_at:
            f.flush()
    f.sync()
    f.close()
    return f


@pytest.mark.parametrize("direct", [True, False])
def test_append_file_holds_what_was_appended_and_resumes_mid_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    if direct and not _takes_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    if not direct:
        monkeypatch.setattr(direct_io, "_open_direct", lambda path: None)
    rng = np.random.default_rng(5)
    pieces = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in rng.integers(1, 3 * ALIGN, 40)]
    path = tmp_path / "a.bin"
    f = _append(path, pieces, flush_at={3, 4, 17, 30})
    expect = b"".join(pieces)
    assert path.read_bytes() == expect and f.size == len(expect)
    assert (f.direct_bytes >= len(expect) - ALIGN) if direct else f.direct_bytes == 0
    cut = 3 * ALIGN + 123  # a resumed file keeps its first `cut` bytes, whatever follows them
    more = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in rng.integers(1, 2 * ALIGN, 9)]
    _append(path, more, flush_at={0, 5}, start=cut)
    assert path.read_bytes() == expect[:cut] + b"".join(more)


def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system may take O_DIRECT at open and refuse the write (EINVAL): the bytes still land."""
    if not _takes_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    real = os.pwrite
    refused: list[int] = []

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        if fd == f.direct:
            refused.append(offset)
            raise OSError(errno.EINVAL, "refused")
        return real(fd, data, offset)

    f = AppendFile(tmp_path / "a.bin", buffer_bytes=ALIGN)
    monkeypatch.setattr(direct_io.os, "pwrite", pwrite)
    data = np.arange(5 * ALIGN + 7, dtype=np.uint8).tobytes()
    f.write(data)
    f.sync()
    f.close()
    assert refused and f.refused and f.direct_bytes == 0 and (tmp_path / "a.bin").read_bytes() == data


def test_placed_files_are_written_direct_where_the_file_system_allows(tmp_path: Path) -> None:
    """NpyWriter (the row map, row maps of packs) and the bins bypass the page cache: their bytes are
    not copied by the kernel into page-cache pages first (a CPU-second per GB on the benchmark VM)."""
    if not _takes_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    out = NpyWriter(tmp_path / "a.npy", np.int64, (10_000,))
    assert out.out.direct is not None and fcntl.fcntl(out.out.direct, fcntl.F_GETFL) & os.O_DIRECT
    out.write(np.arange(10_000))
    out.close()
    assert out.out.direct_bytes >= 80_000 - ALIGN
    assert np.array_equal(np.load(tmp_path / "a.npy"), np.arange(10_000))
    opened: list[AppendFile] = []
    real = direct_io.AppendFile.__init__

    def spy(self: AppendFile, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        opened.append(self)

    feats = np.arange(3000 * 5, dtype=np.float32).reshape(3000, 5)
    bin_of = (np.arange(3000) % 3).astype(np.int16)
    files = [BinFile(f"b{b}", tmp_path / f"b{b}.bin", 1000) for b in range(3)]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(direct_io.AppendFile, "__init__", spy)
        write_bins(feats, bin_of, files, tmp_path, "k", chunk_rows=333)
    assert len(opened) == 3 and all(f.direct_bytes >= 5 * 4 * 1000 - ALIGN for f in opened)
    for b, f in enumerate(files):
        assert np.array_equal(np.fromfile(f.path, dtype=np.float32).reshape(-1, 5), feats[bin_of == b])
