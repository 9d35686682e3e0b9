"""--strategy=multiworker and --strategy=mirrored against the single-device reference.

Workers are real processes (tests/distribute/multiworker_worker.py) with TF_CONFIG on free
localhost ports, started through tfbig-launch or directly; every run is bounded by a timeout.
The reference is the single-device trainer reading, per step, exactly the examples all workers
read together (`PipelinesTask`).
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_trainer import assert_weights_close, make_cfg, weights  # noqa: E402

from launch.local import free_ports, tf_config  # noqa: E402
from tfbig import config as config_lib  # noqa: E402
from tfbig.tasks.gpt import GPTTask  # noqa: E402
from tfbig.trainer import Trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "multiworker_worker.py")
TIMEOUT = 240


class PipelinesTask(GPTTask):
    """The data `num_pipelines` workers read, for one process: each batch is the
    concatenation of the pipelines' batches of batch_size / num_pipelines."""

    def __init__(self, train, num_pipelines):
        super().__init__(train)
        self.num_pipelines = num_pipelines

    def dataset(self, split, batch_size, input_context=None, **kwargs):
        n = self.num_pipelines
        parts = tuple(super(PipelinesTask, self).dataset(
            split, batch_size // n, tf.distribute.InputContext(n, i, n), **kwargs)
            for i in range(n))
        return tf.data.Dataset.zip(parts).map(
            lambda *batches: tf.nest.map_structure(lambda *t: tf.concat(t, 0), *batches))


def write_config(cfg, directory):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "experiment.json")
    with open(path, "w") as f:
        json.dump(config_lib.to_dict(cfg), f)
    return path


def worker_env():
    return {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}


def launch(cfg, out, workers=2, extra=()):
    """Run the worker script under tfbig-launch; returns (exit code, output)."""
    command = [sys.executable, "-m", "launch.local", f"--workers={workers}", "--",
               sys.executable, WORKER, write_config(cfg, out), str(out), *extra]
    proc = subprocess.run(command, env=worker_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


def start_workers(cfg, out, workers=2):
    """Start worker processes directly (no launcher), output to out/log{i}.txt."""
    path = write_config(cfg, out)
    addresses = [f"localhost:{port}" for port in free_ports(workers)]
    procs = []
    for index in range(workers):
        log = open(os.path.join(out, f"log{index}.txt"), "w")
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, path, str(out)], stdout=log, stderr=subprocess.STDOUT,
            env={**worker_env(), "TF_CONFIG": tf_config(addresses, index)}, cwd=ROOT))
    return procs


def read_log(out, index):
    with open(os.path.join(out, f"log{index}.txt")) as f:
        return f.read()


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def worker_result(out, rank):
    with open(os.path.join(out, f"worker{rank}.json")) as f:
        summary = json.load(f)
    with np.load(os.path.join(out, f"worker{rank}.npz")) as data:
        return summary, [data[f"arr_{i}"] for i in range(len(data.files))]


def reference(gpt_data, model_dir, num_pipelines, **train):
    """The single-device run on the examples `num_pipelines` workers read together."""
    cfg = make_cfg(gpt_data, model_dir, **train)
    trainer = Trainer(cfg, task=PipelinesTask(cfg.train, num_pipelines))
    return trainer, trainer.fit()


# Clipping at 0.5 is active (the averaged gradient norm is above it at every step), and a
# large Adam epsilon makes the update proportional to the gradient rather than to its sign, so
# summing instead of averaging, averaging twice, or clipping before averaging all change the
# weights. (With epsilon 1e-8, Adam also turns the rounding noise of gradients that are
# exactly zero in theory - attention key biases - into full-size steps.)
EQUIVALENCE = dict(max_steps=4, batch_size=8, grad_accum_steps=2, grad_clip_norm=0.5,
                   epsilon=0.1, learning_rate=3e-2, dropout=0.0)


@pytest.mark.multiproc
def test_two_workers_equal_one_process_on_the_same_data(gpt_data, tmp_path):
    cfg = make_cfg(gpt_data, tmp_path / "run", strategy="multiworker", **EQUIVALENCE)
    code, output = launch(cfg, tmp_path)
    assert code == 0, output
    (first, w0), (second, w1) = worker_result(tmp_path, 0), worker_result(tmp_path, 1)
    assert first["num_replicas"] == 2 and first["step"] == EQUIVALENCE["max_steps"]
    assert first["train"]["grad_norm"] > EQUIVALENCE["grad_clip_norm"]
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)  # the workers hold identical weights
    single, summary = reference(gpt_data, tmp_path / "single", 2, **EQUIVALENCE)
    assert_weights_close(w0, weights(single), rtol=1e-5)
    assert first["train"]["loss"] == pytest.approx(summary["train"]["loss"], rel=1e-5)
    assert "[worker 0]" in output and "[worker 1]" in output
    assert os.path.exists(first["checkpoint"] + ".index")  # the chief's, in --model_dir
    assert second["checkpoint"] is not None and not os.path.exists(
        os.path.dirname(second["checkpoint"]))  # the other worker's copy was deleted
