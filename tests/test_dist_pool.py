"""The rank pools' scheduling under README's command (tests/dist_pool.py, ``RANKS``)."""

from __future__ import annotations


def test_rank_tests_run_on_one_xdist_worker(request, pool2):
    """Every test on the pools is in xdist's ``ranks`` group, and under ``--dist loadgroup``
    xdist really groups it: the scheduler reads the group from the node id, which xdist
    rewrites. pytest 9.2 ignores that rewrite (pyproject.toml pins pytest below it); the
    ranks then ran on both workers at once and the suite took longer than on one."""
    assert request.node.get_closest_marker("xdist_group").args == ("ranks",)
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@ranks"), request.node.nodeid
    assert pool2.run(_rank) == [0, 1]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()
