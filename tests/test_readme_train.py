"""README's "Train your own model" script, exactly as written there, on 2 ranks (torchrun),
against one process training the same model on the same global batches in the same order.

The script logs the loss every 2 steps (``autopar.StepLog``); the reference reads the
same permutation of the dataset (``DistributedSampler`` with one replica and the script's
seed) in global batches, with the script's optimizer, scheduler and clipping. Whatever
plan autopar picks for 2 CPU ranks (data, tensor or pipeline parallel), the losses match
to float32 rounding.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from dist_pool import RANKS
from torch.utils.data import DataLoader, DistributedSampler

pytestmark = RANKS  # spawns its own ranks (tests/dist_pool.py)

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^step (\d+) \| loss ([0-9.]+) \| .* \| peak memory [0-9.]+ GiB \(\w[\w ]*\)$",
                  re.M)


def readme_script() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Train your own model"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def reference(script: str) -> dict[int, float]:
    """One process: the script's model, data, optimizer, scheduler and clipping."""
    names: dict = {"__name__": "readme_script"}
    exec(compile(script, "README.md", "exec"), names)  # noqa: S102 - the README's own code
    torch.manual_seed(0)
    net, data = names["Net"](), names["Points"]()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 16)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    losses, step = {}, 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=32, sampler=sampler, drop_last=True):
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            losses[step] = loss.item()
    return losses


def test_the_readme_training_script_runs_on_two_ranks_like_one_process(tmp_path):
    script = readme_script()
    path = tmp_path / "train.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    logged = {int(s): float(v) for s, v in LINE.findall(run.stdout + run.stderr)}
    want = reference(script)
    assert sorted(logged) == list(range(2, 17, 2)), run.stderr[-4000:]  # rank 0 only, every 2
    torch.testing.assert_close([logged[s] for s in sorted(logged)],
                               [want[s] for s in sorted(logged)], rtol=1e-5, atol=1e-6)
