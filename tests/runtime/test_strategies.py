"""The strategy specs (runtime/strategies.py) against the meaning each strategy had when it
was spread over tables: which mesh the runtime shards it on, which FSDP2 flags wait for the
last micro-batch, what the cost model shards, and when the planner offers it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autopar.planner.costs import _states_bytes
from cost_models.memory import precision
from runtime.data_parallel import _mesh_for, _sync_flags
from runtime.plan import LayerPlan, PlanError
from runtime.strategies import STRATEGIES, spec

TP_STYLES = {"fc": "colwise"}


def _layer(strategy: str) -> LayerPlan:
    styles = TP_STYLES if spec(strategy).tensor_parallel else {}
    return LayerPlan(module="h.0", strategy=strategy, tp_styles=styles)


@pytest.mark.parametrize(("strategy", "mesh"), [
    ("replicate", "world_replicate"), ("zero1", "world"), ("zero2", "world"),
    ("fsdp", "world"), ("fsdp_modules", "world"), ("hsdp", "hsdp"), ("tp", "dp_replicate"), ("tp_zero1", "dp"),
    ("tp_zero2", "dp"), ("tp_fsdp", "dp"),
])
def test_each_strategy_runs_on_its_data_parallel_mesh(strategy, mesh):
    meshes = SimpleNamespace(**{name: name for name in
                                ("world_replicate", "world", "hsdp", "dp_replicate", "dp")})
    assert _mesh_for(_layer(strategy), meshes) == mesh


class _Flags:
    """Records which FSDP2 per-micro-batch switches a strategy sets."""

    def __init__(self) -> None:
        self.calls: set[str] = set()

    def set_requires_gradient_sync(self, value, recurse):
        self.calls.add("gradient_sync")

    def set_reshard_after_backward(self, value, recurse):
        self.calls.add("reshard_after_backward")

    def set_requires_all_reduce(self, value, recurse):
        self.calls.add("all_reduce")


@pytest.mark.parametrize(("strategy", "flags"), [
    ("replicate", {"gradient_sync"}), ("tp", {"gradient_sync"}),
    ("zero1", {"gradient_sync", "reshard_after_backward"}),
    ("zero2", {"reshard_after_backward"}), ("fsdp", set()), ("fsdp_modules", set()),
    ("tp_fsdp", set()),
    ("tp_zero1", {"gradient_sync", "reshard_after_backward"}),
    ("tp_zero2", {"reshard_after_backward"}), ("hsdp", {"all_reduce"}),
])
def test_gradient_accumulation_defers_what_each_strategy_reduces_once(strategy, flags):
    module = _Flags()
    _sync_flags(module, spec(strategy), last=False)
    assert module.calls == flags


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_cost_model_shards_exactly_the_states_of_the_zero_stage(strategy):
    """Two micro-batches at pp = 1, n = 4 shards, float32: parameters, gradients and
    optimizer states are each divided by n from ZeRO stage 3, 2 and 1 on (the unsharded
    parameter of stages 1-2 is the copy kept gathered through the step; with one
    micro-batch ZeRO-1 is ZeRO-2's program, so two tell them apart)."""
    s, prec, n = spec(strategy), precision("float32"), 4
    params, grads, optimizer, *_ = _states_bytes(s, False, 1000.0, n if s.sharded else 1, 2,
                                                 prec)
    assert optimizer == 1000 * prec.optimizer_bytes / (n if s.zero_stage >= 1 else 1)
    assert grads == 1000 * prec.held_grad_bytes / (n if s.zero_stage >= 2 else 1)
    p = 1000 * prec.param_bytes
    assert params == {0: p, 1: p + p / n, 2: p + p / n, 3: p / n}[s.zero_stage]


def _available(replicas, tp, microbatches=1, hsdp=None, tp_split=True, tie=None,
               module_units=0):
    return [s for s in STRATEGIES
            if spec(s).unavailable(replicas=replicas, tp=tp, microbatches=microbatches,
                                   hsdp_shard_size=hsdp, tp_split=tp_split, tie=tie,
                                   module_units=module_units) is None]


def test_availability_on_hand_chosen_meshes():
    assert _available(1, 1) == ["replicate", "fsdp"]
    assert _available(4, 1) == ["replicate", "zero2", "fsdp"]
    assert _available(4, 1, microbatches=2) == ["replicate", "zero1", "zero2", "fsdp"]
    # tp_zero*/tp_fsdp need a data-parallel rank to shard over; zero2 shards over the tp
    # group.
    assert _available(1, 4) == ["replicate", "zero2", "fsdp", "tp"]
    assert _available(2, 8, hsdp=8) == ["replicate", "zero2", "fsdp", "hsdp", "tp", "tp_zero2",
                                        "tp_fsdp"]
    # the distributed optimizer accumulates unsharded: with one micro-batch it is tp_zero2
    assert _available(2, 4, microbatches=2) == ["replicate", "zero1", "zero2", "fsdp", "tp",
                                                "tp_zero1", "tp_zero2", "tp_fsdp"]
    assert _available(2, 2, tp_split=False) == ["replicate", "zero2", "fsdp"]
    assert _available(2, 2, tie="h.0 and lm_head share wte") == ["replicate", "zero2", "fsdp"]
    # one FSDP2 unit per weight matrix: a layer with two or more, untied, not a MoE layer
    assert _available(4, 1, module_units=6) == ["replicate", "zero2", "fsdp", "fsdp_modules"]
    assert _available(1, 1, module_units=2) == ["replicate", "fsdp", "fsdp_modules"]
    assert _available(4, 1, module_units=1) == ["replicate", "zero2", "fsdp"]
    assert _available(4, 1, module_units=None) == ["replicate", "zero2", "fsdp"]
    assert _available(4, 1, module_units=6, tie="h.0 and lm_head share wte") == [
        "replicate", "zero2", "fsdp"]


def test_shard_ranks_follow_the_data_parallel_group():
    shards = {s: spec(s).shard_ranks(4, 2, 4) for s in STRATEGIES}
    assert shards == {"replicate": 1, "zero1": 8, "zero2": 8, "fsdp": 8, "fsdp_modules": 8,
                      "hsdp": 4,
                      "tp": 1, "tp_zero1": 4, "tp_zero2": 4, "tp_fsdp": 4}


def test_plan_validation_reads_the_specs():
    with pytest.raises(PlanError, match="offload needs a fully sharded strategy"):
        LayerPlan(module="h.0", strategy="zero2", offload=True)
    with pytest.raises(PlanError, match="sequence_parallel needs a tensor-parallel"):
        LayerPlan(module="h.0", strategy="fsdp", sequence_parallel=True)
    assert LayerPlan(module="h.0", strategy="tp_fsdp", tp_styles=TP_STYLES, offload=True,
                     sequence_parallel=True).option == "tp_fsdp+sp+offload"


def test_readme_lists_every_strategy_once_in_spec_order():
    """README's strategy table is the user's view of runtime/strategies.py."""
    from pathlib import Path

    lines = (Path(__file__).parents[2] / "README.md").read_text().splitlines()
    start = lines.index("| strategy | parameters | gradients synchronised by |")
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip().strip("`"))
    assert rows == list(STRATEGIES)
