"""SIGTERM (preemption) on a single device: checkpoint after the current step, exit 143, resume.

The handler lives in the Strategy surface (watch_preemption / should_stop), so every backend
gets it; the multi-worker case is in test_multiworker.py.
"""
import os
import signal
import subprocess
import sys

import pytest

import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_multiworker import (  # noqa: E402
    ROOT, TIMEOUT, WORKER, kill_all, wait_for, worker_env, worker_result, write_config)
from test_trainer import assert_weights_close, make_cfg, weights  # noqa: E402

from tfbig.distribute.base import SingleDevice  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402


@pytest.mark.slow  # a SIGTERM on one rank saving and stopping all: test_horovod's preempted scenario (default)
def test_sigterm_saves_a_checkpoint_and_the_next_start_resumes_there(gpt_data, tmp_path):
    cfg = make_cfg(gpt_data, tmp_path / "run", max_steps=1000, dropout=0.1)
    first = tmp_path / "first"
    os.makedirs(first)
    log_path = first / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, WORKER, write_config(cfg, first), str(first)],
                                env=worker_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "step 3/1000" in log_path.read_text(), TIMEOUT, "step 3")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=TIMEOUT)
    finally:
        kill_all([proc])
    assert code == 143, log_path.read_text()[-3000:]
    summary, _ = worker_result(first, 0)
    step = summary["step"]
    assert summary["preempted"] and 3 <= step < 1000
    assert tf.train.latest_checkpoint(str(tmp_path / "run")).endswith(f"ckpt-{step}")
    assert "preempted (SIGTERM) after step" in log_path.read_text()

    resumed = Trainer(cfg)
    assert int(resumed.step.numpy()) == step
    resumed.fit(steps=2)
    straight = Trainer(make_cfg(gpt_data, tmp_path / "straight", max_steps=1000, dropout=0.1))
    straight.fit(steps=step + 2)
    assert_weights_close(weights(resumed), weights(straight), rtol=1e-6)


def test_the_sigterm_handler_is_only_installed_during_training():
    strategy = SingleDevice()
    before = signal.getsignal(signal.SIGTERM)
    with strategy.watch_preemption():
        assert signal.getsignal(signal.SIGTERM) is not before
        assert not strategy.should_stop()
        signal.raise_signal(signal.SIGTERM)  # handled: the process lives on
        assert strategy.should_stop()
    assert signal.getsignal(signal.SIGTERM) is before
