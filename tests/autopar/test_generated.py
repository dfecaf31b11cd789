"""Generated files take hostile names as data: no module, model, cluster or script name
can inject a TOML table or a shell command (tomli-w, shlex.quote, escaped comments)."""

from __future__ import annotations

import dataclasses
import subprocess
import tomllib

import pytest

from autopar.export import Job, Launch, slurm_script, torchrun_script
from autopar.exports import export_torchtitan
from autopar.generated import comment, toml_value
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan

HOSTILE = [
    'h.1"]\n[job]\ndump_folder = "/etc',
    "x'; rm -rf ~; echo '",
    "$(touch /tmp/autopar-pwned)`id`",
    "line\r\n# [job]\n\x1b[2J\u2028tail",
    'a\\"b',
]


def _plan(name: str) -> Plan:
    """A two-stage pipeline plan whose second stage starts at module ``name``, made for
    model ``name`` on cluster ``name``."""
    return Plan(global_batch=8, mesh=Mesh(pp=2), pipeline=PipelineSpec(num_microbatches=2),
                model=name, cluster=name, seq_len=64,
                layers=(LayerPlan(module="h.0", stage=0), LayerPlan(module=name, stage=1)))


def _blocks_plan(name: str) -> Plan:
    """``_plan`` with both layers one class of blocks, as the engine exports need."""
    plan = _plan(name)
    return dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(la, layer_class="block") for la in plan.layers))


@pytest.mark.parametrize("name", [*HOSTILE, "x\ntouch pwned"])
def test_torchtitan_script_keeps_a_hostile_name_in_its_comments(tmp_path, name):
    plan_path = f"{tmp_path}/{name.replace('/', '_')}.json"
    text = export_torchtitan(_blocks_plan(name), plan_path).file("torchtitan.sh").text
    argv = _run(text, tmp_path, ["--module", name])
    assert argv[argv.index("--module") + 1] == name
    assert argv[-1] == "activation-checkpoint:none"
    assert not (tmp_path / "pwned").exists()


def test_torchtitan_export_refuses_a_seq_len_that_is_not_an_integer():
    from autopar.errors import ConfigError

    plan = _blocks_plan("h.1")
    object.__setattr__(plan, "seq_len", "abc")  # as a hand-edited plan could carry
    with pytest.raises(ConfigError, match="seq_len is 'abc', not an integer"):
        export_torchtitan(plan, "plan.json")


def _stub(folder, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def _run(text: str, tmp_path, args: list[str] | None = None) -> list[str]:
    """Run a generated script (with ``args``) with stub torchrun, srun and scontrol on
    PATH; the arguments torchrun received."""
    import os

    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    _stub(bin_, "torchrun", 'printf "%s\\0" "$@" > "$ARGS_OUT"')
    _stub(bin_, "srun", 'exec "$@"')
    _stub(bin_, "scontrol", "echo node0")
    script = tmp_path / "job.sh"
    script.write_text(text)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "ARGS_OUT": str(tmp_path / "args"),
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node0"}
    done = subprocess.run(["bash", str(script), *(args or [])], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    return (tmp_path / "args").read_bytes().decode().split("\0")[:-1]


@pytest.mark.parametrize("name", [*HOSTILE, "$(touch pwned)", "; touch pwned #", "x\ntouch pwned"])
def test_launch_scripts_pass_hostile_names_as_single_words(tmp_path, name):
    plan = _plan(name)
    plan_path = f"{tmp_path}/{name.replace('/', '_')}.json"
    launch = Launch(nodes=1, nproc_per_node=2)
    argv = _run(torchrun_script(plan, plan_path, launch), tmp_path)
    assert argv[argv.index("--model") + 1] == name
    assert argv[argv.index("--plan") + 1] == plan_path
    job = Job(script=str(tmp_path / "train.py"), script_args=(name, "--flag"))
    argv = _run(slurm_script(plan, plan_path, launch, job), tmp_path)
    assert argv[-2:] == [name, "--flag"]
    assert not (tmp_path / "pwned").exists()


def test_comment_and_toml_value_escape_what_could_break_a_line():
    assert comment("a\nb\rc\x00d") == "a\\nb\\rc\\x00d"
    assert tomllib.loads(f"v = {toml_value(HOSTILE[0])}")["v"] == HOSTILE[0]
