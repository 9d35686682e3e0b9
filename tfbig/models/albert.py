"""ALBERT: a bidirectional encoder with a factorised embedding and shared layers, read top to bottom.

attention -> feed-forward -> block -> embedding -> backbone -> heads -> config -> models.
Lan et al. (2019): word pieces are embedded in a small space E and projected to the hidden size H
(vocab x E + E x H instead of vocab x H), and the `num_layers` transformer layers reuse
`num_groups` parameter sets (one for the released models): layer i runs group
i * num_groups // num_layers. Post-LayerNorm blocks as in BERT, GELU feed-forward, truncated-normal
initialisation (std 0.02). Softmax, LayerNorm and all logits stay in float32 under mixed precision.

Heads: masked-LM (tied to the word embedding), sentence-order prediction on the pooled [CLS],
and a start/end span head for SQuAD. The model knows nothing about distribution.

Example:
    config = AlbertConfig.from_preset("tiny", vocab_size=500)
    model = AlbertForPretraining(config)
    out = model({"input_ids": ids, "segment_ids": seg, "input_mask": mask,
                 "masked_lm_positions": positions})
    out["mlm_logits"]  # (B, P, 500);  out["sop_logits"]  # (B, 2)
"""
import dataclasses
import math

import keras
from keras import ops

from tfbig.models.configs import ALBERT_PRESETS, AlbertConfig  # noqa: F401 - re-exported


def _truncated_normal(stddev):
    return keras.initializers.TruncatedNormal(stddev=stddev)


class SelfAttention(keras.layers.Layer):
    """Bidirectional multi-head self-attention over the unpadded positions of `input_mask`."""

    def __init__(self, hidden_size, num_heads, dropout=0.0, initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.dropout = dropout
        self.initializer_range = initializer_range
        self.head_size = hidden_size // num_heads
        init = _truncated_normal(initializer_range)
        self.qkv = keras.layers.Dense(3 * hidden_size, kernel_initializer=init, name="qkv")
        self.proj = keras.layers.Dense(hidden_size, kernel_initializer=init, name="proj")
        self.attn_dropout = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        self.qkv.build(input_shape)
        self.proj.build(input_shape[:-1] + (self.hidden_size,))

    def call(self, x, input_mask, training=False):
        """x: (B, T, H); input_mask: (B, T), 1 for real tokens, 0 for padding."""
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        qkv = ops.reshape(self.qkv(x), (batch, length, 3, self.num_heads, self.head_size))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, T, nh, hs)
        scores = ops.einsum("bqhd,bkhd->bhqk", q, k)  # (B, nh, T, T)
        scores = ops.cast(scores, "float32") / math.sqrt(self.head_size)
        keep = ops.cast(input_mask, "bool")[:, None, None, :]  # (B, 1, 1, T)
        scores = ops.where(keep, scores, -1e9)
        probs = ops.cast(ops.softmax(scores, axis=-1), q.dtype)
        probs = self.attn_dropout(probs, training=training)
        y = ops.einsum("bhqk,bkhd->bqhd", probs, v)  # (B, T, nh, hs)
        return self.proj(ops.reshape(y, (batch, length, self.hidden_size)))

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "dropout": self.dropout,
                "initializer_range": self.initializer_range}


class FeedForward(keras.layers.Layer):
    """Position-wise Dense(intermediate) -> GELU -> Dense(hidden)."""

    def __init__(self, hidden_size, intermediate_size, initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.initializer_range = initializer_range
        init = _truncated_normal(initializer_range)
        self.fc = keras.layers.Dense(intermediate_size, kernel_initializer=init, name="fc")
        self.proj = keras.layers.Dense(hidden_size, kernel_initializer=init, name="proj")

    def build(self, input_shape):
        self.fc.build(input_shape)
        self.proj.build(input_shape[:-1] + (self.intermediate_size,))

    def call(self, x):
        return self.proj(ops.gelu(self.fc(x), approximate=True))  # ALBERT's gelu_new

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "initializer_range": self.initializer_range}


