"""--strategy=multiworker and --strategy=mirrored against the single-device reference.

Workers are real processes (tests/distribute/multiworker_worker.py) with TF_CONFIG on free
localhost ports, started through tfbig-launch or directly; every run is bounded by a timeout.
The reference is the single-device trainer reading, per step, exactly the examples all workers
read together (`ReplicasTask`).
"""
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from equality import RecordedGradients  # noqa: E402
from test_trainer import ReplicasTask, assert_weights_close, make_cfg, weights  # noqa: E402

from tfbig.training.workers import free_ports, tf_config  # noqa: E402
from tfbig import config as config_lib  # noqa: E402
from tfbig.tasks import get_task  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "multiworker_worker.py")
TIMEOUT = 240



def write_config(cfg, directory):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "experiment.json")
    with open(path, "w") as f:
        json.dump(config_lib.to_dict(cfg), f)
    return path


def worker_env():
    return {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}


def launch_command(cfg, out, workers=2, extra=()):
    return [sys.executable, "-m", "tfbig.commands.launch", f"--workers={workers}", "--",
            sys.executable, WORKER, write_config(cfg, out), str(out), *extra]


def launch(cfg, out, workers=2, extra=()):
    """Run the worker script under tfbig-launch; returns (exit code, output)."""
    proc = subprocess.run(launch_command(cfg, out, workers, extra), env=worker_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


def launch_in_background(cfg, out, workers=2, command=None):
    """tfbig-launch as a running process, its output in out/launch.txt."""
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "launch.txt"), "w")
    return subprocess.Popen(command or launch_command(cfg, out, workers), env=worker_env(),
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def kill_all(procs):
    """Test clean-up: no process (nor a launcher's worker) outlives its test."""
    for proc in procs:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


def cli_flags(cfg):
    """tfbig-train flags for every field of `cfg`."""
    flags = []
    for section in dataclasses.fields(cfg):
        for name, value in dataclasses.asdict(getattr(cfg, section.name)).items():
            flags.append((f"--{name}" if value else f"--no{name}") if isinstance(value, bool)
                         else f"--{name}={value}")
    return flags


def start_workers(out, command, envs):
    """Start one process per env (no launcher), output to out/log{i}.txt."""
    procs = []
    for index, env in enumerate(envs):
        log = open(os.path.join(out, f"log{index}.txt"), "w")
        procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                      env={**worker_env(), **env}, cwd=ROOT))
    return procs


def tf_config_envs(workers=2):
    addresses = [f"localhost:{port}" for port in free_ports(workers)]
    return [{"TF_CONFIG": tf_config(addresses, index)} for index in range(workers)]


def read_log(out, name):
    with open(os.path.join(out, name)) as f:
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


def reference(data_dir, model_dir, num_pipelines, steps=None, **train):
    """The single-device run on the examples `num_pipelines` workers read together."""
    cfg = make_cfg(data_dir, model_dir, **train)
    trainer = Trainer(cfg, task=ReplicasTask(cfg.train, num_pipelines, get_task(cfg.train, cfg)))
    trainer.recorded = RecordedGradients(trainer)  # tests/equality.py
    return trainer, trainer.fit(steps)


# Clipping at 0.5 is active (the averaged gradient norm is above it at every step), and a
# large Adam epsilon makes the update proportional to the gradient rather than to its sign, so
# summing instead of averaging, averaging twice, or clipping before averaging all change the
# weights. (With epsilon 1e-8, Adam also turns the rounding noise of gradients that are
# exactly zero in theory - attention key biases - into full-size steps.)
EQUIVALENCE = dict(max_steps=4, batch_size=8, grad_accum_steps=2, grad_clip_norm=0.5,
                   epsilon=0.1, learning_rate=3e-2, dropout=0.0, xla=True)


# ALBERT (MLM + SOP, LAMB as its recipe) on shards of seq_length 32.
ALBERT = dict(model="albert", seq_length=32, optimizer="lamb", weight_decay=0.01)


