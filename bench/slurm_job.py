"""The exported ``job.slurm`` under a real SLURM: a one-machine cluster (slurmctld + slurmd
from Debian's ``slurm-wlm``, ``AuthType=auth/none``, everything in a temporary directory),
``sbatch`` of the script ``autopar export --format slurm`` wrote, unchanged; the job must
complete and its losses match one process's.

    apt-get install -y slurm-wlm        # as root; slurmd must run as root
    python bench/slurm_job.py [--ranks 2] [--steps 3] [--script] [--keep DIR]

The job trains gpt-tiny for ``--steps`` steps under a tensor-parallel plan, mesh
dp=ranks/2 × tp=2, on ``--ranks`` CPU ranks of this machine's one node (``--device cpu``:
no GPUs requested): ``autopar run`` on the built-in model, or with ``--script`` a user's
``train.py`` that calls ``autopar.compile``. Prints the job's state, its
losses against one process's, and the timings; exits 1 when they differ.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from autopar.zoo import get_model
from runtime.launch import free_port
from runtime.plan import LayerPlan, Mesh, Plan

REPO = Path(__file__).resolve().parent.parent
MODEL = "gpt-tiny"


def slurm_conf(tmp: Path, host: str, cpus: int) -> str:
    """A minimal one-node cluster: no munge, no cgroups, no accounting."""
    return "\n".join([
        "ClusterName=autopar-bench",
        f"SlurmctldHost={host}",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "AuthType=auth/none",
        "CredType=cred/none",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={tmp / 'state'}",
        f"SlurmdSpoolDir={tmp / 'spool'}",
        f"SlurmctldPidFile={tmp / 'slurmctld.pid'}",
        f"SlurmdPidFile={tmp / 'slurmd.pid'}",
        f"SlurmctldLogFile={tmp / 'slurmctld.log'}",
        f"SlurmdLogFile={tmp / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/linear",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        f"NodeName={host} CPUs={cpus} State=UNKNOWN",
        f"PartitionName=bench Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def start_cluster(tmp: Path, env: dict[str, str]) -> list[subprocess.Popen]:
    host = socket.gethostname()
    for sub in ("state", "spool"):
        (tmp / sub).mkdir()
    conf = tmp / "slurm.conf"
    conf.write_text(slurm_conf(tmp, host, os.cpu_count() or 1))
    env["SLURM_CONF"] = str(conf)
    daemons = [subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
               for daemon in ("slurmctld", "slurmd")]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = run(["sinfo", "--noheader", "-o", "%T"], env, check=False).strip()
        if state.startswith("idle"):
            return daemons
        time.sleep(1)
    stop(daemons)
    raise SystemExit(f"the SLURM node did not come up (sinfo: {state!r}); see {tmp}/*.log")


def stop(daemons: list[subprocess.Popen]) -> None:
    for daemon in daemons:
        daemon.terminate()
    for daemon in daemons:
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()


def run(argv: list[str], env: dict[str, str], *, check: bool = True) -> str:
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result.stdout


# Megatron-style tensor parallelism in every block, the embedding and the head, so the
# job really splits layers across the node's ranks (the planner keeps a model this small
# replicated).
BLOCK_TP = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
            "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}


def tp_plan(ranks: int) -> Plan:
    spec = get_model(MODEL)
    layers = [LayerPlan(module="wte", strategy="tp", tp_styles={"": "embedding_rowwise"}),
              LayerPlan(module="wpe", strategy="replicate"),
              *(LayerPlan(module=f"h.{i}", strategy="tp", tp_styles=BLOCK_TP)
                for i in range(spec.config.n_layer)),
              LayerPlan(module="ln_f", strategy="replicate"),
              LayerPlan(module="lm_head", strategy="tp", tp_styles={"": "colwise_gather"})]
    return Plan(global_batch=spec.default_batch, mesh=Mesh(dp=ranks // 2, tp=2),
                layers=tuple(layers), model=MODEL)


# --script: a user's own training script, which takes the plan from autopar.compile.
TRAIN = """
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
trainer = autopar.compile(spec.build(seed=0), "local",
                          spec.example_inputs(spec.default_batch, device="meta"),
                          loss_fn=spec.loss_fn)
