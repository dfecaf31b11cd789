"""Memory per rank for each parallelism dimension on 2 CPU ranks: the planner's cost model
(``autopar.planner.costs.layer_cost``, summed over the layers) against what the runtime holds.

    python bench/memory_dims.py

Model: the zoo's gpt-small (4 blocks, h=128, 4 heads, vocab 512; fused attention, no
dropout), global batch 16, sequence 64, AdamW. Fused attention because context
parallelism needs it; no dropout because CPU dropout keeps a float32 noise tensor where the
capture models CUDA's 1-byte mask (tests/passes/test_recompute_memory.py).

Measured on every rank (the table gives the largest over the 2 ranks), during the second
training step so optimizer states exist:

- states: unique storages of every parameter alive (``nn.Parameter`` objects found by the
  garbage collector: sharded and gathered FSDP2 parameters, DTensors by their local shard),
  of their gradients and of the optimizer states, plus DDP's gradient buckets
  (``bucket_sizes`` of DDP's logging data), taken after the first micro-batch's backward:
  with one micro-batch, before the optimizer step; with two, between them (what ZeRO-1/2
  keep across micro-batches).
- activations: storages made during the first micro-batch's forward (the model's, not the
  loss's) that are still alive when it returns, parameters, gradients, buffers and the
  logits left out. This sees what autograd saves and, under checkpointing, the inputs the
  checkpoint keeps and the selective policy's cache, which ``saved_tensors_hooks`` cannot
  (tests/passes/test_recompute_memory.py).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import time
import warnings
from dataclasses import dataclass

from runtime.plan import LayerPlan, Mesh, Plan

MODEL = "gpt-small"
BATCH, SEQ = 16, 64
WORLD = 2
BLOCK_TP = {
    "attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
    "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise",
}
DIMENSIONS = ("replicate", "zero1", "zero2", "fsdp", "tp", "tp+sp", "cp", "selective",
              "full", "bf16", "mixed")


def _spec():
    from autopar.zoo import get_model

    return get_model(MODEL)


def _names(n_layer: int) -> list[str]:
    return ["wte", "wpe", *(f"h.{i}" for i in range(n_layer)), "ln_f", "lm_head"]


def make_plan(dimension: str, n_layer: int, sp_styles: dict[str, str]) -> Plan:
    """Every layer ``dimension`` on dp=2, the Megatron split on tp=2, cp=2, or a mix of
    fsdp and replicate layers on dp=2 (which runs every layer on FSDP2)."""
    if dimension in ("tp", "tp+sp"):
        sp = dimension == "tp+sp"
        blocks = [LayerPlan(module=f"h.{i}", strategy="tp", sequence_parallel=sp,
                            tp_styles=sp_styles if sp else BLOCK_TP) for i in range(n_layer)]
        layers = [LayerPlan(module="wte", strategy="tp", tp_styles={"": "embedding_rowwise"}),
                  LayerPlan(module="wpe", strategy="replicate"), *blocks,
                  LayerPlan(module="ln_f", strategy="replicate"),
                  LayerPlan(module="lm_head", strategy="tp", tp_styles={"": "colwise_gather"})]
        return Plan(global_batch=BATCH, mesh=Mesh(dp=1, tp=WORLD), layers=tuple(layers))
    if dimension == "cp":  # every sample's sequence split over the 2 ranks
        layers = tuple(LayerPlan(module=n, strategy="replicate") for n in _names(n_layer))
        return Plan(global_batch=BATCH, seq_len=SEQ, mesh=Mesh(dp=1, cp=WORLD), layers=layers)
    if dimension == "mixed":  # FSDP2 for all: sharded embeddings and head, replicated blocks
        layers = tuple(LayerPlan(module=n, strategy="fsdp" if n in ("wte", "lm_head")
                                 else "replicate") for n in _names(n_layer))
        return Plan(global_batch=BATCH, mesh=Mesh(dp=WORLD), layers=layers)
    strategy = dimension if dimension in ("zero1", "zero2", "fsdp") else "replicate"
    recompute = dimension if dimension in ("selective", "full") else "none"
    layers = tuple(LayerPlan(module=n, strategy=strategy,
                             recompute=recompute if n.startswith("h.") else "none")
                   for n in _names(n_layer))
    # ZeRO-1 differs from ZeRO-2 only across micro-batches; both keep their promise there.
    accumulation = 2 if dimension in ("zero1", "zero2") else 1
    dtype = "bfloat16" if dimension == "bf16" else "float32"
    return Plan(global_batch=BATCH, mesh=Mesh(dp=WORLD), layers=layers,
                gradient_accumulation=accumulation, param_dtype=dtype)


def predict(graph, plan: Plan) -> tuple[float, float]:
    """(states, activations) bytes per rank: layer_cost summed over the layers (modelled)."""
    from dataclasses import replace

    from autopar.planner.costs import layer_cost
    from cost_models.hardware import Cluster
    from cost_models.memory import precision
    from runtime.data_parallel import uses_ddp
    from runtime.plan import option_label

    cluster, prec = Cluster.local(WORLD), precision(plan.param_dtype)
    states = activations = 0.0
    ddp = uses_ddp(list(plan.layers), mixed_precision=plan.param_dtype != "float32")
    for info in graph.layers:
        la = plan.layer(info.name)
        option = option_label(la.strategy, la.recompute, la.offload, la.sequence_parallel)
        # The loss's kept copy is outside the measured activations (module docstring).
        cost = layer_cost(replace(info, loss_bytes=0), option, plan.mesh, cluster, prec,
                          plan.microbatches)
        # FSDP2's gathered copy of float32 replicated parameters: not on DDP, which holds one.
        states += cost.states_bytes - (cost.gathered_bytes if ddp else 0.0)
        activations += cost.activations_bytes
    return states, activations


# -- on every rank -----------------------------------------------------------------------


def _storage(t):
    """The untyped storage holding ``t``'s local data (DTensor shard, collective result)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    while isinstance(t, (DTensor, AsyncCollectiveTensor)):
        t = t._local_tensor if isinstance(t, DTensor) else t.elem
    return t.untyped_storage()


