"""Chaos under the supervisor (tfbig-launch --max_restarts): 10 SIGKILLs at random moments of a
deterministic run (a seeded draw of when and which process: starting, building, compiling,
training, saving), on 2 TF_CONFIG workers and on 2 Horovod ranks (not elastic). The job ends,
every kill was a restart, and the final weights are bit-identical to an uninterrupted run's.
Slow (minutes each: every restart starts TensorFlow again); the default run keeps the
supervisor's rules on real processes (tests/test_supervisor.py)."""
import os
import random
import re
import time

import numpy as np
import psutil
import pytest

from test_supervisor import (TIMEOUT, horovod_job, horovod_rank, model_tensors, restart_lines,
                             stop, training_job, worker)

KILLS = 10
MAX_STEPS = 12  # long enough that the job is still running when the 10th kill comes
ELASTIC_STEPS = 80  # the same for an elastic job, whose resets cost no restart (see its test)


def random_kills(log, launcher, find, seed, recoveries=restart_lines):
    """SIGKILL one of the job's two processes (drawn) at a drawn moment, 0.5-25 s after the
    job's last (re)start, KILLS times; waits for each recovery (a line of `recoveries(log
    text)`: a restart). Returns the kills as (seconds after the (re)start, the process's index,
    the last step this attempt logged before it)."""
    rng, kills = random.Random(seed), []
    while len(kills) < KILLS:
        delay, index = rng.uniform(0.5, 25.0), rng.randrange(2)
        started = time.monotonic()
        while time.monotonic() - started < delay:
            assert launcher.poll() is None, f"ended after {len(kills)} kills:\n" + open(log).read()[-4000:]
            time.sleep(0.05)
        victim = find(launcher, index)
        if victim is None:  # not started yet (the back-off, horovodrun's own start): draw again
            continue
        before = open(log).read()
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            continue
        steps = re.findall(r"\] step (\d+)/", before.split("[tfbig-launch] restart ")[-1])
        kills.append((round(delay, 1), index, f"after step {steps[-1]}" if steps else "before step 1"))
        deadline = time.monotonic() + TIMEOUT  # the supervisor notices and restarts the job
        while len(recoveries(open(log).read())) < len(kills):
            assert launcher.poll() is None and time.monotonic() < deadline, open(log).read()[-4000:]
            time.sleep(0.05)
    return kills


def survived(tmp_path, killed, straight, find, recoveries=restart_lines):
    """The kills (random_kills) of the `killed` job (its log: tmp_path/killed.log) until it
    ends; both it and the `straight` one must end with code 0. Returns (kills, its log)."""
    log = f"{tmp_path / 'killed'}.log"
    try:
        kills = random_kills(log, killed, find, seed=2026, recoveries=recoveries)
        print(f"kills (seconds after a start, process, where): {kills}")
        killed.wait(timeout=TIMEOUT)
    finally:
        stop([killed, straight])
    output = open(log).read()
    assert straight.returncode == 0, open(f"{tmp_path / 'straight'}.log").read()[-4000:]
    assert killed.returncode == 0, output[-5000:]
    return kills, output


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("job, find", [(training_job, worker), (horovod_job, horovod_rank)],
                         ids=["tf_config_workers", "horovod_ranks"])
def test_ten_kills_at_random_moments_end_bit_identical(gpt_data, tmp_path, job, find):
    flags = [f"--max_steps={MAX_STEPS}"]
    straight = job(gpt_data, tmp_path / "straight", train=flags)
    straight.wait(timeout=TIMEOUT)  # before the chaos: the two jobs do not share the cores
    killed = job(gpt_data, tmp_path / "killed", f"--max_restarts={KILLS}", "--restart_backoff=0.2",
                 train=flags)
    kills, output = survived(tmp_path, killed, straight, find)
    assert len(restart_lines(output)) == KILLS, (kills, output[-5000:])
    assert f"step {MAX_STEPS}/{MAX_STEPS}" in output.split(restart_lines(output)[-1])[1]
    ours, reference = model_tensors(tmp_path / "killed"), model_tensors(tmp_path / "straight")
    assert len(ours) > 20 and ours.keys() == reference.keys()
    for key in reference:
        np.testing.assert_array_equal(ours[key], reference[key], err_msg=f"{key} after {kills}")


