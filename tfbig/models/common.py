"""What the GPT and ALBERT architecture configs share: presets by name and the checks that
refuse a bad config, or data that does not fit it, before any graph is built."""

# How attention computes its scores (--attention): the whole (T, S) softmax, or tiles of it
# (tfbig.models.attention); "auto" is blockwise from BLOCKWISE_FROM keys on, where
# benchmarks/long_context.py measured it no slower than dense on a CPU.
ATTENTION_KINDS = ("auto", "dense", "blockwise")
BLOCKWISE_FROM = 1024
# Config fields that change how a model computes, not its weights: a run resumes, and a
# checkpoint loads, under other values of them.
COMPUTE_FIELDS = ("attention", "attention_block_size")


def check_attention(attention, block_size):
    """Refuse an unknown --attention or a non-positive --attention_block_size."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"--attention={attention!r}: expected one of "
                         f"{' | '.join(ATTENTION_KINDS)}")
    if block_size <= 0:
        raise ValueError(f"--attention_block_size={block_size}: expected a positive number "
                         f"of rows per tile (e.g. 512)")


def uses_blockwise(attention, seq_length):
    """Whether attention over `seq_length` keys runs blockwise under --attention."""
    return attention == "blockwise" or (attention == "auto" and seq_length >= BLOCKWISE_FROM)


class ArchitectureConfig:
    """Base of the architecture dataclasses (GPTConfig, AlbertConfig).

    A subclass sets `family` (its name in messages), returns its preset table from a
    classmethod `presets()`, and calls `_check_fields` from `__post_init__`."""

    @classmethod
    def from_preset(cls, name, **overrides):
        """A preset with fields overridden (None values are ignored)."""
        presets = cls.presets()
        if name not in presets:
            raise ValueError(f"unknown {cls.family} preset {name!r}; choose one of "
                             f"{sorted(presets)}")
        return cls(**{**presets[name], **{k: v for k, v in overrides.items() if v is not None}})

    def _check_fields(self, positive):
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{type(self).__name__}.{name} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}; choose num_heads among the divisors "
                             f"of {self.hidden_size}")
        check_attention(self.attention, self.attention_block_size)

    def check_inputs(self, seq_length=None, vocab_size=None):
        """Raise ValueError before any graph is built if data does not fit this model."""
        if seq_length is not None and seq_length > self.seq_length:
            raise ValueError(f"sequence length {seq_length} is above the model's position table "
                             f"(seq_length={self.seq_length})")
        if vocab_size is not None and vocab_size != self.vocab_size:
            raise ValueError(f"the data's vocab_size={vocab_size} differs from the model's "
                             f"vocab_size={self.vocab_size}")
