"""Checkpoints are data: a crafted checkpoint is refused and nothing in it runs.

Each attack plants a pickle whose payload would create a marker file (``builtins.open``
with mode "w"); the test asserts the refusal, its message, and that the marker never
appears. Checkpoints are written offline (DCP's ``no_dist`` path, one process), in the
layout ``runtime.checkpoint_format`` describes, from a small MLP with AdamW (so the
optimizer's hyper-parameters are stored as pickled bytes, the second pickle path).
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from runtime.checkpoint_format import (
    DCP_METADATA,
    LATEST,
    CheckpointCorruptError,
    Manifest,
    UnsafeCheckpointError,
    commit,
    fingerprint,
    latest,
    verify,
)
from runtime.dcp_safe import read_metadata
from runtime.plan import Mesh, Plan


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _plan() -> Plan:
    return Plan(global_batch=4, mesh=Mesh(dp=1))


def save_offline(root: Path, step: int = 1) -> Path:
    """An autopar checkpoint of ``_model`` after one AdamW step, written by one process."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    tmp = root / f".tmp-step_{step:08d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(str(tmp)),
                 no_dist=True)
    final = root / f"step_{step:08d}"
    commit(tmp, final, Manifest(step=step, world_size=1, plan=_plan().to_dict(),
                                fingerprint=fingerprint(model.state_dict())))
    return final


class _Payload:
    """Unpickling it opens ``path`` for writing: the file appearing proves code ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def plant_metadata(ckpt: Path, marker: Path) -> None:
    """Replace ``.metadata`` by a malicious pickle padded to the original size, so the
    manifest's size check passes."""
    size = (ckpt / DCP_METADATA).stat().st_size
    evil = pickle.dumps(_Payload(marker), protocol=4)
    assert len(evil) < size
    (ckpt / DCP_METADATA).write_bytes(evil + b"\0" * (size - len(evil)))  # pickle stops at STOP


def plant_value(ckpt: Path, marker: Path, key: str = "optim.param_groups.0.lr") -> None:
    """Point one non-tensor value (read by DCP with torch.load) at a malicious torch.save
    blob appended to the data file; the (legitimate) metadata is rewritten to match."""
    md = pickle.loads((ckpt / DCP_METADATA).read_bytes())  # our own file, written just now
    index = next(i for i in md.storage_data if i.fqn.endswith(key.rsplit(".", 1)[1])
                 and i.fqn.startswith("optim.param_groups"))
    info = md.storage_data[index]
    data = ckpt / info.relative_path
    import io

    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[index] = type(info)(info.relative_path, offset, len(buf.getvalue()),
                                        info.transform_descriptors)
    (ckpt / DCP_METADATA).write_bytes(pickle.dumps(md, protocol=4))
    manifest = Manifest.read(ckpt)
    from runtime.checkpoint_format import MANIFEST, list_files

    (ckpt / MANIFEST).write_text(Manifest(**{**manifest.__dict__, "files": list_files(ckpt)}).to_json())


def test_a_genuine_checkpoint_reads_and_reshards(tmp_path):
    from runtime.checkpoint import reshard

    ckpt = save_offline(tmp_path / "c")
    _, _, md = verify(tmp_path / "c")
    assert md.state_dict_metadata == pickle.loads((ckpt / DCP_METADATA).read_bytes()).state_dict_metadata
    out = reshard(tmp_path / "c", tmp_path / "out", _plan(), _model())
    assert verify(out)[0] == out


def test_crafted_metadata_is_refused_by_verify_and_runs_nothing(tmp_path):
    ckpt = save_offline(tmp_path / "c")
    marker = tmp_path / "pwned"
    plant_metadata(ckpt, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"io\.open.*not one of DCP's metadata types"):
        verify(ckpt)
    assert not marker.exists()


def test_crafted_metadata_is_refused_by_reshard_cli_with_exit_2(tmp_path, capsys):
    from autopar.cli import main

    ckpt = save_offline(tmp_path / "c")
    marker = tmp_path / "pwned"
    plant_metadata(ckpt, marker)
    plan = tmp_path / "b.json"
    plan.write_text(_plan().to_json())
    code = main(["reshard", str(tmp_path / "c"), "--plan", str(plan), "--out", str(tmp_path / "o"),
                 "--model", "mlp"])
    err = capsys.readouterr().err
    assert code == 2 and "may be crafted to run code" in err and "Traceback" not in err, err
    assert not marker.exists() and not (tmp_path / "o").exists()


