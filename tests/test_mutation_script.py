"""analysis/mutation.py's report logic (no mutmut run): older rounds' diffs are carried over from the
committed report, and an unterminated diff block is named."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "analysis" / "mutation.py"
_spec = importlib.util.spec_from_file_location("mutation_script", _PATH)
mut = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("mutation_script", mut)
_spec.loader.exec_module(mut)


def test_previous_diffs_reads_each_survivors_block_and_names_an_unclosed_one(tmp_path):
    report = tmp_path / "m.md"
    report.write_text("- `a.x__mutmut_1`: equivalent\n\n```diff\n-a\n+b\n```\n- `b.y__mutmut_2`: no diff here\n"
                      "- `c.z__mutmut_3`: gap\n```diff\n-1\n+2\n```\n", encoding="utf-8")
    assert mut._previous_diffs(report) == {"a.x__mutmut_1": "-a\n+b", "c.z__mutmut_3": "-1\n+2"}
    assert mut._previous_diffs(tmp_path / "none.md") == {}
    report.write_text("- `a.x__mutmut_1`: gap\n```diff\n-a\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"m\.md: the diff block of a\.x__mutmut_1 opened at line 2 is never closed"):
        mut._previous_diffs(report)


def test_record_totals_sum_the_record():
    record = {"a": (30, "c1", ["x__mutmut_1", "x__mutmut_2"]), "b": (8, "c2", [])}
    total = mut.record_totals(record)
    assert total["checked"] == 38 and total["killed in the run"] == 36
