"""Checkpoint integrity: sums recorded at save, damaged checkpoints skipped at resume, kept."""
import os
import shutil

import numpy as np
import pytest

from test_trainer import make_cfg, weights
from tfbig.checkpoints import integrity
from tfbig.errors import DamagedCheckpointError
from tfbig.training.logs import RunLogger
from tfbig.training.trainer import Trainer


class Recorder(RunLogger):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages = []

    def info(self, message):
        self.messages.append(message)
        super().info(message)


def data_file(prefix):
    return prefix + ".data-00000-of-00001"


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


DAMAGE = {"truncated": truncate, "flipped_byte": flip_byte, "missing": os.remove}


def test_record_and_verify_name_each_damaged_file(tmp_path):
    files = []
    for i in range(3):
        files.append(str(tmp_path / f"part{i}.bin"))
        with open(files[-1], "wb") as f:
            f.write(bytes(range(256)) * 40)
    sums = integrity.record(files, str(tmp_path / "parts.sums.json"))
    assert integrity.verify(sums) == []
    truncate(files[0])
    flip_byte(files[1])
    os.remove(files[2])
    problems = integrity.verify(sums)
    assert len(problems) == 3
    assert problems[0] == f"{files[0]}: 5120 bytes, 10240 recorded (truncated)"
    assert problems[1].startswith(f"{files[1]}: checksum ") and problems[1].endswith(" recorded")
    assert problems[2] == f"{files[2]}: missing"


@pytest.fixture(scope="module")
def trained(gpt_data, tmp_path_factory):
    """A run with checkpoints at steps 2 and 4 (with sums) and its final weights."""
    root = tmp_path_factory.mktemp("integrity")
    trainer = Trainer(make_cfg(gpt_data, root / "run", max_steps=4, checkpoint_every=2))
    trainer.fit()
    return root / "run", trainer


def test_save_records_sums_of_every_checkpoint_file(trained):
    run, _ = trained
    for step in (2, 4):
        prefix = str(run / f"ckpt-{step}")
        assert os.path.exists(prefix + integrity.SUMS_SUFFIX)
        assert integrity.verify_checkpoint(prefix) == []


@pytest.mark.parametrize("kind", [  # one kind of damage by default; the rest take the same path
    kind if kind == "truncated" else pytest.param(kind, marks=pytest.mark.slow)
    for kind in sorted(DAMAGE)])
def test_resume_falls_back_to_the_newest_intact_checkpoint(gpt_data, trained, tmp_path, kind):
    source, straight = trained
    run = tmp_path / "run"
    shutil.copytree(source, run)
    before = sorted(os.listdir(run))
    damaged = data_file(str(run / "ckpt-4"))
    DAMAGE[kind](damaged)
    cfg = make_cfg(gpt_data, run, max_steps=4, checkpoint_every=2)
    logger = Recorder(str(run), True, 4)
    resumed = Trainer(cfg, logger=logger)
    assert resumed.restored_from == str(run / "ckpt-2")
    assert int(resumed.step.numpy()) == 2
    warning = [m for m in logger.messages if m.startswith("WARNING")]
    problem = {"truncated": "bytes, ", "flipped_byte": "checksum ", "missing": "missing"}[kind]
    assert len(warning) == 1 and f"checkpoint {run / 'ckpt-4'} is damaged ({damaged}: " \
        in warning[0] and problem in warning[0], warning
    assert f"resuming from {run / 'ckpt-2'} instead" in warning[0]
    # Nothing deleted: each damaged file is kept under FILE.damaged and named in the warning.
    kept = [n for n in before if n.startswith("ckpt-4.") and not (kind == "missing"
                                                                  and n.startswith("ckpt-4.data"))]
    for name in kept:
        assert os.path.exists(run / (name + integrity.DAMAGED_SUFFIX)), name
        assert str(run / (name + integrity.DAMAGED_SUFFIX)) in warning[0]
    resumed.fit()  # the resumed run ends where the uninterrupted one did
    for ours, theirs in zip(weights(resumed), weights(straight)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-8)
    assert integrity.verify_checkpoint(str(run / "ckpt-4")) == []
    for name in kept:  # the new save of step 4 did not overwrite the damaged files
        assert os.path.exists(run / (name + integrity.DAMAGED_SUFFIX)), name


def test_a_relative_model_dir_resumes_and_generates(gpt_data, trained, tmp_path, monkeypatch):
    """The main job's --model_dir is relative (runs/gpt-small): its second run resumes from it
    and tfbig-generate reads it (both joined the directory to the state file's paths twice)."""
    from tfbig.convert.run_dir import load_model

    source, _ = trained
    shutil.copytree(source, tmp_path / "runs" / "gpt")
    monkeypatch.chdir(tmp_path)
    assert integrity.newest_intact("runs/gpt") == ("runs/gpt/ckpt-4", {})
    resumed = Trainer(make_cfg(gpt_data, "runs/gpt", max_steps=4, checkpoint_every=2))
    assert resumed.restored_from == "runs/gpt/ckpt-4" and int(resumed.step.numpy()) == 4
    model, _ = load_model("runs/gpt")
    for ours, theirs in zip(model.weights, resumed.model.weights):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_no_intact_checkpoint_is_an_error_that_changes_nothing(gpt_data, trained, tmp_path):
    source, _ = trained
    run = tmp_path / "run"
    shutil.copytree(source, run)
    flip_byte(data_file(str(run / "ckpt-4")))
    os.remove(str(run / "ckpt-2.index"))
    before = sorted(os.listdir(run))
    with pytest.raises(DamagedCheckpointError) as error:
        Trainer(make_cfg(gpt_data, run, max_steps=4, checkpoint_every=2))
    message = str(error.value)
    assert message.startswith(f"--model_dir={run}: no intact checkpoint to resume from: "
                              f"{run / 'ckpt-4'} ({data_file(str(run / 'ckpt-4'))}: checksum ")
    assert f"{run / 'ckpt-2'} ({run / 'ckpt-2.index'}: missing)" in message
    assert message.endswith("start afresh with another --model_dir (nothing was changed)")
    assert sorted(os.listdir(run)) == before


def test_checkpoint_without_sums_is_checked_by_reading_it_back(trained, tmp_path):
    source, _ = trained
    run = tmp_path / "run"
    shutil.copytree(source, run)
    prefix = str(run / "ckpt-4")
    os.remove(prefix + integrity.SUMS_SUFFIX)  # as saved by an older tfbig
    assert integrity.verify_checkpoint(prefix) == []
    flip_byte(data_file(prefix))
    problems = integrity.verify_checkpoint(prefix)
    assert len(problems) == 1 and problems[0].startswith(f"{prefix}: unreadable (")


def test_rotated_checkpoints_leave_no_sums_behind(gpt_data, tmp_path):
    Trainer(make_cfg(gpt_data, tmp_path, max_steps=3, checkpoint_every=1,
                     keep_checkpoints=1)).fit()
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(integrity.SUMS_SUFFIX)) == [
        "ckpt-3.sums.json"]
