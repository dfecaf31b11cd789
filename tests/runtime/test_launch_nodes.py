"""Two nodes for real: the exported ``torchrun.sh``, run as written by two torchrun agents on
this machine (2 nodes × 2 CPU ranks, c10d rendezvous on 127.0.0.1), trains gpt-tiny under
a plan with data parallelism across the nodes and tensor parallelism (tp=2) inside each,
and its losses match one process's."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
from dist_pool import RANKS
from reference import single_process_losses
from test_runtime_numerics import gpt_tp

from autopar.cli import main
from runtime.launch import free_port
from runtime.plan import Plan

pytestmark = RANKS  # spawns its own ranks (tests/dist_pool.py)

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def two_node_script(tmp: Path) -> Path:
    plan = dataclasses.replace(Plan.from_json(gpt_tp(dp=2, tp=2)), model="gpt-tiny")
    plan.save(tmp / "plan.json")
    script = tmp / "torchrun.sh"
    assert main(["export", str(tmp / "plan.json"), "--format", "torchrun", "--nodes", "2",
                 "--nproc-per-node", "2", "--device", "cpu", "--out", str(script)]) == 0
    return script


def test_exported_torchrun_script_trains_on_two_nodes_like_one_process(tmp_path):
    script = two_node_script(tmp_path)
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert "--nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d" in text
    assert "--model gpt-tiny" in text and "--device cpu" in text
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "AUTOPAR_LOG_LEVEL": "WARNING"}
    nodes = [subprocess.Popen([str(script)], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=150) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, out[-2000:] + err[-4000:]
    lines = [line.split() for out, _ in outputs for line in out.splitlines()
             if line.startswith("step ")]
    losses = [float(words[-1]) for words in lines]
    assert [int(words[1]) for words in lines] == list(range(1, STEPS + 1))  # rank 0 only
    assert "mesh pp=1 × dp=2 × tp=2" in "".join(out for out, _ in outputs)
    assert losses == pytest.approx(single_process_losses("gpt-tiny", steps=STEPS), rel=1e-5)


def test_two_node_script_without_the_head_node_address_says_so(tmp_path):
    script = two_node_script(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "MASTER_ADDR"}
    result = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "set MASTER_ADDR to the address of the first node" in result.stderr
