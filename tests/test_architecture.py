"""The package import direction of ARCHITECTURE.md: autopar > passes > runtime > cost_models."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["cost_models", "runtime", "passes", "autopar"]  # bottom to top


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_packages_import_only_downward():
    violations = []
    for level, package in enumerate(LAYERS):
        above = set(LAYERS[level + 1:])
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in imported_packages(path) & above:
                violations.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not violations, "imports against the architecture:\n" + "\n".join(violations)


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from autopar.planner import search\nimport passes.records\n")
    assert imported_packages(bad) == {"autopar", "passes"}


def test_cost_models_use_torch_for_dtypes_at_most():
    for path in (ROOT / "cost_models").rglob("*.py"):
        assert "torch" not in imported_packages(path) or "dtype" in path.read_text(), path
