"""Your own Keras model on tfbig: the billion-parameter GPT post's `MyModel`, in Keras 3.

The post builds `MyModel` from `TokenAndPositionEmbedding` and `TransformerBlock` (Keras'
miniature-GPT example), writes its own loss and tf.data pipeline, then adds Horovod by hand.
Here tfbig's Trainer does the distribution: the model, loss and data below are all a user
writes, and every tfbig-train flag applies (--strategy, --zero_stage, --precision,
--grad_accum_steps, --model_dir: a rerun resumes, ...).

    python examples/own_model.py --model_dir=/tmp/own --max_steps=50
    horovodrun -np 2 -H localhost:2 --gloo python examples/own_model.py --strategy=horovod \\
        --model_dir=/tmp/own2 --max_steps=50
    ... --strategy=horovod --zero_stage=3 --shard_degree=2   # ZeRO-3 over MiCS groups of 2
    ... --strategy=horovod --tensor_parallel=2   # heads, vocabulary and FFNs split (LAYOUT)
    ... --strategy=horovod --pipeline_stages=2   # MyModel cut between the layers of PIPELINE
    ... --strategy=horovod --context_parallel=2  # every sequence cut over 2 ranks (CONTEXT)
    python examples/own_model.py --strategy=pipeline --num_microbatches=4   # 2 CPU devices
    python examples/own_model.py --plan_only     # memory per rank and step time, no training
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers  # noqa: E402

import tfbig  # noqa: E402


# ---- the model: the post's, in Keras 3 ---------------------------------------------------------
class TransformerBlock(layers.Layer):
    """Causal self-attention and a feed-forward network, each with a residual and LayerNorm."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim, self.num_heads, self.ff_dim, self.rate = embed_dim, num_heads, ff_dim, rate
        self.att = layers.MultiHeadAttention(num_heads, key_dim=embed_dim // num_heads)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def build(self, input_shape):
        self.att.build(input_shape, input_shape)
        self.ffn.build(input_shape)
        self.layernorm1.build(input_shape)
        self.layernorm2.build(input_shape)

    def call(self, inputs, training=None):
        attention_output = self.att(inputs, inputs, use_causal_mask=True)
        out1 = self.layernorm1(inputs + self.dropout1(attention_output, training=training))
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)

    def get_config(self):
        return {**super().get_config(), "embed_dim": self.embed_dim,
                "num_heads": self.num_heads, "ff_dim": self.ff_dim, "rate": self.rate}


