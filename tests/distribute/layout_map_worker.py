"""One process of tests/distribute/test_layout_map.py: a user model around a keras-hub backbone
(Llama or Qwen, tiny) trained with `tfbig.train`, split by the backbone's own LayoutMap
(`get_layout_map` on `tfbig.device_mesh`), the keras-hub model code unchanged.

    python layout_map_worker.py FAMILY MODEL_DIR FLAGS_JSON

The chief writes MODEL_DIR/losses.json and weights.npz (+ weights.json): the trained weights
gathered whole by the run's strategy.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfbig  # noqa: E402

VOCAB, SEQ = 64, 8
BLOCKS = ("backbone.transformer_layers.*",)  # the backbone's own attribute path
# The odd sizes: 6 query heads, 3 KV heads, hidden 48, 3 layers.
SHAPE = dict(vocabulary_size=VOCAB, num_layers=3, num_query_heads=6, num_key_value_heads=3,
             hidden_dim=48, intermediate_dim=64, dtype="float32")


def backbone(family, tie=False, **shape):
    import keras_hub

    shape = {**SHAPE, **shape}
    if family == "llama":
        return keras_hub.models.LlamaBackbone(**shape, tie_word_embeddings=tie)
    return keras_hub.models.QwenBackbone(**shape, tie_word_embeddings=tie)  # q, k, v biases


class BackboneLM(keras.Model):
    """A keras-hub decoder backbone and its token table's reverse projection (the logits)."""

    def __init__(self, family, tie=False, shape=None, **kwargs):
        super().__init__(**kwargs)
        self.family, self.tie = family, tie
        self.backbone = backbone(family, tie, **(shape or {}))

    def call(self, token_ids):
        hidden = self.backbone({"token_ids": token_ids,
                                "padding_mask": tf.ones_like(token_ids)})  # (B, T, 48)
        return self.backbone.token_embedding(hidden, reverse=True)  # (B, T, VOCAB)


def model_fn(family, tie=False, **shape):
    def build():
        model = BackboneLM(family, tie, shape, name=f"{family}_lm")
        model(tf.zeros((1, SEQ), tf.int32))
        return model

    return build


def layout_map(family, tensor_parallel):
    import keras_hub

    classes = {"llama": keras_hub.models.LlamaBackbone, "qwen": keras_hub.models.QwenBackbone}
    return classes[family].get_layout_map(tfbig.device_mesh(tensor_parallel=tensor_parallel),
                                          model_parallel_dim_name="tensor",
                                          data_parallel_dim_name="data")


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


def train(family, model_dir, flags):
    layout = layout_map(family, flags["tensor_parallel"])
    run = tfbig.train(model_fn(family), loss_fn, dataset_fn, model_dir=model_dir,
                      name=f"{family}_lm", tensor_layout=layout, checkpoint_layers=BLOCKS,
                      **flags)
    trainer = run.trainer
    variables = trainer.model.trainable_variables
    values = trainer.strategy.gather_full(variables)
    if trainer.strategy.is_chief:
        with open(os.path.join(model_dir, "losses.json"), "w") as f:
            json.dump(run.losses, f)
        with open(os.path.join(model_dir, "weights.json"), "w") as f:
            json.dump([v.path for v in variables], f)
        np.savez(os.path.join(model_dir, "weights.npz"), *values)
    run.close()


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
