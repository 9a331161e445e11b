"""parse_dmidecode_slots / parse_dmidecode_system on a real Supermicro capture and messy variants."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from moment.errors import SourceError
from moment.topology.sources.dmidecode import DmiSlot, parse_dmidecode_slots, parse_dmidecode_system

FIXTURES = Path(__file__).parent / "fixtures"
SUPERMICRO = FIXTURES / "supermicro-sys-4029gp-trt"

# designation -> (bus address, width, gen, in use, length, ID, header line), read off the capture
SUPERMICRO_SLOTS = {
    "CPU2 Slot1 PCI-E 3.0 X16": ("0000:88:00.0", 16, 3, True, "Long", "1", 1373),
    "CPU2 Slot2 PCI-E 3.0 X16": ("0000:89:00.0", 16, 3, True, "Long", "2", 1394),
    "CPU2 Slot3 PCI-E 3.0 X16": ("0000:b1:00.0", 16, 3, True, "Long", "3", 1415),
    "CPU2 Slot4 PCI-E 3.0 X16": ("0000:b2:00.0", 16, 3, True, "Long", "4", 1436),
    "CPU2 Slot5 PCI-E 3.0 X8": ("0000:d7:02.0", 8, 3, False, "Short", "5", 1457),
    "CPU1 Slot6 PCI-E 3.0 X8": ("0000:5e:00.0", 8, 3, True, "Short", "6", 1477),
    "PCH Slot7 PCI-E 3.0 X4": ("0000:00:1c.0", 8, 3, False, "Short", "7", 1498),  # Type says x8
    "CPU1 Slot8 PCI-E 3.0 X16": ("0000:3d:00.0", 16, 3, True, "Long", "8", 1518),
    "CPU1 Slot9 PCI-E 3.0 X16": ("0000:3e:00.0", 16, 3, True, "Long", "9", 1539),
    "CPU1 Slot10 PCI-E 3.0 X16": ("0000:1a:00.0", 16, 3, True, "Long", "10", 1560),
    "CPU1 Slot11 PCI-E 3.0 X16": ("0000:1b:00.0", 16, 3, True, "Long", "11", 1581),
}


@pytest.fixture(scope="module")
def text() -> str:
    return (SUPERMICRO / "dmidecode.txt").read_text()


def _record(handle: int, designation: str, slot_type: str, extra: str = "", usage: str = "In Use") -> str:
    return (
        f"Handle 0x{handle:04X}, DMI type 9, 17 bytes\n"
        "System Slot Information\n"
        f"\tDesignation: {designation}\n"
        f"\tType: {slot_type}\n"
        f"\tCurrent Usage: {usage}\n"
        "\tLength: Long\n"
        f"{extra}"
        "\n"
    )


def _one(text: str) -> DmiSlot:
    (slot,) = parse_dmidecode_slots(text)
    return slot


# --- the real capture ---------------------------------------------------------------------------


def test_supermicro_slots(text):
    slots = parse_dmidecode_slots(text, "dmidecode.txt")
    assert len(slots) == 11
    got = {s.designation: (s.bus_address, s.width, s.gen, s.in_use, s.length, s.slot_id, s.line) for s in slots}
    assert got == SUPERMICRO_SLOTS
    assert all(s.form == "pcie" for s in slots)
    assert next(s for s in slots if s.designation.startswith("PCH")).slot_type == "x8 PCI Express 3 x8"


def test_supermicro_header_lines_point_at_handles(text):
    lines = text.split("\n")
    for slot in parse_dmidecode_slots(text):
        assert lines[slot.line - 1].startswith("Handle 0x") and "DMI type 9," in lines[slot.line - 1]


def test_supermicro_system(text):
    system = parse_dmidecode_system(text)
    cpu = {"version": "Intel(R) Xeon(R) Silver 4210 CPU @ 2.20GHz", "cores": 10, "threads": 20}
    assert system == {
        "manufacturer": "Supermicro",
        "product": "SYS-4029GP-TRT",
        "cpus": [{"socket": "CPU1", **cpu}, {"socket": "CPU2", **cpu}],
        "memory_gb": 128,  # 4 x 32 GB populated of 24 type 17 entries
    }


def test_slot_only_dump(text):
    """``dmidecode -t slot``: the preamble and the type 9 records only."""
    records = text.split("\n\n")
    only_slots = "\n\n".join([records[0]] + [r for r in records if "DMI type 9," in r]) + "\n"
    assert [s.designation for s in parse_dmidecode_slots(only_slots)] == list(SUPERMICRO_SLOTS)
    assert parse_dmidecode_system(only_slots) == {}


def test_truncated_capture(text):
    cut = text[: text.index("Designation: CPU1 Slot8") + 20]  # in the middle of the 8th slot
    slots = parse_dmidecode_slots(cut)
    assert [s.designation for s in slots[:7]] == list(SUPERMICRO_SLOTS)[:7]
    assert len(slots) == 8 and slots[-1].bus_address is None and slots[-1].slot_type == ""


# --- synthetic records --------------------------------------------------------------------------


def test_out_of_spec_type_takes_gen_from_designation():
    slot = _one(_record(0x10, "PCIE1 Gen4 X16", "x16 <OUT OF SPEC>"))
    assert (slot.width, slot.gen, slot.form, slot.slot_type) == (16, 4, "pcie", "x16 <OUT OF SPEC>")
    slot = _one(_record(0x10, "SLOT3", "x8 <OUT OF SPEC>"))
    assert (slot.width, slot.gen) == (8, None)
    slot = _one(_record(0x10, "PCIE1", "x16 <OUT OF SPEC>"))
    assert slot.gen is None  # the "1" of PCIE1 is a slot number, not a generation


def test_designation_gens():
    assert _one(_record(1, "PCIe Gen5 x16 Slot 2", "x16 PCI Express")).gen == 5
    assert _one(_record(1, "SLOT6 PCIe 4.0 X16", "x16 PCI Express")).gen == 4
    assert _one(_record(1, "RSR1 Slot", "x16 PCI Express Gen 4 x16")).gen == 4
    assert _one(_record(1, "RSR1 Slot", "x16 PCI Express")).gen is None


def test_width_falls_back_to_designation():
    slot = _one(_record(1, "CPU1 SLOT2 PCI-E 4.0 X8", "Other PCI Express 4"))
    assert (slot.width, slot.gen) == (8, 4)
    assert _one(_record(1, "PCIE_X1_1", "Unknown PCI Express")).width == 1
    assert _one(_record(1, "PCIEX16_2", "Unknown PCI Express")).width is None  # glued to a word: no guess


def test_forms():
    forms = {
        ("M.2 NVMe Drive Slot 1", "x4 M.2 Socket 3"): "m2",
        ("M2_1", "x4 PCI Express 3"): "m2",
        ("NVMe Bay 3", "x4 PCI Express 4 SFF-8639 (U.2)"): "u2",
        ("U.2_2", "x4 PCI Express 3"): "u2",
        ("E1.S bay 7", "x4 EDSFF E1.S, E1.L"): "e1s",
        ("OCP3.0 Slot", "x16 OCP NIC 3.0 Small Form Factor (SFF)"): "ocp",
        ("CPU1 Slot2", "x16 PCI Express 5 x16"): "pcie",
        ("ISA1", "16-bit ISA"): "other",
        ("DIMM2 riser", "x16 <OUT OF SPEC>"): "other",
    }
    for (designation, slot_type), form in forms.items():
        assert _one(_record(1, designation, slot_type)).form == form, designation


def test_usage_length_id_and_addresses():
    extra = "\tID: 3\n\tCharacteristics:\n\t\t3.3 V is provided\n\tBus Address: 88:00.0\n"
    slot = _one(_record(1, "S", "x16 PCI Express 3 x16", extra, usage="Available"))
    assert (slot.in_use, slot.length, slot.slot_id, slot.bus_address) == (False, "Long", "3", "0000:88:00.0")
    assert _one(_record(1, "S", "x8 PCI Express", "\tBus Address: 0002:C1:00.0\n")).bus_address == "0002:c1:00.0"
    assert _one(_record(1, "S", "x8 PCI Express", "\tBus Address: ff:1f.7\n")).bus_address == "0000:ff:1f.7"
    assert _one(_record(1, "S", "x8 PCI Express", "\tBus Address: Unknown\n")).bus_address is None
    assert _one(_record(1, "S", "x8 PCI Express", usage="Unknown")).in_use is None


def test_dmidecode_3_5_layout_with_spaces():
    """Newer dmidecode: "Data Bus Width" is a raw SMBIOS code (13 = x16) and a Generation line."""
    text = (
        "# dmidecode 3.5\n"
        "Handle 0x0007, DMI type 9, 24 bytes\n"
        "System Slot Information\n"
        "        Designation: PCIe Slot 1\n"
        "        Type: x16 PCI Express 5 x16\n"
        "        Current Usage: In Use\n"
        "        Length: Long\n"
        "        ID: 1\n"
        "        Characteristics: None\n"
        "        Bus Address: 0002:01:00.0\n"
        "        Data Bus Width: 13\n"
        "        Peer Devices: 0\n"
        "        PCI Express Generation: 5\n"
        "        Slot Physical Width: x16\n"
        "        Height: Full height\n"
    )
    slot = _one(text)
    assert (slot.width, slot.gen, slot.bus_address, slot.in_use, slot.line) == (16, 5, "0002:01:00.0", True, 2)


def test_crlf_and_indentation(text):
    expected = parse_dmidecode_slots(text)
    assert parse_dmidecode_slots(text.replace("\n", "\r\n")) == expected
    assert parse_dmidecode_slots(text.replace("\t", "    ")) == expected
    assert parse_dmidecode_system(text.replace("\n", "\r\n").replace("\t", "  "))["memory_gb"] == 128


def test_no_slot_records_is_empty_list():
    text = "# dmidecode 3.3\nHandle 0x0001, DMI type 1, 27 bytes\nSystem Information\n\tManufacturer: Acme\n"
    assert parse_dmidecode_slots(text) == []
    assert parse_dmidecode_system(text) == {"manufacturer": "Acme"}


def test_system_sizes_and_unpopulated_sockets():
    text = (
        "Handle 0x0004, DMI type 4, 48 bytes\nProcessor Information\n\tSocket Designation: P0\n"
        "\tVersion: AMD EPYC 9654 96-Core Processor\n\tStatus: Populated, Enabled\n\tCore Count: 96\n"
        "\tThread Count: 192\n\n"
        "Handle 0x0005, DMI type 4, 48 bytes\nProcessor Information\n\tSocket Designation: P1\n"
        "\tVersion: Not Specified\n\tStatus: Unpopulated\n\n"
        "Handle 0x0011, DMI type 17, 40 bytes\nMemory Device\n\tSize: 16384 MB\n\tVolatile Size: 16 GB\n\n"
        "Handle 0x0012, DMI type 17, 40 bytes\nMemory Device\n\tSize: 1 TB\n\n"
        "Handle 0x0013, DMI type 17, 40 bytes\nMemory Device\n\tSize: No Module Installed\n\n"
        "Handle 0x0014, DMI type 17, 40 bytes\nMemory Device\n\tSize: 512 MB\n"
    )
    system = parse_dmidecode_system(text)
    epyc = {"socket": "P0", "version": "AMD EPYC 9654 96-Core Processor", "cores": 96, "threads": 192}
    assert system["cpus"] == [epyc]
    assert system["memory_gb"] == 16 + 1024 + 0.5


# --- not dmidecode ------------------------------------------------------------------------------


def test_empty_and_garbage():
    with pytest.raises(SourceError, match="empty"):
        parse_dmidecode_slots("")
    data = random.Random(0).randbytes(4096)
    with pytest.raises(SourceError, match="binary"):
        parse_dmidecode_slots(data.decode("latin-1"), "dmi.bin")
    with pytest.raises(SourceError, match="binary"):
        parse_dmidecode_slots(data)
    assert parse_dmidecode_system("") == {}
    assert parse_dmidecode_system(data.decode("latin-1")) == {}
    assert parse_dmidecode_system(data) == {}


def test_lspci_text_is_rejected():
    lspci = (SUPERMICRO / "lspci-vvnn.txt").read_text()
    with pytest.raises(SourceError, match="not dmidecode output") as err:
        parse_dmidecode_slots(lspci, "lspci-vvnn.txt")
    assert err.value.source == "lspci-vvnn.txt"
    assert parse_dmidecode_system(lspci) == {}


def test_fuzzed_capture_never_raises_anything_else(text):
    rng = random.Random(2)
    lines = text.split("\n")
    for _ in range(60):
        mutated = lines[rng.randrange(len(lines) // 2) :]
        for _ in range(40):
            if not mutated:
                break
            i = rng.randrange(len(mutated))
            cut = mutated[i][: rng.randrange(len(mutated[i]) + 1)]
            mutated[i] = rng.choice([cut, cut + ": x", "\tBus Address: " + cut, "\tType: x" + cut])
        try:
            slots = parse_dmidecode_slots("\n".join(mutated))
        except SourceError:
            continue
        assert all(isinstance(s, DmiSlot) for s in slots)
        assert isinstance(parse_dmidecode_system("\n".join(mutated)), dict)


def test_a_capture_appended_twice_gives_each_slot_once_with_a_warning() -> None:
    text = (Path(__file__).parent / "fixtures" / "supermicro-sys-4029gp-trt" / "dmidecode.txt").read_text()
    notes: list[str] = []
    assert parse_dmidecode_slots(text * 2, "dmidecode.txt", notes) == parse_dmidecode_slots(text)
    assert notes and notes[0].startswith("dmidecode.txt: ") and "repeated" in notes[0]
    assert parse_dmidecode_system(text * 2) == parse_dmidecode_system(text)
