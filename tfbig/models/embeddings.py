"""Token (+ position, + segment) embeddings and the masked-LM head tied to the word table:
the ends of GPT, ALBERT and BERT (their blocks: tfbig.models.layers).

Example:
    embedding = Embeddings(vocab_size=500, seq_length=128, width=64, name="embedding")
    x = embedding(token_ids)                              # (B, T, 64)
"""
import keras
from keras import ops

from tfbig.models.activations import gelu
from tfbig.models.layers import make_initializer


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
