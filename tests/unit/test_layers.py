"""Imports point one way: the core (`hetsim/`) <- `strategies/` <- `search/`.

Every import statement is checked, at the top of a module or inside a function, so that a
climbing import cannot hide in a function body.  `hetsim.testing` (the contract suite a
third-party family runs) is the one part of the core that may use the registry: it tests the
layer above, and nothing in the core imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"hetsim": 0, "hetsim.strategies": 1, "hetsim.search": 2}
"""hetsim.search.train (training with a found plan) is the stage after the search, in its layer."""
FOLDERS = {"hetsim": "hetsim", "strategies": "hetsim.strategies", "search": "hetsim.search"}
EXEMPT = ("hetsim.testing",)


def layer_of(module: str) -> int | None:
    best = None
    for name, level in LAYERS.items():
        if module == name or module.startswith(name + "."):
            if best is None or len(name) > len(best[0]):
                best = (name, level)
    return None if best is None else best[1]


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root)
    pkg = FOLDERS[rel.parts[0]]
    parts = [p for p in rel.with_suffix("").parts[1:] if p != "__init__"]
    return ".".join([pkg, *parts])


def imported(tree: ast.AST, here: str, is_pkg: bool) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".") if is_pkg else here.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]  # `from hetsim import strategies`
    return out


def climbing_imports(root: Path = ROOT) -> list[str]:
    bad = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            here = module_name(path, root)
            if here.startswith(EXEMPT):
                continue
            mine = layer_of(here)
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, mod in imported(tree, here, path.name == "__init__.py"):
                theirs = layer_of(mod)
                if theirs is not None and theirs > mine and not mod.startswith(EXEMPT):
                    bad.append(f"{path.relative_to(root)}:{line} imports {mod} (layer {theirs} > {mine})")
    return bad


def test_imports_point_one_way():
    bad = climbing_imports()
    assert not bad, "imports that climb a layer (core <- strategies <- search):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("folder", "line"),
    [
        ("hetsim/model", "from hetsim.strategies import get"),
        ("hetsim/execution", "    from hetsim.search.study import open_study"),
        ("strategies", "import hetsim.search.app"),
        ("hetsim/reporting", "from hetsim import strategies"),
    ],
)
def test_layer_check_catches_a_climbing_import(tmp_path, folder, line):
    """The checker itself: a copy of the tree with one climbing import added fails it."""
    import shutil

    for name in FOLDERS:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    victim = tmp_path / folder / "zz_climb.py"
    body = line if not line.startswith(" ") else "def f():\n" + line
    victim.write_text(f'"""A module that climbs."""\n{body}\n')
    found = climbing_imports(tmp_path)
    assert any("zz_climb.py" in b for b in found), found
