"""Bad input to tfbig-train ends in one line naming it, exit code 2, and nothing lost: data whose
manifest.json says another seq_length than its shards hold, a manifest naming a missing
tokenizer, and a loss that turns non-finite in fp32 (the last good checkpoint is kept)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import tensorflow as tf

from tfbig.commands import cli
from tfbig import data
from tfbig.checkpoints import integrity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--preset=tiny", "--num_layers=2", "--hidden_size=32", "--num_heads=4", "--batch_size=8",
        "--log_every=1", "--sample_tokens=0", "--noxla", "--eval_steps=2", "--deterministic"]


def train(*flags):
    """python -m tfbig.train with `flags` -> (exit code, stdout + stderr)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-m", "tfbig.train", *TINY, *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return done.returncode, done.stdout + done.stderr


def error_lines(output):
    return [line for line in output.splitlines() if line.startswith("tfbig-train: error:")]


def edited_copy(source, target, **fields):
    """A copy of the prepared directory `source` whose manifest.json says `fields` instead."""
    shutil.copytree(source, target)
    path = os.path.join(target, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest.update(fields)
    with open(path, "w") as f:
        json.dump(manifest, f)
    return str(target)


def test_a_manifest_with_another_seq_length_than_its_shards_is_refused_before_step_1(gpt_data, tmp_path):
    data_dir = edited_copy(gpt_data, tmp_path / "data", seq_length=32)  # the shards hold 16 + 1
    code, output = train(f"--data_dir={data_dir}", f"--model_dir={tmp_path / 'run'}", "--max_steps=3")
    assert code == 2, output[-3000:]
    assert "Traceback" not in output and "step 1/" not in output
    (line,) = error_lines(output)
    assert "train-00000-of-" in line and os.path.join(data_dir, "manifest.json") in line
    assert "17 input_ids values" in line and "seq_length 32 (33 values)" in line
    assert "written with seq_length 16" in line
    assert not tf.train.latest_checkpoint(str(tmp_path / "run"))


def test_make_dataset_checks_every_split_and_mixture_source(gpt_data, tmp_path):
    good = gpt_data
    bad = edited_copy(gpt_data, tmp_path / "bad", seq_length=8)
    with pytest.raises(ValueError, match=r"hold 17 input_ids values.*seq_length 8 \(9 values\)"):
        data.make_dataset(bad, "validation", 4, seq_length=8, shuffle=False, repeat=False)
    data.make_dataset(good, "validation", 4, seq_length=16, shuffle=False, repeat=False)  # intact: fine
    other = edited_copy(gpt_data, tmp_path / "other", seq_length=8)
    with pytest.raises(ValueError, match=r"other/train-00000-of-\d+\.tfrecord: its records hold 17"):
        data.make_dataset(f"{other}:0.5,{bad}:0.5", "train", 4, seq_length=8)  # each source read


def test_a_manifest_naming_a_missing_tokenizer_is_one_line_naming_both(gpt_data, tmp_path):
    data_dir = edited_copy(gpt_data, tmp_path / "data", tokenizer="spm.model")
    with pytest.raises(FileNotFoundError) as caught:
        data.open_manifest(data_dir)
    message = cli.user_message(caught.value)  # what tfbig-train prints after "error:"
    assert message == (f"{data_dir}/manifest.json names the tokenizer 'spm.model', but "
                       f"{data_dir}/spm.model is missing; copy it back beside the shards or "
                       "prepare the data again (tfbig-prep)")
    code, output = train(f"--data_dir={data_dir}", f"--model_dir={tmp_path / 'run'}", "--max_steps=2")
    assert code == 2 and "Traceback" not in output, output[-3000:]
    assert error_lines(output) == [f"tfbig-train: error: {message}"]
    assert not os.path.exists(tmp_path / "run")  # refused before the run directory was made


def test_a_nonfinite_loss_is_one_line_exit_2_and_the_last_good_checkpoint_is_kept(gpt_data, tmp_path):
    # A learning rate of 1e30: step 1's update is finite (its checkpoint is written), step 2's
    # loss is not.
    run = tmp_path / "run"
    code, output = train(f"--data_dir={gpt_data}", f"--model_dir={run}", "--max_steps=10",
                         "--checkpoint_every=1", "--learning_rate=1e30", "--warmup_steps=0",
                         "--grad_clip_norm=0", "--weight_decay=0")
    assert code == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    (line,) = error_lines(output)
    assert "non-finite loss or gradient at or before step 2" in line and "--precision=fp32" in line
    assert f"last good checkpoint in {run} is kept" in line
    latest = tf.train.latest_checkpoint(str(run))
    assert latest.endswith("ckpt-1") and integrity.verify_checkpoint(latest) == []
