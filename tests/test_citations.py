"""Every file a document or a comment cites exists: paths (``train/loop.py``, ``docs/...md``,
``configs/ocr/smoke.yaml``, ``scripts/...``), Markdown links, and dotted module references
(``train.backends.paddle.compat.zlib_load_order_problem``: the module, and the name in it).

Scanned: README.md and docs/*.md (all their text); the comments and docstrings of every Python
file, and the string literals of the project's own packages (their messages cite files too);
the comments of YAML, shell, Dockerfile, Makefile and requirements files. Framework-free.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path

import pytest

from train.config.schema import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
TOP = ("train", "datasets", "scripts", "bench", "tests", "docs", "configs", "docker", "k8s")
TOP += ("requirements",)
ROOT_FILES = ("README.md", "Makefile", "compose.yaml", "compose.cpu.yaml", "pyproject.toml")
PACKAGES = ("train", "datasets", "scripts", "bench", "tests")

# A repository path: a top-level folder, then path characters (a "*" glob, a "{a,b}" choice),
# ending in a word character; not part of a longer path, a URL or a dotted name.
PATH = re.compile(
    r"(?<![\w./$~-])((?:" + "|".join(TOP) + r")/"
    r"(?:[\w./*-]*\{[\w.,*-]+\}(?:[\w./*-]*[\w*])?|[\w./*-]*[\w*])"
    r"|(?:" + "|".join(re.escape(f) for f in ROOT_FILES) + r")(?![\w.-])"
    r"|[A-Z][A-Z_]+\.md\b)"
)
# Words that make a path a pattern to fill in, not a file: scripts/NAME.py, PRESET-FW.json.
PLACEHOLDERS = {"NAME", "PRESET", "FW", "FILE", "PATH", "DIR", "x"}
# Cited on purpose although absent, and why.
ABSENT_ON_PURPOSE = {
    "train/val": "scripts/make_synthetic.py: the train and val splits, not a path",
    "bench/results/merged.json": "scripts/bench_loader.py: the default name of a merged result",
    "train.evaluate": "scripts/ci_containers.sh: a command the comment says is not here yet",
    "scripts/gpu_check.py": "scripts/gpu_check/__main__.py: the check's former single-file name",
}
DOTTED = re.compile(r"(?<![\w./$-])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
# Dotted words that are not modules: config keys of the train: section, and file names.
NOT_MODULES = {f"train.{field.name}" for field in dataclasses.fields(TrainConfig)}
FILE_SUFFIXES = {"log", "tsv", "h5", "jsonl", "json", "yaml", "yml", "txt", "md", "png", "mdb"}
FILE_SUFFIXES |= {"pt", "npz", "partial", "lock"}


def tracked_files() -> list[Path]:
    """The files git tracks (what a commit holds; work in progress is checked once added)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def python_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the comments and docstrings; of every string in the packages proper."""
    source = path.read_text(encoding="utf-8")
    strings_too = path.relative_to(ROOT).parts[0] in ("train", "datasets", "scripts", "bench")
    texts = []
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                docstrings.add(doc.value.lineno)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        line = token.start[0]
        if token.type == tokenize.COMMENT or (
            token.type == tokenize.STRING and (strings_too or line in docstrings)
        ):
            texts.append((line, token.string))
    return texts


def hash_comments(path: Path) -> list[tuple[int, str]]:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return [(i, line[line.index("#") :]) for i, line in enumerate(lines, 1) if "#" in line]


def texts_of(path: Path) -> list[tuple[int, str]]:
    name = path.name
    if name.endswith(".md") and (path.parent == ROOT or path.parent == ROOT / "docs"):
        return list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))
    if name.endswith(".py"):
        return python_texts(path)
    if name.endswith((".yaml", ".yml", ".sh", ".Dockerfile")) or name in ("Makefile",):
        return hash_comments(path)
    if name.endswith(".txt") and path.parent == ROOT / "requirements":
        return hash_comments(path)
    return []


@cache
def module_names(path: Path) -> frozenset[str]:
    """The names a module defines at its top level (and its package's submodules)."""
    names = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.iterdir() if p.suffix == ".py" or p.is_dir()}
    return frozenset(names)


