"""--async_checkpoint (tfbig/checkpoints/async_write.py): the state copied to host, written beside
training; the restored state is the synchronous save's, bit for bit; a death during the write
resumes from the previous checkpoint."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from test_trainer import make_cfg
from tfbig.checkpoints import integrity
from tfbig.checkpoints.async_write import WRITE_SLEEP_ENV
from tfbig.training.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"  # its variables' full names carry a process-wide counter


def tensors(prefix):
    reader = tf.train.load_checkpoint(prefix)
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if k != GRAPH}


def state(trainer):
    return [v.numpy() for v in trainer.model.variables + trainer.optimizer.variables
            + [trainer.step, trainer.batches_consumed]]


def test_an_asynchronous_checkpoint_restores_the_synchronous_state_bit_for_bit(
        gpt_data, tmp_path, monkeypatch):
    sync = Trainer(make_cfg(gpt_data, tmp_path / "sync", max_steps=3, checkpoint_every=2,
                            async_checkpoint="off"))
    sync.fit()
    # the writer waits 1 s before it writes the step-2 copy: step 3 updates the variables first
    monkeypatch.setenv(WRITE_SLEEP_ENV, "1")
    cfg = make_cfg(gpt_data, tmp_path / "async", max_steps=3, checkpoint_every=2,
                   async_checkpoint="on")
    summary = Trainer(cfg).fit()
    assert summary["checkpoint"] == str(tmp_path / "async" / "ckpt-3")
    for step in (2, 3):
        ours, reference = (tensors(str(tmp_path / run / f"ckpt-{step}"))
                           for run in ("async", "sync"))
        assert len(ours) > 40 and ours.keys() == reference.keys()
        for key in reference:
            np.testing.assert_array_equal(ours[key], reference[key], err_msg=key)
        assert integrity.verify_checkpoint(str(tmp_path / "async" / f"ckpt-{step}")) == []
    monkeypatch.delenv(WRITE_SLEEP_ENV)
    restored = Trainer(cfg)  # resumes at step 3 from the asynchronous checkpoint
    assert restored.restored_from.endswith("ckpt-3")
    for ours, reference in zip(state(restored), state(sync), strict=True):
        np.testing.assert_array_equal(ours, reference)


def test_auto_writes_beside_training_on_one_piece_only(gpt_data, tmp_path):
    trainer = Trainer(make_cfg(gpt_data, tmp_path / "run", max_steps=1))
    assert trainer.cfg.train.async_checkpoint == "auto" and trainer.async_checkpoint
    with pytest.raises(ValueError,
                       match=r"--async_checkpoint=yes: expected one of auto \| on \| off"):
        Trainer(make_cfg(gpt_data, tmp_path / "bad", async_checkpoint="yes"))
    assert not os.path.exists(tmp_path / "bad")


FLAGS = ["--preset=tiny", "--seq_length=16", "--num_layers=2", "--hidden_size=32",
         "--num_heads=4", "--dropout=0", "--batch_size=8", "--max_steps=6", "--learning_rate=3e-3",
         "--warmup_steps=2", "--log_every=1", "--checkpoint_every=2", "--eval_steps=2",
         "--deterministic", "--sample_tokens=0", "--noxla", "--peak_tflops=1",
         "--monitor_interval_ms=0", "--async_checkpoint=on"]


@pytest.mark.slow  # a TensorFlow start in a subprocess and three runs (~40 s)
def test_a_process_killed_during_the_write_resumes_from_the_previous_checkpoint(gpt_data, tmp_path):
    run = tmp_path / "run"
    cfg = make_cfg(gpt_data, run, max_steps=6, checkpoint_every=2, async_checkpoint="on")
    Trainer(cfg).fit(steps=2)  # ckpt-2, complete
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", WRITE_SLEEP_ENV: "600"}
    proc = subprocess.Popen([sys.executable, "-m", "tfbig.train", *FLAGS, f"--data_dir={gpt_data}",
                             f"--model_dir={run}"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = []
    for line in proc.stdout:  # step 4's copy is taken, its write sleeps; step 5 trains
        output.append(line)
        if "step 5/6" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=600)
    assert proc.returncode == -signal.SIGKILL, "".join(output)[-3000:]
    assert tf.train.latest_checkpoint(str(run)).endswith("ckpt-2")
    assert not os.path.exists(f"{run}/ckpt-4.index")
    resumed = Trainer(cfg)
    assert resumed.restored_from.endswith("ckpt-2") and int(resumed.step.numpy()) == 2
    resumed.fit()
    straight = Trainer(make_cfg(gpt_data, tmp_path / "straight", max_steps=6, checkpoint_every=2))
    straight.fit()
    for ours, reference in zip(state(resumed), state(straight), strict=True):
        np.testing.assert_array_equal(ours, reference)
