"""Llama: a Llama-class decoder in Keras 3 (Llama 2/3, Mistral, Qwen 2/3), read top to bottom.

RMSNorm -> rotary position embedding (tfbig.models.rope) -> grouped-query attention -> SwiGLU MLP -> block ->
config (tfbig.models.llama_config) -> model. Pre-norm blocks, no biases (Qwen 2's q/k/v biases
and Qwen 3's QK-norm are config fields), an untied output layer unless `tie_embeddings`.
Grouped-query attention keeps `num_kv_heads` key/value heads, each serving `num_heads //
num_kv_heads` query heads (query head h reads key/value head h // groups, as Hugging Face's
repeat_kv and keras-hub's repeat); the key/value cache holds the key/value heads only.
Norm statistics, RoPE, softmax and logits are float32 under mixed precision. The model knows
nothing about distribution; its checkpoint keys are "block_0/attn/query/kernel", ...

Example:
    config = LlamaConfig.from_preset("tiny", vocab_size=500)
    model = Llama(config)
    logits = model(tf.zeros([2, 16], tf.int32))  # (2, 16, 500)
"""
import dataclasses
import math

import keras
from keras import ops

from tfbig.models.attention import blockwise_attention
from tfbig.models.common import uses_blockwise
from tfbig.models.layers import make_initializer
from tfbig.models.layout import ModelLayout, Split
from tfbig.models.llama_config import LLAMA_PRESETS, LlamaConfig  # noqa: F401 - re-exported
from tfbig.models.moe import SparseMoE
from tfbig.models.rope import ROPE_FIELDS, apply_rope, rope_frequencies  # noqa: F401 - re-exported

# How Llama may be split over a tensor group (data; the layout language: tfbig.models.layout).
# Megatron's attention and MLP pairs: q, k, v, gate and up column-parallel, proj and down
# row-parallel, query heads and key/value heads both split (whole groups per rank); each RMSNorm's
# output enters the split region once for the column layers that read it; Qwen 3's query/key
# norms apply one scale to every rank's own heads.
TENSOR_LAYOUT = (
    ("blocks.*.attn_norm", Split("region_input")),
    ("blocks.*.attn", Split("grouped_heads")),
    ("blocks.*.attn.query", Split("shared_column")),
    ("blocks.*.attn.key", Split("shared_column")),
    ("blocks.*.attn.value", Split("shared_column")),
    ("blocks.*.attn.proj", Split("row")),
    ("blocks.*.attn.attn_dropout", Split("own_mask")),
    ("blocks.*.attn.query_norm", Split("shared_norm", sequence=False)),
    ("blocks.*.attn.key_norm", Split("shared_norm", sequence=False)),
    ("blocks.*.mlp_norm", Split("region_input")),
    ("blocks.*.mlp", Split("width")),
    ("blocks.*.mlp.gate", Split("shared_column")),
    ("blocks.*.mlp.up", Split("shared_column")),
    ("blocks.*.mlp.down", Split("row")),
    ("embedding", Split("vocab")),
    ("head", Split("vocab_column")),
    ("final_norm", Split("vocab_input")),
    # --sequence_parallel: each norm runs on the rank's chunk of positions (its output
    # gathered whole into the split region, the row outputs reduce-scattered back to chunks)
    ("blocks.*.drop", Split("sequence_mask")),
)

