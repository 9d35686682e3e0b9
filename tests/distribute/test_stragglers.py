"""Stragglers named during training (tfbig/training/stragglers.py): on 2 real Horovod ranks, the
rank tfbig-doctor's test hook slows is named with its host in the log and the summary; the
other is not."""
import re
import socket

import pytest

from test_horovod import horovodrun, read

TRAIN = ["-m", "tfbig.train", "--strategy=horovod", "--preset=tiny", "--num_layers=2",
         "--hidden_size=32", "--num_heads=4", "--seq_length=16", "--batch_size=8",
         "--max_steps=4", "--log_every=1", "--checkpoint_every=100", "--eval_steps=1",
         "--sample_tokens=0", "--noxla", "--dropout=0", "--warmup_steps=1", "--peak_tflops=1",
         "--monitor_interval_ms=0", "--straggler_every=2"]  # not --deterministic: the
# all-reduce is timed (a fast rank's wait for the slow one is not its own work)


@pytest.mark.slow  # a horovodrun launch (1-8 min on the shared 2 cores)
@pytest.mark.multiproc
def test_a_rank_slowed_on_purpose_is_named_with_its_host(gpt_data, tmp_path):
    env = {"TFBIG_DOCTOR_TEST_DELAY_RANK": "1", "TFBIG_DOCTOR_TEST_DELAY_SECONDS": "0.5"}
    code = horovodrun([*TRAIN, f"--data_dir={gpt_data}", f"--model_dir={tmp_path / 'run'}"],
                      tmp_path / "log.txt", env=env)
    output = read(tmp_path / "log.txt")
    assert code == 0, output[-5000:]
    host = re.escape(socket.gethostname())
    named = re.findall(rf"straggler at step (\d+): rank (\d) on host {host} takes (\d+\.\d+) s "
                       rf"per step of its own work, (\d+)% below the median rate", output)
    assert [(step, rank) for step, rank, _, _ in named] == [("2", "1"), ("4", "1")], output[-5000:]
    assert all(float(seconds) >= 0.5 for _, _, seconds, _ in named)
    assert re.search(rf"stragglers: rank 1 on host {host} \(at step 2, 4\)", output)
