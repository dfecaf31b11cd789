"""runtime.files: outputs checked before the work, written atomically, temp files cleaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import files
from runtime.files import OutputError, check_output, check_output_dir, write_atomic

REPO = Path(__file__).resolve().parents[2]


def test_write_atomic_replaces_the_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("old")
    write_atomic(target, "new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["plan.json"]
    assert target.stat().st_mode & 0o777 == 0o644
    write_atomic(target, b"\x00bytes", mode=0o755)
    assert target.read_bytes() == b"\x00bytes" and target.stat().st_mode & 0o777 == 0o755


def test_a_failed_write_keeps_the_old_file_and_removes_its_temp(tmp_path, monkeypatch):
    target = tmp_path / "p.toml"
    target.write_text("keep me")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, "half")
    assert target.read_text() == "keep me" and os.listdir(tmp_path) == ["p.toml"]


_KILLED_WRITER = """
import os, sys, time
import runtime.files as files
def stall(fd):  # the data is written; die before the rename
    print("ready", flush=True)
    time.sleep(60)
files.os.fsync = stall
files.write_atomic(sys.argv[1], "torn")
"""


def test_a_killed_write_leaves_the_old_file_and_its_temp_is_removed_by_the_next(tmp_path):
    target = tmp_path / "torchrun.sh"
    target.write_text("hand-edited")
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(target)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert target.read_text() == "hand-edited"
    left = [p for p in tmp_path.iterdir() if p != target]
    assert len(left) == 1 and left[0].name.endswith(".tmp"), left  # SIGKILL runs no cleanup
    write_atomic(target, "next")
    assert target.read_text() == "next" and list(tmp_path.iterdir()) == [target]


def test_check_output_refuses_before_any_work(tmp_path):
    (tmp_path / "exists.json").write_text("mine")
    with pytest.raises(OutputError, match="output directory .*missing does not exist"):
        check_output(tmp_path / "missing" / "p.json")
    with pytest.raises(OutputError, match="is a directory; give a file name"):
        check_output(tmp_path)
    with pytest.raises(OutputError, match="exists; pass --force to overwrite it"):
        check_output(tmp_path / "exists.json")
    assert check_output(tmp_path / "exists.json", force=True) == tmp_path / "exists.json"
    assert (tmp_path / "exists.json").read_text() == "mine"


def test_check_output_refuses_a_read_only_directory(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    # root may write anywhere, so ask access() as an unprivileged user would be answered
    real = os.access
    monkeypatch.setattr(files.os, "access", lambda p, mode: real(p, mode) and Path(p) != ro)
    with pytest.raises(OutputError, match="not writable"):
        check_output(ro / "p.toml")


def test_check_output_dir_names_every_file_it_would_overwrite(tmp_path):
    (tmp_path / "job.slurm").write_text("#SBATCH --account=mine")
    with pytest.raises(OutputError, match=r"already holds job.slurm; pass --force"):
        check_output_dir(tmp_path, ["torchrun.sh", "job.slurm"])
    check_output_dir(tmp_path, ["torchrun.sh", "job.slurm"], force=True)
    check_output_dir(tmp_path / "new", ["torchrun.sh"])  # created later
    with pytest.raises(OutputError, match="does not exist"):
        check_output_dir(tmp_path / "a" / "b", ["x"])
    with pytest.raises(OutputError, match="is a file, not a directory"):
        check_output_dir(tmp_path / "job.slurm", ["x"])
