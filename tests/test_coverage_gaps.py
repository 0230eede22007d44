"""tests/coverage_gaps.py on small synthetic coverage.py JSON reports: statements and branches
matched by their text and scope across edits that move lines, removed code allowed, losses
listed with a non-zero exit status."""

from __future__ import annotations

import json
from pathlib import Path

from tests import coverage_gaps

SOURCE = """\
def parse(text):
    if not text:
        return None
    return text.split()


def render(items):
    if items is None:
        return None
    return " ".join(items)
"""


def write_report(path: Path, files: dict[str, dict], with_source: bool = True) -> Path:
    """A coverage.py JSON report (the keys coverage_gaps reads) of ``files``: path -> source,
    executed / missing / excluded lines, executed / missing branches."""
    report = {"meta": {"branch_coverage": True}, "files": {}}
    for name, spec in files.items():
        executed, missing = spec.get("executed", []), spec.get("missing", [])
        branches, missed = spec.get("branches", []), spec.get("missed_branches", [])
        entry = {
            "executed_lines": executed,
            "missing_lines": missing,
            "excluded_lines": spec.get("excluded", []),
            "executed_branches": branches,
            "missing_branches": missed,
            "summary": {
                "covered_lines": len(executed),
                "num_statements": len(executed) + len(missing),
                "covered_branches": len(branches),
                "num_branches": len(branches) + len(missed),
            },
        }
        if with_source:
            entry["source"] = spec["source"]
        report["files"][name] = entry
    path.write_text(json.dumps(report), encoding="utf-8")
    return path


# Every statement of SOURCE ran but the early returns; both ifs went one way.
ALL_BUT_EARLY_RETURNS = {
    "source": SOURCE,
    "executed": [1, 2, 4, 7, 8, 10],
    "missing": [3, 9],
    "branches": [[2, 4], [8, 10]],
    "missed_branches": [[2, 3], [8, 9]],
}


def gaps(tmp_path, capsys, before: dict, after: dict) -> tuple[int, str]:
    status = coverage_gaps.main(
        [
            str(write_report(tmp_path / "before.json", before)),
            str(write_report(tmp_path / "after.json", after)),
        ]
    )
    return status, capsys.readouterr().out


def test_the_same_coverage_loses_nothing(tmp_path, capsys):
    status, out = gaps(
        tmp_path,
        capsys,
        {"train/a.py": ALL_BUT_EARLY_RETURNS},
        {"train/a.py": ALL_BUT_EARLY_RETURNS},
    )
    assert status == 0
    assert out.strip() == (
        "covered lines/branches: before 6/2, after 6/2; lost 0/0 "
        "(in removed code, not counted: 0/0)"
    )


def test_a_statement_and_a_branch_no_longer_run_are_listed_with_their_text(tmp_path, capsys):
    after = {
        "source": SOURCE,
        "executed": [1, 2, 4, 7],
        "missing": [3, 8, 9, 10],
        "branches": [[2, 4]],
        "missed_branches": [[2, 3], [8, 9], [8, 10]],
    }
    status, out = gaps(
        tmp_path, capsys, {"train/a.py": ALL_BUT_EARLY_RETURNS}, {"train/a.py": after}
    )
    assert status == 1
    assert out.splitlines() == [
        "train/a.py: 2 lines, 1 branch no longer covered",
        "  line 8: if items is None:",
        '  line 10: return " ".join(items)',
        "  branch 8->10: if items is None:",
        "covered lines/branches: before 6/2, after 4/1; lost 2/1 "
        "(in removed code, not counted: 0/0)",
    ]


def test_lines_moved_by_an_edit_above_them_are_the_same_statements(tmp_path, capsys):
    inserted = "import os\n\n\n" + SOURCE  # every line three further down
    after = {
        "source": inserted,
        "executed": [1, 4, 5, 7, 10, 11, 13],
        "missing": [6, 12],
        "branches": [[5, 7], [11, 13]],
        "missed_branches": [[5, 6], [11, 12]],
    }
    status, out = gaps(
        tmp_path, capsys, {"train/a.py": ALL_BUT_EARLY_RETURNS}, {"train/a.py": after}
    )
    assert status == 0, out
    assert "lost 0/0" in out


def test_the_same_text_in_another_function_is_another_statement(tmp_path, capsys):
    """`return None` in parse and in render: render's stays lost when parse's now runs, and a
    new `return None` above render's does not shift render's identity."""
    before = {"source": SOURCE, "executed": [1, 2, 7, 8, 9], "missing": [3, 4, 10]}
    edited = SOURCE.replace("    return text.split()\n", "    return None\n    return 1\n")
    after = {"source": edited, "executed": [1, 2, 3, 8, 9], "missing": [4, 5, 10, 11]}
    status, out = gaps(tmp_path, capsys, {"train/a.py": before}, {"train/a.py": after})
    assert status == 1
    assert "  line 10: return None" in out.splitlines()  # render's, now at line 10
    assert "lost 1/0" in out


