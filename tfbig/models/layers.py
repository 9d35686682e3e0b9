"""The transformer layers GPT, ALBERT and BERT are built from, read top to bottom.

initializers -> attention -> feed-forward -> block -> embeddings -> masked-LM head. One set of
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


def gelu(x, approximate=True):
    """GELU (tanh form, or erf with approximate=False) whose backward keeps only its input.

    The forward is keras' own (the same values); the gradient is the closed-form derivative,
    evaluated from `x` in float32. Differentiating keras' composite instead keeps every
    intermediate of the formula (x^3, the tanh argument, the tanh...): measured on this CPU,
    about 11 of the 32 hidden-widths of activations a GPT block holds per token for its
    backward, which this brings down to the one 4h input a fused GELU kernel keeps.

    The derivative is evaluated only once the gradient of the output exists (its input waits
    for a value read from it): needing only `x`, it would otherwise be ready as soon as the
    forward made `x`, and TensorFlow's executor, which runs whatever is ready, evaluated it
    then or later as its thread order fell, holding the result (and some of the formula's
    4h-wide temporaries) beside the rest of the forward and backward."""
    @ops.custom_gradient
    def gelu_keeping_input(x):
        def grad(*args, upstream=None):
            upstream = args[0] if upstream is None else upstream
            x_now = ops.cast(x, "float32") + _zero_from(upstream)  # x, once upstream exists
            return ops.cast(ops.cast(upstream, "float32") * _gelu_derivative(x_now, approximate),
                            upstream.dtype)
        return ops.gelu(x, approximate=approximate), grad

    return gelu_keeping_input(x)


def _zero_from(tensor):
    """A float32 0 computed from one element of `tensor` (0 whatever it holds, inf or nan):
    adding it to a value makes that value wait for `tensor` without changing it."""
    first = ops.reshape(tensor, (-1,))[0]
    return ops.cast(ops.isnan(first), "float32") * 0.0


def _gelu_derivative(x, approximate):
    """d gelu(x) / dx of float32 `x`."""
    if approximate:  # 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3)
        c = math.sqrt(2.0 / math.pi)
        t = ops.tanh(c * (x + 0.044715 * x * x * x))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x)
    # x Phi(x): Phi(x) + x phi(x)
    return 0.5 * (1.0 + ops.erf(x / math.sqrt(2.0))) + x * ops.exp(-0.5 * x * x) / math.sqrt(
        2.0 * math.pi)


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


class Embeddings(keras.layers.Layer):
    """Token + learned position (+ segment) embeddings of width `width` [-> LayerNorm] -> dropout.

    (B, T) ids -> (B, T, width). GPT: token and position, no norm. BERT/ALBERT: word, position
    and segment tables (`type_vocab_size`), then LayerNorm (`layer_norm_epsilon`). The token
    table is the attribute `token_name` ("token" for GPT, "word" for BERT/ALBERT): its name is
    part of the checkpoint keys, and the models tie their output projection to it.
    """

    def __init__(self, vocab_size, seq_length, width, type_vocab_size=0, dropout=0.0,
                 layer_norm_epsilon=None, token_name="token", initializer="normal",
                 initializer_range=0.02, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.width = width
        self.type_vocab_size = type_vocab_size
        self.dropout = dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.token_name = token_name
        self.initializer = initializer
        self.initializer_range = initializer_range

        def table(rows, name):
            return keras.layers.Embedding(rows, width, name=name, embeddings_initializer=(
                make_initializer(initializer, initializer_range)))

        setattr(self, token_name, table(vocab_size, token_name))
        self.position = table(seq_length, "position")
        self.segment = table(type_vocab_size, "segment") if type_vocab_size else None
        self.norm = (keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="norm")
                     if layer_norm_epsilon is not None else None)
        self.drop = keras.layers.Dropout(dropout)

    @property
    def tokens(self):
        """The token (word) embedding layer."""
        return getattr(self, self.token_name)

    def build(self, input_shape):
        for table in (self.tokens, self.position, self.segment):
            if table is not None:
                table.build(input_shape)
        if self.norm is not None:
            self.norm.build(tuple(input_shape) + (self.width,))

    def call(self, token_ids, segment_ids=None, training=False, start_index=0):
        positions = start_index + ops.arange(ops.shape(token_ids)[1])  # (T,)
        x = self.tokens(token_ids) + self.position(positions)[None]  # (B, T, width)
        if self.segment is not None:
            if segment_ids is None:
                raise ValueError(f"{self.name}: this embedding has a segment table; pass "
                                 f"segment_ids")
            x = x + self.segment(segment_ids)
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x, training=training)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "seq_length": self.seq_length, "width": self.width,
                "type_vocab_size": self.type_vocab_size, "dropout": self.dropout,
                "layer_norm_epsilon": self.layer_norm_epsilon, "token_name": self.token_name,
                "initializer": self.initializer, "initializer_range": self.initializer_range}


class MaskedLMHead(keras.layers.Layer):
    """Dense(H -> E, GELU) -> LayerNorm -> logits against a tied (vocab, E) table + bias.

    BERT has E = H; ALBERT's E is its factorised embedding size."""

    def __init__(self, vocab_size, embedding_size, layer_norm_epsilon=1e-12,
                 initializer="truncated_normal", initializer_range=0.02, approximate_gelu=True,
                 **kwargs):
        super().__init__(**kwargs)
        self.approximate_gelu = approximate_gelu
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer = initializer
        self.initializer_range = initializer_range
        self.dense = keras.layers.Dense(embedding_size, name="dense", kernel_initializer=(
            make_initializer(initializer, initializer_range)))
        self.norm = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, name="norm")

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.norm.build(tuple(input_shape[:-1]) + (self.embedding_size,))
        self.bias = self.add_weight(shape=(self.vocab_size,), initializer="zeros", name="bias")

    def call(self, x, word_table):
        """x: (B, P, H) hidden states at the masked positions -> float32 logits (B, P, vocab)."""
        h = self.norm(gelu(self.dense(x), approximate=self.approximate_gelu))  # (B, P, E)
        logits = ops.einsum("bpe,ve->bpv", h, ops.cast(word_table, h.dtype))
        return ops.cast(logits, "float32") + ops.cast(self.bias, "float32")

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "embedding_size": self.embedding_size,
                "layer_norm_epsilon": self.layer_norm_epsilon, "initializer": self.initializer,
                "initializer_range": self.initializer_range,
                "approximate_gelu": self.approximate_gelu}

