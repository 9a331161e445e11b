"""One way to parse a size (moment/sizes.py): the forms every size option accepts, the refusals
(one line naming the option), and the commands that take one: `moment place --gpu-cache/--cpu-cache`,
`moment dataset import --memory`, `moment infer --memory`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moment.sizes import Size, SizeError, parse_bytes, parse_size

N, ROW = 10_000, 64  # a dataset of 10,000 rows of 64 bytes


@pytest.mark.parametrize(
    ("text", "rows"),
    [
        ("1%", 100),
        ("100%", N),
        ("0.5 %", 50),
        ("20000", 312),  # a bare number is bytes: 20,000 B of 64 B rows
        ("6400B", 100),
        ("1KiB", 16),
        ("1ki", 16),
        ("64k", 1000),
        ("4GB", 4 * 10**9 // ROW),
        ("4gb", 4 * 10**9 // ROW),
        ("512MiB", 512 * 2**20 // ROW),
        ("1.5 GB", int(1.5e9) // ROW),
        ("2e9", 2 * 10**9 // ROW),
        ("250rows", 250),
        ("1 row", 1),
        ("1e3rows", 1000),
        ("0rows", 0),
        ("0", 0),
    ],
)
def test_cache_sizes_parse_to_rows(text: str, rows: int) -> None:
    assert parse_size(text, "--gpu-cache").rows(N, ROW) == rows


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4GB", 4 * 10**9),
        ("512MB", 512 * 10**6),
        ("1GiB", 2**30),
        ("2e9", 2 * 10**9),
        ("1.5 gb", 1.5e9),
        ("20000", 20000),
    ],
)
def test_memory_sizes_parse_to_bytes(text: str, value: int) -> None:
    assert parse_bytes(text, "--memory") == value


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("lots", "expected a size like 4GB, 512MiB, 2e9, 1%, 20000rows"),
        ("4XB", "expected a size like"),
        ("-1GB", "expected a size like"),
        ("", "expected a size like"),
        ("GB", "expected a size like"),
        ("1e999GB", "expected a size like"),
        ("nan", "expected a size like"),
        ("4 GB 2", "expected a size like"),
        ("101%", "a share of the vertices is at most 100%"),
        ("1.5rows", "a whole number of rows"),
    ],
)
def test_bad_cache_sizes_are_one_line_naming_the_option(text: str, why: str) -> None:
    with pytest.raises(SizeError) as caught:
        parse_size(text, "--cpu-cache")
    said = str(caught.value)
    assert said.startswith(f"--cpu-cache {text!r}") and why in said and "\n" not in said
    assert caught.value.problem == said.removeprefix("--cpu-cache ")  # argparse names the option itself


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0", "at least 1 byte"),
        ("0.5", "at least 1 byte"),
        ("1%", "is a share of the vertices: expected a size like 4GB, 512MiB, 2e9"),
        ("20000rows", "is a count of rows"),
        ("4XB", "expected a size like 4GB, 512MiB, 2e9"),
    ],
)
def test_bad_memory_sizes_are_one_line_naming_the_option(text: str, why: str) -> None:
    with pytest.raises(SizeError, match=f"^--memory {text!r}") as caught:
        parse_bytes(text, "--memory")
    assert why in str(caught.value)


@pytest.mark.parametrize(("text", "value"), [("1.5x", 1500), ("2 X", 2000), ("20GB", 20 * 10**9), ("2048", 2048)])
def test_a_multiple_of_a_size_where_an_option_takes_one(text: str, value: int) -> None:
    assert parse_size(text, "--pack-budget", ("bytes", "multiple")).bytes_of(1000) == value
    with pytest.raises(SizeError, match="is a multiple of a size: expected a size like 4GB"):
        parse_size("2x", "--memory", ("bytes",))


def test_a_size_in_rows_needs_no_dataset_row_size() -> None:
    assert parse_size("300rows", "x") == Size(300, "rows")
    assert Size(300, "rows").rows(10, 1) == 300  # not capped here: the caller caps by the vertices


def _moment(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moment", *argv], capture_output=True, text=True, timeout=120)


def test_place_refuses_a_bad_cache_size_before_any_work(plan_file: Path, small_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "placed"
    for option, text in (("--gpu-cache", "4XB"), ("--cpu-cache", "120%")):
        done = _moment(
            "place", "--plan", str(plan_file), "--dataset", str(small_dataset), "--out", str(out), option, text
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].count(f"{option} '{text}'") == 1, done.stderr
        assert not out.exists() and not out.with_name("placed.partial").exists()


def test_import_and_infer_refuse_a_bad_memory_budget(tmp_path: Path) -> None:
    done = _moment(
        "dataset", "import", "--features", "f.npy", "--labels", "l.npy", "--out", str(tmp_path / "d"), "--memory", "1%"
    )
    assert done.returncode == 2 and "--memory '1%' is a share of the vertices" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "d").exists()
    done = _moment("infer", "--data", "d", "--checkpoint", "c", "--out", "o", "--device", "cpu", "--memory", "4XB")
    assert done.returncode == 2 and "argument --memory: '4XB': expected a size like 4GB" in done.stderr, done.stderr
