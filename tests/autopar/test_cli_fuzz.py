"""Seeded fuzzing of ``autopar`` flag lists: any mix of valid and hostile values exits 0 or
2 with one error line, never a traceback or a hang, and changes no file but the output it
asked for. Commands that would train or measure get a last flag that stops them before
any rank starts (a missing plan, an output directory as ``--out``), after every other flag
was checked. Derandomized, so a failure reproduces."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

from dist_pool import RANKS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input_cli import snapshot

from autopar.cli import main
from runtime.plan import LayerPlan, Mesh, Plan

pytestmark = RANKS  # spawns its own ranks (tests/dist_pool.py)

VALUES = st.one_of(
    st.sampled_from(["-1", "0", "1", "2", "4", "8", "nan", "inf", "-inf", "1e300", "abc", "",
                     "99999999999999999999", "1.5", "1000000000", "2,3", " 7", "-0"]),
    st.integers(-10, 10**6).map(str),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
            max_size=6),
)
PATHS = ["{d}/p.json", "{d}/missing.json", "{d}", "{d}/latin1.json", "{d}/garbage.json",
         "{d}/out.txt", "{d}/sub/out.txt", "{d}/nodir/x"]

# command: (fixed head, flags taking a value, switches, tail that stops real work)
COMMANDS = {
    "explain": (["explain", "{plan}"], ["--top"], [], []),
    "export": (["export", "{plan}"], ["--format", "--nodes", "--nproc-per-node", "--steps",
                                      "--device", "--out"], ["--force"], []),
    "plan": (["plan", "--model", "mlp"], ["--nodes", "--batch", "--seq", "--dtype", "--top",
                                          "--json", "--export", "--time-limit"], ["--force"],
             []),
    "run": (["run", "--model", "gpt-tiny"], ["--nproc", "--steps", "--batch", "--seq", "--seed",
                                             "--timeout", "--ckpt-every", "--keep", "--device"],
            ["--resume", "--async-save"], ["--plan", "{d}/missing.json"]),
    "calibrate": (["calibrate"], ["--nproc", "--backend", "--attention-shape", "--loss-shape"],
                  ["--quick", "--force"], ["--out", "{d}"]),
}
OUTPUT_FLAGS = ("--out", "--json", "--export")


def _workspace(d: Path) -> None:
    plan = Plan(global_batch=8, mesh=Mesh(dp=2), model="gpt-tiny",
                layers=(LayerPlan(module="net.0"),))
    (d / "p.json").write_text(plan.to_json())
    (d / "latin1.json").write_bytes(b'{"model": "caf\xe9"}')
    (d / "garbage.json").write_text('{"version": 1, "layers": 5, "mesh": null}')
    (d / "out.txt").write_text("mine")
    (d / "sub").mkdir()


@st.composite
def argvs(draw) -> list[str]:
    name = draw(st.sampled_from(sorted(COMMANDS)))
    head, valued, switches, tail = COMMANDS[name]
    argv = [a.replace("{plan}", draw(st.sampled_from(PATHS))) for a in head]
    for _ in range(draw(st.integers(0, 4))):
        if switches and draw(st.booleans()):
            argv.append(draw(st.sampled_from(switches)))
            continue
        flag = draw(st.sampled_from(valued))
        value = draw(st.sampled_from(PATHS)) if flag in OUTPUT_FLAGS else draw(VALUES)
        argv += [flag, value]
    return argv + tail


@settings(max_examples=80, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=argvs())
def test_fuzzed_flags_exit_0_or_2_and_write_only_what_was_asked(tmp_path_factory, capsys, argv):
    d = tmp_path_factory.mktemp("w")
    _workspace(d)
    argv = [a.replace("{d}", str(d)) for a in argv]
    asked = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in OUTPUT_FLAGS}
    before = snapshot(d)
    try:
        with redirect_stdout(io.StringIO()):
            code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        assert [line for line in err.splitlines() if "error:" in line], (argv, err)
    after = snapshot(d)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    allowed = {str(Path(p).relative_to(d)) for p in asked if p != str(d)}
    changed = {c for c in changed if not any(c == a or c.startswith(a + "/") for a in allowed)}
    assert not changed, (argv, changed)