class TransformerBlock(keras.layers.Layer):
    """Post-LN encoder block (BERT/ALBERT): x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, hidden_size, num_heads, intermediate_size, dropout=0.0,
                 layer_norm_epsilon=1e-12, initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.intermediate_size = intermediate_size
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.attn = SelfAttention(hidden_size, num_heads, dropout, initializer_range, name="attn")
        self.attn_norm = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon,
                                                         name="attn_norm")
        self.ffn = FeedForward(hidden_size, intermediate_size, initializer_range, name="ffn")
        self.ffn_norm = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon,
                                                        name="ffn_norm")
        self.drop = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        for layer in (self.attn, self.attn_norm, self.ffn, self.ffn_norm):
            layer.build(input_shape)

    def call(self, x, input_mask, training=False):
        x = self.attn_norm(x + self.drop(self.attn(x, input_mask, training=training),
                                         training=training))
        return self.ffn_norm(x + self.drop(self.ffn(x), training=training))

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "intermediate_size": self.intermediate_size,
                "dropout": self.dropout, "layer_norm_epsilon": self.layer_norm_epsilon,
                "initializer_range": self.initializer_range}


class FactorisedEmbedding(keras.layers.Layer):
    """Word + position + segment embeddings of size E, LayerNorm, dropout (B, T) -> (B, T, E).

    The projection to the hidden size lives in the backbone, so the MLM head can reuse the
    (vocab_size, E) word table.
    """

    def __init__(self, vocab_size, seq_length, embedding_size, type_vocab_size=2, dropout=0.0,
                 layer_norm_epsilon=1e-12, initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.embedding_size = embedding_size
        self.type_vocab_size = type_vocab_size
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        init = _truncated_normal(initializer_range)
        self.word = keras.layers.Embedding(vocab_size, embedding_size, name="word",
                                           embeddings_initializer=init)
        self.position = keras.layers.Embedding(seq_length, embedding_size, name="position",
                                               embeddings_initializer=init)
        self.segment = keras.layers.Embedding(type_vocab_size, embedding_size, name="segment",
                                              embeddings_initializer=init)
        self.norm = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="norm")
        self.drop = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        for table in (self.word, self.position, self.segment):
            table.build(input_shape)
        self.norm.build(tuple(input_shape) + (self.embedding_size,))

    def call(self, input_ids, segment_ids, training=False):
        positions = ops.arange(ops.shape(input_ids)[1])  # (T,)
        x = self.word(input_ids) + self.position(positions)[None] + self.segment(segment_ids)
        return self.drop(self.norm(x), training=training)  # (B, T, E)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "seq_length": self.seq_length, "embedding_size": self.embedding_size,
                "type_vocab_size": self.type_vocab_size, "dropout": self.dropout,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "initializer_range": self.initializer_range}


class AlbertBackbone(keras.layers.Layer):
    """Embedding -> E-to-H projection -> num_layers calls of num_groups shared blocks -> pooler.

    call(input_ids, segment_ids, input_mask) -> (sequence (B, T, H), pooled [CLS] (B, H)).
    """

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = config if isinstance(config, AlbertConfig) else AlbertConfig(**config)
        cfg = self.config
        init = _truncated_normal(cfg.initializer_range)
        self.embedding = FactorisedEmbedding(
            cfg.vocab_size, cfg.seq_length, cfg.embedding_size, cfg.type_vocab_size, cfg.dropout,
            cfg.layer_norm_epsilon, cfg.initializer_range, name="embedding")
        self.projection = keras.layers.Dense(cfg.hidden_size, kernel_initializer=init,
                                             name="projection")
        # One attribute per group, not a list: tf.train.Checkpoint does not see into the
        # TrackedList Keras 3 makes of a list attribute, so listed blocks would not be saved.
        for g in range(cfg.num_groups):
            setattr(self, f"group_{g}", TransformerBlock(
                cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.dropout,
                cfg.layer_norm_epsilon, cfg.initializer_range, name=f"group_{g}"))
        self.pooler = keras.layers.Dense(cfg.hidden_size, activation="tanh",
                                         kernel_initializer=init, name="pooler")

    @property
    def groups(self):
        """The num_groups shared transformer blocks."""
        return [getattr(self, f"group_{g}") for g in range(self.config.num_groups)]

    def build(self, input_shape=None):
        hidden_shape = (None, None, self.config.hidden_size)
        self.embedding.build((None, None))
        self.projection.build((None, None, self.config.embedding_size))
        for block in self.groups:
            block.build(hidden_shape)
        self.pooler.build((None, self.config.hidden_size))
        self.built = True

    def call(self, input_ids, segment_ids, input_mask, training=False):
        x = self.projection(self.embedding(input_ids, segment_ids, training=training))  # (B,T,H)
        for layer in range(self.config.num_layers):
            x = self.groups[self.config.group_of_layer(layer)](x, input_mask, training=training)
        return x, self.pooler(x[:, 0])  # (B, T, H), (B, H)

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}


class MaskedLMHead(keras.layers.Layer):
    """Dense(H -> E, GELU) -> LayerNorm -> logits against the tied (vocab, E) word table + bias."""

    def __init__(self, vocab_size, embedding_size, layer_norm_epsilon=1e-12,
                 initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.dense = keras.layers.Dense(embedding_size, kernel_initializer=_truncated_normal(
            initializer_range), name="dense")
        self.norm = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="norm")

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.norm.build(tuple(input_shape[:-1]) + (self.embedding_size,))
        self.bias = self.add_weight(shape=(self.vocab_size,), initializer="zeros", name="bias")

    def call(self, x, word_table):
        """x: (B, P, H) hidden states at the masked positions -> float32 logits (B, P, vocab)."""
        h = self.norm(ops.gelu(self.dense(x), approximate=True))  # (B, P, E)
        logits = ops.einsum("bpe,ve->bpv", h, ops.cast(word_table, h.dtype))
        return ops.cast(logits, "float32") + ops.cast(self.bias, "float32")

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "embedding_size": self.embedding_size,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "initializer_range": self.initializer_range}


def _inputs(inputs):
    return inputs["input_ids"], inputs["segment_ids"], inputs["input_mask"]


@keras.saving.register_keras_serializable(package="tfbig")
class AlbertForPretraining(keras.Model):
    """Backbone + tied masked-LM head + sentence-order head.

    inputs: dict of int32 input_ids, segment_ids, input_mask (B, T) and masked_lm_positions
    (B, P). Returns {"mlm_logits": (B, P, vocab) float32, "sop_logits": (B, 2) float32}.
    """

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = config if isinstance(config, AlbertConfig) else AlbertConfig(**config)
        cfg = self.config
        self.backbone = AlbertBackbone(cfg, name="backbone")
        self.mlm_head = MaskedLMHead(cfg.vocab_size, cfg.embedding_size, cfg.layer_norm_epsilon,
                                     cfg.initializer_range, name="mlm_head")
        self.sop_dropout = keras.layers.Dropout(cfg.dropout)
        self.sop_head = keras.layers.Dense(2, kernel_initializer=_truncated_normal(
            cfg.initializer_range), name="sop_head")

    def build(self, input_shape=None):
        self.backbone.build()
        self.mlm_head.build((None, None, self.config.hidden_size))
        self.sop_head.build((None, self.config.hidden_size))
        self.built = True

    def call(self, inputs, training=False):
        sequence, pooled = self.backbone(*_inputs(inputs), training=training)
        positions = ops.cast(inputs["masked_lm_positions"], "int32")[:, :, None]  # (B, P, 1)
        masked = ops.take_along_axis(sequence, positions, axis=1)  # (B, P, H)
        mlm_logits = self.mlm_head(masked, self.backbone.embedding.word.embeddings)
        sop_logits = self.sop_head(self.sop_dropout(pooled, training=training))
        return {"mlm_logits": mlm_logits, "sop_logits": ops.cast(sop_logits, "float32")}

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}


@keras.saving.register_keras_serializable(package="tfbig")
class AlbertForQuestionAnswering(keras.Model):
    """Backbone + span head: per-token start and end logits for extractive QA (SQuAD).

    inputs: dict of int32 input_ids, segment_ids, input_mask (B, T).
    Returns {"start_logits": (B, T) float32, "end_logits": (B, T) float32}.
    """

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = config if isinstance(config, AlbertConfig) else AlbertConfig(**config)
        self.backbone = AlbertBackbone(self.config, name="backbone")
        self.span_head = keras.layers.Dense(2, kernel_initializer=_truncated_normal(
            self.config.initializer_range), name="span_head")

    def build(self, input_shape=None):
        self.backbone.build()
        self.span_head.build((None, None, self.config.hidden_size))
        self.built = True

    def call(self, inputs, training=False):
        sequence, _ = self.backbone(*_inputs(inputs), training=training)
        logits = ops.cast(self.span_head(sequence), "float32")  # (B, T, 2)
        return {"start_logits": logits[..., 0], "end_logits": logits[..., 1]}

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}
