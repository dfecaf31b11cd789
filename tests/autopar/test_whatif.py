"""autopar.whatif.repeat_blocks: a graph captured with few blocks, repeated to many, keeps
its per-cut facts aligned with its layers."""

from __future__ import annotations

import dataclasses

import torch

from autopar.planner.published import SEQ_LEN, VOCAB, MegatronRow, megatron_graph
from autopar.whatif import repeat_blocks
from autopar.zoo import GPT, GPTConfig, get_model
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


def test_a_published_row_captured_with_two_blocks_equals_its_full_depth_capture():
    """megatron_graph captures two blocks and repeats them: every layer record, cut fact and
    class equals capturing all of the row's blocks; only the capture statistics differ."""
    row = MegatronRow(params_b=0.1, heads=4, hidden=128, layers=7, tp=1, pp=1, gpus=8,
                      global_batch=8, tflops_per_gpu=0.0, microbatch=1, interleave=1)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=row.layers, n_head=row.heads, n_embd=row.hidden,
                              vocab_size=VOCAB, block_size=SEQ_LEN, attention="unfused",
                              dropout=0.1))
    tokens = torch.zeros(row.global_batch, SEQ_LEN, dtype=torch.long, device="meta")
    full = build_layer_graph(model, (tokens,), model_name=f"gpt-{row.params_b}b")
    repeated = megatron_graph(row)
    assert len(repeated.layers) == len(full.layers) == row.layers + 4
    stats = {"capture_s", "build_s", "graph_nodes"}
    assert dataclasses.replace(repeated, extra={}) == dataclasses.replace(full, extra={})
    assert {k: v for k, v in repeated.extra.items() if k not in stats} == \
        {k: v for k, v in full.extra.items() if k not in stats}