for step in range(1, args.steps + 1):
    (x,), y = spec.make_batch(spec.default_batch, seed=step)
    loss = trainer.train_step(x, y)
    if dist.get_rank() == 0:
        print(f"step {step}  loss {loss!r}", flush=True)
"""


def export_job(tmp: Path, ranks: int, steps: int, user_script: bool) -> Path:
    """plan.json and the job script, as a user would make them."""
    from autopar.cli import main

    tp_plan(ranks).save(tmp / "plan.json")
    script = tmp / "job.slurm"
    what = ["--steps", str(steps)]
    if user_script:
        (tmp / "train.py").write_text(TRAIN)
        what = ["--script", str(tmp / "train.py"), "--", *what]  # the script's own --steps
    code = main(["export", str(tmp / "plan.json"), "--format", "slurm", "--nodes", "1",
                 "--nproc-per-node", str(ranks), "--device", "cpu", "--out", str(script),
                 *what])
    if code != 0:
        raise SystemExit(f"autopar export failed ({code})")
    return script


def wait_for(job: str, env: dict[str, str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = dict(word.split("=", 1) for word in
                      run(["scontrol", "show", "job", job], env).split() if "=" in word)
        if fields.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return f"{fields.get('JobState')} (exit code {fields.get('ExitCode')})"
        time.sleep(1)
    run(["scancel", job], env, check=False)
    return f"TIMEOUT after {timeout_s:.0f} s"


def one_process_losses(steps: int) -> list[float]:
    """What `autopar run --model gpt-tiny` trains, on one process (seed 0, AdamW 1e-3)."""
    spec = get_model(MODEL)
    model = spec.build(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        (x,), y = spec.make_batch(spec.default_batch, seed=1 + step)
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks on the node (even)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="seconds for the job")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (logs)")
    parser.add_argument("--script", action="store_true",
                        help="launch a user's train.py (export --script) instead of "
                             "`autopar run --model gpt-tiny`")
    args = parser.parse_args()
    missing = [tool for tool in ("slurmctld", "slurmd", "sbatch") if not shutil.which(tool)]
    if missing:
        print(f"{', '.join(missing)} not found: apt-get install -y slurm-wlm", file=sys.stderr)
        return 2
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="autopar-slurm-")).resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    script = export_job(tmp, args.ranks, args.steps, args.script)
    started = time.monotonic()
    daemons = start_cluster(tmp, env)
    try:
        up = time.monotonic() - started
        job = run(["sbatch", "--parsable", f"--chdir={tmp}", str(script)], env).strip()
        submitted = time.monotonic()
        state = wait_for(job, env, args.timeout)
        took = time.monotonic() - submitted
    finally:
        stop(daemons)
    out = (tmp / f"slurm-{job}.out").read_text() if (tmp / f"slurm-{job}.out").exists() else ""
    losses = {int(line.split()[1]): float(line.split()[-1]) for line in out.splitlines()
              if line.startswith("step ")}
    reference = one_process_losses(args.steps)
    print(f"slurm {run(['sinfo', '-V'], env).strip()}: cluster up in {up:.1f} s; job {job} "
          f"{state} in {took:.1f} s")
    print(next((line for line in out.splitlines() if "rank(s): mesh" in line or
                "runtime.apply: mesh" in line), "no header"))
    print(f"{'step':>4}  {'job.slurm':>14}  {'one process':>14}")
    for step, ref in enumerate(reference, 1):
        got = losses.get(step)
        print(f"{step:>4}  {got if got is not None else float('nan'):>14.8f}  {ref:>14.8f}")
    ok = (state.startswith("COMPLETED") and len(losses) == args.steps
          and all(abs(losses[s] - r) <= 1e-5 * abs(r) for s, r in enumerate(reference, 1)))
    print("losses match one process (rtol 1e-5)" if ok else
          f"FAILED: see {tmp}/slurm-{job}.out and {tmp}/*.log")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