def elastic_job(data_dir, model_dir, *launch_flags, train=(), step_seconds=0.0):
    """horovod_job's run as an elastic job: 1 or 2 ranks, on two names of this host (a dead
    rank's host is left out by Horovod for the rest of that launch); each rank sleeps
    `step_seconds` in each step (tfbig-doctor's test hook)."""
    discovery = f"{model_dir}.hosts.sh"
    with open(discovery, "w") as f:
        f.write("#!/bin/sh\nprintf 'localhost:1\\n127.0.0.1:1\\n'\n")
    os.chmod(discovery, 0o755)
    return horovod_job(data_dir, model_dir, *launch_flags, hosts=[
        "--min-np", "1", "--max-np", "2", "--host-discovery-script", discovery],
        train=["--elastic", "--elastic_commit_every=1", *train],
        env_more={"TFBIG_DOCTOR_TEST_DELAY_RANK": "0,1",
                  "TFBIG_DOCTOR_TEST_DELAY_SECONDS": str(step_seconds)} if step_seconds else {})


def recoveries(output):
    """The job's restarts (by tfbig-launch) and its resets (elastic, in the surviving ranks)."""
    return restart_lines(output) + re.findall(r"elastic: world \d+ -> \d+ ranks", output)


@pytest.mark.slow
@pytest.mark.multiproc
def test_ten_kills_of_an_elastic_job_end_within_float_order_noise(gpt_data, tmp_path):
    """The same chaos on elastic Horovod under the supervisor: a rank that dies mid-run leaves
    the other training on alone (a reset from the last commit, no restart); a death before
    every rank joined Horovod's first rendezvous (Gloo aborts the others in C++), or the death
    of the last rank, ends the launch and the supervisor restarts it from the newest
    checkpoint. The world changes between 2 and 1 rank, and with it the order of each step's
    gradient sum: the weights match the uninterrupted run's to float-order noise, not bits
    (measured: at most 4.6e-5 apart, in a key bias, whose gradient is zero up to rounding and
    which Adam's normalisation moves by rounding's sign; the tolerance tells steps apart: the
    uninterrupted run's weights one step before its end fail it in 23 of 28 variables).
    A rank that survives alone finishes the run in seconds: the steps are slowed (2 s each, a
    sleep) and more of them, so that the job is still running at the 10th kill."""
    flags = [f"--max_steps={ELASTIC_STEPS}", "--dropout=0.0"]
    straight = elastic_job(gpt_data, tmp_path / "straight", train=flags)
    straight.wait(timeout=TIMEOUT)
    killed = elastic_job(gpt_data, tmp_path / "killed", f"--max_restarts={KILLS}",
                         "--restart_backoff=0.2", train=flags, step_seconds=2.0)
    kills, output = survived(tmp_path, killed, straight, horovod_rank, recoveries)
    restarts, resets = restart_lines(output), recoveries(output)[len(restart_lines(output)):]
    print(f"{len(restarts)} restarts, {len(resets)} elastic resets")
    assert len(restarts) + len(resets) == KILLS and restarts and resets, (kills, output[-5000:])
    assert f"step {ELASTIC_STEPS}/{ELASTIC_STEPS}" in output.split(restarts[-1])[1]
    ours, reference = model_tensors(tmp_path / "killed"), model_tensors(tmp_path / "straight")
    assert len(ours) > 20 and ours.keys() == reference.keys()
    worst = max(float(np.max(np.abs(ours[k] - reference[k]))) for k in reference)
    print(f"largest weight difference: {worst:.3g}")
    for key in reference:
        np.testing.assert_allclose(ours[key], reference[key], rtol=1e-3, atol=1e-4,
                                   err_msg=f"{key} after {kills}")
