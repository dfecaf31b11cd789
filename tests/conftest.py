"""Session-wide pools of gloo ranks (see tests/dist_pool.py), shared by every runtime test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dist_pool import DistPool


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
