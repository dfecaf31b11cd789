"""The autopar command: plan output, JSON, run, and exit status 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dist_pool import RANKS
from reference import single_process_losses

from autopar.cli import main
from runtime.plan import PLAN_VERSION, Plan


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autopar.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_plan_prints_layers_step_time_and_memory_and_writes_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt2-small", "--cluster", "dgx-a100-80g",
                 "--batch", "16", "--seq", "512", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(path)
    assert "h.0 … h.11" in out and "Block" in out
    assert "predicted step time" in out and "peak memory per rank" in out
    assert f"{plan.prediction.step_time_s * 1e3:.3f} ms" in out
    assert plan.global_batch == 16 and plan.seq_len == 512
    assert json.loads(path.read_text())["version"] == PLAN_VERSION


def test_plan_output_is_the_plan_alone():
    """A fresh process (the solver prints its banner once per process, to the C stdout):
    nothing of HiGHS's on stdout or stderr before or around the plan."""
    result = run_cli("plan", "--model", "gpt-tiny", "--cluster", "local")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("model gpt-tiny on local")
    assert "HiGHS 1" not in result.stdout + result.stderr  # "solver HiGHS optimal" is ours


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--model", "gpt5"], "unknown model 'gpt5'"),
        (["plan", "--cluster", "dgx-z"], "unknown cluster preset 'dgx-z'"),
        # 64 GPUs, 6 layers: every layout (tp ≤ 8, pp ≤ 6) leaves dp ∈ {2, 4, 8, ...}; an odd
        # sequence leaves no context-parallel split either.
        (["plan", "--model", "gpt-tiny", "--nodes", "8", "--batch", "3", "--seq", "7"],
         "not divisible by any data-parallel degree"),
        (["plan", "--model", "gpt3-175b", "--nodes", "1", "--batch", "8", "--seq", "2048"],
         "smallest per-rank memory any plan needs is"),
        (["plan", "--model", "gpt2-small", "--seq", "4096"], "exceeds gpt2-small's block_size"),
        (["run", "--plan", "/nonexistent/plan.json"], "cannot read plan file"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_malformed_cluster_file_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "cluster.toml"
    bad.write_text('name = "x"\n[device]\nname = "g"\n')
    result = run_cli("plan", "--model", "gpt-tiny", "--cluster", str(bad))
    assert result.returncode == 2
    assert f"{bad}: missing field 'intra_node'" in result.stderr
    assert "Traceback" not in result.stderr


@RANKS  # spawns its own ranks (tests/dist_pool.py)
def test_run_trains_like_one_process_and_rejects_a_plan_for_another_world(tmp_path, capsys):
    assert main(["run", "--model", "gpt-tiny", "--nproc", "2", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert losses == pytest.approx(single_process_losses("gpt-tiny", steps=3), rel=1e-5)

    plan_path = tmp_path / "plan4.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local", "--batch", "8",
                 "--json", str(plan_path)]) == 0
    plan = Plan.load(plan_path)
    if plan.world_size != 2:
        assert main(["run", "--model", "gpt-tiny", "--nproc", "2", "--plan", str(plan_path)]) == 2
        assert "pass --nproc" in capsys.readouterr().err


def test_precision_the_device_lacks_exits_2_naming_it(tmp_path, capsys):
    cluster = tmp_path / "no-bf16.toml"
    cluster.write_text(
        'name = "fp32-only"\nnodes = 1\ndevices_per_node = 2\n'
        '[device]\nname = "old-gpu"\nmemory_gib = 16\nmemory_bandwidth_GBps = 900\n'
        '[device.peak_tflops]\nfloat32 = 15\n'
        '[intra_node]\nkind = "pcie"\nbandwidth_GBps = 16\nlatency_us = 10\n'
        '[inter_node]\nkind = "network"\nbandwidth_GBps = 5\nlatency_us = 20\n')
    args = ["plan", "--model", "gpt-tiny", "--cluster", str(cluster), "--dtype", "bfloat16"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "device 'old-gpu' has no peak FLOP/s for dtype 'bfloat16'" in err
    assert "Traceback" not in err


def test_context_parallel_plan_whose_sequence_does_not_split_exits_2(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--cluster", "local", "--batch", "8",
                 "--seq", "12", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    # cp on one stage (cp does not combine with pp, which the mesh itself refuses)
    data["mesh"] |= {"pp": 1, "dp": data["mesh"]["dp"] // 2 or 1, "cp": 4}
    data["pipeline"] = None
    data["layers"] = [{**layer, "stage": 0} for layer in data["layers"]]
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["run", "--plan", str(path), "--model", "gpt-tiny", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "seq_len 12 is not divisible by 2 × mesh.cp = 8" in err
    assert "Traceback" not in err


def _write_plan(tmp_path, model: str, change) -> str:
    """A plan the planner made for ``model`` on 2 local ranks, edited by ``change``."""
    path = tmp_path / f"{model}.json"
    assert main(["plan", "--model", model, "--cluster", "local", "--batch", "8",
                 "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return str(path)


def test_run_of_a_plan_splitting_a_tie_exits_2_naming_the_modules_before_any_rank(tmp_path):
    def split_tie(data):
        for layer in data["layers"]:
            layer["strategy"] = "fsdp" if layer["module"] == "wte" else "replicate"

    path = _write_plan(tmp_path, "gpt-tiny-tied", split_tie)
    result = run_cli("run", "--model", "gpt-tiny-tied", "--nproc", "2", "--plan", path)
    assert result.returncode == 2, result.stderr
    assert "'wte', 'lm_head' share parameter 'wte.weight' = 'lm_head.weight'" in result.stderr
    assert "Traceback" not in result.stderr


def test_plan_prices_for_a_chosen_software_generation(tmp_path, capsys):
    """--software: the same preset priced as another stack ran it (DeepSpeed's 2021 ZeRO-3
    keeps less of the GEMM rate than autopar's own runtime: a slower step), and said so."""
    args = ["plan", "--model", "gpt2-small", "--cluster", "dgx-a100-80g", "--batch", "16",
            "--seq", "512"]
    steps = {}
    for software in ("torch-eager", "deepspeed-zero3-2021"):
        path = tmp_path / f"{software}.json"
        assert main([*args, "--software", software, "--json", str(path)]) == 0
        assert f"software: {software}" in capsys.readouterr().out
        steps[software] = Plan.load(path).prediction.step_time_s
    assert steps["deepspeed-zero3-2021"] > steps["torch-eager"]


def test_plan_refuses_a_software_generation_over_a_calibrated_cluster(tmp_path):
    from importlib import resources

    preset = (resources.files("cost_models") / "presets" / "dgx-a100-80g.toml").read_text()
    path = tmp_path / "measured.toml"
    path.write_text('provenance = "calibrated"\n' + preset)
    result = run_cli("plan", "--model", "gpt-tiny", "--cluster", str(path),
                     "--software", "torchtitan-2024")
    assert result.returncode == 2
    assert "is calibrated" in result.stderr and "--software torchtitan-2024" in result.stderr
    unknown = run_cli("plan", "--model", "gpt-tiny", "--software", "titan")
    assert unknown.returncode == 2 and "deepspeed-zero3-2021" in unknown.stderr
