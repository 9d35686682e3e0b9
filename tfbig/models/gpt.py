"""GPT: a decoder-only transformer in Keras 3, built from the shared layers (tfbig.models.layers).

Token + position embedding, `num_layers` causal blocks in the gpt2 style (parts ln_1, attn, ln_2,
mlp), pre-LayerNorm by default (post-LN as an option), GELU MLP, optional weight tying, GPT-2
initialisation (std 0.02, residual projections scaled by 1/sqrt(2 * num_layers)). Softmax,
LayerNorm and the logits stay in float32 under mixed precision. The model knows nothing about
distribution.

Example:
    config = GPTConfig.from_preset("tiny", vocab_size=500)
    model = GPT(config)
    logits = model(tf.zeros([2, 16], tf.int32))  # (2, 16, 500)
"""
import dataclasses
import math

import keras
from keras import ops

from tfbig.models.configs import GPT_PRESETS, GPTConfig  # noqa: F401 - re-exported
from tfbig.models.embeddings import Embeddings
from tfbig.models.layers import TransformerBlock, make_initializer
from tfbig.models.layout import ModelLayout, Split

# How GPT may be split over a tensor group (data; the layout language: tfbig.models.layout)
TENSOR_LAYOUT = (
    ("blocks.*.attn", Split("heads")),
    ("blocks.*.attn.qkv", Split("column", sections=3)),
    ("blocks.*.attn.proj", Split("row")),
    ("blocks.*.attn.attn_dropout", Split("own_mask")),
    ("blocks.*.mlp", Split("width")),
    ("blocks.*.mlp.fc", Split("column")),
    ("blocks.*.mlp.proj", Split("row")),
    ("embedding.token", Split("vocab")),
    ("head", Split("vocab_column")),
    ("final_norm", Split("vocab_input")),
    ("embedding.position", Split("positions")),
    ("embedding.drop", Split("sequence_mask")),
    ("blocks.*.attn.resid_dropout", Split("sequence_mask")),
    ("blocks.*.mlp.drop", Split("sequence_mask")),
)


@keras.saving.register_keras_serializable(package="tfbig")
class GPT(keras.Model):
    """Decoder-only language model: token ids (B, T) -> float32 logits (B, T, vocab_size)."""

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = config if isinstance(config, GPTConfig) else GPTConfig(**config)
        cfg = self.config
        residual_std = cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.embedding = Embeddings(cfg.vocab_size, cfg.seq_length, cfg.hidden_size,
                                    dropout=cfg.dropout, token_name="token",
                                    initializer_range=cfg.initializer_range, name="embedding")
        self.blocks = [TransformerBlock(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size,
                                        cfg.dropout, cfg.layer_norm_epsilon, cfg.pre_layer_norm,
                                        causal=True, style="gpt2",
                                        initializer_range=cfg.initializer_range,
                                        output_initializer_range=residual_std, name=f"block_{i}",
                                        attention=cfg.attention,
                                        attention_block_size=cfg.attention_block_size)
                       for i in range(cfg.num_layers)]
        self.final_norm = (keras.layers.LayerNormalization(epsilon=cfg.layer_norm_epsilon,
                                                           name="final_norm")
                           if cfg.pre_layer_norm else None)
        self.head = (None if cfg.tie_embeddings else keras.layers.Dense(
            cfg.vocab_size, use_bias=False, name="head",
            kernel_initializer=make_initializer("normal", cfg.initializer_range)))

    def build(self, input_shape=None):
        hidden_shape = (None, None, self.config.hidden_size)
        self.embedding.build((None, None))
        for block in self.blocks:
            block.build(hidden_shape)
        if self.final_norm is not None:
            self.final_norm.build(hidden_shape)
        if self.head is not None:
            self.head.build(hidden_shape)
        self.built = True

    def layout(self):
        """How this model may be split (data the backends read: tfbig.models.layout). A tied
        word table is read twice a step (embedding and logits), so ZeRO-3 gathers it per step."""
        tied = self.config.tie_embeddings
        return ModelLayout(
            pipeline=("decoder", "embedding.token.embeddings"),
            tensor=TENSOR_LAYOUT,
            gather_per_call=("blocks.*", "final_norm", "head") + (() if tied else ("embedding",)),
            gather_per_step=("embedding",) if tied else (),
            blocks="blocks",
            context=(("embedding", "inputs"), ("embedding.position", "positions"),
                     ("blocks.*.attn", "attention")),
            local_loss=True)

    def logits(self, x):
        """Final norm and vocabulary projection of hidden states (B, T, C) -> (B, T, V) float32."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.head is not None:
            return ops.cast(self.head(x), "float32")
        table = ops.cast(self.embedding.token.embeddings, x.dtype)  # (V, C)
        # A matmul, not einsum("btc,vc->btv"): TF differentiates that einsum into a batched
        # (B, V, C) weight gradient summed over B afterwards; this is one (V, C) dot over all
        # B*T tokens (XLA CPU: 6-10% of a whole training step, benchmarks/vs_keras_hub.py).
        return ops.cast(ops.matmul(x, ops.transpose(table)), "float32")  # (B, T, V)

    def call(self, token_ids, training=False):
        x = self.embedding(token_ids, training=training)  # (B, T, C)
        for block in self.blocks:
            x = block(x, training=training)
        return self.logits(x)

    def init_cache(self, batch_size, max_length):
        """An empty key/value cache: (num_layers, 2, B, max_length, nh, hs) in the compute dtype."""
        cfg = self.config
        return ops.zeros((cfg.num_layers, 2, batch_size, max_length, cfg.num_heads,
                          cfg.hidden_size // cfg.num_heads), self.compute_dtype)

    def call_with_cache(self, token_ids, cache, cache_index):
        """Logits for `token_ids` at positions cache_index.. and the updated cache."""
        x = self.embedding(token_ids, start_index=cache_index)
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, layer_cache = block(x, cache=cache[i], cache_index=cache_index)
            new_cache.append(layer_cache)
        return self.logits(x), ops.stack(new_cache)

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}
