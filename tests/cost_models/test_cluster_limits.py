"""Cluster limits through the Python API: counts a planner could not enumerate, and a
cluster that is neither a preset name nor a path, are refused with a message."""

from __future__ import annotations

import pytest

from cost_models.errors import ConfigError
from cost_models.hardware import MAX_DEVICES, Cluster


def test_node_counts_beyond_the_limits_are_refused_not_enumerated():
    with pytest.raises(ConfigError, match="nodes = 1000000000 is beyond the limit of 100000"):
        Cluster.preset("dgx-a100-80g", nodes=10**9)
    with pytest.raises(ConfigError, match=f"devices is beyond the limit of {MAX_DEVICES}"):
        Cluster.from_toml_text(_preset_text().replace("devices_per_node = 8", "devices_per_node = 1024")
                               .replace("nodes = 1\n", "nodes = 2048\n"), source="big.toml")
    assert Cluster.preset("dgx-a100-80g", nodes=100_000).world_size == 800_000


def test_a_cluster_that_is_not_a_name_or_path_is_named():
    with pytest.raises(ConfigError, match="a cluster is a preset name or a .toml path, got int 42"):
        Cluster.load(42)


def _preset_text() -> str:
    from importlib import resources

    return (resources.files("cost_models") / "presets" / "dgx-a100-80g.toml").read_text()
