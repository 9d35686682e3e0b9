"""A user model's own losses (`model.losses`: its add_loss calls and weight regularizers) are
added to the task's loss through tfbig.train, as Keras' fit adds them: a model whose output
Dense has an L2 kernel regularizer and whose call adds an activity penalty trains exactly as
the same model computing both terms in its outputs for the task's loss to add (each step's
loss and every final weight, fp32, from the same seed). Where a layout cannot add them
exactly (split or gathered weights, a loss computed in parts, recomputed layers) they are
refused by name before anything is written."""
import os
import sys

import keras
import numpy as np
import pytest
from keras import layers, ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import own_model  # noqa: E402

import tfbig  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402

STEPS = dict(max_steps=4, batch_size=8, learning_rate=3e-2, warmup_steps=1, xla=False,
             eval_steps=0, log_every=1, seed=3)
L2, ACTIVITY = 0.05, 0.01  # the regularizer's and the activity penalty's coefficients


class Penalised(keras.Model):
    """Embedding -> Dense(tanh) -> Dense(vocabulary). `in_model`: the output kernel's L2
    regularizer and the hidden activity penalty are the model's own losses (a regularizer and
    add_loss); otherwise the call returns their sum as "extra" (one per row) beside the
    logits."""

    def __init__(self, in_model, kernel_l2=True, **kwargs):
        super().__init__(**kwargs)
        self.in_model = in_model
        self.embedding = layers.Embedding(32, 16)
        self.hidden = layers.Dense(16, activation="tanh")
        self.head = layers.Dense(32, kernel_regularizer=keras.regularizers.L2(L2)
                                 if in_model and kernel_l2 else None)
        self.blocks = [self.hidden]  # what --activation_checkpointing would recompute

    def call(self, tokens):
        h = self.hidden(self.embedding(tokens))
        activity = ACTIVITY * ops.mean(ops.square(h))
        logits = self.head(h)
        if self.in_model:
            self.add_loss(activity)
            return logits
        extra = activity + L2 * ops.sum(ops.square(self.head.kernel))
        return {"logits": logits, "extra": ops.broadcast_to(extra, ops.shape(tokens)[:1])}


def model_fn(in_model, kernel_l2=True):
    def build():
        model = Penalised(in_model, kernel_l2)
        model(ops.zeros((1, 16), "int32"))
        return model
    return build


def by_hand(targets, outputs):
    return own_model.loss_fn(targets, outputs["logits"]) + ops.mean(outputs["extra"])


def test_the_models_own_losses_are_added_to_the_task_loss(tmp_path):
    ours = tfbig.train(model_fn(True), own_model.loss_fn, own_model.dataset_fn,
                       model_dir=str(tmp_path / "ours"), **STEPS)
    theirs = tfbig.train(model_fn(False), by_hand, own_model.dataset_fn,
                         model_dir=str(tmp_path / "theirs"), **STEPS)
    assert len(ours.model.losses) == 2  # the regularizer's and the add_loss term
    np.testing.assert_allclose(ours.losses, theirs.losses, rtol=1e-6)
    assert len(ours.losses) == 4 and ours.losses[0] != ours.losses[-1]
    for a, b in zip(ours.model.trainable_variables, theirs.model.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7, err_msg=a.path)
    # the penalties matter: without them the same steps end elsewhere
    plain = tfbig.train(model_fn(False), lambda t, o: own_model.loss_fn(t, o["logits"]),
                        own_model.dataset_fn, model_dir=str(tmp_path / "plain"), **STEPS)
    assert not np.allclose(plain.model.head.kernel.numpy(), ours.model.head.kernel.numpy())
    for run in (ours, theirs, plain):
        run.close()


@pytest.mark.parametrize("flags, message", [
    ({"strategy": "horovod", "zero_stage": 3, "checkpoint_layers": ("blocks.*",)},
     "--zero_stage=3: the weights are gathered only inside their layers' calls"),
    ({"activation_checkpointing": True, "checkpoint_layers": ("blocks.*",)},
     "--activation_checkpointing: the recomputed layers' own losses"),
    ({"strategy": "pipeline", "num_microbatches": 2,
      "pipeline_layers": ("embedding", "hidden", "head")},
     "--pipeline_stages=2: the last stage computes the loss without the others' layers"),
])
def test_a_layout_that_cannot_add_them_exactly_refuses_them_by_name(tmp_path, flags, message):
    run_dir = tmp_path / "run"
    with pytest.raises(UsageError) as error:
        tfbig.train(model_fn(True), own_model.loss_fn, own_model.dataset_fn,
                    model_dir=str(run_dir), **{**STEPS, **flags})
    assert "'s model has weight regularizers (penalised/dense_1/kernel): " + message in str(
        error.value)
    assert not run_dir.exists() or not os.listdir(run_dir)


def test_an_add_loss_the_layout_cannot_add_is_refused_by_name(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(UsageError) as error:
        tfbig.train(model_fn(True, kernel_l2=False), own_model.loss_fn, own_model.dataset_fn,
                    model_dir=str(run_dir), **STEPS, activation_checkpointing=True,
                    checkpoint_layers=("blocks.*",))
    assert ("'s model adds 1 loss(es) of its own in its call (add_loss): "
            "--activation_checkpointing: ") in str(error.value)
    assert not run_dir.exists() or not os.listdir(run_dir)

