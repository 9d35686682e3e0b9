"""The single-device training loop: learning, accumulation, XLA, precision, resume, failures."""
import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from tfbig.config import ExperimentConfig
from tfbig.models.generation import Generator
from tfbig.convert.run_dir import load_model
from tfbig.tasks.gpt import GPTTask
from tfbig.training.trainer import NonFiniteLossError, Trainer


def make_cfg(data_dir, model_dir, **train):
    cfg = ExperimentConfig()
    defaults = dict(data_dir=data_dir, model_dir=str(model_dir), preset="tiny", seq_length=16, num_layers=2,
                    hidden_size=32, num_heads=4, dropout=0.0, batch_size=8, max_steps=4,
                    learning_rate=3e-3, warmup_steps=2, log_every=1, checkpoint_every=1000,
                    eval_steps=2, deterministic=True, sample_tokens=0, xla=False)
    for key, value in {**defaults, **train}.items():
        setattr(cfg.train, key, value)
    # MFU against a given peak: no CPU matmul probe (~5 s of every core at each process's first
    # fit per precision, while other ranks wait); tests/profiling measure with the probe
    cfg.profile.peak_tflops = 1.0
    return cfg


def weights(trainer):
    return [v.numpy() for v in trainer.model.trainable_variables]


def assert_weights_close(a, b, rtol=1e-5, atol=1e-7):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


class ReplicasTask:
    """What `num_replicas` data-parallel processes read, for one process: each batch is the
    concatenation of their batches of batch_size / num_replicas (the distributed tests'
    single-device reference). Wraps any task (GPT by default); the rest is the task's."""

    def __init__(self, train, num_replicas, task=None):
        self.task = task or GPTTask(train)
        self.num_replicas = num_replicas

    def __getattr__(self, name):
        return getattr(self.task, name)

    def dataset(self, split, batch_size, input_context=None, **kwargs):
        if split != "train":  # evaluation reads the split in order whatever the layout
            return self.task.dataset(split, batch_size, input_context, **kwargs)
        n = self.num_replicas
        parts = tuple(self.task.dataset(split, batch_size // n,
                                        tf.distribute.InputContext(n, i, n), **kwargs)
                      for i in range(n))
        return tf.data.Dataset.zip(parts).map(
            lambda *batches: tf.nest.map_structure(lambda *t: tf.concat(t, 0), *batches))


def test_loss_falls_on_a_tiny_corpus(gpt_data, tmp_path):
    trainer = Trainer(make_cfg(gpt_data, tmp_path, max_steps=40, log_every=40, xla=True))
    first = trainer.evaluate()["loss"]
    summary = trainer.fit()
    assert summary["eval"]["loss"] < first - 0.5
    assert 0 < summary["eval"]["bits_per_byte"] < first
    assert np.isfinite(summary["train"]["tokens_per_sec"])


def test_accumulated_gradients_equal_one_larger_batch(gpt_data, tmp_path):
    trainer = Trainer(make_cfg(gpt_data, tmp_path))
    batch = next(iter(trainer.task.dataset("train", 8, shuffle=False)))
    whole = tf.nest.map_structure(lambda t: t[None], batch)  # (1, 8, T+1)
    split = tf.nest.map_structure(lambda t: tf.reshape(t, (4, 2, -1)), batch)  # (4, 2, T+1)
    loss_whole, grads_whole, _ = trainer.forward_backward(whole)
    loss_split, grads_split, _ = trainer.forward_backward(split)
    np.testing.assert_allclose(loss_split, loss_whole, rtol=1e-6)
    for a, b in zip(grads_split, grads_whole):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


@pytest.mark.slow  # the accumulated gradients equal one larger batch's by default (the test above); Horovod's accum scenario trains with accumulation
def test_accumulated_training_equals_one_larger_batch(gpt_data, tmp_path):
    # epsilon=1 keeps Adam's update linear in the gradient: with a tiny epsilon an element
    # whose gradient is ~0 turns summation-order noise into a full-size step.
    one = Trainer(make_cfg(gpt_data, tmp_path / "one", max_steps=3, epsilon=1.0))
    one.fit()
    accumulated = Trainer(make_cfg(gpt_data, tmp_path / "acc", max_steps=3, epsilon=1.0,
                                   grad_accum_steps=4))
    accumulated.fit()
    assert_weights_close(weights(one), weights(accumulated))


@pytest.mark.slow  # XLA against the graph step: test_compiled_step trains both ways by default
def test_xla_and_graph_losses_agree(gpt_data, tmp_path):
    losses = {}
    for xla in (False, True):
        trainer = Trainer(make_cfg(gpt_data, tmp_path / str(xla), max_steps=3, xla=xla))
        losses[xla] = trainer.fit()["train"]["loss"]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-4)


@pytest.mark.parametrize("precision", [  # fp16's loss scaling trains by default in test_horovod
    pytest.param("mixed_float16", marks=pytest.mark.slow), "mixed_bfloat16"])
def test_mixed_precision_steps_stay_finite(gpt_data, tmp_path, precision):
    trainer = Trainer(make_cfg(gpt_data, tmp_path, precision=precision, max_steps=3, xla=True))
    summary = trainer.fit()
    assert np.isfinite(summary["train"]["loss"])
    assert trainer.model.blocks[0].attn.qkv.compute_dtype != "float32"
    if precision == "mixed_float16":
        assert summary["train"]["loss_scale"] > 1.0  # dynamic loss scaling is active


