"""The test tiers: which tests are slow, from measured times.

`make test` runs every test. `make test-quick` runs the unit tier, the tests not listed in
tests/slow_tests.txt, for the inner loop of an edit: the listed ones are those that took at least
SLOW_S seconds in a full run (end-to-end trainings in subprocesses, multi-rank launches, real
servers and containers). conftest.py marks them `slow`. Regenerate the list, and the measured
tables of docs/testing.md (each half's time, the slow tier's share, the slowest tests; the region
between its MEASURED_BEGIN and MEASURED_END lines, nothing else), from the JUnit XML files that
`make test` writes:

    python -m tests.tiers .cache/test-reports/torch.xml .cache/test-reports/paddle.xml

``python -m tests.tiers --table`` and the same files prints the tables and writes nothing.

A new test is in the quick tier until the list is regenerated; the quick tier's own time is
printed by pytest, and the slowest tests of each half by `make test` (--durations).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOW_S = 3.0
LIST = Path(__file__).with_name("slow_tests.txt")
DOC = Path(__file__).resolve().parent.parent / "docs" / "testing.md"
# The region of DOC that main() rewrites (the marker lines themselves stay).
MEASURED_BEGIN = "<!-- measured:begin (python -m tests.tiers writes this region) -->"
MEASURED_END = "<!-- measured:end -->"
HEADER = (
    "# Tests that took >= {slow:g} s in a full `make test` (both halves; seconds, node id):\n"
    "# `make test-quick` leaves them out. Made by: python -m tests.tiers "
    ".cache/test-reports/torch.xml .cache/test-reports/paddle.xml\n"
)


def node_id(case: ET.Element) -> str:
    """pytest's node id of a JUnit testcase (classname: the dotted module, then any class)."""
    parts = case.get("classname", "").split(".")
    module = "/".join(parts[:2]) + ".py" if len(parts) >= 2 else parts[0]
    return "::".join([module, *parts[2:], case.get("name", "")])


def slow_tests(reports: list[Path], slow_s: float = SLOW_S) -> dict[str, float]:
    """Node id -> seconds (the longest over the reports) of every test at or over ``slow_s``."""
    times: dict[str, float] = {}
    for report in reports:
        for case in ET.parse(report).iter("testcase"):
            if case.find("skipped") is not None:
                continue
            nid = node_id(case)
            times[nid] = max(times.get(nid, 0.0), float(case.get("time", 0.0)))
    return {nid: t for nid, t in sorted(times.items()) if t >= slow_s}


def read_list(path: Path = LIST) -> set[str]:
    if not path.is_file():
        return set()
    lines = path.read_text(encoding="utf-8").splitlines()
    # "<seconds>  <node id>": node ids may hold spaces (parameter ids), so the id comes last.
    return {line.split(None, 1)[1] for line in lines if line.strip() and line[0] != "#"}


def durations(report: Path) -> dict[str, float]:
    """Node id -> seconds (setup, call and teardown) of every test run in one report."""
    return {
        node_id(case): float(case.get("time", 0.0))
        for case in ET.parse(report).iter("testcase")
        if case.find("skipped") is None
    }


def table(reports: list[Path], top: int = 30) -> str:
    """A Markdown summary of full runs: per report its tests, their seconds and the slow tier's
    share of them, then the ``top`` slowest tests over all reports."""
    lines = [f"| half | tests | seconds | slow tier (>= {SLOW_S:g} s): tests, share of time |"]
    lines.append("|---|---:|---:|---|")
    every: list[tuple[float, str, str]] = []
    for report in reports:
        times = durations(report)
        total = sum(times.values())
        slow = [t for t in times.values() if t >= SLOW_S]
        share = sum(slow) / total if total else 0.0
        lines.append(f"| {report.stem} | {len(times)} | {total:.0f} | {len(slow)}, {share:.0%} |")
        every += [(t, report.stem, nid) for nid, t in times.items()]
    lines += ["", "| seconds | half | test |", "|---:|---|---|"]
    for seconds, half, nid in sorted(every, reverse=True)[:top]:
        lines.append(f"| {seconds:.1f} | {half} | `{nid}` |")
    return "\n".join(lines) + "\n"


def measured_region(text: str) -> tuple[int, int]:
    """The start and end offsets of what lies between the marker lines of ``text``; ValueError
    naming the problem unless each marker is there once, on a line of its own, begin first."""
    lines = text.splitlines(keepends=True)
    found = {}
    for marker in (MEASURED_BEGIN, MEASURED_END):
        at = [i for i, line in enumerate(lines) if line.strip() == marker]
        if len(at) != 1:
            raise ValueError(f"{len(at)} lines read {marker!r}; there must be exactly one")
        found[marker] = at[0]
    begin, end = found[MEASURED_BEGIN], found[MEASURED_END]
    if begin > end:
        raise ValueError(f"{MEASURED_END!r} comes before {MEASURED_BEGIN!r}")
    return sum(map(len, lines[: begin + 1])), sum(map(len, lines[:end]))


def with_measured(text: str, tables: str) -> str:
    """``text`` with the region between its marker lines replaced by ``tables`` (set off by a
    blank line on each side); everything else, the markers included, byte for byte."""
    start, end = measured_region(text)
    return text[:start] + "\n" + tables.strip("\n") + "\n\n" + text[end:]


def unreadable(reports: list[Path]) -> str | None:
    """Why one of ``reports`` cannot be read as a JUnit XML report, or None."""
    for report in reports:
        if not report.is_file():
            return f"{report}: no such file"
        try:
            ET.parse(report)
        except ET.ParseError as error:
            return f"{report}: not XML ({error})"
    return None


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    as_table = bool(argv) and argv[0] == "--table"
    reports = [Path(a) for a in (argv[1:] if as_table else argv)]
    if not reports:
        print(__doc__, file=sys.stderr)
        return 2
    problem = unreadable(reports)
    if problem is not None:
        print(
            f"error: {problem}. HINT: give the JUnit reports make test writes: "
            ".cache/test-reports/torch.xml .cache/test-reports/paddle.xml",
            file=sys.stderr,
        )
        return 2
    if as_table:
        print(table(reports), end="")
        return 0
    try:  # the doc's new text before anything is written: a doc without markers changes nothing
        doc = with_measured(DOC.read_text(encoding="utf-8"), table(reports))
    except (OSError, ValueError) as error:
        print(
            f"error: {DOC}: {error}. HINT: the measured tables go between a line "
            f"{MEASURED_BEGIN} and a line {MEASURED_END}; nothing was written",
            file=sys.stderr,
        )
        return 2
    slow = slow_tests(reports, SLOW_S)
    body = "".join(f"{t:7.1f}  {nid}\n" for nid, t in slow.items())
    LIST.write_text(HEADER.format(slow=SLOW_S) + body, encoding="utf-8")
    print(f"{LIST}: {len(slow)} slow tests, {sum(slow.values()):.0f} s of them")
    if doc != DOC.read_text(encoding="utf-8"):
        DOC.write_text(doc, encoding="utf-8")
    print(f"{DOC}: the measured tables of {', '.join(str(r) for r in reports)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
