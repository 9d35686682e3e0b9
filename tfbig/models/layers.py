"""The transformer layers GPT, ALBERT and BERT are built from, read top to bottom.

initializers -> attention -> feed-forward -> block (embeddings and the masked-LM head:
tfbig.models.embeddings; GELU: tfbig.models.activations). One set of
layers, so tensor parallelism, sharding and every later change is written once. A family chooses
through arguments: causal or bidirectional attention (with a padding mask and, for generation,
a key/value cache), pre- or post-LayerNorm blocks, and the block `style`, which fixes the names
of the block's parts (they are the checkpoint keys, "block_0/ln_1/gamma") and where its residual
dropout sits:

    style   parts (attention norm, attention, MLP norm, MLP)   residual dropout
    gpt2    ln_1, attn, ln_2, mlp                              inside attn and mlp (one each)
    bert    attn_norm, attn, ffn_norm, ffn                      one block-level Dropout, both

Softmax, LayerNorm statistics and logits stay in float32 under mixed precision. The layers know
nothing about distribution: a tensor-parallel backend shrinks `num_heads`/`intermediate_size` and
the Dense widths from outside (tfbig.layouts.tensor_layout), so every width below is read
from those attributes, never recomputed from the constructor's arguments; and with sequence
parallelism the QKV projection's input is a chunk of the sequence that the projection gathers,
so attention takes its length from the projection's output. Context parallelism replaces
`MultiHeadAttention.attend` (scores, softmax, weighted sum) on each instance from outside
(tfbig.distribute.context_parallel).

Example:
    block = TransformerBlock(64, 4, 256, causal=True, style="gpt2")
    y = block(x)                                        # (B, T, 64)
"""
import dataclasses
import math

import keras
from keras import ops

from tfbig.models.activations import gelu
from tfbig.models.attention import blockwise_attention
from tfbig.models.common import check_attention, uses_blockwise

INITIALIZERS = {"normal": keras.initializers.RandomNormal,
                "truncated_normal": keras.initializers.TruncatedNormal}


def make_initializer(kind, stddev):
    """A fresh initializer for ONE variable. An unseeded Keras initializer draws its seed when it
    is created, so one object shared by two variables gives them the same leading values."""
    if kind not in INITIALIZERS:
        raise ValueError(f"initializer={kind!r}: expected one of {sorted(INITIALIZERS)}")
    return INITIALIZERS[kind](stddev=stddev)


