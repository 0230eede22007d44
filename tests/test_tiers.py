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


def test_the_committed_list_names_tests_that_exist():
    listed = tiers.read_list()
    if not listed:
        return
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    missing = listed - set(collected)
    # Tests of the other framework's half are collected too (skipped later), so every listed
    # id must be there unless the test was renamed or removed: then regenerate the list.
    assert (
        not missing
    ), f"regenerate tests/slow_tests.txt (python -m tests.tiers): {sorted(missing)[:5]}"
