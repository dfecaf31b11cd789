"""FSDP2's prefetch beside a block: the liveness walk's peak against MemTracker's, on one rank.

    python bench/memory_prefetch.py

gpt-small with blocks that dominate its memory (hidden 256 to 768, vocabulary 64), 4 × 16
tokens, every layer fsdp in float32 on a 1-rank gloo group; the blocks recomputed or not.
Measured: the second training step under MemTracker (``cost_fidelity.tracked_peak``).
Predicted: the planner's liveness walk (autopar/planner/liveness.py, rule 6) with the
uncosted terms, and the same walk with every prefetch priced as the layer's own parameters
(``prefetch_bytes`` zeroed: the rule before it took the real neighbour). Errors are
(predicted − measured) / measured.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
from cost_fidelity import error, tracked_peak

from autopar.lower import make_trainer
from autopar.planner.costs import layer_cost
from autopar.planner.liveness import step_liveness, uncosted_terms
from autopar.zoo import get_model
from cost_models.hardware import Cluster, MiB
from cost_models.memory import precision
from passes.layer_graph import build_layer_graph
from runtime.launch import free_port, init_local_process_group
from runtime.plan import LayerPlan, Mesh, Plan, option_label

BATCH, SEQ = 4, 16
CASES = ((256, "none"), (512, "none"), (768, "none"), (512, "full"))
"""(hidden, recomputation of the blocks)."""
FP32 = precision("float32")


def run_case(hidden: int, recompute: str) -> tuple[float, float, float, float, str, str]:
    """(block parameters, measured, walk, walk with own-sized prefetches) in bytes, and the
    two walks' peak events."""
    spec = get_model("gpt-small").with_config(n_embd=hidden, vocab_size=64)
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(BATCH, SEQ))
    blocks = max(graph.classes, key=lambda c: len(graph.classes[c]))
    rec = {la.name: recompute if la.layer_class == blocks else "none" for la in graph.layers}
    plan = Plan(global_batch=BATCH, mesh=Mesh(dp=1), param_dtype="float32",
                layers=tuple(LayerPlan(module=la.name, strategy="fsdp", recompute=rec[la.name])
                             for la in graph.layers))
    costs = [layer_cost(la, option_label("fsdp", rec[la.name]), plan.mesh, Cluster.local(1),
                        FP32) for la in graph.layers]
    names = [la.name for la in graph.layers]
    uncosted = uncosted_terms(costs, FP32, foreach=False)
    walk = step_liveness(costs, names, uncosted=uncosted).peak
    own = step_liveness([replace(c, prefetch_bytes=0.0) for c in costs], names,
                        uncosted=uncosted).peak
    trainer = make_trainer(spec.build(seed=0), plan, spec.loss_fn,
                           spec.example_inputs(BATCH, SEQ))
    inputs, targets = spec.make_batch(BATCH, SEQ, seed=0)
    trainer.train_step(inputs, targets)  # optimizer states exist from here on
    measured, _ = tracked_peak(trainer, inputs, targets)
    block = next(c for c, la in zip(costs, graph.layers, strict=True)
                 if la.layer_class == blocks).prefetch_bytes
    return block, measured, walk.total_bytes, own.total_bytes, walk.event, own.event


def main() -> None:
    warnings.filterwarnings("ignore", message=".*FSDP2-wrapped module.*")
    torch.set_num_threads(1)
    init_local_process_group(0, 1, free_port(), timeout_s=30)
    print(f"{'hidden':>6} {'recompute':>9} {'block P':>8} {'measured':>9} "
          f"{'own-sized prefetch':>28} {'walk':>28}   (MiB)")
    for hidden, recompute in CASES:
        block, measured, walk, own, at, own_at = run_case(hidden, recompute)
        print(f"{hidden:>6} {recompute:>9} {block / MiB:>8.2f} {measured / MiB:>9.2f} "
              f"{own / MiB:>8.2f} {error(own, measured):+6.1%} {own_at:<12} "
              f"{walk / MiB:>8.2f} {error(walk, measured):+6.1%} {at:<12}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
