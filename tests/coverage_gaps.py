"""Coverage gaps: what a measured run covered that another one does not.

`make coverage` measures line and branch coverage of train/, datasets/, bench/ and scripts/ over
both halves of the suite and writes .cache/coverage/coverage.json: coverage.py's JSON report with
each measured file's source text added (``--snapshot``, which also prints the totals per
package). A change to the suite (shared trainings, dropped scenarios) may lose no covered line or
branch except in code it removed. Measure before and after, then compare:

    python -m tests.coverage_gaps BEFORE.json AFTER.json

Line numbers move with every edit, so statements are matched by what they say: a line's key is the
function or class it is in, its text (stripped) and how many lines before it in that scope read the
same. A statement covered in BEFORE is lost when its key is a statement in AFTER that did not run
(or that AFTER excludes from measurement); a key that AFTER's file no longer holds as a statement is
removed code (so is an edited line: its text changed). A branch is matched by the keys of its two
ends, and lost when it is among AFTER's branches that did not run. The listing gives each loss's
line in AFTER's file and its text; the last line sums up. Exit status 1 when something covered was
lost, 2 on bad usage.

Some lines run or not by timing (a poll loop's sleep, a race the tests provoke), so one run's
coverage differs a little from the next. Given several BEFORE reports (runs of the same code),
the comparison takes what all of them covered:

    python -m tests.coverage_gaps BEFORE1.json BEFORE2.json AFTER.json
"""

from __future__ import annotations

import ast
import json
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# (enclosing def/class qualified name, stripped line text, occurrence of that text in the scope)
LineKey = tuple[str, str, int]
# A branch's destination: a line's key, or (EXIT, key of the code object's first line) for
# coverage.py's negative destinations (leaving the function, class or module).
EXIT = "<exit>"  # no def or class has this name, so no line key starts with it
BranchEnd = tuple[str, LineKey] | LineKey
BranchKey = tuple[LineKey, BranchEnd]


def enclosing_scopes(source: str) -> dict[int, str]:
    """Line number -> qualified name of the innermost def or class whose body holds the line.
    Lines of the module's own level, and a def's or class's first line (which runs in the
    enclosing scope), are absent. Unparsable text (another Python's syntax) has no scopes."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    scopes: dict[int, str] = {}

    def visit(node: ast.AST, qualname: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{qualname}.{child.name}" if qualname else child.name
                # Set before visiting the children, which then overwrite their own lines.
                for line in range(child.lineno + 1, (child.end_lineno or child.lineno) + 1):
                    scopes[line] = name
                visit(child, name)
            else:
                visit(child, qualname)

    visit(tree, "")
    return scopes


def line_keys(source: str) -> dict[int, LineKey]:
    """Line number (1-based) -> the line's key, for every line of ``source``."""
    scopes = enclosing_scopes(source)
    seen: Counter[tuple[str, str]] = Counter()
    keys: dict[int, LineKey] = {}
    for number, line in enumerate(source.splitlines(), start=1):
        scope, text = scopes.get(number, ""), line.strip()
        keys[number] = (scope, text, seen[scope, text])
        seen[scope, text] += 1
    return keys


@dataclass
class FileCoverage:
    """One file of a report, its statements and branches by key; ``lines`` maps each key back
    to its line number and text in this report's file, for the listing."""

    covered: set[LineKey] = field(default_factory=set)
    not_covered: set[LineKey] = field(default_factory=set)  # missed or excluded statements
    covered_branches: set[BranchKey] = field(default_factory=set)
    missed_branches: set[BranchKey] = field(default_factory=set)
    lines: dict[LineKey, int] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)


def file_coverage(entry: dict, path: str) -> FileCoverage:
    """A coverage.py JSON report's entry for one file, with the ``source`` the snapshot added."""
    if "source" not in entry:
        raise ValueError(
            f"{path}: no source text in the report; "
            "make coverage adds it (python -m tests.coverage_gaps --snapshot REPORT)"
        )
    keys = line_keys(entry["source"])

    def key(line: int) -> LineKey:
        # A line past the text's end (a report and source that disagree) still gets a key of
        # its own, which matches nothing in the other report.
        return keys.get(line, ("", f"<line {line} past the end>", 0))

    def end(line: int) -> BranchEnd:
        return (EXIT, key(-line)) if line < 0 else key(line)

    not_run = entry.get("missing_lines", []) + entry.get("excluded_lines", [])
    result = FileCoverage(
        covered={key(n) for n in entry.get("executed_lines", [])},
        not_covered={key(n) for n in not_run},
        covered_branches={(key(a), end(b)) for a, b in entry.get("executed_branches", [])},
        missed_branches={(key(a), end(b)) for a, b in entry.get("missing_branches", [])},
    )
    result.lines = {k: n for n, k in keys.items()}
    result.text = dict(enumerate(entry["source"].splitlines(), start=1))
    return result


def read_report(path: Path) -> dict[str, FileCoverage]:
    report = json.loads(path.read_text(encoding="utf-8"))
    return {name: file_coverage(entry, name) for name, entry in report["files"].items()}


@dataclass
class Gaps:
    """What BEFORE covered that AFTER does not, per file, and what AFTER no longer has."""

    lost_lines: dict[str, list[LineKey]] = field(default_factory=dict)
    lost_branches: dict[str, list[BranchKey]] = field(default_factory=dict)
    removed_lines: int = 0
    removed_branches: int = 0


