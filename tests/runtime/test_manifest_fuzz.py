"""Seeded fuzzing of a checkpoint's manifest (autopar.json): whatever a damaged or
hand-edited manifest holds, ``verify`` returns or raises CheckpointError naming the file,
never another exception. Derandomized, so a failure reproduces."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dcp_safe import save_offline

from runtime.checkpoint_format import MANIFEST, CheckpointError, verify

FIELDS = ["version", "step", "world_size", "plan", "model", "fingerprint", "loader_state",
          "files", "resharded_from", "unknown"]
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=6),
              st.sampled_from([math.nan, math.inf, -1, 0, 1e300, f"{os.pardir}/x", "", ".metadata"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(["a", ".metadata", "..", "x/y"]),
                                            inner, max_size=3)),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return save_offline(tmp_path_factory.mktemp("good") / "c")


@settings(max_examples=60, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(FIELDS), st.one_of(JSON, st.just(None))),
                      min_size=1, max_size=3))
def test_mutated_manifest_is_accepted_or_named(good, tmp_path_factory, edits):
    ckpt = tmp_path_factory.mktemp("m") / "c"
    shutil.copytree(good, ckpt)
    data = json.loads((good / MANIFEST).read_text())
    for name, value in edits:
        if value is None:
            data.pop(name, None)
        else:
            data[name] = value
    (ckpt / MANIFEST).write_text(json.dumps(data))
    try:
        verify(ckpt)
    except CheckpointError as e:
        assert str(ckpt) in str(e)