class MultiHeadAttention(keras.layers.Layer):
    """Self-attention: fused QKV Dense -> scores -> float32 softmax -> dropout -> output Dense.

    causal=True masks future positions (GPT) and supports a key/value cache for generation;
    `input_mask` (B, T) masks padded keys (BERT/ALBERT). `output_dropout` adds the residual
    dropout after the output projection (the gpt2 block style). `attention` picks how the
    scores are computed (ATTENTION_KINDS): "dense" forms the (B, nh, T, S) probabilities,
    "blockwise" never does (tfbig.models.attention, tiles of `attention_block_size` rows),
    "auto" is blockwise from common.BLOCKWISE_FROM keys on, where it is not slower.
    """

    def __init__(self, hidden_size, num_heads, dropout=0.0, causal=False, output_dropout=False,
                 initializer="normal", initializer_range=0.02, output_initializer_range=None,
                 attention="auto", attention_block_size=512, **kwargs):
        super().__init__(**kwargs)
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        check_attention(attention, attention_block_size)
        self.attention = attention
        self.attention_block_size = attention_block_size
        self.hidden_size = hidden_size  # the width of the heads this layer holds
        self.num_heads = num_heads
        self.dropout = dropout
        self.causal = causal
        self.output_dropout = output_dropout
        self.initializer = initializer
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.head_size = hidden_size // num_heads
        output_std = initializer_range if output_initializer_range is None else \
            output_initializer_range
        self.qkv = keras.layers.Dense(3 * hidden_size, name="qkv", kernel_initializer=(
            make_initializer(initializer, initializer_range)))
        self.proj = keras.layers.Dense(hidden_size, name="proj", kernel_initializer=(
            make_initializer(initializer, output_std)))
        self.attn_dropout = keras.layers.Dropout(dropout)
        self.resid_dropout = keras.layers.Dropout(dropout) if output_dropout else None

    def build(self, input_shape):
        self.qkv.build(input_shape)
        self.proj.build(tuple(input_shape[:-1]) + (self.hidden_size,))

    def call(self, x, input_mask=None, training=False, cache=None, cache_index=None):
        """x: (B, T, C); input_mask: (B, T), 1 for real tokens. With `cache` (2, B, S, nh, hs)
        (causal only) the T new keys/values are written at `cache_index` and attention spans
        the cache; returns (y, new_cache) in that case."""
        qkv = self.qkv(x)  # (B, T, 3C); its shape, not x's, is the attention's (see below)
        batch, length = ops.shape(qkv)[0], ops.shape(qkv)[1]
        qkv = ops.reshape(qkv, (batch, length, 3, self.num_heads, self.head_size))
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, T, nh, hs)
        if cache is not None:
            if not self.causal:
                raise ValueError("a key/value cache needs causal attention")
            start = [0, cache_index, 0, 0]
            k = ops.slice_update(cache[0], start, ops.cast(k, cache.dtype))  # (B, S, nh, hs)
            v = ops.slice_update(cache[1], start, ops.cast(v, cache.dtype))
            cache = ops.stack([k, v])
            k, v = ops.cast(k, q.dtype), ops.cast(v, q.dtype)
        y = self.attend(q, k, v, input_mask, training, cache_index)
        y = self.proj(ops.reshape(y, (batch, length, self.hidden_size)))
        if self.resid_dropout is not None:
            y = self.resid_dropout(y, training=training)
        return y if cache is None else (y, cache)

    def attend(self, q, k, v, input_mask=None, training=False, cache_index=None):
        """The scores, softmax and weighted sum: (B, T, nh, hs) q and (B, S, nh, hs) k, v ->
        (B, T, nh, hs). A backend that splits the sequence over ranks (context parallelism)
        replaces this method on the instance from outside; the layer never knows."""
        if self._blockwise(k.shape[1]):
            return self._blockwise_attention(q, k, v, input_mask, training, cache_index)
        return self._dense_attention(q, k, v, input_mask, training, cache_index)

    def _blockwise(self, keys):
        """Whether this call runs blockwise: `attention`, with "auto" decided by the number of
        keys (dense when it is not known before the call, e.g. an export for any length)."""
        if keys is None:
            return self.attention == "blockwise"
        return uses_blockwise(self.attention, keys)

    def _dense_attention(self, q, k, v, input_mask, training, cache_index):
        """(B, T, nh, hs) -> (B, T, nh, hs) through the whole (B, nh, T, S) softmax."""
        length = ops.shape(q)[1]
        scores = ops.einsum("bqhd,bkhd->bhqk", q, k)  # (B, nh, T, S)
        scores = ops.cast(scores, "float32") / math.sqrt(self.head_size)
        keep = self._keep(length, ops.shape(k)[1], input_mask, cache_index)
        if keep is not None:
            scores = ops.where(keep, scores, -1e9)
        probs = ops.cast(ops.softmax(scores, axis=-1), q.dtype)
        probs = self.attn_dropout(probs, training=training)
        return ops.einsum("bhqk,bkhd->bqhd", probs, v)  # (B, T, nh, hs)

    def _blockwise_attention(self, q, k, v, input_mask, training, cache_index):
        """(B, T, nh, hs) -> (B, T, nh, hs), one tile of scores at a time; the dropout masks
        are drawn from the dropout layer's own seed generator (one draw per call)."""
        rate = self.dropout if training else 0.0
        seed = self.attn_dropout.seed_generator.next() if rate else None
        y, _ = blockwise_attention(q, k, v, causal=self.causal, key_mask=input_mask,
                                   query_offset=0 if cache_index is None else cache_index,
                                   block_size=self.attention_block_size, dropout=rate,
                                   seed=seed)
        return y

    def _keep(self, length, keys, input_mask, cache_index):
        """Which scores count, broadcastable to (B, nh, T, S); None: all of them."""
        keep = None
        if self.causal and cache_index is None:
            keep = ops.tril(ops.ones((length, length), "bool"))[None, None]  # a constant
        elif self.causal:
            query_pos = cache_index + ops.arange(length)[:, None]
            keep = (ops.arange(keys)[None, :] <= query_pos)[None, None]  # (1, 1, T, S)
        if input_mask is not None:
            padding = ops.cast(input_mask, "bool")[:, None, None, :]  # (B, 1, 1, S)
            keep = padding if keep is None else ops.logical_and(keep, padding)
        return keep

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "dropout": self.dropout, "causal": self.causal,
                "output_dropout": self.output_dropout, "initializer": self.initializer,
                "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range,
                "attention": self.attention,
                "attention_block_size": self.attention_block_size}


