"""Damaged captures (appended twice, truncated): a warning naming the file, the rest still used, fast."""

from __future__ import annotations

import time
from pathlib import Path

from moment.cli import main
from moment.topology import build, profiler
from moment.topology.inventory import counts
from moment.topology.pci import PciFunction
from moment.topology.sources.lspci_tree import parse_lspci_tree

FIXTURES = Path(__file__).parent / "fixtures"
ASUS_TV = FIXTURES / "asus-esc8000a-e12" / "lspci-tv.txt"


def _profile(directory: Path) -> tuple[object, list[str]]:
    return profiler.build_profile(profiler.read_capture_dir(directory), directory.name)


def test_a_capture_appended_30_times_is_read_once_with_a_warning_in_under_a_second(tmp_path: Path) -> None:
    once, _ = _profile(FIXTURES / "asus-esc8000a-e12")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "lspci-tv.txt").write_text(ASUS_TV.read_text() * 30)
    start = time.perf_counter()
    machine, warnings = _profile(tmp_path / "c")
    assert time.perf_counter() - start < 1.0
    assert counts(machine) == counts(once)
    assert any(w.startswith("lspci-tv.txt: ") and "repeated" in w for w in warnings)


def test_profile_from_an_appended_capture_exits_zero(tmp_path: Path, capsys) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "lspci-tv.txt").write_text(ASUS_TV.read_text() * 2)
    assert main(["profile", "--from", str(tmp_path / "c"), "--out", str(tmp_path / "p.yaml")]) == 0
    assert "lspci-tv.txt: " in capsys.readouterr().err
    assert (tmp_path / "p.yaml").is_file()


def test_appended_lspci_verbose_capture_warns_naming_it() -> None:
    text = (FIXTURES / "supermicro-sys-4029gp-trt" / "lspci-vvnn.txt").read_text()
    from moment.topology.sources.lspci_verbose import parse_lspci_verbose

    notes: list[str] = []
    twice = parse_lspci_verbose(text * 2, "lspci-vvnn.txt", notes)
    assert [f.bdf for f in twice] == [f.bdf for f in parse_lspci_verbose(text)]
    assert notes and notes[0].startswith("lspci-vvnn.txt: ") and "repeated" in notes[0]


def test_tree_builder_walks_repeated_functions_once() -> None:
    """Even given the repeats directly (no parser in between), the walk is linear, not exponential."""
    functions = parse_lspci_tree(ASUS_TV.read_text())
    copies = [PciFunction(**vars(f)) for _ in range(30) for f in functions]
    start = time.perf_counter()
    tree = build.build_tree(copies)
    assert time.perf_counter() - start < 1.0
    assert sum(len(s.ports) for s in tree.sockets) == sum(len(s.ports) for s in build.build_tree(functions).sockets)


def test_a_function_that_is_its_own_parent_does_not_hang_the_walk() -> None:
    root = PciFunction(bdf="0000:00:01.0", class_code="0604", secondary_bus=1, subordinate_bus=1)
    gpu = PciFunction(bdf="0000:01:00.0", class_code="0302", vendor_id="10de", parent=root.bdf)
    loop = PciFunction(bdf="0000:01:00.1", class_code="0604", parent="0000:01:00.1")
    tree = build.build_tree([root, gpu, loop])
    assert [p.device.kind for s in tree.sockets for p in s.ports if p.device] == ["gpu"]


def test_a_truncated_lspci_verbose_capture_is_used_with_a_warning_naming_it(tmp_path: Path) -> None:
    """The review's repro: the first 3000 bytes of a real ``lspci -vvnn`` capture."""
    text = (FIXTURES / "supermicro-sys-4029gp-trt" / "lspci-vvnn.txt").read_bytes()[:3000]
    (tmp_path / "t1").mkdir()
    (tmp_path / "t1" / "lspci-vvnn.txt").write_bytes(text)
    machine, warnings = _profile(tmp_path / "t1")
    assert any(w.startswith("lspci-vvnn.txt: ") and "truncated" in w for w in warnings)
    assert machine.sockets


