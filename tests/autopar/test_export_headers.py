"""Every engine export's header stays a comment whatever the plan's names hold: a model or
cluster name with a line break must not start a command in a script."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
from export_cases import plan_of

from autopar.exports import EXPORTERS
from runtime.plan import Mesh

INJECTED = "gpt\nrm -rf /tmp/autopar-injected\r\n# more"


@pytest.mark.parametrize("engine", sorted(EXPORTERS))
def test_a_line_break_in_a_name_stays_inside_the_header_comment(engine):
    plan = dataclasses.replace(plan_of(mesh=Mesh(dp=2)), model=INJECTED, cluster=INJECTED)
    export = EXPORTERS[engine](plan, "plan\nrm -rf /tmp/autopar-path.json")
    for f in export.files:
        for line in f.text.splitlines():
            # A command line holding the words is a quoted argument, never a bare command.
            words = shlex.split(line, comments=True) if f.executable else [line]
            assert not (words and words[0] == "rm"), (engine, f.name, line)
