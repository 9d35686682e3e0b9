"""ZeRO-3 and activation checkpointing of a user model that nests a functional keras-hub
backbone (tests/distribute/nested_worker.py): the transformer layers named by the backbone's
own attribute path are gathered and recomputed one at a time, every other weight (the
backbone's embeddings and final norm, the user's head) once per step; a variable belongs to
the named layer that holds it, though the backbone tracks it too. On 2 Horovod ranks it equals
one process: each step's loss (rtol 1e-5) and every trained weight (tests/equality.py's rule).
"""
import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from equality import RecordedGradients  # noqa: E402
from test_horovod import horovodrun, read  # noqa: E402

import nested_worker  # noqa: E402

from tfbig.api import configure  # noqa: E402
from tfbig.tasks.user import FunctionTask  # noqa: E402
from tfbig.tasks.user_adapter import UserTask  # noqa: E402
from tfbig.training.finetune import LossRecorder  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

WORKER = os.path.join(HERE, "nested_worker.py")
FLAGS = dict(max_steps=4, batch_size=8, learning_rate=3e-3, warmup_steps=1, xla=False,
             log_every=1, eval_steps=0, grad_clip_norm=0.5, peak_tflops=1.0)


def one_process(model_dir):
    """The same task and flags in this process: (losses, RecordedGradients)."""
    task = UserTask(FunctionTask(nested_worker.model_fn, nested_worker.loss_fn,
                                 nested_worker.dataset_fn, name="backbone_lm",
                                 checkpoint_layers=nested_worker.NAMED))
    trainer = Trainer(configure(model_dir=str(model_dir), **FLAGS), task=task,
                      logger=LossRecorder(str(model_dir), True, 4))
    recorded = RecordedGradients(trainer)
    trainer.fit()
    return trainer.logger.losses, recorded


def outputs(model_dir):
    losses = json.loads((model_dir / "losses.json").read_text())
    paths = json.loads((model_dir / "weights.json").read_text())
    with np.load(model_dir / "weights.npz") as saved:
        return losses, dict(zip(paths, (saved[f"arr_{i}"] for i in range(len(paths)))))


@pytest.mark.slow
@pytest.mark.multiproc
def test_zero3_with_recompute_of_a_nested_keras_hub_backbone_equals_one_process(tmp_path):
    flags = {**FLAGS, "strategy": "horovod", "zero_stage": 3, "activation_checkpointing": True}
    code = horovodrun([WORKER, str(tmp_path / "zero3"), json.dumps(flags)],
                      tmp_path / "log.txt")
    assert code == 0, read(tmp_path / "log.txt")[-6000:]
    assert json.loads((tmp_path / "zero3" / "zero.json").read_text())["zero_stage"] == 3
    ours, weights = outputs(tmp_path / "zero3")
    losses, recorded = one_process(tmp_path / "one")
    assert len(ours) == 4 and ours[0] != ours[-1]
    np.testing.assert_allclose(ours, losses, rtol=1e-5)
    # the backbone's 2 x 16 transformer weights, its 2 embeddings and final norm (2), the head (2)
    assert sorted(weights) == sorted(recorded.paths) and len(recorded.paths) == 2 * 16 + 2 + 2 + 2
    recorded.assert_equal({p: weights[p] for p in recorded.paths})
