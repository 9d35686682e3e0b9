"""Chaos under the supervisor (tfbig-launch --max_restarts): 10 SIGKILLs at random moments of a
deterministic run (a seeded draw of when and which process: starting, building, compiling,
training, saving), on 2 TF_CONFIG workers and on 2 Horovod ranks (not elastic). The job ends,
every kill was a restart, and the final weights are bit-identical to an uninterrupted run's.
Slow (minutes each: every restart starts TensorFlow again); the default run keeps the
supervisor's rules on real processes (tests/test_supervisor.py)."""
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


def random_kills(log, launcher, find, seed):
    """SIGKILL one of the job's two processes (drawn) at a drawn moment, 0.5-25 s after the
    job's last (re)start, KILLS times; waits for each restart. Returns the kills as (seconds
    after the (re)start, the process's index, the last step this attempt logged before it)."""
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
        while len(restart_lines(open(log).read())) < len(kills):
            assert launcher.poll() is None and time.monotonic() < deadline, open(log).read()[-4000:]
            time.sleep(0.05)
    return kills


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
    log = f"{tmp_path / 'killed'}.log"
    try:
        kills = random_kills(log, killed, find, seed=2026)
        print(f"kills (seconds after a start, process, where): {kills}")
        killed.wait(timeout=TIMEOUT)
    finally:
        stop([killed, straight])
    output = open(log).read()
    assert straight.returncode == 0, open(f"{tmp_path / 'straight'}.log").read()[-4000:]
    assert killed.returncode == 0, output[-5000:]
    assert len(restart_lines(output)) == KILLS, (kills, output[-5000:])
    assert f"step {MAX_STEPS}/{MAX_STEPS}" in output.split(restart_lines(output)[-1])[1]
    ours, reference = model_tensors(tmp_path / "killed"), model_tensors(tmp_path / "straight")
    assert len(ours) > 20 and ours.keys() == reference.keys()
    for key in reference:
        np.testing.assert_array_equal(ours[key], reference[key], err_msg=f"{key} after {kills}")
