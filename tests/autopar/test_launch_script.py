"""``autopar run train.py [ARGS]``: the user's script on local ranks under torchrun, the plan
passed by path; and every request it cannot serve refused with exit 2 before a rank starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_pool import RANKS
from reference import single_process_losses
from test_runtime_numerics import gpt_tp

from autopar.cli import main

pytestmark = RANKS  # spawns its own ranks (tests/dist_pool.py)

REPO = Path(__file__).resolve().parents[2]
STEPS = 3

TRAIN = '''
import argparse

import torch.distributed as dist

import autopar
from autopar.zoo import get_model
from runtime.launch import init_from_env

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
args = parser.parse_args()
init_from_env()
spec = get_model("gpt-tiny")
model = spec.build(seed=0)
example = spec.example_inputs(spec.default_batch, device="meta")
trainer = autopar.compile(model, "local", example, loss_fn=spec.loss_fn)
for step in range(args.steps):
    (x,), y = spec.make_batch(spec.default_batch, seed=1 + step)
    loss = trainer.train_step(x, y)
    if dist.get_rank() == 0:
        print(f"mesh {trainer.plan.mesh.describe()} step {step + 1} loss {loss!r}", flush=True)
'''

NO_COMPILE = '''
import sys
print("training without autopar", sys.argv[1:])
'''


def autopar(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "autopar.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def job(tmp_path) -> Path:
    """A tensor-parallel plan on 2 ranks (the planner would pick data parallelism for
    gpt-tiny, so the mesh shows whose plan ran) and the scripts, in ``tmp_path``."""
    (tmp_path / "plan.json").write_text(gpt_tp(dp=1, tp=2))
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "plain.py").write_text(NO_COMPILE)
    return tmp_path


def test_script_trains_the_plan_passed_by_path_like_one_process(job):
    result = autopar("run", "--log-level", "info", "--nproc", "2", "--plan", "plan.json",
                     "train.py", "--steps", str(STEPS), cwd=job)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = [line.split() for line in result.stdout.splitlines() if " step " in line]
    assert {" ".join(words[:6]) for words in lines} == {"mesh pp=1 × dp=1 × tp=2"}
    assert [int(words[7]) for words in lines] == list(range(1, STEPS + 1))
    losses = [float(words[-1]) for words in lines]
    assert losses == pytest.approx(single_process_losses("gpt-tiny", steps=STEPS), rel=1e-5)
    # --log-level reaches the ranks: one line per record, naming the rank.
    assert f"INFO rank 0 runtime.launch: executing the plan {job / 'plan.json'}" in result.stderr
    assert "\r" not in result.stderr


def test_script_that_never_calls_compile_exits_2_naming_the_plan(job):
    result = autopar("run", "--nproc", "2", "--plan", "plan.json", "plain.py", "--lr", "3e-4",
                     cwd=job)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "training without autopar ['--lr', '3e-4']" in result.stdout
    assert "plain.py ended without calling autopar.compile" in result.stderr
    assert str(job / "plan.json") in result.stderr


@pytest.fixture
def no_launcher(monkeypatch):
    """Any start of torchrun's launcher fails the test: bad input is refused before it."""
    import torch.distributed.run

    def launched(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(torch.distributed.run, "run", launched)


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--plan", "plan.json", "missing.py"], "script missing.py does not exist"),
    (["run", "--nproc", "4", "--plan", "plan.json", "train.py"],
     "1 node(s) × 4 process(es) = 4 ranks, but the plan is for 2"),
    (["run", "--nodes", "2", "--nproc", "1", "--plan", "plan.json", "train.py"],
     "a TP group must stay inside a node"),
    (["run", "--nodes", "2", "--nproc", "2", "train.py"], "needs --rdzv-endpoint"),
    (["run", "--plan", "nowhere.json", "train.py"], "cannot read plan file nowhere.json"),
    (["run", "--model", "gpt-tiny", "train.py"], "--model apply to a built-in model"),
    (["export", "plan.json", "--format", "slurm", "--nodes", "2", "--nproc-per-node", "1"],
     "a TP group must stay inside a node"),
    (["export", "plan.json", "--format", "torchrun", "--nodes", "3", "--nproc-per-node", "2"],
     "3 node(s) × 2 process(es) = 6 ranks, but the plan is for 2"),
    (["export", "plan.json", "--script", "missing.py"], "script missing.py does not exist"),
    (["export", "plan.json", "--script", "train.py", "--steps", "3"],
     "--steps is for the built-in model"),
    (["export", "plan.json", "--nodes", "1", "--nproc-per-node", "2"],
     "the plan names no built-in model to run; pass --script train.py"),
])
def test_bad_requests_exit_2_before_any_rank_starts(job, no_launcher, monkeypatch, capsys,
                                                    args, message):
    monkeypatch.chdir(job)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_missing_script_exits_2_as_a_process(job):
    result = autopar("run", "--nproc", "2", "--plan", "plan.json", "missing.py", cwd=job,
                     timeout=90)
    assert result.returncode == 2
    assert result.stderr.startswith("autopar run: error: script missing.py does not exist")


def test_export_writes_an_executable_slurm_script_for_the_users_script(job, monkeypatch,
                                                                       capsys):
    monkeypatch.chdir(job)
    assert main(["export", "plan.json", "--format", "slurm", "--nodes", "1",
                 "--nproc-per-node", "2", "--script", "train.py", "--out", "job.slurm",
                 "--", "--steps", "3", "--name", "two words"]) == 0
    script = job / "job.slurm"
    text = script.read_text()
    assert os.access(script, os.X_OK)
    assert "--rdzv-id=$SLURM_JOB_ID" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
    assert f"export AUTOPAR_PLAN={job / 'plan.json'}" in text
    assert text.splitlines()[-1].endswith(
        f"-m autopar.launch_script {job / 'train.py'} --steps 3 --name 'two words'")
    assert "#SBATCH --gpus-per-node=2" in text
    assert not list(job.glob(".job.slurm.*"))  # the temporary file was renamed, not left
