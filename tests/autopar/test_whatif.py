"""autopar.whatif.repeat_blocks: a graph captured with few blocks, repeated to many, keeps
its per-cut facts aligned with its layers."""

from __future__ import annotations

import dataclasses

from autopar.whatif import repeat_blocks
from autopar.zoo import get_model
from passes.layer_graph import build_layer_graph


def test_repeated_blocks_keep_each_cut_what_crosses_it_and_where_stages_may_start():
    """The planner once read the cut facts of a repeated graph past their end ("tuple
    index out of range" planning the Megatron 1T row)."""
    spec = get_model("gpt-tiny").with_config(n_layer=2)
    (tokens,), _ = spec.make_batch(2, 16)
    graph = build_layer_graph(spec.build(seed=0), tokens)
    names = [layer.name for layer in graph.layers]
    assert names == ["wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"]
    bb = graph.boundary_bytes
    graph = dataclasses.replace(graph, uncuttable=frozenset({1, 3, 5}))
    deep = repeat_blocks(graph, 5)
    assert [layer.name for layer in deep.layers] == ["wte", "wpe", *(f"h.{i}" for i in range(5)),
                                                      "ln_f", "lm_head"]
    assert deep.boundary_bytes == (*bb[:2], *[bb[2]] * 4, bb[3], *bb[4:])
    # 1 stays; 3 (inside the run of blocks) marks the whole new run; 5 (lm_head) moves by 3.
    assert deep.uncuttable == frozenset({1, 3, 4, 5, 6, 8})
