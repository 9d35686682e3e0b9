"""The model, as the planner sees it: tfbig's own architecture configs and presets, without Keras.

The config dataclasses live in `tfbig.models.configs`, which imports no Keras or TensorFlow:
the planner counts parameters and FLOPs with the very `num_params` / `flops_per_token` the
trainer uses, never with a copy of the formulas, and starts in well under a second.

Example:
    cfg = model_config("gpt", "175b", seq_length=2048)
    cfg.num_params()                                   # 174.6e9
"""
import dataclasses

from tfbig.models.configs import ALBERT_PRESETS, GPT_PRESETS, AlbertConfig, GPTConfig

FAMILIES = {"gpt": (GPTConfig, GPT_PRESETS), "albert": (AlbertConfig, ALBERT_PRESETS)}


def load_configs(family):
    """(config class, preset table) of `family` (gpt | albert)."""
    if family not in FAMILIES:
        raise ValueError(f"--model={family!r}: expected one of {sorted(FAMILIES)}")
    return FAMILIES[family]


def model_config(family, preset, **overrides):
    """The architecture config of a preset with overrides applied (None keeps the preset's)."""
    cls, _ = load_configs(family)
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls.from_preset(preset, **{k: v for k, v in overrides.items() if k in fields})


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the estimates need from a model: sizes of the repeated layer and of the rest."""

    family: str
    num_layers: int  # layers run per token (ALBERT re-runs shared blocks)
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    seq_length: int  # the sequence length trained on
    dropout: bool  # dropout masks are kept for the backward pass
    params: int  # all weights (a shared block counts once)
    layer_params: int  # weights of one transformer layer
    block_params: int  # weights of all distinct transformer layers (ALBERT: its shared groups)
    flops_per_token: float  # model FLOPs (forward + backward), no recomputation
    # with pipeline stages, what the first stage holds besides its layers (the embedding) and
    # what the last holds (final norm / heads and the output matrix: a tied model's copy of
    # the token table, or its own head)
    first_params: int = 0
    last_params: int = 0

    @property
    def shared_layers(self):
        """ALBERT's layers share weights, so splitting them over pipeline stages saves none."""
        return self.family == "albert"


def shape_of(cfg, family, seq_length):
    """A Shape from a GPTConfig/AlbertConfig/BertConfig (from `model_config`) at `seq_length`."""
    c, f = cfg.hidden_size, cfg.intermediate_size
    layer = (3 * c * c + 3 * c) + (c * c + c) + (c * f + f) + (f * c + c) + 4 * c
    distinct = getattr(cfg, "num_groups", cfg.num_layers)
    return Shape(family, cfg.num_layers, c, cfg.num_heads, f, cfg.vocab_size, seq_length,
                 cfg.dropout > 0, cfg.num_params(), layer, distinct * layer,
                 cfg.flops_per_token(seq_length), *_end_params(cfg, family))


def _end_params(cfg, family):
    """(first stage's, last stage's) weights besides their transformer layers."""
    v, c = cfg.vocab_size, cfg.hidden_size
    if family == "gpt":
        return (v + cfg.seq_length) * c, (2 * c if cfg.pre_layer_norm else 0) + v * c
    # ALBERT: embedding and its projection; pooler, MLM and SOP heads. BERT: tables at H, no
    # projection; pooler, MLM and NSP heads.
    e = getattr(cfg, "embedding_size", c)
    projection = e * c + c if family == "albert" else 0
    first = (v + cfg.seq_length + cfg.type_vocab_size) * e + 2 * e + projection
    return first, cfg.num_params() - cfg.num_params(head=None) + c * c + c + v * e