class FeedForward(keras.layers.Layer):
    """Position-wise Dense(intermediate) -> GELU -> Dense(hidden) [-> residual dropout when
    `output_dropout`, the gpt2 block style]. GELU in its tanh form (GPT-2's and ALBERT's
    gelu_new, the original BERT's) unless `approximate_gelu=False` (the erf form)."""

    def __init__(self, hidden_size, intermediate_size, dropout=0.0, output_dropout=False,
                 initializer="normal", initializer_range=0.02, output_initializer_range=None,
                 approximate_gelu=True, **kwargs):
        super().__init__(**kwargs)
        self.approximate_gelu = approximate_gelu
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size  # the width this layer holds
        self.dropout = dropout
        self.output_dropout = output_dropout
        self.initializer = initializer
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        output_std = initializer_range if output_initializer_range is None else \
            output_initializer_range
        self.fc = keras.layers.Dense(intermediate_size, name="fc", kernel_initializer=(
            make_initializer(initializer, initializer_range)))
        self.proj = keras.layers.Dense(hidden_size, name="proj", kernel_initializer=(
            make_initializer(initializer, output_std)))
        self.drop = keras.layers.Dropout(dropout) if output_dropout else None

    def build(self, input_shape):
        self.fc.build(input_shape)
        self.proj.build(tuple(input_shape[:-1]) + (self.intermediate_size,))

    def call(self, x, training=False):
        y = self.proj(gelu(self.fc(x), approximate=self.approximate_gelu))
        return y if self.drop is None else self.drop(y, training=training)

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "dropout": self.dropout,
                "output_dropout": self.output_dropout, "initializer": self.initializer,
                "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range,
                "approximate_gelu": self.approximate_gelu}


@dataclasses.dataclass(frozen=True)
class BlockStyle:
    """The names of a block's parts (its checkpoint keys) and where its residual dropout sits."""

    attn_norm: str
    mlp_norm: str
    mlp: str
    block_dropout: bool  # one Dropout on the block for both branches (else one inside each)


STYLES = {"gpt2": BlockStyle("ln_1", "ln_2", "mlp", block_dropout=False),
          "bert": BlockStyle("attn_norm", "ffn_norm", "ffn", block_dropout=True)}


class TransformerBlock(keras.layers.Layer):
    """Attention and feed-forward branches with residuals.

    pre-LN (GPT-2):   x = x + attn(norm1(x));  x = x + mlp(norm2(x))
    post-LN (BERT):   x = norm1(x + attn(x));  x = norm2(x + mlp(x))
    The parts are attributes named by `style` (STYLES): block.ln_1 / block.attn_norm, ...
    """

    def __init__(self, hidden_size, num_heads, intermediate_size, dropout=0.0,
                 layer_norm_epsilon=1e-5, pre_layer_norm=True, causal=False, style="gpt2",
                 initializer="normal", initializer_range=0.02, output_initializer_range=None,
                 approximate_gelu=True, attention="auto", attention_block_size=512, **kwargs):
        super().__init__(**kwargs)
        if style not in STYLES:
            raise ValueError(f"style={style!r}: expected one of {sorted(STYLES)}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.intermediate_size = intermediate_size
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.pre_layer_norm = pre_layer_norm
        self.causal = causal
        self.style = style
        self.initializer = initializer
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.approximate_gelu = approximate_gelu
        self.attention = attention
        self.attention_block_size = attention_block_size
        names = STYLES[style]
        branch_dropout = not names.block_dropout
        init = dict(initializer=initializer, initializer_range=initializer_range,
                    output_initializer_range=output_initializer_range)
        setattr(self, names.attn_norm, keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, name=names.attn_norm))
        self.attn = MultiHeadAttention(hidden_size, num_heads, dropout, causal, branch_dropout,
                                       attention=attention,
                                       attention_block_size=attention_block_size, name="attn",
                                       **init)
        setattr(self, names.mlp_norm, keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, name=names.mlp_norm))
        setattr(self, names.mlp, FeedForward(hidden_size, intermediate_size, dropout,
                                             branch_dropout, name=names.mlp,
                                             approximate_gelu=approximate_gelu, **init))
        self.drop = keras.layers.Dropout(dropout) if names.block_dropout else None

    def parts(self):
        """(attention norm, attention, MLP norm, MLP), whatever the style names them."""
        names = STYLES[self.style]
        return (getattr(self, names.attn_norm), self.attn, getattr(self, names.mlp_norm),
                getattr(self, names.mlp))

    def build(self, input_shape):
        for layer in self.parts():
            layer.build(input_shape)

    def call(self, x, input_mask=None, training=False, cache=None, cache_index=None):
        norm_1, attn, norm_2, mlp = self.parts()
        attn_out = attn(norm_1(x) if self.pre_layer_norm else x, input_mask, training=training,
                        cache=cache, cache_index=cache_index)
        if cache is not None:
            attn_out, cache = attn_out
        if self.pre_layer_norm:
            x = x + self._residual(attn_out, training)
            x = x + self._residual(mlp(norm_2(x), training=training), training)
        else:
            x = norm_1(x + self._residual(attn_out, training))
            x = norm_2(x + self._residual(mlp(x, training=training), training))
        return x if cache is None else (x, cache)

    def _residual(self, branch, training):
        return branch if self.drop is None else self.drop(branch, training=training)

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "intermediate_size": self.intermediate_size,
                "dropout": self.dropout, "layer_norm_epsilon": self.layer_norm_epsilon,
                "pre_layer_norm": self.pre_layer_norm, "causal": self.causal,
                "style": self.style, "initializer": self.initializer,
                "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range,
                "approximate_gelu": self.approximate_gelu, "attention": self.attention,
                "attention_block_size": self.attention_block_size}