def covered_by_all(runs: list[dict[str, FileCoverage]]) -> dict[str, FileCoverage]:
    """The statements and branches every one of ``runs`` (reports of the same code) covered:
    the first run's files, less what any other run did not cover."""
    first, *others = runs
    stable = {}
    for path, file in first.items():
        covered, branches = set(file.covered), set(file.covered_branches)
        for other in others:
            covered &= other.get(path, FileCoverage()).covered
            branches &= other.get(path, FileCoverage()).covered_branches
        stable[path] = FileCoverage(
            covered=covered,
            not_covered=file.not_covered | (file.covered - covered),
            covered_branches=branches,
            missed_branches=file.missed_branches | (file.covered_branches - branches),
            lines=file.lines,
            text=file.text,
        )
    return stable


def compare(before: dict[str, FileCoverage], after: dict[str, FileCoverage]) -> Gaps:
    gaps = Gaps()
    for path, old in sorted(before.items()):
        new = after.get(path, FileCoverage())  # a file AFTER does not measure is removed code
        lost = old.covered & new.not_covered
        gone = old.covered - new.covered - new.not_covered
        lost_branches = old.covered_branches & new.missed_branches
        gone_branches = old.covered_branches - new.covered_branches - new.missed_branches
        if lost:
            gaps.lost_lines[path] = sorted(lost, key=lambda k: new.lines.get(k, 0))
        if lost_branches:
            gaps.lost_branches[path] = sorted(lost_branches, key=lambda b: new.lines.get(b[0], 0))
        gaps.removed_lines += len(gone)
        gaps.removed_branches += len(gone_branches)
    return gaps


def describe_end(end: BranchEnd, file: FileCoverage) -> str:
    if end[0] == EXIT:
        return f"exit from line {file.lines.get(end[1], '?')}"
    return str(file.lines.get(end, "?"))


def listing(gaps: Gaps, after: dict[str, FileCoverage]) -> str:
    """Per file, each lost statement and branch at its line in AFTER's file, with its text."""
    out = []
    for path in sorted(set(gaps.lost_lines) | set(gaps.lost_branches)):
        file = after[path]
        lines, branches = gaps.lost_lines.get(path, []), gaps.lost_branches.get(path, [])
        counts = f"{len(lines)} line{'s' * (len(lines) != 1)}"
        counts += f", {len(branches)} branch{'es' * (len(branches) != 1)}"
        out.append(f"{path}: {counts} no longer covered")
        for key in lines:
            number = file.lines[key]
            out.append(f"  line {number}: {file.text[number].strip()}")
        for start, end in branches:
            number = file.lines[start]
            out.append(f"  branch {number}->{describe_end(end, file)}: {file.text[number].strip()}")
    return "\n".join(out)


def count(report: dict[str, FileCoverage]) -> tuple[int, int]:
    """Covered statements and branches over all files."""
    return (
        sum(len(f.covered) for f in report.values()),
        sum(len(f.covered_branches) for f in report.values()),
    )


def summary(gaps: Gaps, before: dict[str, FileCoverage], after: dict[str, FileCoverage]) -> str:
    lost_lines = sum(map(len, gaps.lost_lines.values()))
    lost_branches = sum(map(len, gaps.lost_branches.values()))
    (lines_before, branches_before), (lines_after, branches_after) = count(before), count(after)
    return (
        f"covered lines/branches: before {lines_before}/{branches_before}, "
        f"after {lines_after}/{branches_after}; lost {lost_lines}/{lost_branches} "
        f"(in removed code, not counted: {gaps.removed_lines}/{gaps.removed_branches})"
    )


def snapshot(report_path: Path, root: Path = Path(".")) -> dict:
    """Add each measured file's text (read from ``root``, where coverage.py's relative paths
    start) to the report, so that a later report of changed code can still be compared."""
    report = json.loads(report_path.read_text(encoding="utf-8"))
    for name, entry in report["files"].items():
        entry["source"] = (root / name).read_text(encoding="utf-8")
    report_path.write_text(json.dumps(report), encoding="utf-8")
    return report


def package_totals(report: dict) -> str:
    """A table of covered / measured lines and branches per top-level folder."""
    sums: dict[str, Counter] = defaultdict(Counter)
    for name, entry in report["files"].items():
        package = Path(name).parts[0] if len(Path(name).parts) > 1 else "."
        for package_or_all in (package, "total"):
            sums[package_or_all].update(
                {k: entry["summary"].get(k, 0) for k in ("covered_lines", "num_statements")}
                | {k: entry["summary"].get(k, 0) for k in ("covered_branches", "num_branches")}
            )

    def share(covered: int, total: int) -> str:
        return f"{covered:>6}/{total:<6} {covered / total:6.1%}" if total else f"{0:>6}/{0:<6}"

    out = [f"{'package':<10} {'lines covered':>21}   {'branches covered':>21}"]
    for package in [*sorted(p for p in sums if p != "total"), "total"]:
        s = sums[package]
        out.append(
            f"{package:<10} {share(s['covered_lines'], s['num_statements']):>21}   "
            f"{share(s['covered_branches'], s['num_branches']):>21}"
        )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--snapshot":
        print(package_totals(snapshot(Path(argv[1]))))
        return 0
    if len(argv) < 2 or any(arg.startswith("-") for arg in argv):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        before = covered_by_all([read_report(Path(arg)) for arg in argv[:-1]])
        after = read_report(Path(argv[-1]))
    except (OSError, ValueError, KeyError) as error:
        print(f"coverage_gaps: {error}", file=sys.stderr)
        return 2
    gaps = compare(before, after)
    if gaps.lost_lines or gaps.lost_branches:
        print(listing(gaps, after))
    print(summary(gaps, before, after))
    return 1 if gaps.lost_lines or gaps.lost_branches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