def test_resumed_run_equals_uninterrupted_run(gpt_data, tmp_path):
    straight = Trainer(make_cfg(gpt_data, tmp_path / "straight", max_steps=6, dropout=0.1))
    straight_summary = straight.fit()
    first = Trainer(make_cfg(gpt_data, tmp_path / "resumed", max_steps=3, dropout=0.1))
    first.fit()
    second = Trainer(make_cfg(gpt_data, tmp_path / "resumed", max_steps=6, dropout=0.1))
    assert int(second.step.numpy()) == 3 and second.restored_from
    resumed_summary = second.fit()
    assert resumed_summary["train"]["loss"] == pytest.approx(straight_summary["train"]["loss"],
                                                             rel=1e-6)
    assert_weights_close(weights(straight), weights(second), rtol=1e-6)


@pytest.mark.slow  # tests/test_bad_input.py's non-finite fp32 loss through tfbig-train (default) checks the same stop and checkpoint
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(gpt_data, tmp_path):
    Trainer(make_cfg(gpt_data, tmp_path, max_steps=2)).fit()
    good = tf.train.latest_checkpoint(str(tmp_path))
    cfg = make_cfg(gpt_data, tmp_path, max_steps=10, learning_rate=1e30, warmup_steps=0,
                   grad_clip_norm=0.0, weight_decay=0.0)
    with pytest.raises(NonFiniteLossError, match=r"at or before step \d+.*last good checkpoint"):
        Trainer(cfg).fit()
    assert tf.train.latest_checkpoint(str(tmp_path)) == good


def test_bad_batch_size_and_mismatched_model_dir_are_clear_errors(gpt_data, tmp_path):
    with pytest.raises(ValueError, match="--batch_size=6 must be a positive multiple"):
        Trainer(make_cfg(gpt_data, tmp_path / "a", batch_size=6, grad_accum_steps=4))
    Trainer(make_cfg(gpt_data, tmp_path / "b", max_steps=1)).fit()
    with pytest.raises(ValueError, match="holds a checkpoint of a different model.*hidden_size"):
        Trainer(make_cfg(gpt_data, tmp_path / "b", hidden_size=16))


def test_run_writes_tensorboard_events_and_generates(gpt_data, tmp_path):
    Trainer(make_cfg(gpt_data, tmp_path, max_steps=2)).fit()
    tags = set()
    for path in glob.glob(os.path.join(tmp_path, "*", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(value.tag for value in event.summary.value)
    assert {"loss", "learning_rate", "grad_norm", "tokens_per_sec", "bits_per_byte"} <= tags
    model, tokenizer_path = load_model(str(tmp_path))
    assert os.path.exists(tokenizer_path)
    out = Generator(model)([[1, 2, 3]], 5, temperature=0.0)
    assert out.shape == (1, 8)


@pytest.mark.slow  # tests/test_serving.py serves an exported SavedModel against the trained model (default)
def test_exported_savedmodel_equals_the_trained_model(gpt_data, tmp_path):
    from tfbig.commands.export import export

    trainer = Trainer(make_cfg(gpt_data, tmp_path / "run", max_steps=1))
    trainer.fit()
    out = export(str(tmp_path / "run"), str(tmp_path / "export"))
    loaded = tf.saved_model.load(out)
    ids = tf.constant([[1, 5, 9, 2], [3, 3, 7, 8]], tf.int32)
    expected = trainer.model(ids).numpy()
    np.testing.assert_allclose(loaded.signatures["serving_default"](token_ids=ids)["logits"],
                               expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loaded.signatures["next_token_logits"](token_ids=ids)["logits"],
                               expected[:, -1], rtol=1e-5, atol=1e-6)
    assert os.path.exists(os.path.join(out, "assets", "tokenizer.model"))
    with pytest.raises(FileExistsError, match="exists; choose a new directory"):
        export(str(tmp_path / "run"), out)


@pytest.mark.parametrize("section,flag,value,message", [
    ("horovod", "scale_lr", True, "--scale_lr=True has no effect with --strategy=single"),
    ("pipeline", "num_microbatches", 8, "--num_microbatches=8 has no effect with --strategy=single"),
    ("multiworker", "collective", "ring", "it applies to --strategy=multiworker or mirrored"),
    ("albert", "dynamic_masking", True, "--dynamic_masking=True has no effect with --model=gpt"),
])
def test_flags_of_another_backend_are_refused(gpt_data, tmp_path, section, flag, value, message):
    cfg = make_cfg(gpt_data, tmp_path)
    setattr(getattr(cfg, section), flag, value)
    with pytest.raises(ValueError, match=message):
        Trainer(cfg)
    assert not os.path.exists(tmp_path / "config.json")  # refused before touching the run dir


@pytest.mark.slow  # blockwise attention equals dense by default in tests/models/test_attention.py
def test_attention_flag_reaches_the_model_and_a_run_resumes_under_another(gpt_data, tmp_path):
    # --attention changes how scores are computed, not the weights: a resume may change it
    first = Trainer(make_cfg(gpt_data, tmp_path, max_steps=2, attention="blockwise",
                             attention_block_size=8))
    assert (first.model.blocks[0].attn.attention, first.model.blocks[1].attn.attention_block_size
            ) == ("blockwise", 8)
    first.fit()
    second = Trainer(make_cfg(gpt_data, tmp_path, max_steps=3, attention="dense"))
    assert second.restored_from and second.model.blocks[0].attn.attention == "dense"
    with pytest.raises(ValueError, match="--attention='flash': expected one of"):
        Trainer(make_cfg(gpt_data, tmp_path / "c", attention="flash"))
