"""Session-wide pools of gloo ranks (see tests/dist_pool.py), shared by every runtime test.

Tests mirror the packages (tests/<package>/test_<module>.py). Every test folder is put on
``sys.path`` here, before any test module is imported: test modules import each other's
models and plans by module name (``from test_runtime_numerics import GPT``), and the pool's
ranks, started by the first test that needs them, import a job's module by that name.
Test file names are therefore unique across the tree.

The checkout's root goes on ``sys.path`` too: a test folder named like a package
(tests/runtime) would otherwise be imported as an empty namespace package ``runtime``
whenever the real one is reachable only through an editable install's import hook.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
sys.path[:0] = sorted({str(p.parent) for p in _TESTS.rglob("test_*.py")} - set(sys.path))
if str(_TESTS.parent) not in sys.path:
    sys.path.insert(0, str(_TESTS.parent))

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from dist_pool import RANKS, DistPool  # noqa: E402

RANK_POOLS = ("pool2", "pool4")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test on the rank pools joins the ``RANKS`` group (dist_pool.py). First, so that
    xdist's own hook, which reads the group, sees the mark. Without xdist it does nothing."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in RANK_POOLS):
            item.add_marker(RANKS)


@pytest.fixture(scope="session")
def pool2() -> Iterator[DistPool]:
    pool = DistPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4() -> Iterator[DistPool]:
    pool = DistPool(4)
    yield pool
    pool.close()
