"""Exports parse and carry the plan's world size; plots are valid PNGs; the CLI wires both."""

from __future__ import annotations

import shlex

import pytest
from report_cases import BATCH, gpt2_small_plan

from autopar.cli import main
from autopar.errors import ConfigError
from autopar.export import (
    Launch,
    launch_for,
    slurm_script,
    torchrun_argv,
    torchrun_command,
)
from cost_models.schedule import Slot, Timeline
from runtime.plan import Plan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def torchrun_world(argv: list[str]) -> int:
    opts = dict(a.lstrip("-").split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    return int(opts["nnodes"]) * int(opts["nproc-per-node"])


def test_torchrun_command_parses_and_carries_the_world_size():
    plan = gpt2_small_plan(nodes=2)
    launch = launch_for(plan)
    assert launch == Launch(nodes=2, nproc_per_node=8)
    argv = shlex.split(torchrun_command(plan, "my plan.json", launch))
    assert argv[0] == "torchrun" and torchrun_world(argv) == plan.world_size == 16
    tail = argv[argv.index("-m"):]
    assert tail[:3] == ["-m", "autopar.cli", "run"]
    assert tail[tail.index("--plan") + 1] == "my plan.json"
    assert tail[tail.index("--batch") + 1] == str(BATCH)
    assert argv == torchrun_argv(plan, "my plan.json", launch)


def test_slurm_script_requests_the_nodes_and_launches_the_world():
    plan = gpt2_small_plan(nodes=2)
    script = slurm_script(plan, "plan.json", launch_for(plan))
    sbatch = dict(line[len("#SBATCH --"):].split("=", 1) for line in script.splitlines()
                  if line.startswith("#SBATCH"))
    assert int(sbatch["nodes"]) * int(sbatch["gpus-per-node"]) == plan.world_size
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    argv = shlex.split(srun)[1:]
    assert torchrun_world(argv) == plan.world_size
    assert script.startswith("#!/bin/bash\n")


def test_launch_shape_must_match_the_plan():
    plan = gpt2_small_plan()
    with pytest.raises(ConfigError, match="plan is for 8"):
        launch_for(plan, nodes=2, nproc_per_node=8)
    assert launch_for(plan, nodes=2, nproc_per_node=4).world_size == 8


def test_torchtitan_export_of_a_planned_two_node_job_parses_with_its_mesh():
    from test_export_torchtitan import parsed  # torchtitan's own ConfigManager

    plan = gpt2_small_plan(nodes=2)
    c = parsed(plan)  # torchtitan's ParallelDims checks the degrees against the world size
    assert c.parallelism.tensor_parallel_degree == plan.mesh.tp
    assert c.parallelism.pipeline_parallel_degree == plan.mesh.pp
    assert c.training.global_batch_size == plan.global_batch


def test_plots_are_png_files(tmp_path):
    from autopar.plots import plot_memory, plot_scaling, plot_step_time
    from autopar.whatif import ScalingPoint

    plan = gpt2_small_plan(memory_gib=4)
    paths = [plot_memory(plan, tmp_path / "m.png"), plot_step_time(plan, tmp_path / "s.png"),
             plot_scaling([ScalingPoint(gpus=8, samples_per_s=100.0, shape="dp=8"),
                           ScalingPoint(gpus=16, samples_per_s=180.0, shape="dp=16"),
                           ScalingPoint(gpus=4, samples_per_s=None)], tmp_path / "c.png")]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, path


def test_schedule_gantt_from_a_hand_made_timeline(tmp_path):
    from autopar.plots import plot_schedule

    # GPipe on 2 ranks, 2 micro-batches, forward 1 ms and backward 2 ms per stage.
    slots = (Slot(rank=0, stage=0, action="F", microbatch=0, start_s=0.000, end_s=0.001),
             Slot(rank=0, stage=0, action="F", microbatch=1, start_s=0.001, end_s=0.002),
             Slot(rank=1, stage=1, action="F", microbatch=0, start_s=0.001, end_s=0.002),
             Slot(rank=1, stage=1, action="F", microbatch=1, start_s=0.002, end_s=0.003),
             Slot(rank=1, stage=1, action="B", microbatch=0, start_s=0.003, end_s=0.005),
             Slot(rank=1, stage=1, action="B", microbatch=1, start_s=0.005, end_s=0.007),
             Slot(rank=0, stage=0, action="B", microbatch=0, start_s=0.005, end_s=0.007),
             Slot(rank=0, stage=0, action="B", microbatch=1, start_s=0.007, end_s=0.009))
    timeline = Timeline(schedule="GPipe", num_ranks=2, num_microbatches=2, slots=slots,
                        step_time_s=0.009, bubble_fraction=1 - 12 / 18, peak_inflight=(2, 2))
    path = plot_schedule(timeline, tmp_path / "gantt.png")
    assert path.read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(ConfigError):
        plot_schedule(Timeline(schedule="GPipe", num_ranks=1, num_microbatches=1, slots=(),
                               step_time_s=0, bubble_fraction=0, peak_inflight=(0,)),
                      tmp_path / "empty.png")


def test_cli_plan_writes_plots_and_exports_then_explains_and_diffs(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", "--model", "gpt-tiny", "--batch", "16", "--json", str(a),
                 "--plot", str(tmp_path / "png"), "--export", str(tmp_path / "exp")]) == 0
    out = capsys.readouterr().out
    assert "Totals" in out and "Alternatives considered" in out
    for name in ("memory.png", "step_time.png", "scaling.png"):
        assert (tmp_path / "png" / name).read_bytes().startswith(PNG_MAGIC)
    plan = Plan.load(a)
    titan = (tmp_path / "exp" / "torchtitan.sh")
    assert titan.stat().st_mode & 0o100
    assert f"--parallelism.tensor-parallel-degree {plan.mesh.tp}\n" in titan.read_text()
    argv = shlex.split((tmp_path / "exp" / "torchrun.sh").read_text().splitlines()[-1])
    assert argv[0] == "exec" and torchrun_world(argv) == plan.world_size
    assert "#SBATCH --nodes=1" in (tmp_path / "exp" / "job.slurm").read_text()

    assert main(["explain", str(a), plan.layers[0].module]) == 0
    assert f"{plan.layers[0].module}: {plan.layers[0].strategy}" in capsys.readouterr().out
    assert main(["explain", str(a), "nope"]) == 2
    assert "no layer 'nope'" in capsys.readouterr().err
    assert main(["diff", str(a), str(a)]) == 0
    assert "the plans are the same" in capsys.readouterr().out
    assert main(["plan", "--model", "gpt-tiny", "--batch", "16", "--nodes", "2",
                 "--json", str(b)]) == 0
    capsys.readouterr()
    assert main(["diff", str(a), str(b)]) == 1
    assert "mesh" in capsys.readouterr().out or Plan.load(b).mesh == plan.mesh
    assert main(["export", str(b), "--format", "torchrun"]) == 0
    assert torchrun_world(shlex.split(capsys.readouterr().out.splitlines()[-1])) == 16
