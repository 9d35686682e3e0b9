"""Goodput (tfbig/training/goodput.py): productive step time over the run's wall time, badput by
cause, accumulated across restarts in MODEL_DIR/goodput.json; the parts add up to the wall."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tfbig.training import goodput
from tfbig.training.goodput import GoodputClock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steps(clock, count, seconds=0.03, wait=0.01):
    for _ in range(count):
        with clock.step():
            with clock.measure("input_wait"):
                time.sleep(wait)
            time.sleep(seconds)


def test_a_restart_moves_redone_steps_to_lost_progress_and_the_gap_to_restart(tmp_path):
    run = str(tmp_path)
    first = GoodputClock(run, time.time() - 5.0)  # started 5 s ago: imports, build
    first.loop_started()
    steps(first, 3)
    first.checkpoint_saved(3)
    steps(first, 2, seconds=0.1)  # steps 4 and 5: trained again after the restart
    first.write()
    productive_at_3 = first.saved["3"]
    productive_before = first.totals()["productive"]
    time.sleep(0.2)  # the dead process after its last record
    died = time.time()
    time.sleep(0.3)  # the supervisor's back-off and relaunch
    goodput.record_restart(run, died, time.time(), "worker 1 was killed by SIGKILL")
    second = GoodputClock(run, time.time())
    second.resumed(3)
    assert second.restarts == 1
    assert 0.3 <= second.base["restart"] < 0.4
    redone = productive_before - productive_at_3
    assert redone > 0.2  # steps 4 and 5
    assert second.base["lost_progress"] == pytest.approx(redone + 0.2, abs=0.05)
    assert second.base["productive"] == pytest.approx(productive_at_3)
    second.loop_started()
    steps(second, 3)
    summary = second.summary()
    assert summary["wall_seconds"] > 5.8
    assert sum(summary["seconds"].values()) == pytest.approx(summary["wall_seconds"], rel=0.01)
    assert summary["goodput"] == pytest.approx(summary["seconds"]["productive"]
                                               / summary["wall_seconds"])
    assert re.match(r"goodput \d+\.\d% of \d+\.\d s wall \(1 restart\(s\)\); badput: startup ",
                    second.describe())


def test_a_finished_run_trained_further_is_not_a_restart(tmp_path):
    first = GoodputClock(str(tmp_path), time.time() - 1.0)
    first.loop_started()
    steps(first, 2)
    first.write(finished=True)
    time.sleep(0.3)
    second = GoodputClock(str(tmp_path), time.time())
    assert second.restarts == 0 and second.base["restart"] == 0.0
    summary = second.summary()
    assert sum(summary["seconds"].values()) == pytest.approx(summary["wall_seconds"], rel=0.02)


FLAGS = ["--preset=tiny", "--seq_length=16", "--num_layers=2", "--hidden_size=32",
         "--num_heads=4", "--dropout=0", "--batch_size=8", "--max_steps=8", "--learning_rate=3e-3",
         "--warmup_steps=2", "--log_every=1", "--checkpoint_every=2", "--eval_steps=1",
         "--deterministic", "--sample_tokens=0", "--noxla", "--peak_tflops=1",
         "--monitor_interval_ms=0"]


def trainer_process(launcher):
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "tfbig.train" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.slow  # two TensorFlow starts under the supervisor (~60 s)
def test_the_parts_add_up_to_the_wall_time_over_a_killed_and_restarted_run(gpt_data, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    log_path = tmp_path / "log"
    launched = time.time()
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "tfbig.commands.launch", "--max_restarts=1",
             "--restart_backoff=1", "--", sys.executable, "-m", "tfbig.train", *FLAGS,
             f"--data_dir={gpt_data}", f"--model_dir={run}"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        first = None
        while "step 5/8" not in log_path.read_text():  # past the checkpoint of step 4
            first = first or trainer_process(launcher)
            assert launcher.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        assert launcher.wait(timeout=600) == 0, log_path.read_text()[-3000:]
        ended = time.time()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = log_path.read_text()
    assert "restart 1 of 1 in 1 s" in output
    record = json.loads((run / goodput.FILE).read_text())
    seconds, wall = record["seconds"], record["updated"] - record["run_start"]
    assert record["restarts"] == 1 and record["finished"]
    # from the first training process's start (the launcher's own start before it) to the end
    assert launched < record["run_start"] < launched + 5 and record["updated"] <= ended
    assert sum(seconds.values()) == pytest.approx(wall, rel=0.02)
    assert seconds["restart"] >= 1.0  # the back-off, at least
    assert seconds["lost_progress"] > 0  # step 5 (and 6) trained again
    assert seconds["startup"] > seconds["checkpoint_restore"] > 0
    assert re.search(r"goodput \d+\.\d% of \d+\.\d s wall \(1 restart\(s\)\); badput: ", output)
    assert re.search(r"step 8/8 .*\| goodput \d+%", output)
