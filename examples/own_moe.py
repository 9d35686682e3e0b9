"""Mixture-of-experts in your own Keras model: tfbig's SparseMoE layer as the feed-forward
network of each block, trained by tfbig like any Keras model, its experts split over ranks by
--expert_parallel.

`tfbig.models.moe.SparseMoE(hidden, expert_width, num_experts, experts_per_token)` maps
x (B, T, C) to (y, stats): y the weighted sum of each token's k SwiGLU experts (dropless
routing unless `capacity_factor` > 0), stats the router's load-balancing loss ("aux_loss",
1 when balanced), z-loss, tokens per expert and dropped tokens. The model below returns the
blocks' routing statistics beside its logits; the task adds their mean load-balancing loss
to the loss and returns the tokens each expert took beside it (the progress line shows them,
min/mean/max). Nothing else is declared: under --expert_parallel=N every SparseMoE layer of
the model holds E/N experts on each rank of an expert group, tokens reaching them by
all-to-all.

    python examples/own_moe.py --model_dir=/tmp/moe --max_steps=50
    horovodrun -np 2 -H localhost:2 --gloo python examples/own_moe.py --strategy=horovod \\
        --expert_parallel=2 --model_dir=/tmp/moe2 --max_steps=50

Expert groups have data-dependent sizes: the step runs without XLA (the default here).
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers  # noqa: E402

import tfbig  # noqa: E402
from tfbig.models.moe import SparseMoE, routing_metrics  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from own_model import TokenAndPositionEmbedding, dataset_fn  # noqa: E402

SIZE = dict(maxlen=16, vocab_size=32, embed_dim=32, num_heads=2, expert_dim=24, num_experts=4,
            experts_per_token=2, num_layers=2)
AUX_LOSS_COEF = 0.01  # weight of the load-balancing loss (Mixtral's router_aux_loss_coef)


class MoEBlock(layers.Layer):
    """Pre-norm causal self-attention, then a SparseMoE in place of the feed-forward network;
    returns (x, this block's routing statistics: SparseMoE's)."""

    def __init__(self, embed_dim, num_heads, expert_dim, num_experts, experts_per_token,
                 **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads, key_dim=embed_dim // num_heads)
        self.norm1 = layers.LayerNormalization(epsilon=1e-6)
        self.norm2 = layers.LayerNormalization(epsilon=1e-6)
        self.moe = SparseMoE(embed_dim, expert_dim, num_experts, experts_per_token)

    def build(self, input_shape):
        self.norm1.build(input_shape)
        self.att.build(input_shape, input_shape)
        self.norm2.build(input_shape)
        self.moe.build(input_shape)

    def call(self, x):
        h = self.norm1(x)
        x = x + self.att(h, h, use_causal_mask=True)
        y, stats = self.moe(self.norm2(x))
        return x + y, stats


class MoEModel(keras.Model):
    """Token and position embedding, `num_layers` MoE blocks, a vocabulary projection:
    {"logits": (B, T, vocab), "routing": each block's routing statistics}."""

    def __init__(self, maxlen, vocab_size, embed_dim, num_heads, expert_dim, num_experts,
                 experts_per_token, num_layers, **kwargs):
        super().__init__(**kwargs)
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
        self.blocks = [MoEBlock(embed_dim, num_heads, expert_dim, num_experts,
                                experts_per_token) for _ in range(num_layers)]
        self.output_layer = layers.Dense(vocab_size)

    def call(self, inputs):
        x = self.embedding_layer(inputs)
        routing = []
        for block in self.blocks:
            x, stats = block(x)
            routing.append(stats)
        return {"logits": self.output_layer(x), "routing": routing}


def cross_entropy(targets, logits):
    """Per-example mean next-token cross-entropy, float32."""
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        targets, tf.cast(logits, tf.float32), from_logits=True), axis=-1)


class MoETask(tfbig.Task):
    """The counting sequences of examples/own_model.py, learned by MoEModel."""

    name = "own_moe"
    tokens_per_example = SIZE["maxlen"]

    def build_model(self):
        model = MoEModel(**SIZE)
        model(keras.ops.zeros((1, SIZE["maxlen"]), "int32"))  # creates the variables
        return model

    def dataset(self, shard):
        return dataset_fn(shard)

    def loss(self, targets, outputs):
        """Cross-entropy plus the weighted load-balancing loss (the blocks' mean) of this
        batch's routing; beside it the tokens each expert took (min/mean/max over the blocks'
        experts), which the progress line shows."""
        routing = outputs["routing"]
        aux_loss = tf.reduce_mean([tf.cast(r["aux_loss"], tf.float32) for r in routing])
        loss = tf.reduce_mean(cross_entropy(targets, outputs["logits"])) + AUX_LOSS_COEF * aux_loss
        return loss, {"router_aux_loss": aux_loss, **routing_metrics(routing)}

    def validation_outputs(self, targets, outputs):
        return {"loss": cross_entropy(targets, outputs["logits"])}  # each example's


def main(argv):
    from absl import flags

    run = tfbig.train(MoETask(), tfbig.config_from_flags(flags.FLAGS))
    if run.trainer.strategy.is_chief:
        print(f"losses: {[round(loss, 4) for loss in run.losses]}")
        print(f"validation: {run.summary['eval']}")
    run.close()


if __name__ == "__main__":
    from absl import app

    tfbig.define_flags(max_steps=50, batch_size=16, learning_rate=3e-3, warmup_steps=5,
                       model_dir="runs/own_moe", log_every=10, xla=False)
    app.run(main, argv=sys.argv)