class RMSNorm(keras.layers.Layer):
    """x / sqrt(mean(x^2) + epsilon) * scale over the last axis, statistics in float32."""

    def __init__(self, epsilon=1e-5, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        return self.normalize(x, self.scale)

    def normalize(self, x, scale):  # `scale`: the layer's own, or it read another way
        x32 = ops.cast(x, "float32")
        x32 = x32 * ops.rsqrt(ops.mean(ops.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return ops.cast(x32 * ops.cast(scale, "float32"), self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}


class LlamaAttention(keras.layers.Layer):
    """Causal grouped-query self-attention with RoPE: query, key, value Dense -> [QK-norm] ->
    RoPE -> scores -> float32 softmax -> dropout -> proj Dense.

    `attention` picks dense (a (B, kv, groups, T, S) softmax, key/value heads never repeated)
    or blockwise (tfbig.models.attention, key/value heads repeated to the query heads), as
    tfbig's MultiHeadAttention does; `attend` has its signature, so a context-parallel backend
    can replace it on the instance from outside, and `positions` (where RoPE puts the rows this
    layer sees) likewise.
    """

    causal = True  # always (a decoder's): read by backends that replace `attend`

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_size, rope, use_bias=False,
                 qk_norm=False, rms_norm_epsilon=1e-5, dropout=0.0, initializer_range=0.02,
                 output_initializer_range=None, attention="auto", attention_block_size=512,
                 **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.num_heads = num_heads  # the query heads this layer holds
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.rope = dict(rope)
        self.use_bias = use_bias
        self.qk_norm = qk_norm
        self.rms_norm_epsilon = rms_norm_epsilon
        self.dropout = dropout
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range
        self.attention = attention
        self.attention_block_size = attention_block_size
        output_std = output_initializer_range or initializer_range

        def dense(width, name, bias, std=initializer_range):
            return keras.layers.Dense(width, use_bias=bias, name=name,
                                      kernel_initializer=make_initializer("normal", std))

        self.query = dense(num_heads * head_size, "query", use_bias)
        self.key = dense(num_kv_heads * head_size, "key", use_bias)
        self.value = dense(num_kv_heads * head_size, "value", use_bias)
        self.proj = dense(hidden_size, "proj", False, output_std)
        self.query_norm = RMSNorm(rms_norm_epsilon, name="query_norm") if qk_norm else None
        self.key_norm = RMSNorm(rms_norm_epsilon, name="key_norm") if qk_norm else None
        self.attn_dropout = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        for dense in (self.query, self.key, self.value):
            dense.build(input_shape)
        self.proj.build(tuple(input_shape[:-1]) + (self.num_heads * self.head_size,))
        for norm in (self.query_norm, self.key_norm):
            if norm is not None:
                norm.build((None, None, None, self.head_size))

    def call(self, x, training=False, cache=None, cache_index=None):
        """x: (B, T, C). With `cache` (2, B, S, kv, hs) the T new keys/values are written at
        `cache_index` and attention spans the cache; returns (y, new_cache) then."""
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        q = ops.reshape(self.query(x), (batch, length, self.num_heads, self.head_size))
        k = ops.reshape(self.key(x), (batch, length, self.num_kv_heads, self.head_size))
        v = ops.reshape(self.value(x), (batch, length, self.num_kv_heads, self.head_size))
        if self.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)  # per head, before RoPE (Qwen 3)
        inverse = rope_frequencies(self.head_size, self.rope)
        positions = self.positions(length, 0 if cache_index is None else cache_index)
        q, k = apply_rope(q, inverse, positions), apply_rope(k, inverse, positions)
        if cache is not None:
            at = [0, cache_index, 0, 0]
            k = ops.slice_update(cache[0], at, ops.cast(k, cache.dtype))  # (B, S, kv, hs)
            v = ops.slice_update(cache[1], at, ops.cast(v, cache.dtype))
            cache = ops.stack([k, v])
            k, v = ops.cast(k, q.dtype), ops.cast(v, q.dtype)
        y = self.attend(q, k, v, None, training, cache_index)  # (B, T, nh, hs)
        y = self.proj(ops.reshape(y, (batch, length, self.num_heads * self.head_size)))
        return y if cache is None else (y, cache)

    def positions(self, length, start_index):
        """float32 (T,) positions of the T rows this call sees: start_index.. in one process."""
        return ops.cast(start_index, "float32") + ops.arange(length, dtype="float32")

    def attend(self, q, k, v, input_mask=None, training=False, cache_index=None):
        """(B, T, nh, hs) q and (B, S, kv, hs) k, v -> (B, T, nh, hs), causal."""
        if input_mask is not None:
            raise ValueError("LlamaAttention is causal over packed sequences; it takes no "
                             "padding mask")
        keys = k.shape[1]
        if (self.attention == "blockwise" if keys is None
                else uses_blockwise(self.attention, keys)):
            groups = self.num_heads // self.num_kv_heads
            k, v = ops.repeat(k, groups, axis=2), ops.repeat(v, groups, axis=2)  # (B,S,nh,hs)
            rate = self.dropout if training else 0.0
            seed = self.attn_dropout.seed_generator.next() if rate else None
            y, _ = blockwise_attention(q, k, v, causal=True, query_offset=(
                0 if cache_index is None else cache_index),
                block_size=self.attention_block_size, dropout=rate, seed=seed)
            return y
        return self._dense_attention(q, k, v, training, cache_index)

    def _dense_attention(self, q, k, v, training, cache_index):
        batch, length = ops.shape(q)[0], ops.shape(q)[1]
        groups = self.num_heads // self.num_kv_heads
        q = ops.reshape(q, (batch, length, self.num_kv_heads, groups, self.head_size))
        scores = ops.einsum("btkgd,bskd->bkgts", q, k)  # (B, kv, groups, T, S)
        scores = ops.cast(scores, "float32") / math.sqrt(self.head_size)
        query_pos = (0 if cache_index is None else cache_index) + ops.arange(length)[:, None]
        keep = ops.arange(ops.shape(k)[1])[None, :] <= query_pos  # (T, S)
        scores = ops.where(keep[None, None, None], scores, -1e9)
        probs = ops.cast(ops.softmax(scores, axis=-1), q.dtype)
        probs = self.attn_dropout(probs, training=training)
        y = ops.einsum("bkgts,bskd->btkgd", probs, v)  # (B, T, kv, groups, hs)
        return ops.reshape(y, (batch, length, self.num_heads, self.head_size))

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "head_size": self.head_size, "rope": self.rope, "use_bias": self.use_bias,
                "qk_norm": self.qk_norm, "rms_norm_epsilon": self.rms_norm_epsilon,
                "dropout": self.dropout, "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range,
                "attention": self.attention, "attention_block_size": self.attention_block_size}


class SwiGLU(keras.layers.Layer):
    """down(silu(gate(x)) * up(x)): three bias-free matrices, the SiLU in float32."""

    def __init__(self, hidden_size, intermediate_size, initializer_range=0.02,
                 output_initializer_range=None, **kwargs):
        super().__init__(**kwargs)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size  # the width this layer holds
        self.initializer_range = initializer_range
        self.output_initializer_range = output_initializer_range

        def dense(width, name, std):
            return keras.layers.Dense(width, use_bias=False, name=name,
                                      kernel_initializer=make_initializer("normal", std))

        self.gate = dense(intermediate_size, "gate", initializer_range)
        self.up = dense(intermediate_size, "up", initializer_range)
        self.down = dense(hidden_size, "down", output_initializer_range or initializer_range)

    def build(self, input_shape):
        self.gate.build(input_shape)
        self.up.build(input_shape)
        self.down.build(tuple(input_shape[:-1]) + (self.intermediate_size,))

    def call(self, x):
        gate = self.gate(x)  # (B, T, I)
        gate = ops.cast(ops.silu(ops.cast(gate, "float32")), gate.dtype)
        return self.down(gate * self.up(x))  # (B, T, C)

    def get_config(self):
        return {**super().get_config(), "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "initializer_range": self.initializer_range,
                "output_initializer_range": self.output_initializer_range}


class LlamaBlock(keras.layers.Layer):
    """x = x + attn(attn_norm(x));  x = x + mlp(mlp_norm(x))  (dropout on both branches).

    With `config.num_experts` the MLP is a SparseMoE (tfbig.models.moe) and the block returns
    (x, routing statistics)."""

    def __init__(self, config, output_initializer_range=None, **kwargs):
        super().__init__(**kwargs)
        self.config = config if isinstance(config, LlamaConfig) else LlamaConfig(**config)
        self.output_initializer_range = output_initializer_range
        cfg = self.config
        self.attn_norm = RMSNorm(cfg.rms_norm_epsilon, name="attn_norm")
        self.attn = LlamaAttention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size,
            {f: getattr(cfg, f) for f in ROPE_FIELDS}, use_bias=cfg.attention_bias,
            qk_norm=cfg.qk_norm, rms_norm_epsilon=cfg.rms_norm_epsilon, dropout=cfg.dropout,
            initializer_range=cfg.initializer_range,
            output_initializer_range=output_initializer_range, attention=cfg.attention,
            attention_block_size=cfg.attention_block_size, name="attn")
        self.mlp_norm = RMSNorm(cfg.rms_norm_epsilon, name="mlp_norm")
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range,
                          output_initializer_range, name="mlp") if not cfg.num_experts else \
            SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                      cfg.experts_per_token, cfg.router_softmax, cfg.capacity_factor,
                      cfg.shared_intermediate_size, cfg.initializer_range,
                      output_initializer_range, shared_gate=cfg.shared_expert_gate, name="mlp")
        self.drop = keras.layers.Dropout(cfg.dropout)

    def parts(self):
        """(attention norm, attention, MLP norm, MLP), as TransformerBlock.parts()."""
        return self.attn_norm, self.attn, self.mlp_norm, self.mlp

    def build(self, input_shape):
        for layer in self.parts():
            layer.build(input_shape)

    def call(self, x, training=False, cache=None, cache_index=None):
        attn_out = self.attn(self.attn_norm(x), training=training, cache=cache,
                             cache_index=cache_index)
        if cache is not None:
            attn_out, cache = attn_out
        x = x + self.drop(attn_out, training=training)
        mlp_out = self.mlp(self.mlp_norm(x))
        if self.config.num_experts:
            mlp_out, routing = mlp_out
        x = x + self.drop(mlp_out, training=training)
        out = x if cache is None else (x, cache)
        return (out, routing) if self.config.num_experts else out

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config),
                "output_initializer_range": self.output_initializer_range}


