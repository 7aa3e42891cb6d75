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


def test_tests_by_file_picks_the_first_matching_entry_and_names_an_uncovered_file():
    # the specific entry comes before the glob, so scale.py gets its own list, not the glob's
    assert mut.tests_by_file("sketchlab.convert.scale.x_calibrate_gates__mutmut_3") == \
        mut.TESTS_BY_FILE["sketchlab/convert/scale.py"]
    # a method mutant (mutmut names it x\u01c1Class\u01c1method) of a file only the glob covers
    assert mut.source_file("sketchlab.convert.sketched.x\u01c1SketchedMap\u01c1forward__mutmut_1") == \
        "sketchlab/convert/sketched.py"
    assert mut.tests_by_file("sketchlab.convert.sketched.x\u01c1SketchedMap\u01c1forward__mutmut_1") == \
        mut.TESTS_BY_FILE["sketchlab/convert/*.py"]
    # the long-context files have their own lists (issue 35), before the globs that also match them
    assert mut.tests_by_file("sketchlab.convert.exact.x_f__mutmut_1") == ["tests/test_convert_exact.py",
                                                                          "tests/test_convert_memory.py"]
    assert mut.tests_by_file("sketchlab.attention.ops.delta.chunk.x_f__mutmut_1") == ["tests/test_delta.py",
                                                                                       "tests/test_memory.py"]
    assert mut.tests_by_file("sketchlab.attention.ops.decayed.naive.x_f__mutmut_1") == ["tests/test_delta.py",
                                                                                         "tests/test_memory.py"]
    assert mut.tests_by_file("sketchlab.attention.memory_fast.x_f__mutmut_1") == \
        mut.TESTS_BY_FILE["sketchlab/attention/memory*.py"]
    assert mut.tests_by_file("sketchlab.attention.ops.cache.schedule.x_f__mutmut_1") == \
        mut.TESTS_BY_FILE["sketchlab/attention/memory*.py"]
    with pytest.raises(KeyError, match=r"sketchlab/fit\.py \(mutant sketchlab\.fit\.x_f__mutmut_1\)"):
        mut.tests_by_file("sketchlab.fit.x_f__mutmut_1")


def test_every_listed_test_file_exists():
    root = _PATH.parent.parent
    missing = sorted({t for tests in mut.TESTS_BY_FILE.values() for t in tests if not (root / t).is_file()})
    assert missing == []
