"""GPT: a decoder-only transformer in Keras 3, read top to bottom.

attention -> MLP -> block -> embedding -> config -> model. GPT-2 style pre-LayerNorm by default
(post-LN as an option), GELU MLP, optional weight tying, GPT-2 initialisation (std 0.02, residual
projections scaled by 1/sqrt(2 * num_layers)). Softmax, LayerNorm and the logits stay in float32
under mixed precision. The model knows nothing about distribution.

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


def _normal(stddev):
    return keras.initializers.RandomNormal(stddev=stddev)


class CausalSelfAttention(keras.layers.Layer):
    """Multi-head causal self-attention with an optional key/value cache for generation."""

    def __init__(self, hidden_size, num_heads, dropout=0.0, initializer_range=0.02,
                 output_initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.dropout = dropout
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.head_size = hidden_size // num_heads
        self.qkv = keras.layers.Dense(3 * hidden_size, kernel_initializer=_normal(initializer_range),
                                      name="qkv")
        self.proj = keras.layers.Dense(hidden_size, name="proj",
                                       kernel_initializer=_normal(output_initializer_range))
        self.attn_dropout = keras.layers.Dropout(dropout)
        self.resid_dropout = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        self.qkv.build(input_shape)
        self.proj.build(input_shape[:-1] + (self.hidden_size,))

    def call(self, x, training=False, cache=None, cache_index=None):
        """x: (B, T, C). With `cache` (2, B, S, nh, hs) the T new keys/values are written at
        `cache_index` and attention spans the cache; returns (y, new_cache) in that case."""
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        qkv = ops.reshape(self.qkv(x), (batch, length, 3, self.num_heads, self.head_size))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, T, nh, hs)
        if cache is None:
            mask = ops.tril(ops.ones((length, length), "bool"))  # (T, T), folded into a constant
        else:
            start = [0, cache_index, 0, 0]
            k = ops.slice_update(cache[0], start, ops.cast(k, cache.dtype))  # (B, S, nh, hs)
            v = ops.slice_update(cache[1], start, ops.cast(v, cache.dtype))
            cache = ops.stack([k, v])
            k, v = ops.cast(k, q.dtype), ops.cast(v, q.dtype)
            query_pos = cache_index + ops.arange(length)[:, None]
            mask = ops.arange(ops.shape(k)[1])[None, :] <= query_pos  # (T, S)
        scores = ops.einsum("bqhd,bkhd->bhqk", q, k)  # (B, nh, T, S)
        scores = ops.cast(scores, "float32") / math.sqrt(self.head_size)
        scores = ops.where(mask[None, None], scores, -1e9)
        probs = ops.cast(ops.softmax(scores, axis=-1), q.dtype)
        probs = self.attn_dropout(probs, training=training)
        y = ops.einsum("bhqk,bkhd->bqhd", probs, v)  # (B, T, nh, hs)
        y = self.resid_dropout(self.proj(ops.reshape(y, (batch, length, self.hidden_size))),
                               training=training)
        return y if cache is None else (y, cache)

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "dropout": self.dropout,
                "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range}


class MLP(keras.layers.Layer):
    """Position-wise feed-forward: Dense(intermediate) -> GELU -> Dense(hidden) -> dropout."""

    def __init__(self, hidden_size, intermediate_size, dropout=0.0, initializer_range=0.02,
                 output_initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.dropout = dropout
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.fc = keras.layers.Dense(intermediate_size, name="fc",
                                     kernel_initializer=_normal(initializer_range))
        self.proj = keras.layers.Dense(hidden_size, name="proj",
                                       kernel_initializer=_normal(output_initializer_range))
        self.drop = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        self.fc.build(input_shape)
        self.proj.build(input_shape[:-1] + (self.intermediate_size,))

    def call(self, x, training=False):
        h = ops.gelu(self.fc(x), approximate=True)  # (B, T, 4C)
        return self.drop(self.proj(h), training=training)

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "dropout": self.dropout,
                "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range}


class TransformerBlock(keras.layers.Layer):
    """Attention + MLP with residuals; pre-LN (GPT-2) or post-LN (original transformer)."""

    def __init__(self, hidden_size, num_heads, intermediate_size, dropout=0.0,
                 layer_norm_epsilon=1e-5, pre_layer_norm=True, initializer_range=0.02,
                 output_initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.intermediate_size = intermediate_size
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.pre_layer_norm = pre_layer_norm
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.ln_1 = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="ln_1")
        self.attn = CausalSelfAttention(hidden_size, num_heads, dropout, initializer_range,
                                        output_initializer_range, name="attn")
        self.ln_2 = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="ln_2")
        self.mlp = MLP(hidden_size, intermediate_size, dropout, initializer_range,
                       output_initializer_range, name="mlp")

    def build(self, input_shape):
        for layer in (self.ln_1, self.attn, self.ln_2, self.mlp):
            layer.build(input_shape)

    def call(self, x, training=False, cache=None, cache_index=None):
        attn_in = self.ln_1(x) if self.pre_layer_norm else x
        attn_out = self.attn(attn_in, training=training, cache=cache, cache_index=cache_index)
        if cache is not None:
            attn_out, cache = attn_out
        if self.pre_layer_norm:
            x = x + attn_out
            x = x + self.mlp(self.ln_2(x), training=training)
        else:
            x = self.ln_1(x + attn_out)
            x = self.ln_2(x + self.mlp(x, training=training))
        return x if cache is None else (x, cache)

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "intermediate_size": self.intermediate_size,
                "dropout": self.dropout, "layer_norm_epsilon": self.layer_norm_epsilon,
                "pre_layer_norm": self.pre_layer_norm, "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range}


class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned position table of `seq_length` rows, then dropout."""

    def __init__(self, vocab_size, seq_length, hidden_size, dropout=0.0, initializer_range=0.02,
                 **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.hidden_size = hidden_size
        self.dropout = dropout
        self.initializer_range = initializer_range
        self.token = keras.layers.Embedding(vocab_size, hidden_size, name="token",
                                            embeddings_initializer=_normal(initializer_range))
        self.position = keras.layers.Embedding(seq_length, hidden_size, name="position",
                                               embeddings_initializer=_normal(initializer_range))
        self.drop = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        self.token.build(input_shape)
        self.position.build(input_shape)

    def call(self, token_ids, training=False, start_index=0):
        positions = start_index + ops.arange(ops.shape(token_ids)[1])  # (T,)
        x = self.token(token_ids) + self.position(positions)[None]  # (B, T, C)
        return self.drop(x, training=training)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "seq_length": self.seq_length, "hidden_size": self.hidden_size,
                "dropout": self.dropout, "initializer_range": self.initializer_range}


@keras.saving.register_keras_serializable(package="tfbig")
class GPT(keras.Model):
    """Decoder-only language model: token ids (B, T) -> float32 logits (B, T, vocab_size)."""

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = config if isinstance(config, GPTConfig) else GPTConfig(**config)
        cfg = self.config
        residual_std = cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.embedding = TokenAndPositionEmbedding(cfg.vocab_size, cfg.seq_length,
                                                   cfg.hidden_size, cfg.dropout,
                                                   cfg.initializer_range, name="embedding")
        self.blocks = [TransformerBlock(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size,
                                        cfg.dropout, cfg.layer_norm_epsilon, cfg.pre_layer_norm,
                                        cfg.initializer_range, residual_std, name=f"block_{i}")
                       for i in range(cfg.num_layers)]
        self.final_norm = (keras.layers.LayerNormalization(epsilon=cfg.layer_norm_epsilon,
                                                           name="final_norm")
                           if cfg.pre_layer_norm else None)
        self.head = (None if cfg.tie_embeddings else
                     keras.layers.Dense(cfg.vocab_size, use_bias=False, name="head",
                                        kernel_initializer=_normal(cfg.initializer_range)))

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
