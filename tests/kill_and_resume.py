"""The kill -9 check shared by the commands' resume tests: a `--deterministic` run killed
(SIGKILL) after a random checkpointed step, then started again with the same flags, must end
as an uninterrupted run does, with bit-identical weights and output files."""
import os
import random
import re
import signal
import subprocess

import numpy as np
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_killed_and_rerun_equals_uninterrupted(command, tmp_path, steps, outputs):
    """`command(output_dir)` -> argv of a run of `steps` steps that checkpoints every step and
    logs every step ("step k/steps"). Kills one run after a random step in [2, steps - 2], runs
    it again and runs another uninterrupted; compares every `model/` tensor of their last
    checkpoints and the files named in `outputs` (the first: the predictions, written last)."""
    kill_after = random.Random().randint(2, steps - 2)
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.Popen(command(tmp_path / "killed"), cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for line in proc.stdout:  # the checkpoint of step kill_after is written before step + 1
        if f"step {kill_after + 1}/{steps}" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=600)
    assert proc.returncode == -signal.SIGKILL, f"ended before step {kill_after + 1}"
    assert not (tmp_path / "killed" / outputs[0]).exists()  # the predictions come at the end
    for run in ("killed", "straight"):
        done = subprocess.run(command(tmp_path / run), cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=600)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        if run == "killed":  # resumed at the newest intact checkpoint (a save the kill cut
            # short is skipped as damaged; --async_checkpoint: step kill_after's may still have
            # been written beside step kill_after + 1, the one before it was complete)
            resumed = re.search(r"resumed from \S*ckpt-(\d+)", done.stdout + done.stderr)
            assert resumed and int(resumed.group(1)) in (kill_after - 1, kill_after,
                                                         kill_after + 1)
    readers = [tf.train.load_checkpoint(tf.train.latest_checkpoint(str(tmp_path / run)))
               for run in ("killed", "straight")]
    keys = [k for k in readers[1].get_variable_to_shape_map() if k.startswith("model/")]
    assert len(keys) > 30
    for key in keys:
        np.testing.assert_array_equal(readers[0].get_tensor(key), readers[1].get_tensor(key),
                                      err_msg=key)
    for output in outputs:
        assert (tmp_path / "killed" / output).read_text() == \
            (tmp_path / "straight" / output).read_text(), output