def test_crafted_value_in_the_data_file_is_refused_on_load_and_runs_nothing(tmp_path):
    from runtime.checkpoint import reshard

    ckpt = save_offline(tmp_path / "c")
    marker = tmp_path / "pwned"
    plant_value(ckpt, marker)
    verify(ckpt)  # the metadata itself is genuine
    with pytest.raises(CheckpointCorruptError, match="was refused"):
        reshard(ckpt, tmp_path / "out", _plan(), _model())
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_metadata_pointing_outside_its_directory_is_refused(tmp_path):
    ckpt = save_offline(tmp_path / "c")
    md = pickle.loads((ckpt / DCP_METADATA).read_bytes())
    index, info = next(iter(md.storage_data.items()))
    md.storage_data[index] = type(info)(f"{os.pardir}/{os.pardir}/etc/passwd", info.offset, info.length,
                                        info.transform_descriptors)
    (ckpt / DCP_METADATA).write_bytes(pickle.dumps(md, protocol=4))
    with pytest.raises(UnsafeCheckpointError, match="not a file of its own directory"):
        read_metadata(ckpt / DCP_METADATA)


@pytest.mark.parametrize("pointer", [f"{os.pardir}/elsewhere/step_00000001", "/tmp", os.pardir,
                                     f"step_1/{os.pardir}/{os.pardir}/x"])
def test_latest_may_not_point_outside_the_root(tmp_path, pointer):
    save_offline(tmp_path / "c")
    elsewhere = save_offline(tmp_path / "elsewhere")
    (tmp_path / "c" / LATEST).write_text(pointer + "\n")
    with pytest.raises(CheckpointCorruptError, match="refusing to look outside the checkpoint root"):
        latest(tmp_path / "c")
    assert elsewhere.is_dir()


def test_latest_as_a_symlink_or_a_symlinked_step_is_refused(tmp_path):
    save_offline(tmp_path / "c", step=1)
    other = save_offline(tmp_path / "elsewhere", step=5)
    root = tmp_path / "c"
    (root / "step_00000005").symlink_to(other)
    (root / LATEST).write_text("step_00000005\n")
    with pytest.raises(CheckpointCorruptError, match="not a step_N directory inside"):
        latest(root)
    (root / LATEST).unlink()
    assert latest(root).name == "step_00000001"  # the symlinked step is not a checkpoint
    (root / LATEST).symlink_to(other / "autopar.json")
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        latest(root)


def test_reshard_does_not_follow_a_planted_temp_symlink(tmp_path):
    from runtime.checkpoint import reshard

    save_offline(tmp_path / "c")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    # The name the temp directory used to have (out's name, ".tmp-" and the pid).
    planted = tmp_path / f".tmp-out.{os.getpid()}"
    planted.symlink_to(victim)
    out = reshard(tmp_path / "c", tmp_path / "out", _plan(), _model())
    assert out.parent == tmp_path / "out"
    assert [p.name for p in victim.iterdir()] == ["keep.txt"] and planted.is_symlink()
    assert oct((tmp_path / "out").stat().st_mode & 0o777) == oct(0o755)


def test_crafted_metadata_is_refused_on_every_rank_of_a_resumed_run(pool2, tmp_path):
    """``autopar run --resume`` loads through runtime.checkpoint.load on every rank."""
    import shutil

    from test_checkpoint import GPT, bad_load_job, gpt_all, train_save_job

    root = tmp_path / "c"
    pool2.run(train_save_job, GPT, gpt_all("fsdp", 2), str(root))
    marker = tmp_path / "pwned"
    plant_metadata(latest(root), marker)
    for got in pool2.run(bad_load_job, GPT, gpt_all("fsdp", 2), str(root)):
        assert "UnsafeCheckpointError" in got["error"] and "crafted" in got["error"], got
        assert got["unchanged"] and got["optimizer_fresh"]
    assert not marker.exists()
    shutil.rmtree(root)


def save_into_planted_job(root: str) -> str:
    from test_checkpoint import GPT, _trainer, gpt_all

    from runtime import checkpoint
    from runtime.checkpoint_format import CheckpointError

    try:
        checkpoint.save(_trainer(GPT, gpt_all("fsdp", 2)), root, step=2)
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_save_does_not_follow_a_planted_temp_symlink(pool2, tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    (root / ".tmp-step_00000002").symlink_to(victim)
    for got in pool2.run(save_into_planted_job, str(root)):
        assert "cannot create" in got, got
    assert [p.name for p in victim.iterdir()] == ["keep.txt"]
    assert not (root / "step_00000002").exists()
