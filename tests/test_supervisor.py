"""tfbig-launch --max_restarts: the supervisor that restarts the whole job (tfbig/training/supervisor.py).

The rules on small shell jobs (restart, budget, back-off, causes, what is not restarted, every
process stopped), then real training: a worker of a 2-worker TF_CONFIG job killed with SIGKILL
mid-training, the job restarted and finished, its final weights bit-identical to an
uninterrupted run's (the resume is at the exact data position).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import tensorflow as tf

from tfbig.training import supervisor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 600


def env():
    return {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2",
            "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}


def launch(*args, timeout=120):
    """python -m tfbig.commands.launch ARGS -> (exit code, stdout + stderr)."""
    done = subprocess.run([sys.executable, "-m", "tfbig.commands.launch", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def restart_lines(output):
    return [line for line in output.splitlines() if line.startswith("[tfbig-launch] restart ")]


# ---- the rules, on shell jobs ---------------------------------------------------------------
def flaky(tmp_path, *endings):
    """A launcher command whose k-th start ends as endings[k] (shell code), the rest succeed."""
    count = tmp_path / "starts"
    script = (f'n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}; '
              'echo "step $((n + 3))/9"; case $n in '
              + " ".join(f"{i}) {ending};;" for i, ending in enumerate(endings)) + " esac; exit 0")
    return ["--launcher", "--", "sh", "-c", script]


def test_a_failed_job_is_restarted_with_back_off_and_each_cause_logged(tmp_path):
    code, output = launch("--max_restarts=3", "--restart_backoff=0.1",
                          *flaky(tmp_path, "kill -9 $$", "exit 7"))
    assert code == 0, output
    first, second = restart_lines(output)
    assert re.match(r"\[tfbig-launch\] restart 1 of 3 in 0\.1 s: sh \(pid \d+\) was killed by "
                    r"SIGKILL \(exit code 137\), after its progress line of step 3;", first)
    assert re.match(r"\[tfbig-launch\] restart 2 of 3 in 0\.2 s: sh \(pid \d+\) ended with exit "
                    r"code 7, after its progress line of step 4;", second)
    assert (tmp_path / "starts").read_text().strip() == "3"


def test_the_restart_budget_is_kept_and_the_last_code_returned(tmp_path):
    code, output = launch("--max_restarts=2", "--restart_backoff=0",
                          *flaky(tmp_path, "exit 5", "exit 5", "exit 6", "exit 7"))
    assert code == 6, output
    assert len(restart_lines(output)) == 2
    assert output.rstrip().endswith("the budget of --max_restarts=2 restarts is spent")
    assert (tmp_path / "starts").read_text().strip() == "3"


def test_a_user_error_is_not_restarted(tmp_path):
    code, output = launch("--max_restarts=3", "--restart_backoff=0", *flaky(tmp_path, "exit 2"))
    assert code == 2 and not restart_lines(output), output
    assert "not restarting: sh" in output and "an error a restart repeats" in output
    assert (tmp_path / "starts").read_text().strip() == "1"


def test_bad_flags_are_one_line():
    assert launch("--max_restarts=-1", "--", "true") == (
        2, "tfbig-launch: error: --max_restarts=-1: expected 0 (no restart) or more; see "
           "tfbig-launch --help\n")
    code, output = launch("--workers=2", "--", "horovodrun", "-np", "2", "true")
    assert code == 2 and "drop --workers" in output


def test_every_process_the_launcher_started_is_stopped_before_a_restart(tmp_path):
    # The launcher starts a child in a session of its own (as horovodrun's ranks are), which
    # outlives the launcher's exit unless the supervisor stops it.
    pids = tmp_path / "pids"
    child = ("import subprocess, sys; p = subprocess.Popen(['sleep', '600'], "
             "start_new_session=True); open(sys.argv[1], 'a').write(f'{p.pid}\\n')")
    script = (f'{sys.executable} -c "{child}" {pids}; sleep 1; exit 1')
    code, output = launch("--max_restarts=1", "--restart_backoff=0", "--launcher", "--",
                          "sh", "-c", script)
    assert code == 1 and len(restart_lines(output)) == 1, output
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    for pid in started:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# ---- the run directory ----------------------------------------------------------------------
def run_dir(tmp_path, sums=True, **model):
    """A run directory with config.json and ckpt-2, ckpt-4 (ckpt-4's data file damaged if
    sums=False... it has no data at all then)."""
    path = tmp_path / "run"
    path.mkdir()
    config = {"train": {"model": "gpt", "preset": "tiny", "num_layers": 0},
              "model_config": {"num_layers": 2, "hidden_size": 32, "dropout": 0.0,
                               "attention": "auto", **model}}
    (path / "config.json").write_text(json.dumps(config))
    for step in (2, 4):
        for name in (f"ckpt-{step}.index", f"ckpt-{step}.data-00000-of-00001"):
            (path / name).write_bytes(b"x" * 10)
        from tfbig.checkpoints import integrity

        integrity.record_checkpoint(str(path / f"ckpt-{step}"))
    (path / "checkpoint").write_text('model_checkpoint_path: "ckpt-4"\n'
                                     'all_model_checkpoint_paths: "ckpt-2"\n'
                                     'all_model_checkpoint_paths: "ckpt-4"\n')
    return path


def test_a_run_directory_of_another_model_is_refused_before_anything_starts(tmp_path):
    path = run_dir(tmp_path)
    marker = tmp_path / "started"
    code, output = launch("--max_restarts=2", "--launcher", "--", "sh", "-c", f"touch {marker}",
                          "x", f"--model_dir={path}", "--preset=tiny", "--num_layers=4",
                          "--hidden_size=32", "--dropout=-1", "--attention=dense")
    assert code == 2 and not marker.exists(), output
    assert output == (f"tfbig-launch: error: --model_dir={path} holds a checkpoint of another "
                      "model than the command asks for: --num_layers=4 (its config.json: 2). "
                      "Use another --model_dir, or the run's own flags; nothing was started or "
                      "changed; see tfbig-launch --help\n")
    code, output = launch("--launcher", "--", "sh", "-c", f"touch {marker}", "x",
                          f"--model_dir={path}", "--num_layers=2", "--preset=tiny")
    assert code == 0 and marker.exists(), output  # the same model: started


def test_where_a_restart_resumes_is_named(tmp_path):
    path = run_dir(tmp_path)
    assert supervisor.resume_point(str(path)) == (4, [])
    assert "resumes from the checkpoint of step 4" in supervisor.describe_resume(str(path))
    (path / "ckpt-4.data-00000-of-00001").write_bytes(b"y" * 10)  # damaged: same size, other sum
    assert supervisor.resume_point(str(path)) == (2, [str(path / "ckpt-4")])
    assert "step 2" in supervisor.describe_resume(str(path))
    (path / "ckpt-2.index").unlink()
    assert supervisor.describe_resume(str(path)).startswith(
        f"--model_dir={path} holds no intact checkpoint ({path}/ckpt-4, {path}/ckpt-2 damaged)")
    assert supervisor.describe_resume(str(tmp_path / "new")) == (
        f"--model_dir={tmp_path / 'new'} holds no checkpoint yet: the job starts again from step 0")


def test_command_flags_and_the_default_run_dir():
    words = ["horovodrun", "-np", "2", "tfbig-train", "--model_dir", "r", "--noxla", "--seed=3"]
    assert supervisor.command_flags(words) == {"model_dir": "r", "xla": "false", "seed": "3"}
    assert supervisor.run_dir(["python", "-m", "tfbig.train", "--seed=1"]) == "runs/gpt-small"
    assert supervisor.run_dir(["python", "worker.py"]) is None


# ---- real training: a worker killed, the job restarted, the same weights --------------------
TRAIN = ["--strategy=multiworker", "--preset=tiny", "--num_layers=2", "--hidden_size=32",
         "--num_heads=4", "--seq_length=16", "--batch_size=8", "--max_steps=8", "--log_every=1",
         "--checkpoint_every=1", "--eval_steps=1", "--sample_tokens=0", "--noxla",
         "--deterministic", "--dropout=0.1", "--learning_rate=3e-3", "--warmup_steps=2",
         "--peak_tflops=1", "--monitor_interval_ms=0"]  # no CPU matmul probe, no monitor thread


def training_job(data_dir, model_dir, *launch_flags, train=()):
    """tfbig-launch --workers=2 LAUNCH_FLAGS -- python -m tfbig.train ... as a process (`train`:
    more flags of tfbig.train, later ones win)."""
    command = [sys.executable, "-m", "tfbig.commands.launch", "--workers=2", *launch_flags, "--",
               sys.executable, "-m", "tfbig.train", *TRAIN, f"--data_dir={data_dir}",
               f"--model_dir={model_dir}", *train]
    log = open(f"{model_dir}.log", "w")
    return subprocess.Popen(command, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)


def worker(launcher, index):
    for child in psutil.Process(launcher.pid).children():
        if f'"index": {index}' in child.environ().get("TF_CONFIG", ""):
            return child
    return None


def wait_for(path, text, proc, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while text not in open(path).read():
        assert proc.poll() is None, f"ended ({proc.returncode}) before {text!r}: {open(path).read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout}s"
        time.sleep(0.1)


def model_tensors(model_dir):
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(model_dir)))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.startswith("model/")}


def stop(procs):
    for proc in procs:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()


# 54-79 s (six TensorFlow starts): slow, to keep the default run's time; the default run keeps
# the supervisor's restart causes, back-off, budget and process stopping on real processes
@pytest.mark.slow
@pytest.mark.multiproc
def test_a_worker_killed_mid_training_is_restarted_and_ends_bit_identical(gpt_data, tmp_path):
    straight = training_job(gpt_data, tmp_path / "straight")  # beside it: the reference
    killed = training_job(gpt_data, tmp_path / "killed", "--max_restarts=2", "--restart_backoff=0.5")
    log = f"{tmp_path / 'killed'}.log"
    try:
        wait_for(log, "step 4/8", killed)
        victim = worker(killed, 1)
        victim.kill()  # SIGKILL, mid-training
        killed.wait(timeout=TIMEOUT)
        straight.wait(timeout=TIMEOUT)
    finally:
        stop([killed, straight])
    output = open(log).read()
    assert killed.returncode == 0 and straight.returncode == 0, output[-5000:]
    (line,) = restart_lines(output)
    assert re.search(rf"restart 1 of 2 in 0\.5 s: worker 1 \(pid {victim.pid}\) was killed by "
                     r"SIGKILL \(exit code 137\), after its progress line of step (\d+); it "
                     r"resumes from the checkpoint of step (\d+) in --model_dir=", line), line
    logged, resumed = map(int, re.search(r"step (\d+); it resumes from .* step (\d+)", line).groups())
    # --async_checkpoint: the save of step `logged` waits for the write of the one before it
    assert 4 <= logged < 8 and resumed in (logged - 2, logged - 1, logged, logged + 1)
    assert f"resumed from {tmp_path / 'killed'}/ckpt-{resumed} at step {resumed}" in output
    assert "step 8/8" in output.split(line)[1]
    ours, reference = model_tensors(tmp_path / "killed"), model_tensors(tmp_path / "straight")
    assert len(ours) > 20 and ours.keys() == reference.keys()
    for key in reference:
        np.testing.assert_array_equal(ours[key], reference[key], err_msg=key)


def horovod_job(data_dir, model_dir, *launch_flags, train=(), hosts=("-H", "localhost:2"),
                env_more=None):
    """tfbig-launch LAUNCH_FLAGS -- horovodrun -np 2 HOSTS ... python -m tfbig.train
    --strategy=horovod (`train`: as training_job's; `env_more`: more environment)."""
    flags = [f if f != "--strategy=multiworker" else "--strategy=horovod" for f in TRAIN]
    command = [sys.executable, "-m", "tfbig.commands.launch", *launch_flags, "--",
               "horovodrun", "-np", "2", *hosts, "--gloo",
               sys.executable, "-m", "tfbig.train", *flags, f"--data_dir={data_dir}",
               f"--model_dir={model_dir}", *train]
    log = open(f"{model_dir}.log", "w")
    return subprocess.Popen(command, cwd=ROOT, env={**env(), "TF_NUM_INTEROP_THREADS": "1",
                                                    "TF_NUM_INTRAOP_THREADS": "1",
                                                    **(env_more or {})},
                            stdout=log, stderr=subprocess.STDOUT)


def horovod_rank(launcher, rank):
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("HOROVOD_RANK") == str(rank) and "tfbig.train" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_horovod_rank_killed_mid_training_is_restarted_and_ends_bit_identical(gpt_data, tmp_path):
    straight = horovod_job(gpt_data, tmp_path / "straight")
    killed = horovod_job(gpt_data, tmp_path / "killed", "--max_restarts=2", "--restart_backoff=0.5")
    log = f"{tmp_path / 'killed'}.log"
    try:
        wait_for(log, "step 4/8", killed)
        victim = horovod_rank(killed, 1)
        victim.kill()
        killed.wait(timeout=TIMEOUT)
        straight.wait(timeout=TIMEOUT)
    finally:
        stop([killed, straight])
    output = open(log).read()
    assert killed.returncode == 0 and straight.returncode == 0, output[-5000:]
    (line,) = restart_lines(output)
    assert re.search(r"restart 1 of 2 in 0\.5 s: horovodrun \(pid \d+\) ended with exit code 1 "
                     r"after its rank 1 ended: exit code 137, after its progress line of step \d+; "
                     r"it resumes from the checkpoint of step \d+", line), line
    ours, reference = model_tensors(tmp_path / "killed"), model_tensors(tmp_path / "straight")
    assert len(ours) > 20 and ours.keys() == reference.keys()
    for key in reference:
        np.testing.assert_array_equal(ours[key], reference[key], err_msg=key)


def kill_when(log, text, since, launcher, index):
    """Once `text` is in the log after offset `since`, SIGKILL worker `index`; returns (whether
    the kill landed on a live worker, the log offset then)."""
    deadline = time.monotonic() + TIMEOUT
    while text not in open(log).read()[since:]:
        assert launcher.poll() is None and time.monotonic() < deadline, open(log).read()[-3000:]
        time.sleep(0.05)
    victim = worker(launcher, index)
    while victim is None and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # after a restart line: the new workers start after the back-off
        victim = worker(launcher, index)
    try:
        victim.kill()
    except (AttributeError, psutil.NoSuchProcess):  # the job had just finished
        return False, len(open(log).read())
    return True, len(open(log).read())


@pytest.mark.slow
@pytest.mark.multiproc
def test_chaos_kills_before_step_1_mid_run_and_at_the_final_save_end_bit_identical(gpt_data, tmp_path):
    straight = training_job(gpt_data, tmp_path / "straight")
    killed = training_job(gpt_data, tmp_path / "killed", "--max_restarts=5", "--restart_backoff=0.2")
    log = f"{tmp_path / 'killed'}.log"
    landed = []
    try:
        ok, offset = kill_when(log, "step 3/8", 0, killed, 1)  # mid-training
        landed.append(ok)
        # the restarted workers, still importing and building (no progress line yet)
        ok, offset = kill_when(log, "[tfbig-launch] restart 1", offset, killed, 0)
        landed.append(ok and "step " not in open(log).read()[offset:])
        ok, offset = kill_when(log, "step 8/8", offset, killed, 1)  # the final save follows
        landed.append(ok)
        killed.wait(timeout=TIMEOUT)
        straight.wait(timeout=TIMEOUT)
    finally:
        stop([killed, straight])
    output = open(log).read()
    assert killed.returncode == 0 and straight.returncode == 0, output[-5000:]
    assert landed[0] and landed[1], output[-5000:]
    assert len(restart_lines(output)) == sum(landed), output[-5000:]
    assert "holds no checkpoint yet" not in output  # every restart resumed from a checkpoint
    ours, reference = model_tensors(tmp_path / "killed"), model_tensors(tmp_path / "straight")
    for key in reference:
        np.testing.assert_array_equal(ours[key], reference[key], err_msg=key)