@pytest.mark.multiproc
@pytest.mark.parametrize("model", ["gpt", pytest.param("albert", marks=pytest.mark.slow)])
def test_two_workers_equal_one_process_on_the_same_data(model, gpt_data, albert_data, tmp_path):
    data, train = (gpt_data, EQUIVALENCE) if model == "gpt" else (albert_data,
                                                                  {**EQUIVALENCE, **ALBERT})
    train = {**train, "eval_steps": 0}  # the whole validation split: 217 records, uneven
    cfg = make_cfg(data, tmp_path / "run", strategy="multiworker", **train)
    # ALBERT's workers recompute every call of its shared block; the reference does not
    cfg.pipeline.activation_checkpointing = model == "albert"
    code, output = launch(cfg, tmp_path)
    assert code == 0, output
    (first, w0), (second, w1) = worker_result(tmp_path, 0), worker_result(tmp_path, 1)
    assert first["num_replicas"] == 2 and first["step"] == EQUIVALENCE["max_steps"]
    assert first["train"]["grad_norm"] > EQUIVALENCE["grad_clip_norm"]
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)  # the workers hold identical weights
    single, summary = reference(data, tmp_path / "single", 2, **train)
    single.recorded.assert_equal(w0, atol=1e-7)
    assert first["train"]["loss"] == pytest.approx(summary["train"]["loss"], rel=1e-5)
    # each worker evaluated its share (the last batch padded); gathered, every record once
    assert first["eval"] == pytest.approx(summary["eval"], rel=1e-5)
    assert "[worker 0]" in output and "[worker 1]" in output
    assert os.path.exists(first["checkpoint"] + ".index")  # the chief's, in --model_dir
    assert second["checkpoint"] is not None and not os.path.exists(
        os.path.dirname(second["checkpoint"]))  # the other worker's copy was deleted


@pytest.mark.slow
@pytest.mark.multiproc
def test_mixed_float16_with_xla_on_two_workers(gpt_data, tmp_path):
    # Loss scaling across workers: the optimizer unscales and checks the all-reduced gradients,
    # so every worker takes the same skip-or-apply decision.
    train = {**EQUIVALENCE, "precision": "mixed_float16"}
    cfg = make_cfg(gpt_data, tmp_path / "run", strategy="multiworker", **train)
    code, output = launch(cfg, tmp_path)
    assert code == 0, output
    (first, w0), (second, w1) = worker_result(tmp_path, 0), worker_result(tmp_path, 1)
    for result in (first, second):
        assert result["train"]["loss_scale"] > 1 and result["train"]["skipped_steps"] == 0
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
    single, summary = reference(gpt_data, tmp_path / "single", 2, **train)
    assert first["train"]["loss"] == pytest.approx(summary["train"]["loss"], rel=1e-3)
    assert_weights_close(w0, weights(single), rtol=1e-3, atol=1e-5)


# Long enough to be signalled mid-run; the numerics of EQUIVALENCE, so the resumed workers can
# be compared with one uninterrupted process.
PREEMPTION = {**EQUIVALENCE, "max_steps": 1000, "xla": False}


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigterm_saves_on_every_worker_and_a_restart_resumes_there(gpt_data, tmp_path):
    cfg = make_cfg(gpt_data, tmp_path / "run", strategy="multiworker", **PREEMPTION)
    first = tmp_path / "first"
    launcher = launch_in_background(cfg, first)
    try:
        wait_for(lambda: "step 3/1000" in read_log(first, "launch.txt"), TIMEOUT, "step 3")
        launcher.send_signal(signal.SIGTERM)  # tfbig-launch forwards it to both workers
        code = launcher.wait(timeout=TIMEOUT)
    finally:
        kill_all([launcher])
    output = read_log(first, "launch.txt")
    assert code == 143, output
    (a, _), (b, _) = worker_result(first, 0), worker_result(first, 1)
    step = a["step"]
    assert a["preempted"] and b["preempted"] and b["step"] == step and 3 <= step < 1000
    assert tf.train.latest_checkpoint(str(tmp_path / "run")).endswith(f"ckpt-{step}")
    assert "Traceback" not in output

    second = tmp_path / "second"
    code, output = launch(cfg, second, extra=("--steps=2",))
    assert code == 0, output
    (a, w0), (b, w1) = worker_result(second, 0), worker_result(second, 1)
    assert a["restored_step"] == b["restored_step"] == step and a["step"] == step + 2
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
    single, _ = reference(gpt_data, tmp_path / "single", 2, steps=step + 2, **PREEMPTION)
    single.recorded.assert_equal(w0, atol=1e-7)


