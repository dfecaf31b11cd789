"""Every bad input ``autopar`` refuses, with the message it gives: the table of
docs/bad-input.md (tests/autopar/test_bad_input_cli.py checks both).

A case is (label, setup, argv, message): ``setup(dir)`` writes the files the case needs
into an empty directory and returns a dict of names for ``argv`` (a format string), and
``message`` is a phrase the one-line error must hold.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from runtime.plan import Mesh, Plan

PRESET = Path(__file__).resolve().parents[2] / "cost_models" / "presets" / "dgx-a100-80g.toml"


def cluster(replace: str, by: str, raw: bytes | None = None):
    """A setup writing the DGX A100 preset with ``replace`` swapped for ``by``."""
    def setup(d: Path) -> dict:
        text = PRESET.read_text()
        assert replace in text, replace
        (d / "c.toml").write_bytes(raw if raw is not None else text.replace(replace, by, 1).encode())
        return {}
    return setup


def plan_file(plan: Plan | None = None, raw: bytes | None = None):
    def setup(d: Path) -> dict:
        (d / "p.json").write_bytes(raw if raw is not None else (plan or tiny_plan()).to_json().encode())
        return {}
    return setup


def tiny_plan(**kw) -> Plan:
    return Plan(**{"global_batch": 8, "mesh": Mesh(dp=2), "model": "gpt-tiny", **kw})


def files(**contents: str):
    def setup(d: Path) -> dict:
        for name, text in contents.items():
            path = d / name.replace("__", "/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (d / "p.json").write_text(tiny_plan().to_json())
        (d / "tp.json").write_text(_TP_PLAN.to_json())
        return {}
    return setup


def nothing(d: Path) -> dict:
    return {}


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def crafted_checkpoint(d: Path) -> dict:
    """A committed checkpoint whose .metadata is a pickle that would create ``pwned``."""
    from runtime.checkpoint_format import Manifest, commit

    tmp = d / "ck" / ".tmp-step_00000001"
    tmp.mkdir(parents=True)
    evil = pickle.dumps(_Payload(str(d / "pwned")), protocol=4)
    (tmp / ".metadata").write_bytes(evil)
    commit(tmp, d / "ck" / "step_00000001", Manifest(step=1, world_size=2, model="gpt-tiny",
                                                      plan=tiny_plan().to_dict()))
    (d / "p.json").write_text(tiny_plan().to_json())
    return {}


def outside_pointer(d: Path) -> dict:
    crafted_checkpoint(d)
    (d / "ck" / "latest").write_text(f"{os.pardir}/elsewhere\n")
    return {}


_C = ["plan", "--model", "mlp", "--cluster", "{d}/c.toml", "--time-limit", "1"]
_TP_PLAN = Plan(global_batch=8, mesh=Mesh(dp=4, tp=2), model="gpt-tiny")

CASES: list[tuple[str, object, list[str], str]] = [
    # -- cluster files
    ("cluster: bandwidth NaN", cluster("bandwidth_GBps = 300", "bandwidth_GBps = nan"), _C,
     "[intra_node]: bandwidth_GBps must be a positive number, from 1e-06 to 1e+09, got nan"),
    ("cluster: bandwidth inf", cluster("bandwidth_GBps = 25", "bandwidth_GBps = inf"), _C,
     "[inter_node]: bandwidth_GBps must be a positive number, from 1e-06 to 1e+09, got inf"),
    ("cluster: bandwidth 1e-300", cluster("bandwidth_GBps = 300", "bandwidth_GBps = 1e-300"), _C,
     "bandwidth_GBps must be a positive number, from 1e-06 to 1e+09, got 1e-300"),
    ("cluster: peak 1e300", cluster("float32 = 19.5", "float32 = 1e300"), _C,
     "[device]: peak_tflops.float32 must be a positive number, from 1e-09 to 1e+09, got 1e+300"),
    ("cluster: memory 1e300 GiB", cluster("memory_gib = 80", "memory_gib = 1e300"), _C,
     "[device]: memory_gib must be a finite non-negative number, got 1e+300"),
    ("cluster: memory 0", cluster("memory_gib = 80", "memory_gib = 0"), _C,
     "[device]: memory_bytes must be a positive number, from 1.04858e+06"),
    ("cluster: latency negative", cluster("latency_us = 5", "latency_us = -5"), _C,
     "[intra_node]: latency_us must be a finite non-negative number, got -5"),
    ("cluster: latency inf", cluster("latency_us = 5", "latency_us = inf"), _C,
     "latency_us must be a finite non-negative number, got inf"),
    ("cluster: overlap slowdown NaN", cluster("dp_slowdown = 1.1", "dp_slowdown = nan"), _C,
     "[overlap]: dp_slowdown must be a number in [1, 10)"),
    ("cluster: nodes = 1e12", cluster("nodes = 1\n", "nodes = 1e12\n"), _C,
     "c.toml: nodes must be a positive integer, got 1000000000000.0"),
    ("cluster: nodes = 10^12", cluster("nodes = 1\n", "nodes = 1000000000000\n"), _C,
     "c.toml: nodes = 1000000000000 is beyond the limit of 100000"),
    ("cluster: name not a string", cluster('name = "dgx-a100-80g"', "name = 5"), _C,
     "c.toml: name must be a string, got 5"),
    ("cluster: not UTF-8", cluster("", "", raw=b'name = "caf\xe9"\n'), _C,
     "c.toml is not UTF-8 text (byte 11)"),
    # -- flags
    ("plan --nodes 1000000000", nothing, ["plan", "--model", "mlp", "--nodes", "1000000000"],
     "argument --nodes: expected a positive node count of at most 100000, got 1000000000"),
    ("plan --time-limit nan", nothing, ["plan", "--time-limit", "nan"],
     "argument --time-limit: expected a number of seconds above 0 and at most 1e7, got 'nan'"),
    ("plan --time-limit -1", nothing, ["plan", "--time-limit", "-1"],
     "argument --time-limit: expected a number of seconds above 0 and at most 1e7, got '-1'"),
    ("explain --top -2", plan_file(), ["explain", "{d}/p.json", "--top", "-2"],
     "argument --top: expected a positive integer, got -2"),
    ("run --keep 0", nothing, ["run", "--keep", "0"],
     "argument --keep: expected a positive integer, got 0"),
    ("run --ckpt-every -1", nothing, ["run", "--ckpt-every", "-1"],
     "argument --ckpt-every: expected an integer >= 0, got -1"),
    ("run --timeout -5", nothing, ["run", "--timeout", "-5"],
     "argument --timeout: expected a number of seconds above 0 and at most 1e7, got '-5'"),
    ("export --nodes -1", plan_file(), ["export", "{d}/p.json", "--nodes", "-1"],
     "argument --nodes: expected a positive node count, got -1"),
    ("export --nproc-per-node -2", plan_file(), ["export", "{d}/p.json", "--nproc-per-node", "-2"],
     "argument --nproc-per-node: expected a positive rank count per node, got -2"),
    ("export --nodes 8 --nproc-per-node 1, tp 2", plan_file(_TP_PLAN),
     ["export", "{d}/p.json", "--nodes", "8", "--nproc-per-node", "1"],
     "a TP group must stay inside a node"),
    ("run train.py --nodes 8 --nproc 1, tp 2", files(**{"train.py": "import autopar\n"}),
     ["run", "--plan", "{d}/tp.json", "--nodes", "8", "--nproc", "1", "--rdzv-endpoint",
      "node0:29500", "{d}/train.py"],
     "a TP group must stay inside a node"),
    # -- outputs, refused before any work
    ("plan --json in a missing directory", nothing,
     ["plan", "--model", "mlp", "--json", "{d}/missing/p.json"],
     "output directory {d}/missing does not exist; create it first"),
    ("plan --json a directory", nothing, ["plan", "--model", "mlp", "--json", "{d}"],
     "--json {d} is a directory; give a file name"),
    ("plan --json over a file", files(**{"p.json": "mine"}),
     ["plan", "--model", "mlp", "--json", "{d}/p.json"],
     "--json {d}/p.json exists; pass --force to overwrite it"),
    ("plan --export a file", files(x="mine"), ["plan", "--model", "mlp", "--export", "{d}/x"],
     "--export directory {d}/x is a file, not a directory"),
    ("plan --export over a hand-edited job.slurm", files(**{"e__job.slurm": "#SBATCH mine"}),
     ["plan", "--model", "mlp", "--export", "{d}/e"],
     "--export directory {d}/e already holds job.slurm; pass --force"),
    ("plan --plot a file", files(x="mine"), ["plan", "--model", "mlp", "--plot", "{d}/x"],
     "--plot directory {d}/x is a file, not a directory"),
    ("calibrate --out a directory", nothing, ["calibrate", "--out", "{d}"],
     "--out {d} is a directory; give a file name"),
    ("calibrate --out in a missing directory", nothing, ["calibrate", "--out", "{d}/no/p.toml"],
     "output directory {d}/no does not exist"),
    ("export --out over a file", files(**{"run.sh": "mine"}),
     ["export", "{d}/p.json", "--out", "{d}/run.sh"],
     "--out {d}/run.sh exists; pass --force to overwrite it"),
    # -- plans
    ("plan file not UTF-8", plan_file(raw=b'{"model": "caf\xe9"}'), ["explain", "{d}/p.json"],
     "{d}/p.json: not a UTF-8 text file (byte 14 is b'\\xe9'); a plan is JSON in UTF-8"),
    ("run --batch 6 with a plan for 8", plan_file(),
     ["run", "--model", "gpt-tiny", "--plan", "{d}/p.json", "--batch", "6"],
     "--batch 6, but the plan was made for a global batch of 8; pass --batch 8 or re-plan"),
    ("run --seq beyond the model's block size", nothing,
     ["run", "--model", "gpt-tiny", "--seq", "1000"],
     "--seq 1000 exceeds gpt-tiny's block_size 64"),
    ("run --plan for another world size", plan_file(),
     ["run", "--model", "gpt-tiny", "--plan", "{d}/p.json", "--nproc", "4"],
     "the plan is for 2 ranks (mesh pp=1 × dp=2 × tp=1) but --nproc is 4; pass --nproc 2"),
    # -- checkpoints
    ("reshard: crafted .metadata", crafted_checkpoint,
     ["reshard", "{d}/ck", "--plan", "{d}/p.json", "--out", "{d}/out"],
     "is not one of DCP's metadata types; the file may be crafted to run code (nothing in it "
     "was executed)"),
    ("run --resume: crafted .metadata", crafted_checkpoint,
     ["run", "--model", "gpt-tiny", "--ckpt-dir", "{d}/ck", "--resume"],
     "the file may be crafted to run code (nothing in it was executed)"),
    ("run --resume: latest points outside", outside_pointer,
     ["run", "--model", "gpt-tiny", "--ckpt-dir", "{d}/ck", "--resume"],
     f"names '{os.pardir}/elsewhere', which is not a step_N directory inside "
     "{d}/ck; refusing to look outside the checkpoint root"),
    ("reshard --out exists", files(**{"o__keep.txt": "mine"}),
     ["reshard", "{d}/ck", "--plan", "{d}/p.json", "--out", "{d}/o"],
     "{d}/o exists; choose a new --out directory"),
]
