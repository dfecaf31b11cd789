"""Every case of tests/autopar/bad_input_cases.py: exit status 2, one line naming what is
wrong, no traceback, no file changed, in well under a second each (nothing is planned,
measured or spawned before the refusal); and docs/bad-input.md lists every case."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from bad_input_cases import CASES

from autopar.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-input.md"


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` with a digest of what it holds."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest()
                                       if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse refuses a flag
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_bad_input_exits_2_with_its_message_and_changes_nothing(label, tmp_path, capsys,
                                                                monkeypatch):
    _, setup, argv, message = next(c for c in CASES if c[0] == label)
    d = tmp_path / "w"
    d.mkdir()
    setup(d)
    monkeypatch.chdir(d)  # anything written by accident lands here and is seen
    before = snapshot(d)
    start = time.perf_counter()
    code, err = run_cli([a.format(d=d) for a in argv], capsys)
    assert code == 2, err
    assert message.format(d=d) in err and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err  # after argparse's usage
    assert snapshot(d) == before
    assert time.perf_counter() - start < 20  # refused before planning or spawning


def test_the_bad_input_table_lists_every_case_with_its_message():
    doc = DOC.read_text()
    for label, _, _, message in CASES:
        row = next((line for line in doc.splitlines() if line.startswith(f"| {label} |")), None)
        assert row is not None, f"docs/bad-input.md has no row for {label!r}"
        assert message.replace("{d}", "DIR").replace("|", "\\|") in row, label
