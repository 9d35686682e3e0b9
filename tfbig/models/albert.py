"""ALBERT: a bidirectional encoder with a factorised embedding and shared layers.

Built from the shared layers (tfbig.models.layers): backbone -> heads -> models.
Lan et al. (2019): word pieces are embedded in a small space E and projected to the hidden size H
(vocab x E + E x H instead of vocab x H), and the `num_layers` transformer layers reuse
`num_groups` parameter sets (one for the released models): layer i runs group
i * num_groups // num_layers. Post-LayerNorm blocks in the bert style (parts attn, attn_norm,
ffn, ffn_norm), GELU feed-forward, truncated-normal initialisation (std 0.02, a separate draw per
weight). Softmax, LayerNorm and all logits stay in float32 under mixed precision.

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

import keras
from keras import ops

from tfbig.models.configs import ALBERT_PRESETS, AlbertConfig  # noqa: F401 - re-exported
from tfbig.models.embeddings import Embeddings, MaskedLMHead
from tfbig.models.layers import TransformerBlock, make_initializer
from tfbig.models.layout import fine_tune_layout, masked_lm_layout


def _truncated_normal(stddev):
    return make_initializer("truncated_normal", stddev)


class AlbertBackbone(keras.layers.Layer):
    """Embedding -> E-to-H projection -> num_layers calls of num_groups shared blocks -> pooler.

    call(input_ids, segment_ids, input_mask) -> (sequence (B, T, H), pooled [CLS] (B, H)).
    """

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = config if isinstance(config, AlbertConfig) else AlbertConfig(**config)
        cfg = self.config
        # The word table lives at the embedding size E; the projection to H is the backbone's,
        # so the MLM head can reuse the (vocab_size, E) table.
        self.embedding = Embeddings(
            cfg.vocab_size, cfg.seq_length, cfg.embedding_size, cfg.type_vocab_size, cfg.dropout,
            cfg.layer_norm_epsilon, token_name="word", initializer="truncated_normal",
            initializer_range=cfg.initializer_range, name="embedding")
        self.projection = keras.layers.Dense(cfg.hidden_size, name="projection",
                                             kernel_initializer=_truncated_normal(
                                                 cfg.initializer_range))
        # One attribute per group, not a list: tf.train.Checkpoint does not see into the
        # TrackedList Keras 3 makes of a list attribute, so listed blocks would not be saved.
        for g in range(cfg.num_groups):
            setattr(self, f"group_{g}", TransformerBlock(
                cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.dropout,
                cfg.layer_norm_epsilon, pre_layer_norm=False, causal=False, style="bert",
                initializer="truncated_normal", initializer_range=cfg.initializer_range,
                attention=cfg.attention,
                attention_block_size=cfg.attention_block_size, name=f"group_{g}"))
        self.pooler = keras.layers.Dense(cfg.hidden_size, activation="tanh", name="pooler",
                                         kernel_initializer=_truncated_normal(
                                             cfg.initializer_range))

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
                                     initializer_range=cfg.initializer_range, name="mlm_head")
        self.sop_dropout = keras.layers.Dropout(cfg.dropout)
        self.sop_head = keras.layers.Dense(2, kernel_initializer=_truncated_normal(
            cfg.initializer_range), name="sop_head")

    def build(self, input_shape=None):
        self.backbone.build()
        self.mlm_head.build((None, None, self.config.hidden_size))
        self.sop_head.build((None, self.config.hidden_size))
        self.built = True

    def layout(self):
        """How this model may be split (data the backends read: tfbig.models.layout)."""
        return masked_lm_layout("groups", "sop_head", projection=True)

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

    def layout(self):
        """How this model may be split (data the backends read: tfbig.models.layout)."""
        return fine_tune_layout("groups", "span_head", projection=True)

    def call(self, inputs, training=False):
        sequence, _ = self.backbone(*_inputs(inputs), training=training)
        logits = ops.cast(self.span_head(sequence), "float32")  # (B, T, 2)
        return {"start_logits": logits[..., 0], "end_logits": logits[..., 1]}

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}
