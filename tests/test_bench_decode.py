"""analysis/bench_decode.py on a tiny problem: every mechanism's row is there, its state flat in L, and
the profile names the memory calls (timings themselves are never tested)."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "analysis" / "bench_decode.py"
_spec = importlib.util.spec_from_file_location("bench_decode", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_decode"] = bench
_spec.loader.exec_module(bench)


def test_rows_and_flat_states(tmp_path):
    out = tmp_path / "decode.md"
    args = ["--L", "96,160", "--d", "8", "--m", "4", "--window", "8", "--sinks", "2", "--cache", "5", "--steps", "2",
            "--reps", "1", "--out", str(out)]
    assert bench.main(args) == 0
    text = out.read_text()
    for row in ("hybrid w=8+2 + cache K=5", "hybrid w=8+2 + decay='input'", "hybrid w=8+2 + delta state",
                "hybrid w=8+2 + gated delta (decay='input')", "hybrid w=8+2 + delta state + cache K=5"):
        for path in ("public call", "lean step"):
            cells = [c for c in (line.split("|") for line in text.splitlines() if line.startswith(f"| {row} |"))
                     if c[2].strip() == path]
            assert [c[3].strip() for c in cells] == ["96", "160"], (row, path)
            assert len({c[11] for c in cells}) == 1, (row, path)  # state MiB flat in L
            check = text.split(f"- {row}, {path}, at L=160")[1].split("\n")[0]
            assert "state constant in L" in check, (row, path)
            if path == "lean step":  # the step's arithmetic and its ratio are there
                assert int(cells[0][9]) > 0 and float(cells[0][10]) > 0 and "time ÷ arithmetic" in check
    assert "Matmul rate measured in this run" in text
    assert "Machine load" in text
    assert bench.main([*args, "--profile"]) == 0
    profile = (tmp_path / "decode_profile.md").read_text()
    assert profile.count("## hybrid") == 5
    assert "`_entry.py:memory_call`" in profile and "`memory_state.py:check_memory_call`" in profile  # the entry's memory path
