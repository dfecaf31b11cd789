"""A plan whose scattered sends cannot split a boundary tensor is refused before any rank
starts (runtime.pipeline_sends.check_sends, called by the pipeline split on meta), not by
the sending rank at its first step while its peers wait for the process-group timeout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.zoo import get_model
from passes.split_stages import split_pipeline
from runtime.pipeline_sends import Send, check_sends
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan, PlanError


class Narrow(nn.Module):
    """Three Linears; the middle one hands on 3 features, which tp = 2 does not split."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def _plan(stages: dict[str, int], *, tp: int = 2, scatter: bool = True,
          schedule: str = "1F1B", sp: frozenset[str] = frozenset()) -> Plan:
    v = 2 if schedule == "Interleaved1F1B" else 1
    layers = tuple(
        LayerPlan(module=m, stage=s, strategy="tp" if m in sp else "replicate",
                  tp_styles={"ln": "sequence_parallel", "fc": "colwise"} if m in sp else {},
                  sequence_parallel=m in sp)
        for m, s in stages.items())
    return Plan(global_batch=8, mesh=Mesh(pp=2, tp=tp), layers=layers,
                pipeline=PipelineSpec(schedule=schedule, num_microbatches=2,
                                      virtual_stages=v, scatter_sends=scatter))


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_the_split_refuses_a_last_dim_tp_does_not_divide(method):
    plan = _plan({"a": 0, "b": 0, "c": 1})
    with pytest.raises(PlanError, match=r"stage 0 sends a tensor \(made by 'b'\) of shape \(4, 3\) "
                                        r"to stage 1.*tp=2, and 3 does not split.*"
                                        r"scatter_sends false"):
        split_pipeline(Narrow(), plan, (torch.ones(4, 4),), method=method)


def test_the_same_cut_splits_whole_or_where_the_last_dim_divides():
    split_pipeline(Narrow(), _plan({"a": 0, "b": 0, "c": 1}, scatter=False), (torch.ones(4, 4),))
    split = split_pipeline(Narrow(), _plan({"a": 0, "b": 1, "c": 1}), (torch.ones(4, 4),))
    assert split.sends == ((Send(name="a", shape=(4, 6), module="a"),),)


def test_a_sequence_shard_is_exempt_and_other_tensors_at_its_boundary_are_not():
    """Stage 0 ends with SP layer 'h' and stage 1 opens with SP layer 'g': h's output
    crosses as each rank's shard; anything else crossing there is still sliced."""
    plan = _plan({"h": 0, "g": 1}, sp=frozenset({"h", "g"}))
    check_sends(plan, ((Send("h", (2, 16, 7), "h"),),))
    with pytest.raises(PlanError, match=r"tensor \('mask'\) of shape \(2, 7\)"):
        check_sends(plan, ((Send("h", (2, 16, 7), "h"), Send("mask", (2, 7), "")),))


def test_an_integer_tensor_crosses_whole_and_is_not_checked():
    """Token ids crossing a scattered boundary are sent whole (only floating tensors are
    sliced), so their last dim need not divide by tp."""
    plan = _plan({"h": 0, "g": 1})
    check_sends(plan, ((Send("ids", (2, 7), "", floating=False),),))
    with pytest.raises(PlanError, match=r"tensor \('ids'\) of shape \(2, 7\)"):
        check_sends(plan, ((Send("ids", (2, 7), ""),),))


def test_boundaries_on_one_rank_are_not_checked():
    """ZBVZeroBubble's middle boundary (stages 1 and 2 on pipeline rank 1) hands tensors
    over in memory, whole."""
    plan = Plan(global_batch=8, mesh=Mesh(pp=2, tp=2),
                pipeline=PipelineSpec(schedule="ZBVZeroBubble", num_microbatches=2,
                                      virtual_stages=2, scatter_sends=True))
    odd = (Send("x", (3,), ""),)
    check_sends(plan, ((), odd, ()))
    with pytest.raises(PlanError, match="stage 2 sends"):
        check_sends(plan, ((), odd, odd))


def _gpt_tp3_plan() -> Plan:
    """gpt-tiny (n_embd 64) on pp 2 × tp 3: 64 features do not split three ways."""
    units = ["wte", "wpe", "h.0", "h.1", "ln_f", "lm_head"]
    layers = tuple(LayerPlan(module=m, stage=0 if i < 3 else 1, strategy="replicate")
                   for i, m in enumerate(units))
    return Plan(global_batch=8, mesh=Mesh(pp=2, tp=3), layers=layers,
                pipeline=PipelineSpec(schedule="1F1B", num_microbatches=2, scatter_sends=True))


def test_autopar_run_refuses_before_spawning(monkeypatch):
    import autopar.training as training

    def spawn(*args, **kwargs):
        raise AssertionError("ranks were spawned")

    monkeypatch.setattr(training, "spawn", spawn)
    with pytest.raises(PlanError, match=r"shape \(4, 16, 64\).*tp=3, and 64 does not split"):
        training.run_local(get_model("gpt-tiny"), _gpt_tp3_plan(), nproc=6, steps=1,
                           batch=8, seq=16)


def test_the_cli_says_it_and_exits_2(tmp_path, capsys):
    from autopar.cli import main

    path = tmp_path / "plan.json"
    path.write_text(_gpt_tp3_plan().to_json())
    code = main(["run", "--model", "gpt-tiny", "--plan", str(path), "--nproc", "6",
                 "--batch", "8", "--seq", "16", "--steps", "1"])
    assert code == 2
    assert "64 does not split" in capsys.readouterr().err


def compile_job(plan_json: str) -> str:
    """``autopar.compile`` with a given plan, on every rank: the refusal, or 'ran'."""
    import autopar

    torch.manual_seed(0)
    try:
        autopar.compile(Narrow(), "local", (torch.ones(4, 4),), loss_fn=lambda out, y: out.sum(),
                        plan=Plan.from_json(plan_json))
    except PlanError as e:
        return str(e)
    return "ran"


def test_compile_refuses_on_every_rank_before_a_collective(pool4):
    """Every rank splits the model on meta and refuses alike: none waits for a peer."""
    plan = _plan({"a": 0, "b": 0, "c": 1})
    messages = pool4.run(compile_job, plan.to_json(), timeout_s=60)
    assert all("(made by 'b') of shape (4, 3)" in m and "3 does not split" in m
               for m in messages), messages