def missing_module(reference: str) -> str | None:
    """Why ``reference`` (a.b.c[.name]) names no module (and name in it) here, or None."""
    parts = reference.split(".")
    if reference in NOT_MODULES or parts[-1] in FILE_SUFFIXES or reference in ABSENT_ON_PURPOSE:
        return None
    folder, module = ROOT, None
    for i, part in enumerate(parts):
        if (folder / part).is_dir():
            folder = folder / part
            module = folder / "__init__.py"
            continue
        if (folder / f"{part}.py").is_file():
            module, rest = folder / f"{part}.py", parts[i + 1 :]
            break
        rest = parts[i:]
        break
    else:
        return None  # a package
    if module is None or not module.is_file():
        return f"no module {'.'.join(parts[: len(parts) - len(rest) + 1])}"
    if rest and rest[0] not in module_names(module):
        return f"{module.relative_to(ROOT)} defines no {rest[0]}"
    return None


def expand(cited: str) -> list[str]:
    """bench/results/full.{json,md} -> bench/results/full.json, bench/results/full.md"""
    match = re.search(r"\{([^}]*)\}", cited)
    if match is None:
        return [cited]
    head, tail = cited[: match.start()], cited[match.end() :]
    return [path for choice in match[1].split(",") for path in expand(head + choice + tail)]


@cache
def ignored(path: str) -> bool:
    """Whether git ignores ``path`` (as a file or a folder): a place the project writes to
    (bench/data/, runs/)."""
    for name in (path, path.rstrip("/") + "/"):
        if subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT).returncode == 0:
            return True
    return False


def missing_path(cited: str, base: Path) -> bool:
    if any(mark in cited for mark in "<>$") or "..." in cited or cited in ABSENT_ON_PURPOSE:
        return False
    if re.search(r"\{[^,}]*\}", cited):
        return False  # a format placeholder: configs/{task}/smoke.yaml
    if PLACEHOLDERS & set(re.split(r"[/.-]", cited)):
        return False
    for path in expand(cited):
        # A path from the root starts with a top-level folder and a slash (docs/x.md), or is a
        # root file; any other is relative to the citing file (benchmarks.md, training.md).
        from_root = path.startswith(tuple(f"{top}/" for top in TOP) + ROOT_FILES)
        target = ROOT / path if from_root else base / path
        if "*" in path:
            if not glob.glob(str(target)):
                return True
        elif not target.exists() and not ignored(str(target.relative_to(ROOT))):
            return True
    return False


def citations() -> list[tuple[str, int, str, str]]:
    """(file, line, cited, why it is wrong) for every citation of what is not here."""
    wrong = []
    for path in tracked_files():
        where = str(path.relative_to(ROOT))
        for first_line, text in texts_of(path):
            for match in PATH.finditer(text):
                if missing_path(match[1], ROOT):
                    line = first_line + text[: match.start()].count("\n")
                    wrong.append((where, line, match[1], "no such file"))
            if path.suffix == ".md":
                for link in MARKDOWN_LINK.findall(text):
                    target = link.split("#")[0]
                    if target and "://" not in target and missing_path(target, path.parent):
                        wrong.append((where, first_line, link, "broken link"))
            for match in DOTTED.finditer(text):
                if PLACEHOLDERS & set(match[1].split(".")):
                    continue  # a pattern to fill in: python -m scripts.NAME
                why = missing_module(match[1])
                if why:
                    line = first_line + text[: match.start()].count("\n")
                    wrong.append((where, line, match[1], why))
    return wrong


def test_every_cited_file_exists():
    wrong = citations()
    assert not wrong, "\n".join(f"{f}:{n}: {c}: {why}" for f, n, c, why in wrong)


@pytest.mark.parametrize(
    "text, found",
    [
        ("see train/loop.py and docs/containers.md.", ["train/loop.py", "docs/containers.md"]),
        ("`configs/ocr/smoke.yaml`, configs/ocr/ and README.md", ["configs/ocr/smoke.yaml"]),
        ("runs/x/train.log or /work/main/train/x.py or https://x/train/y.py", []),
        ("DESIGN.md section 5", ["DESIGN.md"]),
        ("results `bench/results/full.{json,md}`", ["bench/results/full.{json,md}"]),
    ],
)
def test_the_scanner_finds_paths(text, found):
    cited = PATH.findall(text)
    assert [c for c in cited if c in found] == found
    assert all(c in found or c in ("configs/ocr", "README.md") for c in cited)


def test_the_scanner_checks_modules_and_their_names():
    assert missing_module("train.backends.paddle.compat") is None
    assert missing_module("datasets.handles.die_with_parent") is None
    assert missing_module("train.max_steps") is None and missing_module("train.log") is None
    assert missing_module("train.nope") == "train/__init__.py defines no nope"
    assert missing_module("train.backends.nope.x") == "train/backends/__init__.py defines no nope"
    assert missing_module("train.loop.no_such_name") == "train/loop.py defines no no_such_name"
