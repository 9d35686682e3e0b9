"""One process of tests/distribute/test_nested_backbone.py: a user model that nests a keras-hub
GPT2Backbone (a functional model, which tracks its transformer layers' variables too) trained
with `tfbig.train`, its transformer layers named by the backbone's own attribute path.

    python nested_worker.py MODEL_DIR FLAGS_JSON

The chief writes MODEL_DIR/losses.json and weights.npz (+ weights.json): the trained weights
gathered whole by the run's strategy.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfbig  # noqa: E402

VOCAB, SEQ = 48, 12
NAMED = ("backbone.transformer_layers.*",)  # the backbone's own attribute path


class BackboneLM(keras.Model):
    """A keras-hub GPT2Backbone and a vocabulary head of the user's own."""

    def __init__(self, **kwargs):
        import keras_hub

        super().__init__(**kwargs)
        self.backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
            dropout=0.0, max_sequence_length=SEQ)
        self.head = keras.layers.Dense(VOCAB, name="head")

    def call(self, token_ids):
        hidden = self.backbone({"token_ids": token_ids,
                                "padding_mask": tf.ones_like(token_ids)})  # (B, T, 16)
        return self.head(hidden)  # (B, T, VOCAB)


def model_fn():
    model = BackboneLM(name="backbone_lm")
    model(tf.zeros((1, SEQ), tf.int32))
    return model


def loss_fn(targets, logits):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        targets, tf.cast(logits, tf.float32), from_logits=True))


def dataset_fn(shard):
    rows = np.random.default_rng(0 if shard.split == "train" else 1).integers(
        0, VOCAB, size=(128 if shard.split == "train" else 16, SEQ + 1)).astype(np.int32)
    pairs = tf.data.Dataset.from_tensor_slices((rows[:, :-1], rows[:, 1:]))
    if not shard.training:
        return pairs.batch(shard.batch_size)
    pairs = pairs.shuffle(len(rows), seed=shard.seed).repeat()
    return pairs.shard(shard.count, shard.index).batch(shard.batch_size, drop_remainder=True)


def train(model_dir, flags):
    run = tfbig.train(model_fn, loss_fn, dataset_fn, model_dir=model_dir, name="backbone_lm",
                      checkpoint_layers=NAMED, **flags)
    trainer = run.trainer
    variables = trainer.model.trainable_variables
    gather = getattr(trainer.strategy, "gather_full", None)
    values = gather(variables) if gather else [v.numpy() for v in variables]
    if trainer.strategy.is_chief:
        with open(os.path.join(model_dir, "losses.json"), "w") as f:
            json.dump(run.losses, f)
        with open(os.path.join(model_dir, "weights.json"), "w") as f:
            json.dump([v.path for v in variables], f)
        np.savez(os.path.join(model_dir, "weights.npz"), *values)
    run.close()


if __name__ == "__main__":
    train(sys.argv[1], json.loads(sys.argv[2]))
