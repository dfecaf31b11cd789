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


TORCH_DTYPE_NAMES = {"dtype", "finfo", "float32", "float16", "bfloat16", "float64"}


def torch_uses_beyond_dtypes(path: Path) -> list[str]:
    """torch imports other than `from torch import <dtype names>` (ARCHITECTURE: cost_models
    may use torch for dtypes only)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[0] == "torch"]
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "torch":
            names = {a.name for a in node.names}
            if node.module != "torch" or not names <= TORCH_DTYPE_NAMES:
                bad.append(f"from {node.module} import {', '.join(sorted(names))}")
    return bad


def test_cost_models_use_torch_for_dtypes_at_most():
    bad = {str(p.relative_to(ROOT)): torch_uses_beyond_dtypes(p)
           for p in (ROOT / "cost_models").rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_the_torch_check_sees_more_than_dtypes(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("from torch import bfloat16, dtype\n")
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom torch.nn import Linear\n")
    assert torch_uses_beyond_dtypes(ok) == []
    assert torch_uses_beyond_dtypes(bad) == ["torch", "from torch.nn import Linear"]
