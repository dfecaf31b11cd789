"""PyTorch's async TP (runtime/async_tp.py): the plan flag, what it requires, its refusal on
ranks that cannot run it, and what the runtime does to turn it on.

Async TP itself runs on CUDA GPUs only; here (CPU ranks, gloo) the tests check everything
short of its fused kernels: which layers may ask for it, that CPU/gloo ranks refuse it by
name before any collective, and, with the rank check stood in for, that exactly the async
layers are compiled, symmetric memory is enabled on the tp group and Inductor's
micro-pipeline pass is switched on, and that the compiled layers train like one process
(the pass fuses nothing without NCCL, so the numbers are the compiled layers' own).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_runtime_numerics import BLOCK_TP, GPT, _spec, bad_plan_job

from cost_models.hardware import Cluster
from runtime.async_tp import MIN_CAPABILITY, cluster_problem, device_problem
from runtime.plan import LayerPlan, Mesh, Plan, PlanError, option_label, parse_option
from runtime.validate import check_async_tp_ranks

BLOCK_SP = {"ln_1": "sequence_parallel", **{k: v for k, v in BLOCK_TP.items() if "attn" in k},
            "ln_2": "sequence_parallel", **{k: v for k, v in BLOCK_TP.items() if "mlp" in k}}


def _block(name: str, *, async_tp: bool = True) -> LayerPlan:
    return LayerPlan(module=name, strategy="tp", tp_styles=BLOCK_SP, sequence_parallel=True,
                     async_tp=async_tp)


def _plan(*layers: LayerPlan, tp: int = 2) -> Plan:
    return Plan(global_batch=GPT[2], seq_len=GPT[3], mesh=Mesh(dp=1, tp=tp), layers=layers)


# -- the plan ------------------------------------------------------------------------------------

def test_async_tp_is_a_layer_flag_in_the_option_label_and_the_json():
    assert option_label("tp_fsdp", "full", False, True, async_tp=True) == "tp_fsdp+sp+async+full"
    assert parse_option("tp_fsdp+sp+async+full") == {
        "strategy": "tp_fsdp", "recompute": "full", "offload": False,
        "sequence_parallel": True, "expert_parallel": 1, "async_tp": True}
    plan = _plan(_block("h.0"), _block("h.1", async_tp=False))
    assert [la.option for la in plan.layers] == ["tp+sp+async", "tp+sp"]
    data = json.loads(plan.to_json())
    assert [la["async_tp"] for la in data["layers"]] == [True, False]
    assert Plan.from_json(plan.to_json()) == plan
    del data["layers"][0]["async_tp"]  # a plan written before the field: no async TP
    assert Plan.from_dict(data).layers[0].async_tp is False


@pytest.mark.parametrize(("fields", "message"), [
    (dict(strategy="tp", tp_styles=BLOCK_TP), "async_tp needs sequence_parallel"),
    (dict(strategy="fsdp"), "async_tp needs a tensor-parallel strategy"),
])
def test_async_tp_without_sequence_parallel_tp_is_refused_by_name(fields, message):
    with pytest.raises(PlanError, match=message) as e:
        LayerPlan(module="h.0", async_tp=True, **fields)
    assert "'h.0'" in str(e.value)


def test_a_plan_file_with_async_tp_of_the_wrong_type_is_refused():
    data = json.loads(_plan(_block("h.0")).to_json())
    data["layers"][0]["async_tp"] = "yes"
    with pytest.raises(PlanError, match="async_tp"):
        Plan.from_dict(data)


# -- requirements ---------------------------------------------------------------------------------

CAPABLE = dict(device_type="cuda", backend="nccl", capability=(9, 0), local_world_size=8, tp=8)


@pytest.mark.parametrize(("change", "message"), [
    ({}, None),
    ({"capability": (10, 0)}, None),
    ({"local_world_size": None}, None),  # not launched by torchrun: not known, not refused
    ({"device_type": "cpu", "backend": "gloo"}, "ranks run on cpu"),
    ({"backend": "gloo"}, "backend is 'gloo'; async TP needs NCCL"),
    ({"capability": (8, 0)}, "compute capability 8.0; async TP is offered on 9.0"),
    ({"local_world_size": 4}, "tp = 8 ranks do not fit in the 4 local ranks"),
])
def test_what_a_rank_needs_to_run_async_tp(change, message):
    problem = device_problem(**{**CAPABLE, **change})
    if message is None:
        assert problem is None
    else:
        assert message in problem and "async_tp false" in problem


def test_the_clusters_that_can_run_async_tp_are_hopper_nodes_on_nvlink():
    assert MIN_CAPABILITY == (9, 0)
    h100 = Cluster.preset("dgx-h100", nodes=2)
    assert cluster_problem(h100, 8) is None
    assert "16 needs peer-to-peer access over NVLink inside one node" in cluster_problem(h100, 16)
    assert "capability 8.0" in cluster_problem(Cluster.preset("dgx-a100-80g"), 8)
    assert "not a CUDA GPU" in cluster_problem(Cluster.local(2), 2)


def test_cpu_ranks_refuse_an_async_tp_plan_naming_the_layers():
    plan = _plan(_block("h.0"), _block("h.1"), LayerPlan(module="ln_f"))
    with pytest.raises(PlanError) as e:
        check_async_tp_ranks(plan, "cpu")
    text = str(e.value)
    assert "layer 'h.0' and 1 more layer(s) asks for async_tp" in text
    assert "runs on CUDA GPUs only" in text and "set async_tp false" in text
    check_async_tp_ranks(_plan(_block("h.0", async_tp=False)), "cpu")  # nothing asked


def test_gloo_ranks_refuse_it_before_any_collective(pool2):
    plan = _plan(LayerPlan(module="wte"), LayerPlan(module="wpe"), _block("h.0"), _block("h.1"),
                 LayerPlan(module="ln_f"), LayerPlan(module="lm_head"))
    out = pool2.run(bad_plan_job, GPT, plan.to_json())[0]
    assert out.startswith("PlanError: layer 'h.0' and 1 more layer(s) asks for async_tp, but "
                          "ranks run on cpu"), out


# -- what enabling it does ------------------------------------------------------------------------

def enable_job(model: tuple, plan_json: str) -> dict:
    """Apply the plan's TP on CPU ranks with the rank check answering as a capable GPU rank
    would; report what is compiled and switched on, then switch the pass off again."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import runtime.tensor_parallel as tensor_parallel

    plan = Plan.from_json(plan_json)
    net = _spec(model).build("cpu", seed=0)
    mesh = init_device_mesh("cpu", (plan.mesh.tp,), mesh_dim_names=("tp",))
    real = tensor_parallel.rank_problem
    tensor_parallel.rank_problem = lambda *args: None
    try:
        tensor_parallel.apply_tensor_parallel(net, list(plan.layers), mesh)
        return {
            "compiled": sorted(name for name, m in net.named_modules()
                               if getattr(m, "_compiled_call_impl", None) is not None),
            "micro_pipeline_tp": inductor_config._micro_pipeline_tp,
            "symmetric_memory": is_symm_mem_enabled_for_group(mesh.get_group().group_name),
            "sharded": isinstance(net.get_submodule("h.0.attn.q_proj").weight, DTensor),
        }
    finally:
        tensor_parallel.rank_problem = real
        inductor_config._micro_pipeline_tp = False


