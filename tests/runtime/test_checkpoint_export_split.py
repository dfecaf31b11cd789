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
  saved under every call's name (``attention@1.query.weight``);
- a tensor named by a module that runs no op (T5's ``shared.weight``, run as the encoder's
  and the decoder's ``embed_tokens``) was saved by no stage under that name.

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

CASES = ("hf-bert-mlm", "hf-falcon", "hf-albert", "hf-t5")
"""BERT: tied bias, non-persistent buffers (one stage per rank). Falcon: lifted constants,
rotary inv_freq, two stages per rank (its pp=2 plan is interleaved). ALBERT: one layer at
every depth. T5: the embedding's name in ``shared``, a module no stage runs."""


def _job(name: str, plan_json: str, root: str, save: bool, optim: bool = False) -> dict:
    from autopar.lower import make_trainer
    from runtime import checkpoint

    spec, plan = SPECS[name], Plan.from_json(plan_json)
    batch = spec.batch(BATCH, seed=0)
    if plan.mesh.pp > 1:
        trainer = make_trainer(spec.build(seed=0), plan, spec.logits_loss,
                               pipeline_inputs(batch), seed=0)
        trainer.train_step(pipeline_inputs(batch), batch["labels"])
    elif spec.returns_loss:
        trainer = make_trainer(spec.build(seed=3), plan, None, batch, seed=0)
        if save:  # an optimizer state to save
            trainer.train_step(batch)
    else:
        trainer = make_trainer(spec.build(seed=3), plan, spec.logits_loss,
                               pipeline_inputs(batch), seed=0)
        if save:
            trainer.train_step(pipeline_inputs(batch), batch["labels"])
    if save:
        checkpoint.save(trainer, root, step=1)
    else:
        checkpoint.load(trainer, root)
    kinds = ("model.", "optim.") if optim else ("model.",)
    return {k: v for k, v in full_state(trainer).items() if k.startswith(kinds)}


@pytest.mark.parametrize("name", CASES)
def test_a_pipeline_checkpoint_loads_under_fsdp(pool2, tmp_path, name):
    pp, fsdp = variant_plan(name, "pp2")[0], variant_plan(name, "fsdp")[0]
    assert Plan.from_json(pp).mesh.pp == 2
    saved = pool2.run(_job, name, pp, str(tmp_path), True)[0]
    for rank, loaded in enumerate(pool2.run(_job, name, fsdp, str(tmp_path), False)):
        assert loaded.keys() == saved.keys(), f"rank {rank}: {sorted(loaded.keys() ^ saved.keys())}"
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), f"rank {rank}: {key}"


@pytest.mark.parametrize("name", ["hf-t5", "nanogpt-tied"])
def test_an_fsdp_checkpoint_loads_into_a_pipeline_holding_a_tied_copy(pool2, tmp_path, name):
    """One process keys a tied weight's optimizer state by its first name only (T5's
    ``shared.weight``, nanoGPT's ``wte.weight``); the pipeline's last stage holds its copy
    as ``lm_head.weight`` and once found no state for it ("has no optimizer state")."""
    pp, fsdp = variant_plan(name, "pp2")[0], variant_plan(name, "fsdp")[0]
    saved = pool2.run(_job, name, fsdp, str(tmp_path), True, True)[0]
    first = {}
    for n, p in SPECS[name].build(seed=0).named_parameters(remove_duplicate=False):
        first.setdefault(id(p), n)
        first[n] = first[id(p)]
    for rank, loaded in enumerate(pool2.run(_job, name, pp, str(tmp_path), False, True)):
        copies = [k for k in loaded if k.startswith("optim.state.lm_head.weight.")]
        assert copies and not set(copies) & saved.keys()  # read under the first name
        for key, value in loaded.items():
            if key.startswith("optim.") and key not in saved:
                section, _, rest = key.removeprefix("optim.").partition(".")
                fqn, _, field = rest.rpartition(".")
                want = saved[f"optim.{section}.{first[fqn]}.{field}"]
            else:
                want = saved[key]
            same = torch.equal(value, want) if isinstance(value, torch.Tensor) else value == want
            assert same, f"rank {rank}: {key}"
