"""A clone is self-contained: no code, test, benchmark or notebook reads outside the tree.

A user's clone has nothing beside it, so a path that climbs out of the repository
(``Path(__file__).parents[k]`` past the root, a parent folder's path, an absolute path into the
machine it was written on) works only where it was written. Published data the project
checks itself against ships in ``autopar/data/``.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("autopar", "cost_models", "passes", "runtime", "tests", "bench", "notebooks")
OUTSIDE = re.compile(r"""["'](?:\.\./|/work/|/home/|/root/|/tmp/)|["']shared["']|["']shared/""")
"""String literals that name a place outside the tree (a parent folder, a machine's paths,
the folder of published tables that once sat beside a clone)."""


def _python_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def _notebook_sources() -> list[tuple[Path, str]]:
    out = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        out.append((path, "\n".join("".join(c["source"]) for c in cells
                                    if c["cell_type"] == "code")))
    return out


def _levels_up(node: ast.AST) -> int | None:
    """How many folders above ``__file__``'s folder an expression climbs, if it starts at
    ``__file__`` (``Path(__file__).resolve().parents[2]`` → 2, ``.parent.parent`` → 1)."""
    up = 0
    while True:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "parents" and isinstance(node.slice, ast.Constant):
            up += node.slice.value + 1
            node = node.value.value
        elif isinstance(node, ast.Attribute) and node.attr == "parent":
            up += 1
            node = node.value
        elif isinstance(node, ast.Attribute) and node.attr in ("resolve", "absolute"):
            node = node.value
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in ("Path", "PurePath") \
                    and node.args:
                node = node.args[0]
            else:
                node = node.func
        elif isinstance(node, ast.Name) and node.id == "__file__":
            return up - 1  # Path(__file__).parent is the file's own folder: level 0
        else:
            return None


def _climbs_out(path: Path) -> list[str]:
    depth = len(path.relative_to(ROOT).parts) - 1  # folders between the root and the file
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        levels = _levels_up(node) if isinstance(node, (ast.Subscript, ast.Attribute)) else None
        if levels is not None and levels > depth:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} climbs {levels} "
                         f"folder(s) above its own, past the repository root")
    return found


def test_no_python_file_climbs_out_of_the_repository():
    problems = [p for path in _python_files() for p in _climbs_out(path)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", ["python", "notebook"])
def test_no_file_names_a_path_outside_the_repository(kind):
    sources = ([(p, p.read_text()) for p in _python_files() if p != Path(__file__).resolve()]
               if kind == "python" else _notebook_sources())
    problems = [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
                for path, text in sources for m in OUTSIDE.finditer(text)]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_look_for(tmp_path):
    # The same scanners on files that do climb out must complain.
    assert _levels_up(ast.parse("Path(__file__).resolve().parents[2]").body[0].value) == 2
    assert _levels_up(ast.parse("Path(__file__).parent.parent").body[0].value) == 1
    beside = "sha" + "red"  # spelt apart so that scanners of this tree do not flag the test
    assert OUTSIDE.search(f'root / "{beside}" / "validation"')
    assert OUTSIDE.search(f"open('../{beside}/x.csv')")


def test_published_tables_ship_with_the_package():
    from autopar.planner.published import TABLE_PATH, megatron_rows

    assert TABLE_PATH.is_file()
    assert len(megatron_rows()) == 10
    assert (ROOT / "autopar" / "data" / "README.md").is_file()