def test_enabling_compiles_exactly_the_async_layers_on_a_symmetric_memory_group(pool2):
    plan = _plan(_block("h.0"), _block("h.1", async_tp=False))
    for rank in pool2.run(enable_job, GPT, plan.to_json()):
        assert rank == {"compiled": ["h.0"], "micro_pipeline_tp": True,
                        "symmetric_memory": True, "sharded": True}


def compiled_train_job(model: tuple, plan_json: str) -> dict:
    """``train_job`` with the rank checks answering as on capable GPU ranks: the async
    layers are compiled with Inductor and the micro-pipeline pass switched on, which on CPU
    ranks fuses nothing (it needs NCCL), so this runs the compiled layers as they are."""
    import torch._inductor.config as inductor_config
    from test_runtime_numerics import train_job
    from torch._dynamo.utils import counters

    import runtime.tensor_parallel as tensor_parallel
    import runtime.validate as validate

    real = tensor_parallel.rank_problem, validate.rank_problem
    tensor_parallel.rank_problem = validate.rank_problem = lambda *args: None
    try:
        before = counters["stats"]["unique_graphs"]
        result = train_job(model, plan_json)
        return {**result, "graphs": counters["stats"]["unique_graphs"] - before}
    finally:
        tensor_parallel.rank_problem, validate.rank_problem = real
        inductor_config._micro_pipeline_tp = False


def test_compiled_async_layers_train_like_one_process_on_cpu(pool2):
    """What async TP does to the program short of the fused kernels: each async layer
    compiled, after TP and SP, under recomputation (h.1) and FSDP2's hooks, trains like one
    process (3 AdamW steps, test_runtime_numerics' tolerances)."""
    from test_runtime_numerics import assert_matches_reference

    full = dataclasses.replace(_block("h.1"), recompute="full")
    plan = _plan(LayerPlan(module="wte"), LayerPlan(module="wpe"), _block("h.0"), full,
                 LayerPlan(module="ln_f"), LayerPlan(module="lm_head"))
    results = pool2.run(compiled_train_job, GPT, plan.to_json(), timeout_s=600)
    assert all(r.pop("graphs") > 0 for r in results)  # compiled, not run eagerly
    assert_matches_reference(results, GPT)
