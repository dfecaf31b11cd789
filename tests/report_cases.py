"""Plans for report tests: captured once per session (capture is the slow step)."""

from __future__ import annotations

from functools import cache

from autopar.api import search_plans
from autopar.whatif import with_memory
from autopar.zoo import get_model
from cost_models.hardware import Cluster
from runtime.plan import Plan

BATCH, SEQ = 64, 512


@cache
def gpt2_small_plan(nodes: int = 1, memory_gib: float | None = None) -> Plan:
    """GPT-2 small on DGX A100 nodes; ``memory_gib`` shrinks the devices so memory binds."""
    spec = get_model("gpt2-small")
    cluster = Cluster.preset("dgx-a100-80g", nodes=nodes)
    if memory_gib is not None:
        cluster = with_memory(cluster, memory_gib)
    inputs = spec.example_inputs(BATCH, SEQ, device="meta")
    return search_plans(spec.build("meta"), cluster, inputs, model_name=spec.name,
                        seq_len=SEQ).plan