@pytest.mark.slow  # a launch of its own; a death ending a job: tests/test_supervisor.py's fast tests
@pytest.mark.multiproc
def test_a_dead_worker_makes_the_other_fail_fast_with_a_clear_message(gpt_data, tmp_path):
    cfg = make_cfg(gpt_data, tmp_path / "run", strategy="multiworker", max_steps=100000)
    command = [sys.executable, "-m", "tfbig.train", *cli_flags(cfg)]
    procs = start_workers(tmp_path, command, tf_config_envs())
    try:
        wait_for(lambda: "step 3/" in read_log(tmp_path, "log0.txt"), TIMEOUT, "step 3")
        procs[1].kill()
        start = time.monotonic()
        code = procs[0].wait(timeout=TIMEOUT)
        elapsed = time.monotonic() - start
    finally:
        kill_all(procs)
    output = read_log(tmp_path, "log0.txt")
    assert code == 1 and elapsed < 60, output[-3000:]
    assert "tfbig-train: stopped because another worker died" in output, output[-3000:]
    assert "/job:worker/replica:0/task:1" in output  # names the worker that is gone


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_hung_worker_makes_the_other_fail_after_the_collective_timeout(gpt_data, tmp_path):
    cfg = make_cfg(gpt_data, tmp_path / "run", strategy="multiworker", max_steps=50)
    cfg.multiworker.collective_timeout = 5.0
    command = [sys.executable, WORKER, write_config(cfg, tmp_path), str(tmp_path),
               "--hang_rank=1"]  # after 2 steps worker 1 sleeps (alive, heartbeats fine)
    procs = start_workers(tmp_path, command, tf_config_envs())
    try:
        wait_for(lambda: "hanging" in read_log(tmp_path, "log1.txt"), TIMEOUT, "the hang")
        start = time.monotonic()
        code = procs[0].wait(timeout=TIMEOUT)
        elapsed = time.monotonic() - start
    finally:
        kill_all(procs)
    output = read_log(tmp_path, "log0.txt")
    assert code != 0 and elapsed < 5 + 30, output[-3000:]
    assert "DeadlineExceededError" in output and "Collective has timed out" in output


@pytest.mark.slow  # tfbig-launch's handling of a dead worker: tests/test_supervisor.py's fast tests on real processes; a dead worker failing the other fast: the test above
@pytest.mark.multiproc
def test_kill_under_tfbig_launch_fails_the_job_and_stops_the_rest(gpt_data, tmp_path):
    cfg = make_cfg(gpt_data, tmp_path / "run", strategy="multiworker", max_steps=100000)
    launcher = launch_in_background(cfg, tmp_path)
    try:
        wait_for(lambda: "step 3/" in read_log(tmp_path, "launch.txt"), TIMEOUT, "step 3")
        workers = psutil.Process(launcher.pid).children()
        victim = [w for w in workers if "TF_CONFIG" in w.environ()
                  and '"index": 1' in w.environ()["TF_CONFIG"]][0]
        victim.kill()
        code = launcher.wait(timeout=60)
    finally:
        kill_all([launcher])
    output = read_log(tmp_path, "launch.txt")
    assert code == 137, output[-3000:]  # 128 + SIGKILL, the dead worker's status
    assert "worker 1 exited with code 137; killing the other workers" in output
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)


