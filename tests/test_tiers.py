"""tests/tiers.py: the slow tier is read from pytest's own JUnit XML, node ids as pytest names
them (parameter ids with spaces included), and conftest marks exactly those tests."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests import tiers
from tests.conftest import ROOT

SAMPLE = """
def test_fast():
    pass

def test_slow():
    import time
    time.sleep(0.3)

import pytest
@pytest.mark.parametrize("case", ["a b", "c"])
def test_param(case):
    import time
    time.sleep(0.3 if case == "a b" else 0)
"""


def test_slow_list_round_trip_from_a_real_junit_report(tmp_path, monkeypatch):
    module = tmp_path / "tests" / "test_sample.py"
    module.parent.mkdir()
    (module.parent / "__init__.py").write_text("")
    module.write_text(SAMPLE)
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "tests/test_sample.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-2000:]

    slow = tiers.slow_tests([report], slow_s=0.25)
    assert sorted(slow) == [
        "tests/test_sample.py::test_param[a b]",
        "tests/test_sample.py::test_slow",
    ]
    monkeypatch.setattr(tiers, "LIST", tmp_path / "slow_tests.txt")
    monkeypatch.setattr(tiers, "DOC", tmp_path / "testing.md")
    (tmp_path / "testing.md").write_text(f"{tiers.MEASURED_BEGIN}\n{tiers.MEASURED_END}\n")
    monkeypatch.setattr(tiers, "SLOW_S", 0.25)
    assert tiers.main([str(report)]) == 0
    assert tiers.read_list(tmp_path / "slow_tests.txt") == set(slow)
    assert "`tests/test_sample.py::test_slow`" in (tmp_path / "testing.md").read_text()
    summary = tiers.table([report], top=2)
    assert "| report | 4 |" in summary and "| 2, " in summary
    assert "`tests/test_sample.py::test_slow`" in summary and "test_param[a b]" in summary
    assert "test_fast" not in summary and "test_param[c]" not in summary  # the two slowest only


def test_the_committed_list_names_tests_that_exist():
    listed = tiers.read_list()
    assert listed, "tests/slow_tests.txt lists no test: regenerate it (python -m tests.tiers)"
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    # A module that needs the other half's framework at import is not collected here: its ids
    # are checked by the other half's run of this test. Any other listed id must be collected
    # (tests of the other half are, and are skipped later) unless it was renamed or removed.
    modules = {nid.split("::")[0] for nid in collected}
    missing = {
        nid
        for nid in listed - set(collected)
        if nid.split("::")[0] in modules or not (ROOT / nid.split("::")[0]).is_file()
    }
    assert (
        not missing
    ), f"regenerate tests/slow_tests.txt (python -m tests.tiers): {sorted(missing)[:5]}"


def test_a_report_that_is_missing_or_not_xml_is_named_and_the_list_is_kept(
    tmp_path, monkeypatch, capsys
):
    kept = tmp_path / "slow_tests.txt"
    kept.write_text("# the list before\n")
    monkeypatch.setattr(tiers, "LIST", kept)
    monkeypatch.setattr(tiers, "DOC", tmp_path / "testing.md")
    broken = tmp_path / "torch.xml"
    broken.write_text("<testsuite")  # a report cut off mid-write
    for args, problem in (
        ([str(tmp_path / "paddle.xml")], "paddle.xml: no such file"),
        ([str(broken)], "torch.xml: not XML"),
        (["--table", str(broken)], "torch.xml: not XML"),
    ):
        assert tiers.main(args) == 2
        err = capsys.readouterr().err
        assert problem in err and "HINT" in err and "make test" in err
    assert kept.read_text() == "# the list before\n"
    assert tiers.main(["--help"]) == 0 and "slow_tests.txt" in capsys.readouterr().out


# ---------------------------------------------------------------- docs/testing.md's measured tables


def junit(path, cases):
    """A JUnit report as pytest writes it: (module, test name, seconds) per test."""
    rows = "".join(
        f'<testcase classname="tests.{module}" name="{name}" time="{seconds}" />'
        for module, name, seconds in cases
    )
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}'
        "</testsuite></testsuites>"
    )
    return path


def reports(tmp_path, slow_seconds=7.5):
    torch_xml = junit(
        tmp_path / "torch.xml",
        [("test_a", "test_slow", slow_seconds), ("test_a", "test_fast", 0.1)],
    )
    paddle_xml = junit(tmp_path / "paddle.xml", [("test_b", "test_other", 4.0)])
    return [torch_xml, paddle_xml]


def outside(text):
    """What lies outside the measured region, the marker lines included."""
    start, end = tiers.measured_region(text)
    return text[:start], text[end:]


def test_the_tiers_command_rewrites_only_the_measured_region_and_is_idempotent(
    tmp_path, monkeypatch
):
    committed = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    doc, listed = tmp_path / "testing.md", tmp_path / "slow_tests.txt"
    doc.write_text(committed, encoding="utf-8")
    monkeypatch.setattr(tiers, "DOC", doc)
    monkeypatch.setattr(tiers, "LIST", listed)
    xml = reports(tmp_path)

    assert tiers.main([str(x) for x in xml]) == 0
    once = doc.read_text(encoding="utf-8")
    assert outside(once) == outside(committed)
    start, end = tiers.measured_region(once)
    assert once[start:end].strip("\n") == tiers.table(xml).strip("\n")
    assert "`tests/test_a.py::test_slow`" in once and "test_fast" in once
    assert tiers.read_list(listed) == {"tests/test_a.py::test_slow", "tests/test_b.py::test_other"}

    assert tiers.main([str(x) for x in xml]) == 0
    assert doc.read_text(encoding="utf-8") == once  # the same reports: the same bytes

    xml = reports(tmp_path, slow_seconds=9.25)  # a new run replaces the tables, adds nothing
    assert tiers.main([str(x) for x in xml]) == 0
    again = doc.read_text(encoding="utf-8")
    assert outside(again) == outside(committed)
    assert "| 9.2 | torch |" in again and "| 7.5 | torch |" not in again
    assert again.count("| half | tests | seconds |") == 1


@pytest.mark.parametrize(
    "text",
    [
        "# no markers\n",
        f"{tiers.MEASURED_BEGIN}\nonly the first\n",
        f"{tiers.MEASURED_END}\n{tiers.MEASURED_BEGIN}\n",
        f"{tiers.MEASURED_BEGIN}\n{tiers.MEASURED_END}\n{tiers.MEASURED_END}\n",
    ],
    ids=["none", "no-end", "reversed", "twice"],
)
def test_a_doc_without_one_pair_of_markers_is_named_and_nothing_is_written(
    tmp_path, monkeypatch, capsys, text
):
    doc, listed = tmp_path / "testing.md", tmp_path / "slow_tests.txt"
    doc.write_text(text)
    listed.write_text("# the list before\n")
    monkeypatch.setattr(tiers, "DOC", doc)
    monkeypatch.setattr(tiers, "LIST", listed)
    assert tiers.main([str(x) for x in reports(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(doc) in err and tiers.MEASURED_BEGIN in err and "nothing was written" in err
    assert doc.read_text() == text and listed.read_text() == "# the list before\n"


def test_the_committed_tables_and_slow_list_come_from_one_run():
    """docs/testing.md's measured tables are the tiers command's output for the same reports as
    tests/slow_tests.txt: each test's slowest row is its time in the list, and every listed test
    slower than the table's last row is in the table (hand-edited figures fail here)."""
    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    assert "python -m tests.tiers .cache/test-reports/torch.xml" in "".join(outside(text))
    start, end = tiers.measured_region(text)
    region = text[start:end]
    header = tiers.table([]).splitlines()
    assert region.strip("\n").splitlines()[:2] == header[:2], "not the tiers command's format"
    rows = [
        (float(seconds), nid)
        for seconds, nid in re.findall(r"^\| ([0-9.]+) \| \w+ \| `([^`]+)` \|$", region, re.M)
    ]
    assert rows, "no slowest tests in docs/testing.md's measured region"
    listed = {
        line.split(None, 1)[1]: float(line.split(None, 1)[0])
        for line in tiers.LIST.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    slowest = {}
    for seconds, nid in rows:
        slowest[nid] = max(slowest.get(nid, 0.0), seconds)
    rerun = "rerun python -m tests.tiers on one make test's reports (docs/testing.md)"
    assert {nid: listed.get(nid) for nid in slowest} == slowest, rerun
    last = min(seconds for seconds, _ in rows)
    assert {nid for nid, s in listed.items() if s > last} <= set(slowest), rerun
