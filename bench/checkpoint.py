"""Checkpoint save and load time, and size on disk against parameter bytes, on CPU ranks.

    python bench/checkpoint.py [--repeat 3]

Each row trains one AdamW step of a built-in model under a plan on local gloo ranks,
then times (best of ``--repeat``, wall clock on rank 0, every rank synchronised):
a synchronous save (write + commit), the part of an asynchronous save that blocks
training (copy to CPU memory + planning), and a load under the same plan. "ckpt/params"
is the checkpoint's size over the model's parameter bytes: AdamW keeps two moments per
parameter, so about 3x is expected, plus DCP metadata and the per-parameter
hyper-parameters the flattened optimizer state stores. Measured, not modelled.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.zoo import get_model
from runtime.launch import spawn
from runtime.plan import LayerPlan, Mesh, Plan

BLOCK_TP = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
            "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}


def gpt_plan(name: str, strategy: str, dp: int, tp: int, batch: int) -> Plan:
    cfg = get_model(name).config
    blocks = [f"h.{i}" for i in range(cfg.n_layer)]
    if strategy == "tp":
        layers = [LayerPlan(module=b, strategy="tp", tp_styles=BLOCK_TP) for b in blocks]
    else:
        layers = [LayerPlan(module=m, strategy=strategy)
                  for m in ("wte", "wpe", *blocks, "ln_f", "lm_head")]
    return Plan(global_batch=batch, mesh=Mesh(dp=dp, tp=tp), layers=tuple(layers))


def mlp_plan(strategy: str, dp: int, batch: int) -> Plan:
    names = ("proj_in", *(f"blocks.{i}" for i in range(4)), "head")
    return Plan(global_batch=batch, mesh=Mesh(dp=dp),
                layers=tuple(LayerPlan(module=n, strategy=strategy) for n in names))


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def worker(model: str, plan_json: str, root: str, repeat: int) -> dict:
    from runtime import checkpoint
    from runtime.train import Trainer

    spec = get_model(model)
    plan = Plan.from_json(plan_json)
    trainer = Trainer(spec.build(seed=0), plan, spec.loss_fn)
    trainer.train_step(*spec.make_batch(plan.global_batch, seed=1))
    save_s, async_s, load_s = [], [], []
    for i in range(repeat):
        save_s.append(_timed(lambda i=i: checkpoint.save(trainer, root, step=i + 1, keep=1)))
        pending = []
        async_s.append(_timed(lambda i=i, pending=pending: pending.append(
            checkpoint.save(trainer, root, step=100 + i, keep=1, async_save=True))))
        pending[0].wait()
        load_s.append(_timed(lambda: checkpoint.load(trainer, root)))
    ckpt = checkpoint.latest(root)
    return {"save_s": min(save_s), "async_s": min(async_s), "load_s": min(load_s),
            "bytes": sum(p.stat().st_size for p in ckpt.iterdir()),
            "param_bytes": sum(p.numel() * p.element_size() for p in spec.build("meta").parameters())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    rows = [
        ("gpt-small", "DDP", 2, gpt_plan("gpt-small", "replicate", 2, 1, 16)),
        ("gpt-small", "FSDP", 2, gpt_plan("gpt-small", "fsdp", 2, 1, 16)),
        ("gpt-small", "TP blocks", 2, gpt_plan("gpt-small", "tp", 1, 2, 16)),
        ("gpt-small", "FSDP", 4, gpt_plan("gpt-small", "fsdp", 4, 1, 16)),
        ("mlp", "DDP", 2, mlp_plan("replicate", 2, 64)),
        ("mlp", "FSDP", 2, mlp_plan("fsdp", 2, 64)),
        ("mlp", "FSDP", 4, mlp_plan("fsdp", 4, 64)),
    ]
    print(f"{'model':<10} {'plan':<10} {'ranks':>5} {'params MB':>9} {'ckpt MB':>8} "
          f"{'ckpt/params':>11} {'save s':>7} {'async blocks s':>14} {'load s':>7}")
    print("-" * 92)
    for model, label, nproc, plan in rows:
        root = Path(tempfile.mkdtemp(prefix="autopar-bench-ckpt-"))
        try:
            r = spawn(worker, nproc, model, plan.to_json(), str(root / "c"), args.repeat,
                      timeout_s=300)[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        mb = 1e6
        print(f"{model:<10} {label:<10} {nproc:>5} {r['param_bytes'] / mb:>9.1f} "
              f"{r['bytes'] / mb:>8.1f} {r['bytes'] / r['param_bytes']:>10.2f}x "
              f"{r['save_s']:>7.3f} {r['async_s']:>14.3f} {r['load_s']:>7.3f}", flush=True)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