@pytest.mark.slow  # tf.distribute's all-reduce over replicas: the two TF_CONFIG workers' case (default) runs the same strategy code
@pytest.mark.multiproc
def test_mirrored_over_two_cpu_devices_equals_single_device(gpt_data, tmp_path):
    # One input pipeline; its consecutive per-replica batches go to the replicas in order, so
    # the single device with the global batch reads the same examples in each step.
    train = {**EQUIVALENCE, "grad_accum_steps": 1, "xla": False}
    cfg = make_cfg(gpt_data, tmp_path / "run", strategy="mirrored", **train)
    proc = subprocess.run([sys.executable, WORKER, write_config(cfg, tmp_path), str(tmp_path),
                           "--cpu_devices=2"], env=worker_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary, mirrored = worker_result(tmp_path, 0)
    assert summary["num_replicas"] == 2
    single = Trainer(make_cfg(gpt_data, tmp_path / "single", **train))
    recorded = RecordedGradients(single)
    single.fit()
    recorded.assert_equal(mirrored, atol=1e-7)


def free_port_pair(low=20000, high=40000):
    """A port p in [low, high) with p and p + 1 free (SlurmClusterResolver's port layout)."""
    for base in random.sample(range(low, high - 1), 200):
        sockets = [socket.socket() for _ in range(2)]
        try:
            for offset, s in enumerate(sockets):
                s.bind(("localhost", base + offset))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no two consecutive free ports")


@pytest.mark.slow
@pytest.mark.multiproc
def test_srun_environment_makes_a_two_worker_cluster(gpt_data, tmp_path, monkeypatch):
    # What srun sets for 2 tasks on one node; the job id selects the ports (20000 + id).
    monkeypatch.delenv("TF_CONFIG", raising=False)
    job = free_port_pair() - 20000
    envs = [{"SLURM_JOB_ID": str(job), "SLURM_PROCID": str(task), "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2"}
            for task in range(2)]
    cfg = make_cfg(gpt_data, tmp_path / "run", strategy="multiworker", max_steps=2)
    procs = start_workers(tmp_path, [sys.executable, WORKER, write_config(cfg, tmp_path),
                                     str(tmp_path)], envs)
    try:
        codes = [proc.wait(timeout=TIMEOUT) for proc in procs]
    finally:
        kill_all(procs)
    assert codes == [0, 0], read_log(tmp_path, "log0.txt")[-3000:]
    (first, w0), (second, w1) = worker_result(tmp_path, 0), worker_result(tmp_path, 1)
    assert first["num_replicas"] == second["num_replicas"] == 2
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("strategy, options, env, message", [
    ("multiworker", {"collective": "mpi"}, {}, "--collective='mpi': expected one of"),
    ("multiworker", {"collective": "nccl"}, {}, "--collective=nccl needs GPUs"),
    ("multiworker", {"collective_timeout": -1.0}, {}, "--collective_timeout=-1.0: expected"),
    ("mirrored", {"collective": "ring"}, {}, "--collective=ring applies to --strategy=multi"),
    ("multiworker", {"cluster_resolver": "k8s"}, {}, "--cluster_resolver='k8s': expected"),
    ("multiworker", {"cluster_resolver": "tf_config"}, {}, "TF_CONFIG is not set"),
    ("multiworker", {}, {"TF_CONFIG": "{worker: 1}"}, "TF_CONFIG is not valid JSON"),
])
def test_bad_options_are_refused_naming_the_flag(strategy, options, env, message, monkeypatch):
    from tfbig.config import ExperimentConfig
    from tfbig.training.registry import get_strategy

    monkeypatch.delenv("TF_CONFIG", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = ExperimentConfig()
    for key, value in options.items():
        setattr(cfg.multiworker, key, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        get_strategy(strategy, cfg)
