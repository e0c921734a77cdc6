"""bench/ncu_kernels.py's reader of Nsight Compute's per-instruction CSV export (no GPU needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).parent.parent / "bench" / "ncu_kernels.py"
COLUMNS = [
    "Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
    "stall_long_sb", "stall_barrier", "stall_long_sb (Not Issued)",
]  # fmt: skip


def _module():
    spec = importlib.util.spec_from_file_location("ncu_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _export(path: Path) -> None:
    """Two kernels as `ncu --page source --csv --print-source sass` writes them."""
    rows = [
        ["Kernel Name", "_gate_up_kernel"],
        COLUMNS,
        ["0x10", "  LDC R1, c[0x0][0x28]", "5", "384", "0", "0", "0"],
        ["0x20", "  @!P0  BRA 0x7f", "80", "6144", "79", "1", "79"],
        ["0x30", "  WARPGROUP.DEPBAR.LE gsb0, 0x0", "15", "6144", "0", "15", "0"],
        [],
        ["Kernel Name", "_down_kernel"],
        COLUMNS,
        ["0x10", "  EXIT", "4", "256", "0", "4", "0"],
    ]
    path.write_text("\n".join(",".join(f'"{c}"' for c in r) for r in rows) + "\n")


def test_reads_each_kernels_instructions(tmp_path):
    ncu = _module()
    _export(tmp_path / "sass.csv")
    kernels = ncu.read_source_page(tmp_path / "sass.csv")
    assert [name for name, _, _ in kernels] == ["_gate_up_kernel", "_down_kernel"]
    _, columns, rows = kernels[0]
    assert columns == COLUMNS and len(rows) == 3
    assert rows[1][1].strip().startswith("@!P0  BRA") and len(kernels[1][2]) == 1


def test_summary_shares_and_hottest_instruction(tmp_path, capsys):
    ncu = _module()
    _export(tmp_path / "sass.csv")
    ncu.summarize(tmp_path / "sass.csv", top=1)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "## _gate_up_kernel: 3 instructions, 100 samples"
    assert out[1] == "stalls: long_sb 79.0%, barrier 16.0%"  # "(Not Issued)" columns are not counted twice
    assert "80.0%" in out[2] and "@!P0  BRA" in out[2] and "long_sb 79" in out[2]
    assert out[3] == "## _down_kernel: 1 instructions, 4 samples"
