"""Data parallel x pipeline: 2 Horovod ranks x 2 stages (logical CPU devices), launched with a
real `horovodrun -np 2 --gloo`, against the single-device run on the 2x batch.

Each rank is one data-parallel replica holding both stages; each stage's gradients are averaged
over the ranks holding it. The reference is the single-device trainer reading, per step, exactly
the examples both ranks read together (`ReplicasTask`).
"""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from equality import RecordedGradients  # noqa: E402
from test_trainer import ReplicasTask, make_cfg  # noqa: E402

from tfbig import config as config_lib  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "pipeline_horovod_worker.py")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
TIMEOUT = 300

# batch 8 = 2 replicas x 4 sequences, each split into 2 micro-batches; clipping at 0.5 is
# active, so averaging twice, summing, or clipping before averaging would change the weights.
RUN = dict(max_steps=4, batch_size=8, grad_clip_norm=0.5, dropout=0.0, hidden_size=16,
           num_heads=2, eval_steps=1)



def horovodrun(args, log_path):
    """`horovodrun -np 2 -H localhost:2 --gloo python ARGS`, bounded by TIMEOUT."""
    command = [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, *args]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}", "TF_CPP_MIN_LOG_LEVEL": "2"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


@pytest.mark.slow  # a launch; data parallel over pipelines runs by default across ranks
# (test_cross_rank's pp2_dp2_zero1)
@pytest.mark.multiproc
def test_two_replicas_of_a_two_stage_pipeline_equal_one_device_on_the_2x_batch(gpt_data,
                                                                               tmp_path):
    cfg = make_cfg(gpt_data, tmp_path / "run", strategy="pipeline", **RUN)
    cfg.pipeline.pipeline_stages = 2
    cfg.pipeline.num_microbatches = 2
    config_path = tmp_path / "experiment.json"
    config_path.write_text(json.dumps(config_lib.to_dict(cfg)))
    log = tmp_path / "horovodrun.log"
    code = horovodrun([WORKER, str(config_path), str(tmp_path)], log)
    assert code == 0, log.read_text()[-4000:]
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for r, result in enumerate(ranks):
        assert int(result["num_replicas"]) == 2 and int(result["rank"]) == r
        assert [d[-5:] for d in result["devices"]] == ["CPU:0", "CPU:1"]  # both stages
    num_weights = len([k for k in ranks[0].files if k.startswith("w")])
    rank_weights = [[result[f"w{i}"] for i in range(num_weights)] for result in ranks]
    for a, b in zip(*rank_weights):
        np.testing.assert_array_equal(a, b)  # the replicas hold identical weights

    reference_cfg = make_cfg(gpt_data, tmp_path / "single", **RUN)
    reference = Trainer(reference_cfg, task=ReplicasTask(reference_cfg.train, 2))
    recorded = RecordedGradients(reference)
    summary = reference.fit()
    assert summary["train"]["grad_norm"] > RUN["grad_clip_norm"]
    assert float(ranks[0]["loss"]) == pytest.approx(summary["train"]["loss"], rel=1e-5)
    recorded.assert_equal(rank_weights[0])
