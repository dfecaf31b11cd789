"""The functions ``autopar export --format megatron|deepspeed|accelerate`` and
``autopar plan --from-megatron`` call (the command line wires them)."""

from __future__ import annotations

import json

import pytest
from export_cases import plan_of

from autopar.errors import ConfigError
from autopar.exports.command import engine_export, export_output, megatron_comparison
from cost_models.hardware import Cluster
from runtime.plan import Mesh


@pytest.fixture
def plan_path(tmp_path):
    path = tmp_path / "plan.json"
    plan_of(mesh=Mesh(dp=8), strategy="fsdp", param_dtype="bfloat16",
            overrides={"wte": "replicate"}).save(path)
    return path


def test_engine_export_prints_or_writes_every_file(plan_path, tmp_path):
    export = engine_export("accelerate", str(plan_path), nodes=1, nproc_per_node=8)
    printed = export_output(export, None)
    assert "==> accelerate_config.yaml <==" in printed and "==> accelerate_launch.sh <==" in printed
    written = export_output(export, str(tmp_path / "out"))
    assert written == [f"wrote {tmp_path}/out/accelerate_config.yaml",
                       f"wrote {tmp_path}/out/accelerate_launch.sh"]
    assert any("1 layer(s) replicate" in w for w in export.warnings)


def test_deepspeed_prints_its_json_and_names_the_plan_by_absolute_path(plan_path):
    text, = export_output(engine_export("deepspeed", str(plan_path)), None)
    assert json.loads(text)["autopar"]["header"][0].endswith(f"from plan {plan_path}")


def test_unknown_engine_is_refused(plan_path):
    with pytest.raises(ConfigError, match="one of megatron, deepspeed, accelerate"):
        engine_export("horovod", str(plan_path))


def test_from_megatron_compares_on_a_built_in_model():
    text = megatron_comparison("--tensor-model-parallel-size 2 --micro-batch-size 4 "
                               "--global-batch-size 32 --seq-length 64 --bf16", "gpt-small",
                               Cluster.preset("dgx-a100-80g"), time_limit_s=5)
    assert text.startswith("Megatron-LM job: mesh pp=1 × dp=4 × tp=2")
    assert "autopar's plan:" in text and "predicted gain:" in text
