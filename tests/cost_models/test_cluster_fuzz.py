"""Seeded fuzzing of cluster files through ``autopar plan``: whatever a mutated file holds,
the command exits 0 or 2 with one error line, never a traceback or a hang, and writes
nothing. Derandomized (hypothesis derives its examples from the test), so a failure
reproduces; bounded to a few seconds of planning."""

from __future__ import annotations

import io
import math
import tomllib
from contextlib import redirect_stdout
from pathlib import Path

import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.cli import main

PRESET = Path(__file__).resolve().parents[2] / "cost_models" / "presets" / "dgx-a100-80g.toml"
BASE = tomllib.loads(PRESET.read_text())


def _leaves(table: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for key, value in table.items():
        out += _leaves(value, (*prefix, key)) if isinstance(value, dict) else [(*prefix, key)]
    return out


LEAVES = _leaves(BASE)
NUMBERS = st.sampled_from([0, -1, 1e300, -1e300, 1e-300, 5e-324, 1e30, 1e-30, 10**12,
                           2**63 - 1, math.nan, math.inf, -math.inf, 0.5, 3])
HOSTILE = st.one_of(
    NUMBERS, NUMBERS, NUMBERS,  # the file is mostly numbers: most mutations are numbers
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([True, False, "", "nvlink", "x\n[job]"]),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.fixed_dictionaries({"x": st.integers(0, 3)}),
)


def _set(table: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        table = table.setdefault(key, {}) if isinstance(table.get(key, {}), dict) else {}
    if value is _DELETE:
        table.pop(path[-1], None)
    else:
        table[path[-1]] = value


_DELETE = object()
MUTATION = st.tuples(st.sampled_from(LEAVES + [("unknown_field",), ("device", "bogus")]),
                     st.one_of(HOSTILE, st.just(_DELETE)))


def _plan_exit(path: Path, capsys) -> tuple[int, str]:
    try:
        with redirect_stdout(io.StringIO()):
            code = main(["plan", "--model", "mlp", "--cluster", str(path), "--time-limit", "1"])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _assert_clean(code: int, err: str) -> None:
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err, err
    if code == 2:
        assert [line for line in err.splitlines() if "error:" in line], err


@settings(max_examples=60, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_mutated_cluster_files_exit_0_or_2_without_traceback(tmp_path, capsys, mutations):
    data = tomllib.loads(PRESET.read_text())
    for path, value in mutations:
        _set(data, path, value)
    cluster = tmp_path / "c.toml"
    cluster.write_text(tomli_w.dumps(data))
    before = sorted(tmp_path.iterdir())
    _assert_clean(*_plan_exit(cluster, capsys))
    assert sorted(tmp_path.iterdir()) == before


@settings(max_examples=25, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.integers(0, len(PRESET.read_bytes()) - 1), data=st.binary(min_size=1, max_size=4))
def test_byte_damaged_cluster_files_exit_0_or_2_without_traceback(tmp_path, capsys, at, data):
    raw = PRESET.read_bytes()
    cluster = tmp_path / "c.toml"
    cluster.write_bytes(raw[:at] + data + raw[at + len(data):])
    _assert_clean(*_plan_exit(cluster, capsys))
