"""``autopar explain`` says why a layer overlaps its sequence-parallel collectives (PyTorch's
async TP) or not, and why the option was not available: the cluster, or the layer."""

from __future__ import annotations

import functools

import torch

from autopar.api import search_plans
from autopar.explain import explain, format_explanation
from autopar.zoo import GPT, GPTConfig
from cost_models.hardware import Cluster
from runtime.plan import Mesh, Plan


@functools.cache
def plan_on(cluster: str) -> Plan:
    """A 4-block GPT (h = 4,096, 32 heads) at 32 × 4,096 tokens, bf16, on dp 2 × tp 8."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_head=32, n_embd=4096, vocab_size=32768,
                              block_size=4096, bias=False))
    tokens = torch.zeros(32, 4096, dtype=torch.long, device="meta")
    return search_plans(model, Cluster.preset(cluster, nodes=2), tokens, precision="bfloat16",
                        seq_len=4096, mesh=Mesh(dp=2, tp=8)).plan


def test_explain_says_async_tp_was_chosen_on_h100s():
    plan = plan_on("dgx-h100")
    block = plan.layer("h.1")
    assert block.async_tp and block.sequence_parallel
    e = explain(plan, "h.1")
    assert e.async_tp.startswith(f"chosen ({block.option}): ")
    assert f"async TP: chosen ({block.option})" in format_explanation(e)
    report = plan.report()
    assert "+sp+async" in report and "async TP: what the matmuls' chunks do not hide" in report


def test_explain_says_why_a_layer_without_sequence_parallelism_has_none():
    plan = plan_on("dgx-h100")
    e = explain(plan, "wte")
    assert not plan.layer("wte").async_tp
    assert e.async_tp == ("not available: this layer has no sequence-parallel option, and "
                          "async TP overlaps sequence parallelism's all-gathers and "
                          "reduce-scatters")


def test_explain_says_a100s_cannot_run_it():
    plan = plan_on("dgx-a100-80g")
    assert not any(la.async_tp for la in plan.layers)
    assert plan.layer("h.1").sequence_parallel  # the same program, without the overlap
    e = explain(plan, "h.1")
    assert e.async_tp == ("not available: the cluster's device 'A100-SXM4-80GB' has compute "
                          "capability 8.0; PyTorch's async TP is offered on 9.0 (H100) or "
                          "newer, where it is tested and measured")
