"""Surviving a lost rank under torchrun, and resuming on a different world size.

torchrun (``python -m torch.distributed.run``, elastic, ``--max-restarts 1``) runs
``autopar run --ckpt-dir … --resume`` on 2 CPU ranks of gpt-tiny through
tests/elastic_train.py, which kills rank 1 with ``os._exit`` right after step 4 on the
first attempt. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: see autopar/resumable.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_pool import RANKS
from reference import single_process_losses
from test_runtime_numerics import gpt_all

pytestmark = RANKS  # spawns its own ranks (tests/dist_pool.py)

TESTS = Path(__file__).resolve().parents[1]


def torchrun(tmp: Path, *, fail_step: int, steps: int = 6) -> tuple[dict[int, str], str]:
    plan = tmp / "plan.json"
    plan.write_text(gpt_all("fsdp", 2))
    # The script's own folder (tests/) comes first on its sys.path; the checkout's root
    # after it keeps tests/runtime from standing in for the runtime package.
    root = str(TESTS.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "AUTOPAR_TEST_FAIL_STEP": str(fail_step), "AUTOPAR_TEST_FAIL_RANK": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", str(TESTS / "elastic_train.py"),
           "run", "--model", "gpt-tiny", "--steps", str(steps), "--plan", str(plan),
           "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", "3", "--resume", "--timeout", "30"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return losses_by_step(result.stdout), result.stdout


def losses_by_step(out: str) -> dict[int, str]:
    """The last printed loss of each step (a restarted run prints some steps twice)."""
    return {int(line.split()[1]): line.split()[-1] for line in out.splitlines()
            if line.startswith("step ")}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Path, dict[int, str], str]:
    tmp = tmp_path_factory.mktemp("interrupted")
    losses, out = torchrun(tmp, fail_step=4)
    return tmp / "ckpt", losses, out


def test_killed_rank_restarts_and_resumes_with_the_same_losses(interrupted):
    """Rank 1 dies after step 4; torchrun restarts both ranks, which resume from the
    checkpoint of step 3 and redo step 4 to the printed digit the run before the failure
    made (the steps after it are held to one process in the next test)."""
    _, _, out = interrupted
    assert "restart 1, resumed from step 3" in out
    steps = [line.split() for line in out.splitlines() if line.startswith("step ")]
    assert [s[1] for s in steps] == ["1", "2", "3", "4", "4", "5", "6"]
    before_failure, redone = (s[-1] for s in steps if s[1] == "4")
    assert redone == before_failure


def test_resume_on_fewer_ranks_replans_and_reshards(interrupted, capsys):
    from autopar.cli import main

    root, two_ranks, _ = interrupted
    assert main(["run", "--model", "gpt-tiny", "--nproc", "1", "--steps", "8",
                 "--ckpt-dir", str(root), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "on 1 rank(s): mesh pp=1 × dp=1 × tp=1" in out and "resumed from step 6" in out
    one_rank = losses_by_step(out)
    assert sorted(one_rank) == [7, 8]
    reference = single_process_losses("gpt-tiny", steps=8)
    got = [float(two_ranks[s]) for s in range(1, 7)] + [float(one_rank[s]) for s in (7, 8)]
    assert got == pytest.approx(reference, rel=1e-5)