def _bytes_of(tensors) -> dict[int, int]:
    """storage id -> bytes, over the storages of ``tensors`` (None skipped)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    out = {}
    for t in tensors:
        if t is not None:
            s = _storage(t)
            out[StorageWeakRef(s).cdata] = s.nbytes()
    return out


def _parameters(model) -> list:
    """Every parameter tensor the model holds now: the registered ones, and FSDP2's sharded
    and gathered copies of each (FSDP2 registers one or the other in the module; its
    ``FSDPParam`` fields are private, read here only to count their bytes)."""
    params = list(model.parameters())
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = state._fsdp_param_group if state is not None else None
        for fp in group.fsdp_params if group is not None else ():
            params += [fp.sharded_param, getattr(fp, "_unsharded_param", None)]
    return [p for p in params if p is not None]


def states_bytes(trainer, forward_params: dict[int, int]) -> int:
    """Parameters, gradients, optimizer states and DDP buckets held now, with the parameter
    storages alive at the end of the forward (``forward_params``: FSDP2's gathered copies,
    which backward frees) (module docstring)."""
    from torch.nn.parallel import DistributedDataParallel

    params = _parameters(trainer.applied.model)
    optim = [v for state in trainer.optimizer.state.values() for v in state.values()
             if hasattr(v, "untyped_storage")]
    # A storage's size at the end of the forward wins over its size now: backward resizes a
    # gathered copy to 0 in place, the same storage (listed first, it read as 0 here).
    held = (_bytes_of(params) | _bytes_of(p.grad for p in params) | _bytes_of(optim)
            | forward_params)
    buckets = 0  # separate from the gradients unless they are views into the buckets
    ddp = trainer.module
    if isinstance(ddp, DistributedDataParallel) and not ddp.gradient_as_bucket_view:
        sizes = trainer.module._get_ddp_logging_data().get("bucket_sizes", "")
        buckets = sum(int(s) for s in str(sizes).split(",") if s)
    return sum(held.values()) + buckets


class _ForwardProbe:
    """Tracks the storages one forward of ``model`` makes; ``held`` is their alive bytes."""

    def __init__(self, model) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        probe = self

        class Made(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                probe.note(out)
                return out

        self.mode, self.refs, self.held, self.armed = Made(), [], None, False
        self.params: dict[int, int] = {}
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit)
        self.model = model

    def note(self, out) -> None:
        import torch
        import torch.utils._pytree as pytree
        from torch.multiprocessing.reductions import StorageWeakRef

        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = _storage(t)
                self.refs.append((StorageWeakRef(s), s.nbytes()))

    def _enter(self, module, args):
        if not self.armed:
            return None
        self.mode.__enter__()
        # Inputs made here count only if the forward keeps them.
        return tuple(a.clone() if hasattr(a, "clone") else a for a in args)

    def _exit(self, module, args, output):
        if not self.armed:
            return
        self.mode.__exit__(None, None, None)
        self.armed = False
        params = _parameters(self.model)
        self.params = _bytes_of(params)
        excluded = (_bytes_of(params) | _bytes_of(p.grad for p in params)
                    | _bytes_of(self.model.buffers()) | _bytes_of([output]))
        alive = {ref.cdata: n for ref, n in self.refs if not ref.expired()}
        self.held = sum(n for key, n in alive.items() if key not in excluded)
        self.refs.clear()


def measure_job(plan_jsons: list[str]) -> list[tuple[int, int]]:
    """On every rank: (states, activations) bytes of each plan (module docstring)."""
    import torch

    from autopar.lower import make_trainer

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    # FSDP2 warns about every wrapped module returning a view; nothing here writes in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    spec, out = _spec(), []
    for text in plan_jsons:
        plan = Plan.from_json(text)
        trainer = make_trainer(spec.build(seed=0), plan, spec.loss_fn,
                               spec.example_inputs(BATCH, SEQ, device="meta"))
        batch = spec.make_batch(BATCH, SEQ, seed=0)
        trainer.train_step(*batch)  # the optimizer's states exist from here on
        probe = _ForwardProbe(trainer.applied.model)
        seen: list[int] = []
        backward = trainer._backward

        def measured(loss, backward=backward, seen=seen, trainer=trainer, probe=probe):
            backward(loss)
            if not seen:
                seen.append(states_bytes(trainer, probe.params))

        trainer._backward = measured
        probe.armed = True
        trainer.train_step(*batch)
        out.append((seen[0], probe.held))
        del trainer, probe
        gc.collect()
    return out


# -- the table --------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    dimension: str
    predicted_states: float
    measured_states: int
    predicted_activations: float
    measured_activations: int


def run() -> list[Row]:
    from passes.layer_graph import build_layer_graph
    from runtime.launch import spawn

    spec = _spec()
    graph = build_layer_graph(spec.build("meta"), spec.example_inputs(BATCH, SEQ))
    n_layer = spec.config.n_layer
    sp_styles = graph.layers[[la.name for la in graph.layers].index("h.0")].tp.sp_styles
    plans = [make_plan(d, n_layer, sp_styles) for d in DIMENSIONS]
    per_rank = spawn(measure_job, WORLD, [p.to_json() for p in plans], timeout_s=600)
    rows = []
    for i, (dimension, plan) in enumerate(zip(DIMENSIONS, plans, strict=True)):
        states, activations = predict(graph, plan)
        measured = [rank[i] for rank in per_rank]
        rows.append(Row(dimension, states, max(m[0] for m in measured), activations,
                        max(m[1] for m in measured)))
    return rows


def _error(measured: float, predicted: float) -> str:
    return f"{100 * (measured - predicted) / predicted:+.1f}%" if predicted else "-"


def format_table(rows: list[Row]) -> str:
    head = (f"{'dimension':<10} {'pred states':>12} {'meas states':>12} {'err':>7}  "
            f"{'pred acts':>10} {'meas acts':>10} {'err':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.dimension:<10} {r.predicted_states / 1024:>10.0f}KB "
            f"{r.measured_states / 1024:>10.0f}KB "
            f"{_error(r.measured_states, r.predicted_states):>7}  "
            f"{r.predicted_activations / 1024:>8.0f}KB {r.measured_activations / 1024:>8.0f}KB "
            f"{_error(r.measured_activations, r.predicted_activations):>7}")
    lines.append("(per rank, largest over the 2 ranks; err = (measured - predicted) / predicted)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    start = time.perf_counter()
    rows = run()
    print(f"{MODEL}, global batch {BATCH}, seq {SEQ}, {WORLD} CPU ranks "
          f"(gloo), AdamW; {datetime.date.today()}")
    print(format_table(rows))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