@keras.saving.register_keras_serializable(package="tfbig")
class Llama(keras.Model):
    """Llama-class decoder: token ids (B, T) -> float32 logits (B, T, vocab_size)."""

    def __init__(self, config, **kwargs):
        super().__init__(**kwargs)
        self.config = config if isinstance(config, LlamaConfig) else LlamaConfig(**config)
        cfg = self.config
        residual_std = cfg.initializer_range / math.sqrt(2 * cfg.num_layers)
        self.embedding = keras.layers.Embedding(
            cfg.vocab_size, cfg.hidden_size, name="embedding",
            embeddings_initializer=make_initializer("normal", cfg.initializer_range))
        self.blocks = [LlamaBlock(cfg, residual_std, name=f"block_{i}")
                       for i in range(cfg.num_layers)]
        self.final_norm = RMSNorm(cfg.rms_norm_epsilon, name="final_norm")
        self.head = (None if cfg.tie_embeddings else keras.layers.Dense(
            cfg.vocab_size, use_bias=False, name="head",
            kernel_initializer=make_initializer("normal", cfg.initializer_range)))

    def build(self, input_shape=None):
        hidden_shape = (None, None, self.config.hidden_size)
        self.embedding.build((None, None))
        for block in self.blocks:
            block.build(hidden_shape)
        self.final_norm.build(hidden_shape)
        if self.head is not None:
            self.head.build(hidden_shape)
        self.built = True

    def layout(self):
        """How this model may be split (data the backends read: tfbig.models.layout). A tied
        word table is read twice a step (embedding and logits): ZeRO-3 gathers it per step.
        Context parallelism cuts the token ids, puts RoPE at each rank's own positions and
        attends over the group; the loss runs on each rank's own tokens. An MoE model adds its
        MoE MLPs (--expert_parallel) and sums the routers' statistics over the context group
        (the load-balancing loss is over a replica's whole batch); its tensor split is the
        attention's and vocabulary's (MoE MLPs replicated, no sequence split, for that reason)."""
        tied = self.config.tie_embeddings
        gathers = dict(
            gather_per_call=("blocks.*", "final_norm", "head") + (() if tied else ("embedding",)),
            gather_per_step=("embedding",) if tied else ())
        context = (("embedding", "tokens"), ("blocks.*.attn", "rope_positions"),
                   ("blocks.*.attn", "attention"))
        if self.config.num_experts:  # the attention and vocabulary split, the MoE MLP whole
            return ModelLayout(experts=("blocks.*.mlp",), blocks="blocks", **gathers,
                               context=context + (("blocks.*.mlp", "routing_sums"),),
                               local_loss=True,
                               pipeline=("decoder", "embedding.embeddings"), tensor=tuple(
                (path, split) for path, split in TENSOR_LAYOUT
                if ".mlp" not in path and split.kind != "sequence_mask"))
        return ModelLayout(
            pipeline=("decoder", "embedding.embeddings"),
            tensor=TENSOR_LAYOUT,
            **gathers,
            blocks="blocks",
            context=context,
            local_loss=True)

    def logits(self, x):
        """Final norm and vocabulary projection of hidden states (B, T, C) -> (B, T, V) float32."""
        x = self.final_norm(x)
        if self.head is not None:
            return ops.cast(self.head(x), "float32")
        table = ops.cast(self.embedding.embeddings, x.dtype)  # (V, C)
        return ops.cast(ops.matmul(x, ops.transpose(table)), "float32")  # (B, T, V)

    def hidden_states(self, token_ids, training=False):
        """(last block's output (B, T, C) before the final norm, MoE layers' routing or [])."""
        x = self.embedding(token_ids)  # (B, T, C)
        routings = []
        for block in self.blocks:
            x = block(x, training=training)
            if self.config.num_experts:
                x, routing = x
                routings.append(routing)
        return x, routings

    def call(self, token_ids, training=False, return_routing=False):
        """Logits (B, T, V); with `return_routing` (an MoE model) also the routing statistics
        of its MoE layers: aux_loss and z_loss (means over layers), tokens_per_expert (L, E),
        dropped_tokens (L,)."""
        x, routings = self.hidden_states(token_ids, training)
        if not return_routing:
            return self.logits(x)
        if not routings:
            raise ValueError("return_routing: this Llama has no MoE layers (num_experts=0)")
        stacked = {k: ops.stack([r[k] for r in routings]) for k in routings[0]}
        return self.logits(x), {**stacked, "aux_loss": ops.mean(stacked["aux_loss"]),
                                "z_loss": ops.mean(stacked["z_loss"])}

    def init_cache(self, batch_size, max_length):
        """An empty cache of the key/value heads only: (num_layers, 2, B, max_length, kv, hs)."""
        cfg = self.config
        return ops.zeros((cfg.num_layers, 2, batch_size, max_length, cfg.num_kv_heads,
                          cfg.head_size), self.compute_dtype)

    def call_with_cache(self, token_ids, cache, cache_index):
        """Logits for `token_ids` at positions cache_index.. and the updated cache."""
        x = self.embedding(token_ids)
        new_cache = []
        for i, block in enumerate(self.blocks):
            out = block(x, cache=cache[i], cache_index=cache_index)
            x, layer_cache = out[0] if self.config.num_experts else out
            new_cache.append(layer_cache)
        return self.logits(x), ops.stack(new_cache)

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}