def test_removed_code_is_not_a_loss_but_is_counted(tmp_path, capsys):
    shorter = SOURCE.replace('    return " ".join(items)\n', "")
    after = {
        "source": shorter,
        "executed": [1, 2, 4, 7, 8, 9],
        "missing": [3],
        "branches": [[2, 4], [8, 9]],
        "missed_branches": [[2, 3], [8, -7]],
    }
    status, out = gaps(
        tmp_path, capsys, {"train/a.py": ALL_BUT_EARLY_RETURNS}, {"train/a.py": after}
    )
    assert status == 0, out
    # The removed return, and the branch into it (8->10) whose end is gone.
    assert "(in removed code, not counted: 1/1)" in out


def test_a_file_the_after_report_no_longer_has_is_removed_code(tmp_path, capsys):
    other = {"source": "x = 1\n", "executed": [1]}
    status, out = gaps(
        tmp_path,
        capsys,
        {"train/a.py": ALL_BUT_EARLY_RETURNS, "train/gone.py": other},
        {"train/a.py": ALL_BUT_EARLY_RETURNS},
    )
    assert status == 0
    assert "before 7/2, after 6/2; lost 0/0 (in removed code, not counted: 1/0)" in out


def test_a_statement_excluded_after_is_lost(tmp_path, capsys):
    after = dict(ALL_BUT_EARLY_RETURNS, executed=[1, 2, 4, 7, 8], excluded=[10])
    status, out = gaps(
        tmp_path, capsys, {"train/a.py": ALL_BUT_EARLY_RETURNS}, {"train/a.py": after}
    )
    assert status == 1
    assert '  line 10: return " ".join(items)' in out


def test_a_branch_out_of_the_function_is_matched_by_its_def_line(tmp_path, capsys):
    source = "def f(x):\n    if x:\n        g()\n"
    before = {"source": source, "executed": [1, 2, 3], "branches": [[2, 3], [2, -1]]}
    after = {
        "source": "import g\n\n\n" + source,
        "executed": [1, 4, 5, 6],
        "branches": [[5, 6]],
        "missed_branches": [[5, -4]],
    }
    status, out = gaps(tmp_path, capsys, {"train/f.py": before}, {"train/f.py": after})
    assert status == 1
    assert "  branch 5->exit from line 4: if x:" in out.splitlines()


def test_with_several_before_runs_only_what_all_covered_counts(tmp_path, capsys):
    """A line one BEFORE run covered by timing and another did not is not a loss."""
    by_chance = dict(ALL_BUT_EARLY_RETURNS, executed=[1, 2, 3, 4, 7, 8, 10], missing=[9])
    reports = [
        write_report(tmp_path / "before1.json", {"train/a.py": by_chance}),
        write_report(tmp_path / "before2.json", {"train/a.py": ALL_BUT_EARLY_RETURNS}),
        write_report(tmp_path / "after.json", {"train/a.py": ALL_BUT_EARLY_RETURNS}),
    ]
    assert coverage_gaps.main([str(r) for r in reports]) == 0
    assert "before 6/2, after 6/2; lost 0/0" in capsys.readouterr().out
    # Alone, the run that covered it makes it a loss.
    assert coverage_gaps.main([str(reports[0]), str(reports[2])]) == 1
    assert "  line 3: return None" in capsys.readouterr().out


def test_a_report_without_the_snapshots_source_is_refused(tmp_path, capsys):
    plain = write_report(tmp_path / "plain.json", {"train/a.py": ALL_BUT_EARLY_RETURNS}, False)
    assert coverage_gaps.main([str(plain), str(plain)]) == 2
    assert "no source text in the report" in capsys.readouterr().err


def test_usage_without_two_reports(capsys):
    assert coverage_gaps.main([]) == 2
    assert "python -m tests.coverage_gaps BEFORE.json AFTER.json" in capsys.readouterr().err


def test_snapshot_adds_the_sources_and_prints_the_totals_per_package(tmp_path, capsys, monkeypatch):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.py").write_text(SOURCE, encoding="utf-8")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "b.py").write_text("x = 1\n", encoding="utf-8")
    files = {
        "train/a.py": ALL_BUT_EARLY_RETURNS,
        "bench/b.py": {"source": "", "missing": [1]},
    }
    report = write_report(tmp_path / "coverage.json", files, with_source=False)
    monkeypatch.chdir(tmp_path)  # coverage.py's report paths are relative to where it ran
    assert coverage_gaps.main(["--snapshot", str(report)]) == 0
    saved = json.loads(report.read_text(encoding="utf-8"))["files"]
    assert saved["train/a.py"]["source"] == SOURCE
    assert saved["bench/b.py"]["source"] == "x = 1\n"
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == ["bench", "0/1", "0.0%", "0/0"]
    assert table[2].split() == ["train", "6/8", "75.0%", "2/4", "50.0%"]
    assert table[3].split() == ["total", "6/9", "66.7%", "2/4", "50.0%"]


def test_scopes_name_nested_functions_and_methods():
    source = (
        "class A:\n    def m(self):\n        def inner():\n            pass\n        return 1\n"
    )
    assert coverage_gaps.enclosing_scopes(source) == {
        2: "A",
        3: "A.m",
        4: "A.m.inner",
        5: "A.m",
    }
