"""Plans saved by earlier versions of autopar still load: runtime.plan.MIGRATIONS.

data/plan_v1_gpt_small.json was written by autopar's plan format version 1 (commit dbd7caf):
`autopar plan --model gpt-small --cluster dgx-a100-80g --nodes 2 --batch 64 --seq 256 --json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.plan import PLAN_VERSION, Plan, PlanError

V1 = Path(__file__).parent / "data" / "plan_v1_gpt_small.json"


def test_a_version_1_plan_loads_as_the_current_version_with_every_field_kept():
    old = json.loads(V1.read_text())
    plan = Plan.load(V1)
    assert old["version"] == 1 and plan.version == PLAN_VERSION
    assert plan.mesh.describe() == "pp=1 × dp=16 × tp=1"
    assert [la.module for la in plan.layers] == [la["module"] for la in old["layers"]]
    assert all(la.expert_parallel == 1 for la in plan.layers)
    new = json.loads(plan.to_json())
    for key in old:  # everything version 1 said survives, under version 2's names
        if key not in ("version", "layers", "rationale"):
            assert new[key] == old[key], key
    for before, after in zip(old["rationale"]["classes"], new["rationale"]["classes"],
                             strict=True):
        for option, migrated in zip(before["options"], after["options"], strict=True):
            option["buffers_bytes"] = option.pop("buffer_bytes")
            # version 1 recorded no hidden communication; it reads as none
            assert migrated == {**option, "hidden_comm_s": 0.0}
        assert {**after, "options": None} == {**before, "options": None}
    # added since, read as its default: the cluster's reason for no async TP is not known
    assert new["rationale"].pop("async_tp_unavailable") == ""
    # Pipeline sections gained ``scatter_sends`` after version 2 was fixed; off, as the
    # runtime ran them then.
    for alt in new["rationale"]["alternatives"]:
        if alt["pipeline"] is not None:
            assert alt["pipeline"].pop("scatter_sends") is False
    assert {**new["rationale"], "classes": None} == {**old["rationale"], "classes": None}
    for before, after in zip(old["layers"], new["layers"], strict=True):
        # fields added since, each read as its default: no expert parallelism, no async TP
        assert after["expert_parallel"] == 1 and after["async_tp"] is False
        assert {k: v for k, v in after.items()
                if k not in ("expert_parallel", "async_tp")} == before
    assert Plan.from_json(plan.to_json()) == plan
    assert "dp=16" in plan.report()


@pytest.mark.parametrize(("version", "message"), [
    (99, "plan version 99 is not supported (this autopar writes version 2 and reads "
         "versions 1, 2)"),
    ("1", "'version' must be an integer such as 2, got '1'"),
    (None, "'version' must be an integer"),
])
def test_unknown_or_mistyped_versions_are_named(version, message):
    data = json.loads(V1.read_text())
    data["version"] = version
    with pytest.raises(PlanError, match="plan") as e:
        Plan.from_dict(data)
    assert message in str(e.value)
