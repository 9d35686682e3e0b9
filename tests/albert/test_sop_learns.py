"""Sentence-order labels are wired end to end: prep -> shards -> task batches -> model's SOP
head -> task loss and metric.

Each document is two lines, the first drawn from one set of words and the second from another,
so a pair's order shows in its words. Trained on the SOP loss alone, the model must reach high
validation SOP accuracy; if labels did not follow the swap (or the head did not see [CLS]) it
would stay at chance. (Trained jointly with MLM, SOP stays at chance for the first ~1000 steps
of a tiny model; tf-models-official's ALBERT does the same on this data, so the test isolates
the SOP path rather than judge the joint recipe.)"""
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfbig.data import prepare
from tfbig.tasks import get_task

from test_albert_task import make_cfg

FIRST = "love night light sweet fair heaven star moon gentle".split()
SECOND = "sword blood death house honour name rose noble speak".split()


@pytest.mark.slow  # a learning run; ALBERT's losses fall in test_loss_falls_and_metrics_are_reported (default)
def test_sop_labels_follow_the_swap_and_are_learnable(tmp_path, albert_tokenizer):
    rng = random.Random(0)
    text = tmp_path / "text"
    text.mkdir()
    for d in range(600):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 7)))
                 for words in (FIRST, SECOND)]
        (text / f"doc{d:03d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = str(tmp_path / "data")
    prepare([str(text)], data, seq_length=32, vocab_size=1000, tokenizer=albert_tokenizer.path,
            validation_fraction=0.2, format="albert",
            format_options={"max_predictions_per_seq": 5, "dupe_factor": 2})
    cfg = make_cfg(data, tmp_path / "run", seq_length=32)
    task = get_task(cfg.train, cfg)
    model = task.build_model()
    optimizer = keras.optimizers.Adam(1e-3)

    @tf.function
    def train_step(batch):
        with tf.GradientTape() as tape:
            _, metrics = task.loss_from_outputs(model(task.model_inputs(batch), training=True),
                                                batch)
        grads = tape.gradient(metrics["sop_loss"], model.trainable_variables)
        optimizer.apply([g if g is not None else tf.zeros_like(v)
                         for g, v in zip(grads, model.trainable_variables)],
                        model.trainable_variables)

    @tf.function
    def sop_accuracy(batch):
        return task.loss_from_outputs(model(task.model_inputs(batch)), batch)[1]["sop_accuracy"]

    def validation_accuracy():
        batches = task.dataset("validation", 32, None, shuffle=False).take(8)
        return float(np.mean([sop_accuracy(b) for b in batches]))

    labels = np.concatenate([b["next_sentence_labels"].numpy().ravel()
                             for b in task.dataset("train", 32, None).take(20)])
    assert 0.4 < labels.mean() < 0.6  # both orders, about equally often
    before = validation_accuracy()
    for batch in task.dataset("train", 32, None).take(200):
        train_step(batch)
    after = validation_accuracy()
    assert 0.3 < before < 0.7, before
    assert after > 0.9, (before, after)