class TokenAndPositionEmbedding(layers.Layer):
    """Token embedding plus a learned position embedding."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.maxlen, self.vocab_size, self.embed_dim = maxlen, vocab_size, embed_dim
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def build(self, input_shape):
        self.token_emb.build(input_shape)
        self.pos_emb.build((input_shape[-1],))

    def call(self, x):
        positions = self.pos_emb(keras.ops.arange(keras.ops.shape(x)[-1]))
        return self.token_emb(x) + positions

    def get_config(self):
        return {**super().get_config(), "maxlen": self.maxlen, "vocab_size": self.vocab_size,
                "embed_dim": self.embed_dim}


class MyModel(keras.Model):
    """The post's GPT: embedding, `num_layers` transformer blocks, a vocabulary projection."""

    def __init__(self, maxlen, vocab_size, embed_dim, num_heads, feed_forward_dim, num_layers,
                 rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.maxlen = maxlen
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        self.transformer_blocks = [TransformerBlock(embed_dim, num_heads, feed_forward_dim, rate)
                                   for _ in range(num_layers)]
        self.output_layer = layers.Dense(vocab_size)

    def call(self, inputs, training=None):
        x = self.embedding_layer(inputs)  # (B, T, H)
        for block in self.transformer_blocks:
            x = block(x, training=training)
        return self.output_layer(x)  # (B, T, vocab) logits


SIZE = dict(maxlen=16, vocab_size=32, embed_dim=32, num_heads=2, feed_forward_dim=64,
            num_layers=2)


# How --tensor_parallel=T splits MyModel, as data (the model knows nothing of it): each
# rank keeps 1/T of the token table's rows (vocab: it looks up its own ids, the ranks' rows
# summed), of every attention's heads (heads: the ranks' outputs summed), of each feed-forward
# network's first Dense's units (column) and its second Dense's input rows (row: the ranks'
# outputs summed), and of the output projection's vocabulary columns (vocab: the logits
# gathered whole for loss_fn). LayerNorms and the position table stay replicated.
LAYOUT = {"embedding_layer.token_emb": "vocab",
          "transformer_blocks.*.att": "heads",
          "transformer_blocks.*.ffn.layers.0": "column",
          "transformer_blocks.*.ffn.layers.1": "row",
          "output_layer": "vocab"}


# How --context_parallel=C cuts every sequence over C ranks, as data: each rank embeds its own
# positions (tokens: its rows of the token ids; positions: the position table read at them),
# each attention attends from them over the keys and values gathered from the C ranks, and the
# output projection's logits are gathered whole, so loss_fn sees the whole sequence.
CONTEXT = {"embedding_layer.token_emb": "tokens", "embedding_layer.pos_emb": "positions",
           "transformer_blocks.*.att": "attention", "output_layer": "output"}


# Where --strategy=pipeline and --pipeline_stages=K may cut MyModel, as data: the layers whose
# calls in this order are its forward (the embedding, each block, the vocabulary projection).
PIPELINE = ("embedding_layer", "transformer_blocks.*", "output_layer")


# What --plan_only reads of MyModel: the sizes of the transformer it is (tfbig's planner then
# gives its activation memory and step time by the closed forms of tfbig's GPT of that shape).
SHAPE = dict(hidden_size=SIZE["embed_dim"], num_layers=SIZE["num_layers"],
             num_heads=SIZE["num_heads"], seq_length=SIZE["maxlen"],
             vocab_size=SIZE["vocab_size"], intermediate_size=SIZE["feed_forward_dim"])


def model_fn(size=None, rate=0.0):
    """MyModel, built (tfbig calls this inside the backend's scope)."""
    size = size or SIZE
    model = MyModel(**size, rate=rate)
    model(keras.ops.zeros((1, size["maxlen"]), "int32"))  # creates the variables (integer
    return model  # token inputs: Keras' model.build would feed floats and create none)


# ---- the loss and the data: the user's own ------------------------------------------------------
def loss_fn(targets, logits):
    """Mean next-token cross-entropy, in float32 (logits may be float16 under mixed precision)."""
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        targets, tf.cast(logits, tf.float32), from_logits=True))


def sequences(num_examples, maxlen=16, vocab_size=32, seed=0):
    """A toy corpus: counting sequences (k, k+step, k+2 step, ... mod vocab_size) with a random
    start and step per example; the model learns to continue them."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab_size, (num_examples, 1))
    step = rng.integers(1, 4, (num_examples, 1))
    return ((start + step * np.arange(maxlen + 1)) % vocab_size).astype(np.int32)


def dataset_fn(shard, num_examples=512, maxlen=16, vocab_size=32):
    """(inputs, targets) batches for `shard` (tfbig.DataShard): training reads replica
    `shard.index` of `shard.count`'s share of each global batch, shuffled with the run's seed;
    evaluation reads the held-out examples once, in order."""
    if shard.split == "train":
        examples = sequences(num_examples, maxlen, vocab_size, seed=0)
    elif shard.split == "validation":
        examples = sequences(64, maxlen, vocab_size, seed=1)
    else:
        return None
    pairs = tf.data.Dataset.from_tensor_slices((examples[:, :-1], examples[:, 1:]))
    if not shard.training:
        return pairs.batch(shard.batch_size)
    pairs = pairs.shuffle(num_examples, seed=shard.seed).repeat()
    return pairs.shard(shard.count, shard.index).batch(shard.batch_size, drop_remainder=True)


def main(argv):
    from absl import flags

    run = tfbig.train(model_fn, loss_fn, dataset_fn, tfbig.config_from_flags(flags.FLAGS),
                      name="own_model", tokens_per_example=SIZE["maxlen"],
                      checkpoint_layers=("transformer_blocks.*",), tensor_layout=LAYOUT,
                      pipeline_layers=PIPELINE, transformer_shape=SHAPE,
                      context_layout=CONTEXT)
    if flags.FLAGS.plan_only:  # tfbig.train printed the plan; nothing trained
        return
    if run.trainer.strategy.is_chief:
        print(f"losses: {[round(loss, 4) for loss in run.losses]}")
        print(f"validation: {run.summary['eval']}")
        with open(os.path.join(flags.FLAGS.model_dir, "eval_results.json"), "w") as f:
            json.dump(run.summary["eval"], f)
    run.close()


if __name__ == "__main__":
    from absl import app

    tfbig.define_flags(max_steps=50, batch_size=16, learning_rate=3e-3, warmup_steps=5,
                       model_dir="runs/own_model", log_every=10)
    app.run(main, argv=sys.argv)
