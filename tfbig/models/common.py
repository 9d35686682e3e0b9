"""What the GPT and ALBERT architecture configs share: presets by name and the checks that
refuse a bad config, or data that does not fit it, before any graph is built."""


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

    def check_inputs(self, seq_length=None, vocab_size=None):
        """Raise ValueError before any graph is built if data does not fit this model."""
        if seq_length is not None and seq_length > self.seq_length:
            raise ValueError(f"sequence length {seq_length} is above the model's position table "
                             f"(seq_length={self.seq_length})")
        if vocab_size is not None and vocab_size != self.vocab_size:
            raise ValueError(f"the data's vocab_size={vocab_size} differs from the model's "
                             f"vocab_size={self.vocab_size}")
