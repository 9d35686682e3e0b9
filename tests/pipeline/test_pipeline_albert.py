"""ALBERT through the pipeline: shared layer weights read by several stages, a tied MLM table.

ALBERT's masked-LM loss is normalised per micro-batch (by its count of masked tokens), so the
reference is the single-device gradient accumulated over the same M micro-batches.
"""
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from equality import RecordedGradients  # noqa: E402
from test_trainer import make_cfg, weights  # noqa: E402

from tfbig.data import shakespeare# noqa: E402
from tfbig.distribute.base import accumulate_gradients  # noqa: E402
from tfbig.pipeline.strategy import PipelineStrategy  # noqa: E402
from tfbig.tasks.albert import AlbertTask  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

BATCH = 8


@pytest.fixture(scope="module")
def albert_data(tmp_path_factory):
    """tfbig-prep --format=albert of Macbeth's scenes: seq_length 32, vocab 400."""
    from tfbig.data import prepare

    root = tmp_path_factory.mktemp("albert_text")
    play = next(p for p in shakespeare.shakespeare_plays() if shakespeare.play_name(p) == "macbeth")
    with open(play, encoding="utf-8") as file:
        for index, scene in enumerate(shakespeare.play_scenes(file.read())):
            (root / f"scene{index:03d}.txt").write_text(scene, encoding="utf-8")
    out = str(tmp_path_factory.mktemp("albert_data"))
    prepare([str(root)], out, seq_length=32, vocab_size=400, shard_size_mb=0.5,
            doc_per_line=False, validation_fraction=0.2, format="albert",
            format_options={"max_predictions_per_seq": 5, "dupe_factor": 1})
    return out


def albert_cfg(data_dir, model_dir, **pipeline):
    cfg = make_cfg(data_dir, model_dir, model="albert", hidden_size=16, num_heads=2,
                   num_layers=4, batch_size=BATCH, optimizer="lamb", seq_length=32)
    cfg.albert.num_groups, cfg.albert.embedding_size = 2, 8
    for key, value in pipeline.items():
        setattr(cfg.pipeline, key, value)
    return cfg


@pytest.mark.parametrize("num_stages,schedule,checkpointing,jit_compile", [
    pytest.param(4, "gpipe", True, False, marks=pytest.mark.slow, id="gpipe-recompute"),
    pytest.param(4, "1f1b", False, True, id="1f1b-xla")])
def test_gradients_equal_single_device_accumulation(albert_data, tmp_path, num_stages, schedule,
                                                    checkpointing, jit_compile):
    num_micro = 4
    cfg = albert_cfg(albert_data, tmp_path, pipeline_stages=num_stages, schedule=schedule,
                     num_microbatches=num_micro, activation_checkpointing=checkpointing)
    task = AlbertTask(cfg.train, cfg.albert)
    keras.utils.set_random_seed(0)
    strategy = PipelineStrategy(cfg)
    model = strategy.build_model(task)
    # layer_1 runs group_0, which stage 0 owns: its weights are read across devices
    assert strategy.plan[1].layer_names == ["layer_1"]
    batch = next(iter(task.dataset("train", BATCH, shuffle=False)))
    step = strategy.make_forward_backward(None, model.trainable_variables, lambda l: l,
                                          jit_compile)
    loss, grads, metrics = step(tf.nest.map_structure(lambda t: t[None], batch))
    micro = tf.nest.map_structure(
        lambda t: tf.reshape(t, [num_micro, BATCH // num_micro] + t.shape[1:].as_list()), batch)
    ref_loss, ref_grads, ref_metrics = accumulate_gradients(
        lambda b, training: task.loss(model, b, training), model.trainable_variables, micro,
        lambda l: l)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert float(metrics["mlm_accuracy"]) == pytest.approx(float(ref_metrics["mlm_accuracy"]))
    for v, g, r in zip(model.trainable_variables, grads, ref_grads):
        r = r.numpy()
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-5, atol=1e-5 * np.abs(r).max(),
                                   err_msg=v.path)


@pytest.mark.slow  # 12 s: the default run has GPT's stages; ALBERT's across ranks are slow too
# (test_tensor_pipeline's albert_pp2_tp2_sequence)
def test_albert_training_equals_single_device_accumulation(albert_data, tmp_path):
    """M micro-batches through 2 stages = the single-device trainer accumulating M steps."""
    pipeline = albert_cfg(albert_data, tmp_path / "pipe", pipeline_stages=2,
                          num_microbatches=2)
    pipeline.train.strategy = "pipeline"
    single = albert_cfg(albert_data, tmp_path / "single")
    single.train.grad_accum_steps = 2
    trainers = [Trainer(cfg) for cfg in (pipeline, single)]
    recorded = RecordedGradients(trainers[1])
    summaries = [trainer.fit() for trainer in trainers]
    assert summaries[0]["train"]["loss"] == pytest.approx(summaries[1]["train"]["loss"],
                                                          rel=1e-5)
    recorded.assert_equal(weights(trainers[0]))
