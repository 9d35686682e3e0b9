"""BERT: a bidirectional encoder, built from the shared layers (tfbig.models.layers).

Devlin et al. (2018): word + position + segment embeddings at the hidden size with LayerNorm,
`num_layers` post-LayerNorm blocks in the bert style (parts attn, attn_norm, ffn, ffn_norm;
each block its own weights), tanh pooler on [CLS]. It is ALBERT without the factorised
embedding and without layer sharing, so the checkpoint keys are ALBERT's where the parts are
the same ("backbone/embedding/word/embeddings", "mlm_head/...", "span_head/..."); the blocks
are "backbone/block_{i}/..." as in GPT. GELU in its tanh form, as the original TF1 code and
keras-hub compute it, or the erf form (`approximate_gelu=False`, Hugging Face's "gelu") for
models trained with it. The model knows nothing about distribution.

Heads: masked-LM (tied to the word table) + next-sentence prediction on the pooled [CLS]
(pretraining), start/end span logits (SQuAD), and a sentence/pair classifier.

Example:
    config = BertConfig.from_preset("tiny", vocab_size=500)
    model = BertForPretraining(config)
    out = model({"input_ids": ids, "segment_ids": seg, "input_mask": mask,
                 "masked_lm_positions": positions})
    out["mlm_logits"]  # (B, P, 500);  out["nsp_logits"]  # (B, 2)
"""
import dataclasses

import keras
from keras import ops

from tfbig.models.configs import BERT_PRESETS, BertConfig  # noqa: F401 - re-exported
from tfbig.models.embeddings import Embeddings, MaskedLMHead
from tfbig.models.layers import TransformerBlock, make_initializer
from tfbig.models.layout import fine_tune_layout, masked_lm_layout


def _truncated_normal(stddev):
    return make_initializer("truncated_normal", stddev)


def _config(config):
    return config if isinstance(config, BertConfig) else BertConfig(**config)


class BertBackbone(keras.layers.Layer):
    """Embeddings (with LayerNorm) -> num_layers post-LN blocks -> tanh pooler on [CLS].

    call(input_ids, segment_ids, input_mask) -> (sequence (B, T, H), pooled [CLS] (B, H)).
    """

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = _config(config)
        cfg = self.config
        self.embedding = Embeddings(
            cfg.vocab_size, cfg.seq_length, cfg.hidden_size, cfg.type_vocab_size, cfg.dropout,
            cfg.layer_norm_epsilon, token_name="word", initializer="truncated_normal",
            initializer_range=cfg.initializer_range, name="embedding")
        self.blocks = [TransformerBlock(
            cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.dropout,
            cfg.layer_norm_epsilon, pre_layer_norm=False, causal=False, style="bert",
            initializer="truncated_normal", initializer_range=cfg.initializer_range,
            approximate_gelu=cfg.approximate_gelu, attention=cfg.attention,
            attention_block_size=cfg.attention_block_size, name=f"block_{i}")
            for i in range(cfg.num_layers)]
        self.pooler = keras.layers.Dense(cfg.hidden_size, activation="tanh", name="pooler",
                                         kernel_initializer=_truncated_normal(
                                             cfg.initializer_range))

    def build(self, input_shape=None):
        hidden_shape = (None, None, self.config.hidden_size)
        self.embedding.build((None, None))
        for block in self.blocks:
            block.build(hidden_shape)
        self.pooler.build((None, self.config.hidden_size))
        self.built = True

    def call(self, input_ids, segment_ids, input_mask, training=False):
        x = self.embedding(input_ids, segment_ids, training=training)  # (B, T, H)
        for block in self.blocks:
            x = block(x, input_mask, training=training)
        return x, self.pooler(x[:, 0])  # (B, T, H), (B, H)

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}


def _inputs(inputs):
    return inputs["input_ids"], inputs["segment_ids"], inputs["input_mask"]


class _BertModel(keras.Model):
    """A backbone plus the heads a subclass adds in `_heads` and builds in `_build_heads`."""

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = _config(config)
        self.backbone = BertBackbone(self.config, name="backbone")

    def build(self, input_shape=None):
        self.backbone.build()
        self._build_heads(self.config.hidden_size)
        self.built = True

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}


