"""README.md is the project's map, and stays one: at most MAX_LINES lines; its Layout section has
a line for every top-level directory and every Python package (and names only what exists, no
module of train/, whose modules move: docs/architecture.md maps them); its links resolve, anchors
included; every page of docs/ is on its table; its set-up commands are Makefile targets and the
test command is the one .ci/run runs; its compose commands name compose.yaml's services; it keeps
the accuracy figure scripts/ci_containers.sh checks the image's training against.

Each check is a function of the README's text that returns its problems, so the tests below run
them on the README and on broken copies of it (a check that cannot fail proves nothing).
Framework-free: runs in both halves.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 220
PACKAGE_ROOTS = ("train", "datasets", "scripts", "bench")
SETUP = "Set-up: two commands on a fresh machine"
COMPOSE = "GPU quick start (containers)"
LAYOUT = "Layout"
FIX = (
    "add a line `{path:<24} <what it holds>` to the fenced block of README.md's Layout section "
    "(one line per top-level directory and per package; modules go in docs/architecture.md)"
)


# ---------------------------------------------------------------- reading the README


def without_code(text: str) -> str:
    """``text`` with its fenced code blocks blanked (their lines kept, so line counts hold)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section (up to the next ``## `` heading), or ""."""
    match = re.search(rf"^## {re.escape(title)}[ \t]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return match[1] if match else ""


def first_block(body: str) -> list[str]:
    """The lines of the first fenced code block in ``body``."""
    match = re.search(r"^```[^\n]*\n(.*?)^```", body, re.M | re.S)
    return match[1].splitlines() if match else []


def commands(body: str) -> list[str]:
    """The commands of a section's first code block, comments and blank lines left out."""
    return [line.split("#")[0].strip() for line in first_block(body) if line.split("#")[0].strip()]


def layout(text: str) -> dict[str, str]:
    """Path -> description of each line of the Layout block (a line starting in column one
    names a path; indented lines continue its description)."""
    entries: dict[str, str] = {}
    path = None
    for line in first_block(section(text, LAYOUT)):
        if line[:1].strip():
            path, _, description = line.partition(" ")
            entries[path] = description.strip()
        elif path is not None and line.strip():
            entries[path] += " " + line.strip()
    return entries


@cache
def git_files(*options: str) -> tuple[str, ...]:
    listed = subprocess.run(
        ["git", "ls-files", *options], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return tuple(name for name in listed if (ROOT / name).exists())


def top_level_dirs() -> set[str]:
    """Every top-level directory git tracks a file in, dot-directories left out."""
    return {
        name.split("/")[0] + "/"
        for name in git_files("--cached")
        if "/" in name and not name.startswith(".")
    }


def packages() -> set[str]:
    """Every Python package (a folder with __init__.py) of the project's packages, tracked or
    new (not ignored), so a package is on the map before it is committed."""
    return {
        name[: -len("__init__.py")]
        for name in git_files("--cached", "--others", "--exclude-standard")
        if name.endswith("/__init__.py") and name.split("/")[0] in PACKAGE_ROOTS
    }


def paths_in(description: str) -> list[str]:
    """The repository paths a Layout description names: words that start with a top-level
    directory (`bench/results/`, `docs/setup.md`, `.ci/run`)."""
    tops = {top.rstrip("/") for top in top_level_dirs()} | {".ci"}
    words = re.findall(r"(?<![\w./-])(\.?[\w-]+/[\w./-]*)", description)
    return [word.rstrip(".") for word in words if word.split("/")[0] in tops]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated one gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", without_code(path.read_text()), re.M):
        base = slug(match[1])
        out.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return out


def links(text: str) -> list[str]:
    """The targets of the Markdown links (inline and reference) outside code."""
    prose = without_code(text)
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
    return inline + re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", prose, re.M)


# ---------------------------------------------------------------- the checks


def length_problems(text: str) -> list[str]:
    lines = len(text.splitlines())
    if lines <= MAX_LINES:
        return []
    return [
        f"README.md has {lines} lines, over {MAX_LINES}: it is the map; move the detail into "
        "the doc of its topic (docs/) and link it from the README's table"
    ]


def layout_problems(text: str) -> list[str]:
    """Layout paths that do not exist, or are not what their name says (a folder ends in /);
    module files of train/ named there."""
    entries = layout(text)
    if not entries:
        return [f"README.md has no `## {LAYOUT}` section with a fenced block of paths"]
    problems = []
    for path, description in entries.items():
        for named in [path, *paths_in(description)]:
            target = ROOT / named
            if named.endswith("/") and not target.is_dir() or not target.exists():
                problems.append(f"README.md's Layout names {named}, which is not in the tree")
        for named in [path, *paths_in(description)]:
            if named.startswith("train/") and not named.endswith("/"):
                problems.append(
                    f"README.md's Layout names {named}: name train/'s packages only (folders);"
                    " its modules move, and docs/architecture.md maps them"
                )
    return problems


def coverage_problems(text: str) -> list[str]:
    """Top-level directories and packages without a Layout line of their own."""
    named = set(layout(text))
    return [
        f"{path} has no line in README.md's Layout: " + FIX.format(path=path)
        for path in sorted(top_level_dirs() | packages())
        if path not in named
    ]


def link_problems(text: str, base: Path = ROOT) -> list[str]:
    """Relative links whose file is missing, or whose anchor no heading of it makes."""
    problems = []
    for target in links(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        name, _, anchor = target.partition("#")
        path = (base / name).resolve() if name else README
        if not path.exists():
            problems.append(f"README.md links {target}: no such file")
        elif anchor and (path.suffix != ".md" or anchor not in anchors(path)):
            problems.append(f"README.md links {target}: {name or 'README.md'} has no such heading")
    return problems


def map_problems(text: str) -> list[str]:
    """Pages of docs/ the README does not link."""
    linked = {target.partition("#")[0] for target in links(text)}
    return [
        f"docs/{page.name} is not on README.md's table of topics: add a row linking it"
        for page in sorted((ROOT / "docs").glob("*.md"))
        if f"docs/{page.name}" not in linked
    ]


def setup_problems(text: str) -> list[str]:
    """The set-up block: two `make TARGET` commands whose targets the Makefile defines, the
    second (the tests) run as such by .ci/run."""
    found = commands(section(text, SETUP))
    if len(found) != 2:
        return [f"README.md's `## {SETUP}` block has {found}, not the main job and the tests"]
    makefile = (ROOT / "Makefile").read_text()
    problems = [
        f"README.md's set-up command `{command}` is not `make TARGET` with a Makefile target"
        for command in found
        if not re.fullmatch(r"make ([\w-]+)", command)
        or not re.search(rf"^{re.escape(command.split()[1])}:", makefile, re.M)
    ]
    ci_lines = {line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    if found[1] not in ci_lines:
        problems.append(f".ci/run does not run the README's test command `{found[1]}`")
    return problems


def compose_problems(text: str) -> list[str]:
    """Services the quick start's compose commands name that compose.yaml does not define."""
    services = set(yaml.safe_load((ROOT / "compose.yaml").read_text())["services"])
    block = "\n".join(first_block(section(text, COMPOSE)))
    if "docker compose" not in block:
        return [f"README.md's `## {COMPOSE}` section has no compose commands"]
    problems = []
    for call in re.findall(r"docker compose ([^;#\n]*)", block):
        words, named = call.split(), []
        i = 0
        while i < len(words):
            word = words[i]
            if word in ("--exit-code-from", "--profile"):
                named += [words[i + 1]] if word == "--exit-code-from" else []
                i += 2
                continue
            if not word.startswith("-"):
                named.append(word)
            i += 1
        # named: the subcommand, then its service (and any --exit-code-from service)
        for service in named[1:]:
            if service not in services:
                problems.append(f"README.md: `docker compose {call.strip()}`: no service {service}")
    return problems


def accuracy_problems(text: str) -> list[str]:
    """scripts/ci_containers.sh reads make train-ocr's accuracy from the README."""
    script = (ROOT / "scripts" / "ci_containers.sh").read_text()
    pattern = re.search(r'claim = float\(re\.search\(r"([^"]+)"', script)
    if pattern is None:
        return []  # the script no longer reads the README
    if re.search(pattern[1], text) is None:
        return [
            f"README.md lost make train-ocr's accuracy sentence ({pattern[1]!r}), which "
            "scripts/ci_containers.sh checks the image's training against"
        ]
    return []


CHECKS = (
    length_problems,
    layout_problems,
    coverage_problems,
    link_problems,
    map_problems,
    setup_problems,
    compose_problems,
    accuracy_problems,
)


# ---------------------------------------------------------------- the README as it is


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_is_at_most_220_lines():
    assert length_problems(readme()) == []


def test_every_path_the_layout_names_exists_and_no_module_of_train():
    assert layout_problems(readme()) == []


def test_the_layout_names_every_top_level_directory_and_package():
    assert {"train/config/", "train/backends/torch/", "scripts/gpu_check/"} <= packages()
    assert {"train/", "docs/", "tests/"} <= top_level_dirs()
    assert coverage_problems(readme()) == []


def test_every_relative_link_in_the_readme_resolves():
    assert links(readme()), "no links found: the reader is broken"
    assert link_problems(readme()) == []


def test_every_doc_is_on_the_readmes_table():
    assert map_problems(readme()) == []


def test_the_setup_commands_are_make_targets_and_ci_runs_the_test_command():
    assert commands(section(readme(), SETUP)) == ["make train-ocr", "make test"]
    assert setup_problems(readme()) == []


def test_the_compose_commands_name_compose_services():
    assert compose_problems(readme()) == []


def test_the_readme_keeps_the_accuracy_the_container_stage_checks():
    assert accuracy_problems(readme()) == []


# ---------------------------------------------------------------- and broken copies of it


def replace(old: str, new: str):
    def edit(text: str) -> str:
        assert old in text, f"the README no longer holds {old!r}: update this test's edit"
        return text.replace(old, new, 1)

    return edit


def drop_layout_line(path: str):
    return lambda text: re.sub(rf"^{re.escape(path)} .*\n", "", text, count=1, flags=re.M)


def add_layout_line(line: str):
    return lambda text: re.sub(r"^(```\n)(?=\.ci/)", rf"\g<1>{line}\n", text, count=1, flags=re.M)


@pytest.mark.parametrize(
    "edit, check, says",
    [
        (lambda text: text + "\n" * MAX_LINES, length_problems, "lines, over"),
        (add_layout_line("nowhere/                 x"), layout_problems, "nowhere/"),
        (add_layout_line("train/tasks.py           x"), layout_problems, "packages only"),
        (replace("CI's entry point", "see configs/nope/"), layout_problems, "configs/nope/"),
        (drop_layout_line("train/tune/"), coverage_problems, "train/tune/ has no line"),
        (drop_layout_line("scripts/gpu_check/"), coverage_problems, "scripts/gpu_check/"),
        (drop_layout_line("k8s/"), coverage_problems, "k8s/ has no line"),
        (replace("(docs/setup.md)", "(docs/set-up.md)"), link_problems, "no such file"),
        (replace("(docs/testing.md)", "(docs/testing.md#nope)"), link_problems, "no such heading"),
        (replace("(docs/tuning.md)", "(docs/tuning.txt)"), map_problems, "docs/tuning.md"),
        (replace("make test        #", "make tests       #"), setup_problems, "make tests"),
        (replace("make train-ocr   #", "python -m train  #"), setup_problems, "python -m train"),
        (replace("run --rm doctor ", "run --rm doktor "), compose_problems, "no service doktor"),
        (replace("0.995 exact-match", "0.995 exact"), accuracy_problems, "accuracy sentence"),
    ],
    ids=[
        "too-long",
        "layout-path-missing",
        "layout-names-a-train-module",
        "layout-description-path-missing",
        "no-line-for-train-tune",
        "no-line-for-scripts-gpu_check",
        "no-line-for-k8s",
        "link-to-a-missing-file",
        "link-to-a-missing-heading",
        "doc-not-on-the-table",
        "test-command-not-ci-s",
        "main-job-not-a-make-target",
        "compose-service-typo",
        "accuracy-sentence-gone",
    ],
)
def test_each_check_fails_on_a_readme_that_drifted(edit, check, says):
    problems = check(edit(readme()))
    assert any(says in problem for problem in problems), problems


def test_a_new_package_fails_naming_itself_and_the_fix(monkeypatch):
    monkeypatch.setattr(f"{__name__}.packages", lambda: {"train/", "train/new_subpackage/"})
    assert coverage_problems(readme()) == [
        "train/new_subpackage/ has no line in README.md's Layout: "
        + FIX.format(path="train/new_subpackage/")
    ]
