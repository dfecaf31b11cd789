"""A plan file's every field is checked when read: names, JSON types, integer ranges,
encoding, then each record's own rules; the error names the file and the field. The
published JSON Schema (docs/plan.schema.json) is the one the reader enforces."""

from __future__ import annotations

import json
from pathlib import Path

import fastjsonschema
import pytest

from runtime.plan import Plan, PlanError, plan_json_schema

DATA = Path(__file__).parent / "data"
SCHEMA = Path(__file__).parents[2] / "docs" / "plan.schema.json"


def _plan() -> dict:
    return json.loads(Plan.load(DATA / "plan_v1_gpt_small.json").to_json())


def _with(path: str, value):
    data, node = _plan(), None
    keys = path.split(".")
    node = data
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[keys[-1]] = value
    return data


@pytest.mark.parametrize(("path", "value", "message"), [
    ("layers", 5, "plan.json: layers: Expected `array`, got `int`"),
    ("layers.0.tp_styles", ["colwise"], "layers[0].tp_styles: Expected `object`, got `array`"),
    ("model", None, "model: Expected `str`, got `null`"),
    ("prediction.step_time_s", "fast", "prediction.step_time_s: Expected `float`, got `str`"),
    ("global_batch", 2**64, "global_batch: an integer of 65 bits is out of range"),
    ("version", "1", "'version' must be an integer such as 2, got '1'"),
    ("mesh.dp", True, "mesh.dp: Expected `int`, got `bool`"),
    ("layers.0.strategy", "zero9", "layers[0]: layer 'wte': unknown strategy 'zero9'"),
    ("layers.0.colour", "red", "layers[0]: unknown field(s) ['colour']"),
    ("rationale.classes.0.options.0.speed", 1, "rationale: classes[0]: options[0]: unknown "
                                               "field(s) ['speed']"),
])
def test_a_wrong_field_is_named_with_what_was_expected(tmp_path, path, value, message):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(_with(path, value)))
    with pytest.raises(PlanError) as e:
        Plan.load(bad)
    assert message in str(e.value) and str(bad) in str(e.value)


def test_an_integer_json_itself_refuses_is_named(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(_plan()).replace('"global_batch": 64', '"global_batch": ' + "9" * 5000))
    with pytest.raises(PlanError, match="plan.json: not valid JSON .*4300 digits"):
        Plan.load(bad)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_bytes(b'{"model": "\xff"}')
    with pytest.raises(PlanError, match=r"not a UTF-8 text file \(byte 11"):
        Plan.load(bad)


def test_not_an_object_is_named():
    with pytest.raises(PlanError, match="a plan must be a JSON object, got an array"):
        Plan.from_json("[1, 2]")


def test_the_published_schema_is_the_readers_and_accepts_what_autopar_writes():
    assert json.loads(SCHEMA.read_text()) == json.loads(json.dumps(plan_json_schema()))
    validate = fastjsonschema.compile(json.loads(SCHEMA.read_text()))
    validate(_plan())
    with pytest.raises(fastjsonschema.JsonSchemaException):
        validate(_with("layers.0.stage", "first"))
