"""Evaluation on every replica: padded last batch, gathered in dataset order, each record once."""
import math

import numpy as np
import pytest
import tensorflow as tf

from tfbig.training import evaluation
from tfbig.training.trainer import Trainer
from test_trainer import make_cfg


def _records(n):
    return lambda: tf.data.Dataset.from_tensor_slices({"x": tf.range(n)})


@pytest.mark.parametrize("pipelines,replicas", [(1, 1), (2, 2), (1, 2), (2, 4)])
def test_replicas_gathered_in_order_are_the_dataset_once(pipelines, replicas):
    """12 records, global batch 8: two global batches, the second padded with 4 repeats;
    replica r of a batch holds rows [r, r + 1) x 8 / replicas (its pipeline's in turn)."""
    global_batch, num = 8, evaluation.num_batches(12, 8)
    assert num == 2
    per_replica = []  # [replica][batch] -> {"x", "valid"}
    for p in range(pipelines):
        context = tf.distribute.InputContext(pipelines, p, replicas)
        dataset = evaluation.padded_batches(lambda: _records(12)().batch(8), global_batch, num)
        elements = list(dataset(context).as_numpy_iterator())
        local = replicas // pipelines  # tf.distribute hands a pipeline's elements out in turn
        per_replica += [elements[i::local] for i in range(local)]
    gathered = [{k: np.concatenate([per_replica[r][b][k] for r in range(replicas)])
                 for k in ("x", "valid")} for b in range(num)]
    assert [len(g["x"]) for g in gathered] == [8, 8]
    np.testing.assert_array_equal(evaluation.drop_padding(gathered)["x"], np.arange(12))


def test_eval_steps_caps_the_global_batches():
    assert evaluation.num_batches(12, 16) == 1
    assert evaluation.num_batches(100, 16, limit=3) == 3
    assert evaluation.num_batches(100, 16, limit=0) == 7


def test_a_split_smaller_than_one_batch_is_evaluated_whole(gpt_data, tmp_path):
    """The validation split (fewer records than one global batch) is scored record by record:
    the padded rows do not count."""
    records = Trainer(make_cfg(gpt_data, tmp_path / "probe")).task.manifest.splits[
        "validation"].records
    batch = 16 * math.ceil((records + 1) / 16)
    assert records % batch, "the last (only) batch must be padded"
    trainer = Trainer(make_cfg(gpt_data, tmp_path / "run", batch_size=batch, eval_steps=0))
    assert trainer.eval_batches == 1
    summary = trainer.evaluate()
    rows = next(trainer.task.dataset("validation", records, shuffle=False, repeat=False,
                                     drop_remainder=False).as_numpy_iterator())
    assert len(rows["input_ids"]) == records
    expected = trainer.task.validation_step(trainer.model, rows)["loss"].numpy().mean()
    assert summary["loss"] == pytest.approx(float(expected), rel=1e-6)
