"""Imports flow one way: the packages and train/'s layers, bottom up, as docs/architecture.md's
"Layers" section declares them (the one place they are declared; this test reads it).

The graph is built from the source (ast), with every import a module runs: those inside
functions included, those under ``if TYPE_CHECKING:`` left out (they never run), and an import
of ``a.b.c`` counted as an import of ``a.b`` and ``a`` too, whose ``__init__`` runs first. On that
graph: no cycle in any package, nobody imports ``train.__main__``, no import from a lower
package to a higher one, and no import from a lower layer of train/ to a higher one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES_LINE = "Packages, bottom up:"


def modules_of(package: str) -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(inner) for inner in ast.walk(child))
    return skipped


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports when it runs, its own packages left out."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            while target:  # the module, then each package whose __init__ runs before it
                if target != name and not name.startswith(target + "."):
                    found.add(target)
                target = target.rpartition(".")[0]
    return found


def declared_order() -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The packages bottom up, and train/'s layers bottom up (name, module patterns)."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    paragraph = next(part for part in section.split("\n\n") if part.startswith(PACKAGES_LINE))
    packages = re.findall(r"`([\w.]+)`", paragraph)
    layers = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"\d+\. .+", cells[0]):
            layers.append((cells[0].split(". ", 1)[1], re.findall(r"`([\w.*]+)`", cells[1])))
    return packages, layers


PACKAGES, LAYERS = declared_order()
MODULES = {name: path for package in PACKAGES for name, path in modules_of(package).items()}
GRAPH = {name: imports_of(name, path, set(MODULES)) for name, path in MODULES.items()}


def layer_of(module: str) -> int | None:
    """The layer whose pattern names ``module`` most closely (``train.tune.__main__`` over
    ``train.tune.*``); None when no pattern does."""
    best = None
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            full = "train" if pattern == "train" else f"train.{pattern}"
            if full.endswith(".*"):
                stem = full[:-2]
                matches = module == stem or module.startswith(stem + ".")
                score = len(stem)
            else:
                matches, score = module == full, len(full) + 1
            if matches and (best is None or score > best[1]):
                best = (index, score)
    return None if best is None else best[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_declaration_is_read():
    assert PACKAGES == ["datasets", "train", "bench", "scripts"]
    assert len(LAYERS) >= 5, LAYERS
    assert len(GRAPH) > 100


def test_every_train_module_has_a_layer():
    missing = [name for name in MODULES if name.startswith("train") and layer_of(name) is None]
    assert missing == [], (
        f"{missing}: no layer in docs/architecture.md's Layers table; add each to the layer "
        "whose modules it imports (or a higher one)"
    )


@pytest.mark.parametrize("package", ["datasets", "train", "bench", "scripts"])
def test_no_import_cycle(package):
    inside = {
        name: {target for target in targets if target.split(".")[0] == package}
        for name, targets in GRAPH.items()
        if name.split(".")[0] == package
    }
    assert cycles(inside) == []


def test_nothing_imports_train_main():
    importers = sorted(name for name, targets in GRAPH.items() if "train.__main__" in targets)
    assert importers == [], (
        f"{importers} import train.__main__, the entry point; what they need belongs in "
        "train/cli.py (or the module that owns it)"
    )


def test_packages_import_only_their_own_and_lower_packages():
    rank = {package: order for order, package in enumerate(PACKAGES)}
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if rank[target.split(".")[0]] > rank[name.split(".")[0]]
    )
    assert upward == []


def test_train_imports_only_its_own_and_lower_layers():
    upward = []
    for name, targets in GRAPH.items():
        if not name.startswith("train"):
            continue
        for target in targets:
            if target.startswith("train") and layer_of(target) > layer_of(name):
                upward.append(
                    f"{name} ({LAYERS[layer_of(name)][0]}) -> {target} "
                    f"({LAYERS[layer_of(target)][0]})"
                )
    assert sorted(upward) == [], "imports that go up docs/architecture.md's layer order"


def test_the_checks_find_what_they_look_for(tmp_path):
    """The graph, the cycle finder and the layer lookup on made-up input: a cycle, a parent
    package's __init__, a TYPE_CHECKING import and the most specific pattern."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "c.py", "sub/__init__.py", "sub/d.py"):
        (package / name).write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nimport pkg.a\nfrom pkg.sub.d import x\n"
        "if TYPE_CHECKING:\n    import pkg.c\n"
    )
    paths = {"pkg": "__init__.py", "pkg.a": "a.py", "pkg.b": "b.py", "pkg.c": "c.py"}
    paths |= {"pkg.sub": "sub/__init__.py", "pkg.sub.d": "sub/d.py"}
    graph = {name: imports_of(name, package / path, set(paths)) for name, path in paths.items()}
    # pkg.c only under TYPE_CHECKING: never run; pkg.sub's __init__ runs before pkg.sub.d
    assert graph["pkg.b"] == {"pkg.a", "pkg.sub", "pkg.sub.d"}
    assert graph["pkg.a"] == {"pkg.b"}  # inside a function
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert layer_of("train.tune.__main__") == layer_of("train.__main__")
    assert layer_of("train.tune.run") != layer_of("train.__main__")
