"""scripts/ncu_stalls.py: reading Nsight Compute's source-page CSV (CPU, synthetic files)."""
from __future__ import annotations

import gzip
import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "ncu_stalls.py")
_spec = importlib.util.spec_from_file_location("_ncu_stalls", _PATH)
ncu_stalls = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_stalls)

_HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
           "Instructions Executed", "stall_barrier", "stall_long_sb", "stall_barrier (Not Issued)"]


def _write(path, rows, compress):
    lines = ['"Kernel Name","void k(int)",', ",".join(f'"{h}"' for h in _HEADER)]
    lines += [",".join(f'"{v}"' for v in r) for r in rows]
    data = "\n".join(lines) + "\n"
    if compress:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        with open(path, "w") as f:
            f.write(data)


@pytest.mark.parametrize("compress", [False, True])
def test_load_reads_offsets_counts_and_unlisted_samples(tmp_path, compress):
    path = str(tmp_path / ("a.csv.gz" if compress else "a.csv"))
    _write(path, [["0x7f0000001000", "  LDC R1, c[0x0][0x28]", "10", "9", "1,024", "4", "1", "3"],
                  ["0x7f0000001010", "HGMMA.64x128x16.F32.BF16 R88, R184", "50", "50", "512", "2", "0", "2"],
                  ["0x7f0000001020", "EXIT", "0", "0", "256", "0", "0", "0"]], compress)
    instrs = ncu_stalls.load(path)
    assert [i["offset"] for i in instrs] == [0, 0x10, 0x20]
    assert instrs[0]["sass"] == "LDC R1, c[0x0][0x28]"
    assert instrs[0]["executed"] == 1024
    assert instrs[0]["stalls"] == {"barrier": 4, "long_sb": 1, "unlisted": 5}
    assert instrs[1]["stalls"]["unlisted"] == 48  # what the columns do not name (warpgroup arrive)
    samples, executed, reasons = ncu_stalls.totals(instrs)
    assert (samples, executed) == (60, 1792)
    assert reasons == {"barrier": 6, "long_sb": 1, "unlisted": 53}


def test_compare_scales_the_base_launch(tmp_path, capsys):
    a, b = str(tmp_path / "a.csv"), str(tmp_path / "b.csv")
    _write(a, [["0x1000", "BAR.SYNC", "30", "30", "100", "30", "0", "30"]], False)
    _write(b, [["0x2000", "BAR.SYNC", "40", "40", "200", "20", "20", "20"]], False)
    assert ncu_stalls.main([a, "--base", b, "--work", "0.5", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "samples 30 vs 20" in out
    lines = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()[-3:]}
    assert lines["barrier"] == ["30", "10", "+20"]
    assert lines["long_sb"] == ["0", "10", "-10"]


def test_not_a_source_page_is_a_clear_error(tmp_path):
    path = str(tmp_path / "x.csv")
    with open(path, "w") as f:
        f.write('"ID","Kernel Name"\n"0","k"\n')
    with pytest.raises(ValueError, match="Address"):
        ncu_stalls.load(path)


def test_shared_wavefronts_by_opcode(tmp_path, capsys):
    header = _HEADER + ["L1 Wavefronts Shared"]
    path = str(tmp_path / "s.csv")
    rows = [["0x1000", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR12], R152", "5", "5", "8", "0", "0", "0", "1,200"],
            ["0x1010", "@!P2 LDS.64 R18, [R0+0x30000]", "1", "1", "8", "0", "1", "0", "300"],
            ["0x1020", "LDS.64 R4, [R4]", "1", "1", "8", "0", "1", "0", "100"],
            ["0x1030", "FFMA R1, R2, R3, R4", "1", "1", "8", "0", "0", "0", "0"]]
    with open(path, "w") as f:
        f.write('"Kernel Name","void k(int)",\n' + ",".join(f'"{h}"' for h in header) + "\n")
        f.write("\n".join(",".join(f'"{v}"' for v in r) for r in rows) + "\n")
    instrs = ncu_stalls.load(path)
    assert ncu_stalls.shared_by_opcode(instrs) == [("HGMMA.64x64x16", 1200), ("LDS.64", 400)]
    assert ncu_stalls.main([path, "--top", "0", "--shared"]) == 0
    out = capsys.readouterr().out
    assert "1600 in all" in out and "75.0%" in out and "25.0%" in out


def test_opcode_strips_predicates_and_keeps_one_modifier():
    assert ncu_stalls.opcode("@!P0  BRA 0x7f") == "BRA"
    assert ncu_stalls.opcode("STS.64 [R11], R2") == "STS.64"
    assert ncu_stalls.opcode("WARPGROUP.DEPBAR.LE gsb0, 0x1") == "WARPGROUP.DEPBAR"
    assert ncu_stalls.opcode("") == ""