@keras.saving.register_keras_serializable(package="tfbig")
class BertForPretraining(_BertModel):
    """Backbone + masked-LM head tied to the word table + next-sentence head on [CLS].

    inputs: dict of int32 input_ids, segment_ids, input_mask (B, T) and masked_lm_positions
    (B, P). Returns {"mlm_logits": (B, P, vocab) float32, "nsp_logits": (B, 2) float32}.
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        cfg = self.config
        self.mlm_head = MaskedLMHead(cfg.vocab_size, cfg.hidden_size, cfg.layer_norm_epsilon,
                                     initializer_range=cfg.initializer_range,
                                     approximate_gelu=cfg.approximate_gelu, name="mlm_head")
        self.nsp_dropout = keras.layers.Dropout(cfg.dropout)
        self.nsp_head = keras.layers.Dense(2, kernel_initializer=_truncated_normal(
            cfg.initializer_range), name="nsp_head")

    def _build_heads(self, hidden):
        self.mlm_head.build((None, None, hidden))
        self.nsp_head.build((None, hidden))

    def layout(self):
        """How this model may be split (data the backends read: tfbig.models.layout)."""
        return masked_lm_layout("blocks", "nsp_head")

    def call(self, inputs, training=False):
        sequence, pooled = self.backbone(*_inputs(inputs), training=training)
        positions = ops.cast(inputs["masked_lm_positions"], "int32")[:, :, None]  # (B, P, 1)
        masked = ops.take_along_axis(sequence, positions, axis=1)  # (B, P, H)
        mlm_logits = self.mlm_head(masked, self.backbone.embedding.word.embeddings)
        nsp_logits = self.nsp_head(self.nsp_dropout(pooled, training=training))
        return {"mlm_logits": mlm_logits, "nsp_logits": ops.cast(nsp_logits, "float32")}


@keras.saving.register_keras_serializable(package="tfbig")
class BertForQuestionAnswering(_BertModel):
    """Backbone + span head: per-token start and end logits for extractive QA (SQuAD).

    inputs: dict of int32 input_ids, segment_ids, input_mask (B, T).
    Returns {"start_logits": (B, T) float32, "end_logits": (B, T) float32}.
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.span_head = keras.layers.Dense(2, kernel_initializer=_truncated_normal(
            self.config.initializer_range), name="span_head")

    def _build_heads(self, hidden):
        self.span_head.build((None, None, hidden))

    def layout(self):
        """How this model may be split (data the backends read: tfbig.models.layout)."""
        return fine_tune_layout("blocks", "span_head")

    def call(self, inputs, training=False):
        sequence, _ = self.backbone(*_inputs(inputs), training=training)
        logits = ops.cast(self.span_head(sequence), "float32")  # (B, T, 2)
        return {"start_logits": logits[..., 0], "end_logits": logits[..., 1]}


@keras.saving.register_keras_serializable(package="tfbig")
class BertClassifier(_BertModel):
    """Backbone + dropout + Dense(num_classes) on the pooled [CLS]: sentence or pair labels
    (GLUE-style). inputs as BertForQuestionAnswering; returns {"logits": (B, num_classes)}.
    """

    def __init__(self, config, num_classes=2, **kwargs):
        super().__init__(config, **kwargs)
        self.num_classes = num_classes
        self.classifier_dropout = keras.layers.Dropout(self.config.dropout)
        self.classifier_head = keras.layers.Dense(num_classes, kernel_initializer=(
            _truncated_normal(self.config.initializer_range)), name="classifier_head")

    def _build_heads(self, hidden):
        self.classifier_head.build((None, hidden))

    def layout(self):
        """How this model may be split (data the backends read: tfbig.models.layout)."""
        return fine_tune_layout("blocks", "classifier_head")

    def call(self, inputs, training=False):
        _, pooled = self.backbone(*_inputs(inputs), training=training)
        logits = self.classifier_head(self.classifier_dropout(pooled, training=training))
        return {"logits": ops.cast(logits, "float32")}  # (B, num_classes)

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes}
