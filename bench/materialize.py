"""A model built on meta, compiled on 4 CPU ranks: memory per rank against the plan.

    python bench/materialize.py                 # FSDP and TP+FSDP, 4 ranks
    python bench/materialize.py --steps 3 --n-layer 8

The model (a zoo GPT, ``CONFIG``) is built under ``torch.device("meta")`` on every rank
and compiled with ``autopar.lower.make_trainer`` (what ``autopar.compile`` runs once it
has a plan): parallelized on meta, then each rank allocates and initialises only its own
shards (``runtime.materialize``). Per rank the table prints, in MiB:

- ``full``: the whole model's fp32 parameters, which no rank should ever hold;
- ``shards``: the plan's parameter bytes per rank (``Prediction.memory.params_bytes``),
  what ``compile`` should allocate;
- ``compile``: the rise of the process's peak resident memory (``ru_maxrss``) over its
  resident memory just before the model was built (after torch was imported, the process
  group started and a narrow copy of the model compiled and stepped, so that lazily
  loaded modules are in it: that baseline is the stated fixed overhead, printed below);
- ``step 1`` and ``steady``: the same rise at the end of the first step and of the last,
  next to the plan's predicted peak per rank (parameters, gradients, Adam states,
  activations, gathered layers; allocator margin excluded).

Besides the baseline, ``compile`` may exceed ``shards`` by one parameter's full tensor
(the largest, printed below): each random fill is drawn whole on the CPU and sliced, so
that every rank and one process agree (``runtime.materialize``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

# glibc's malloc raises its mmap threshold (up to 32 MiB) as blocks are freed and then
# keeps freed blocks of that size in the heap, so resident memory would count memory the
# program no longer holds. Fixed at 1 MiB, large blocks go back to the system when freed,
# and the peak resident memory is the peak of what was live. Read when a rank starts.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1024 * 1024))

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from cost_fidelity import Case, make_plan  # noqa: E402

from autopar.zoo import get_model  # noqa: E402
from cost_models.hardware import Cluster  # noqa: E402
from passes.layer_graph import build_layer_graph  # noqa: E402
from runtime.launch import spawn  # noqa: E402
from runtime.plan import Mesh, Plan  # noqa: E402

MODEL = "gpt-small"
CONFIG = dict(n_layer=8, n_head=16, n_embd=1024, vocab_size=8192, block_size=64)
"""About 118 M parameters, 450 MiB in fp32: GEMM-bound blocks, small embeddings, so no
single parameter dominates (the largest is an MLP weight, 16 MiB)."""
BATCH, SEQ = 4, 64
NPROC = 4
MiB = 1024**2
CASES = (
    Case(name="FSDP", mesh=Mesh(dp=4), strategy="fsdp"),
    Case(name="TP+FSDP", mesh=Mesh(dp=2, tp=2), strategy="tp_fsdp"),
)


def _spec(n_layer: int):
    return get_model(MODEL).with_config(**{**CONFIG, "n_layer": n_layer})


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def rank_job(plan_json: str, n_layer: int, steps: int) -> dict:
    """Build on meta, compile, train ``steps`` steps; the peak-RSS rise at each point."""
    torch.set_num_threads(1)
    from autopar.lower import make_trainer

    spec = _spec(n_layer)
    # A narrow copy first: what compile imports and registers lazily (DTensor ops, FSDP2)
    # is then in the baseline.
    tiny = get_model(MODEL).with_config(**{**CONFIG, "n_layer": n_layer, "n_embd": 64,
                                           "n_head": 2, "vocab_size": 128})
    make_trainer(tiny.build("meta"), Plan.from_json(plan_json), tiny.loss_fn,
                 tiny.example_inputs(BATCH, SEQ), seed=0).train_step(
        *tiny.make_batch(BATCH, SEQ, seed=0))
    baseline = _rss_bytes()
    model = spec.build("meta")
    trainer = make_trainer(model, Plan.from_json(plan_json), spec.loss_fn,
                           spec.example_inputs(BATCH, SEQ), seed=0)
    out = {"baseline": baseline, "compile": _peak_bytes() - baseline,
           "shards": sum(_local(p) for p in trainer.applied.model.parameters())}
    for step in range(steps):
        trainer.train_step(*spec.make_batch(BATCH, SEQ, seed=step))
        if step == 0:
            out["step 1"] = _peak_bytes() - baseline
    out["steady"] = _peak_bytes() - baseline
    return out


def _local(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=CONFIG["n_layer"])
    args = parser.parse_args()
    spec = _spec(args.n_layer)
    meta = spec.build("meta")
    full = sum(p.numel() * p.element_size() for p in meta.parameters())
    largest = max(p.numel() * p.element_size() for p in meta.parameters())
    graph = build_layer_graph(meta, spec.example_inputs(BATCH, SEQ, device="meta"),
                              model_name=MODEL, seq_len=SEQ)
    cluster = Cluster.local(NPROC)
    print(f"{MODEL} {args.n_layer} layers: full fp32 model {full / MiB:.0f} MiB; "
          f"{NPROC} CPU ranks, global batch {BATCH} × {SEQ}, {args.steps} steps\n")
    print(f"{'plan':<9} {'rank':>4} {'full':>6} {'shards':>7} {'held':>6} {'compile':>8} "
          f"{'step 1':>7} {'steady':>7} {'planned':>8}")
    baselines = []
    for case in CASES:
        plan, predicted = make_plan(graph, cluster, case)
        planned_shards = plan.prediction.memory.params_bytes
        rows = spawn(rank_job, NPROC, plan.to_json(), args.n_layer, args.steps, timeout_s=900)
        for rank, row in enumerate(rows):
            baselines.append(row["baseline"])
            print(f"{case.name:<9} {rank:>4} {full / MiB:>6.0f} {planned_shards / MiB:>7.1f} "
                  f"{row['shards'] / MiB:>6.1f} {row['compile'] / MiB:>8.1f} "
                  f"{row['step 1'] / MiB:>7.1f} {row['steady'] / MiB:>7.1f} "
                  f"{predicted.peak_bytes / MiB:>8.1f}")
    print(f"\nshards: planned parameter bytes per rank; held: what the rank's parameters "
          f"hold after compile. Fixed overhead, not counted above: the process's resident "
          f"memory before the model is built, after a narrow copy was compiled and "
          f"stepped ({min(baselines) / MiB:.0f}-{max(baselines) / MiB:.0f} MiB: torch, gloo, "
          f"lazily loaded modules), plus at most one full parameter "
          f"during initialisation ({largest / MiB:.0f} MiB). planned: the plan's peak per "
          f"rank, allocator margin excluded.")


if __name__ == "__main__":
    main()