def test_a_complete_capture_gives_no_truncation_warning() -> None:
    for name in ("supermicro-sys-4029gp-trt", "asus-esc8000a-e12", "switchtec-8x3090"):
        _, warnings = _profile(FIXTURES / name)
        assert not any("truncated" in w for w in warnings), name


def test_a_truncated_lspci_tree_capture_warns_naming_it(tmp_path: Path) -> None:
    text = ASUS_TV.read_text()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "lspci-tv.txt").write_text(text[: len(text) // 2])
    _, warnings = _profile(tmp_path / "c")
    assert any(w.startswith("lspci-tv.txt: ") and "truncated" in w for w in warnings)


def test_non_well_formed_nccl_xml_keeps_what_was_read_with_a_warning(tmp_path: Path) -> None:
    """The review's repro: the first 2000 bytes of a real NCCL dump (6 of its 8 GPUs)."""
    text = (FIXTURES / "switchtec-8x3090" / "nccl-topo.xml").read_bytes()[:2000]
    (tmp_path / "t2").mkdir()
    (tmp_path / "t2" / "nccl-topo.xml").write_bytes(text)
    machine, warnings = _profile(tmp_path / "t2")
    assert any(w.startswith("nccl-topo.xml:") and "not well-formed" in w for w in warnings)
    assert 0 < counts(machine)["gpus"] < 8


def test_every_bundled_capture_appended_twice_warns_naming_it_and_changes_nothing(tmp_path: Path) -> None:
    """``>>`` twice on each real capture set: the same profile, and a warning naming each doubled file."""
    for source in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        doubled = tmp_path / source.name
        doubled.mkdir()
        captures = [f for f in source.iterdir() if f.name != "SOURCE.md"]
        for f in captures:
            (doubled / f.name).write_bytes(f.read_bytes() * 2)
        once, _ = _profile(source)
        twice, warnings = _profile(doubled)
        assert counts(twice) == counts(once), source.name
        named = {f.name for f in captures if any(w.startswith(f.name + ":") for w in warnings)}
        parsed = {"lspci-tv.txt", "lspci-vvnn.txt", "nvidia-smi-topo-m.txt", "nccl-topo.xml"}
        assert named >= {f.name for f in captures} & parsed, (source.name, warnings)
        assert not any("truncated" in w for w in warnings), (source.name, warnings)


def test_truncated_nvidia_smi_and_dmidecode_captures_warn_naming_them(tmp_path: Path) -> None:
    """Cut anywhere (a few points spread through each real capture): used, with a warning naming it."""
    cases = {
        "nvidia-smi-topo-m.txt": (FIXTURES / "dgx-like-8xa100", []),
        "dmidecode.txt": (FIXTURES / "supermicro-sys-4029gp-trt", ["lspci-vvnn.txt"]),
    }
    for name, (source, companions) in cases.items():
        data = (source / name).read_bytes()
        for k in (1, 3, 5, 7, 9):
            cut = tmp_path / f"{name}-{k}"
            cut.mkdir()
            for other in companions:
                (cut / other).write_bytes((source / other).read_bytes())
            (cut / name).write_bytes(data[: len(data) * k // 10])
            _, warnings = _profile(cut)
            assert any(w.startswith(name + ":") and "truncated" in w for w in warnings), (name, k, warnings)


def test_a_capture_name_on_something_not_a_file_is_skipped_with_a_warning_naming_it(tmp_path: Path) -> None:
    """A directory, a FIFO or a link to a device where a capture should be: skipped, said, not read
    (reading /dev/zero would never end)."""
    import os
    import shutil

    src = FIXTURES / "supermicro-sys-4029gp-trt"
    for odd in ("dir", "fifo", "zero"):
        d = tmp_path / odd
        shutil.copytree(src, d)
        (d / "dmidecode.txt").unlink()
        if odd == "dir":
            (d / "dmidecode.txt").mkdir()
        elif odd == "fifo":
            os.mkfifo(d / "dmidecode.txt")
        else:
            (d / "dmidecode.txt").symlink_to("/dev/zero")
        _, warnings = _profile(d)
        said = [w for w in warnings if w.startswith("skipped dmidecode.txt: ")]
        assert len(said) == 1 and "not a regular file" in said[0], warnings
