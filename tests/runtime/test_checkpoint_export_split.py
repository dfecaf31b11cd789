"""A checkpoint saved under a pipeline split by ``torch.export`` loads under another plan.

An exported stage names what it holds by the export's names, not the model's state-dict
names, in three ways that once made such a checkpoint unloadable anywhere else
(CheckpointMismatchError: "saved from a different model"):

- a buffer the model does not save (BERT's ``position_ids``, Llama's ``inv_freq``) or a
  constant lifted from ``forward`` (Falcon's ``lifted_tensor_0``) was saved;
- a tensor the model saves under two names (BERT's head bias, ``cls.predictions.bias`` and
  ``cls.predictions.decoder.bias``) was saved under one;
- a rank holding two stages (interleaved schedules) saved every buffer (``merged_view``);
- a module run at several depths (ALBERT's layer), one module per call in the stage, was
  saved under every call's name (``attention@1.query.weight``).

Each model trains one step under its pp=2 plan, is saved, and is loaded by a differently
initialised fsdp trainer on 2 ranks; every model entry must come back bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from real_models import pipeline_inputs
from test_checkpoint import full_state
from test_real_models import BATCH, SPECS, variant_plan

from runtime.plan import Plan

CASES = ("hf-bert-mlm", "hf-falcon", "hf-albert")
"""BERT: tied bias, non-persistent buffers (one stage per rank). Falcon: lifted constants,
rotary inv_freq, two stages per rank (its pp=2 plan is interleaved). ALBERT: one layer at
every depth."""


def _job(name: str, plan_json: str, root: str, save: bool) -> dict:
    from autopar.lower import make_trainer
    from runtime import checkpoint

    spec, plan = SPECS[name], Plan.from_json(plan_json)
    batch = spec.batch(BATCH, seed=0)
    if plan.mesh.pp > 1:
        trainer = make_trainer(spec.build(seed=0), plan, spec.logits_loss,
                               pipeline_inputs(batch), seed=0)
        trainer.train_step(pipeline_inputs(batch), batch["labels"])
    else:
        trainer = make_trainer(spec.build(seed=3), plan, None, batch, seed=0)
    if save:
        checkpoint.save(trainer, root, step=1)
    else:
        checkpoint.load(trainer, root)
    return {k: v for k, v in full_state(trainer).items() if k.startswith("model.")}


@pytest.mark.parametrize("name", CASES)
def test_a_pipeline_checkpoint_loads_under_fsdp(pool2, tmp_path, name):
    pp, fsdp = variant_plan(name, "pp2")[0], variant_plan(name, "fsdp")[0]
    assert Plan.from_json(pp).mesh.pp == 2
    saved = pool2.run(_job, name, pp, str(tmp_path), True)[0]
    for rank, loaded in enumerate(pool2.run(_job, name, fsdp, str(tmp_path), False)):
        assert loaded.keys() == saved.keys(), f"rank {rank}: {sorted(loaded.keys() ^ saved.keys())}"
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), f"rank {rank}: {key}"
