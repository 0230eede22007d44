"""tests/tiers.py: the slow tier is read from pytest's own JUnit XML, node ids as pytest names
them (parameter ids with spaces included), and conftest marks exactly those tests."""

from __future__ import annotations

import subprocess
import sys

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
    monkeypatch.setattr(tiers, "SLOW_S", 0.25)
    assert tiers.main([str(report)]) == 0
    assert tiers.read_list(tmp_path / "slow_tests.txt") == set(slow)
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
