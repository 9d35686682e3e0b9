"""The model, as the planner sees it: tfbig's own architecture configs and presets, without Keras.

The config dataclasses live in `tfbig.models.configs`, which imports no Keras or TensorFlow:
the planner counts parameters and FLOPs with the very `num_params` / `flops_per_token` the
trainer uses, never with a copy of the formulas, and starts in well under a second.

It also holds the cost of each pipeline layer (`layer_specs`: embedding, the transformer layers,
the head, as tfbig.pipeline.layers cuts a model): tfbig-train balances its stages by these
costs (tfbig.layouts.partition) and the plan lays out its stages with the same partition.

Example:
    cfg = model_config("gpt", "175b", seq_length=2048)
    cfg.num_params()                                   # 174.6e9
    layer_specs(cfg, 2048)                             # [LayerSpec("embedding"), ...]
"""
import dataclasses

from tfbig.models.common import uses_blockwise
from tfbig.models.configs import ALBERT_PRESETS, GPT_PRESETS, AlbertConfig, BertConfig, GPTConfig
from tfbig.models.llama_config import LLAMA_PRESETS, LlamaConfig

FAMILIES = {"gpt": (GPTConfig, GPT_PRESETS), "albert": (AlbertConfig, ALBERT_PRESETS),
            "llama": (LlamaConfig, LLAMA_PRESETS)}


def load_configs(family):
    """(config class, preset table) of `family` (gpt | albert | llama)."""
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
    # the pipeline layers (LayerSpecs: embedding, transformer layers, head) whose FLOPs
    # tfbig-train's partition balances over stages
    pipe_layers: tuple = ()
    # attention runs blockwise (--attention; "auto" by seq_length): no (T, T) tensor is kept,
    # only a float32 log-sum-exp per head and token
    blockwise: bool = False
    # trainable variables as tfbig's models create them (the optimizer updates each with its
    # own ops; a calibration times that per variable)
    num_variables: int = 0
    # key/value heads per query head (grouped-query attention: Llama's num_kv_heads / num_heads)
    kv_fraction: float = 1.0
    # a gated MLP (Llama's SwiGLU: gate, up and down matrices) instead of one up, one down
    gated_mlp: bool = False
    # weights of the routed experts of every MoE layer (what --expert_parallel splits); the
    # FLOPs above count the k experts a token uses, `params` all E
    expert_params: int = 0
    num_experts: int = 0  # E routed experts per MoE layer (every Llama block); 0: dense
    experts_per_token: int = 0  # k experts each token is sent to (--expert_parallel's traffic)

    @property
    def active_params(self):
        """Weights one token multiplies by: an MoE model's k of its E routed experts."""
        if not self.num_experts:
            return self.params
        return round(self.params - self.expert_params * (1 - self.experts_per_token
                                                         / self.num_experts))

    @property
    def kv_heads(self):
        """Key/value heads: a tensor-parallel degree divides them (whole heads per rank)."""
        return round(self.num_heads * self.kv_fraction)

    @property
    def shared_layers(self):
        """ALBERT's layers share weights, so splitting them over pipeline stages saves none."""
        return self.family == "albert"


def shape_of(cfg, family, seq_length, masked_per_seq=None):
    """A Shape from a GPTConfig/AlbertConfig/BertConfig (from `model_config`) at `seq_length`
    (`masked_per_seq`: ALBERT/BERT's masked-LM positions per sequence, for the head's cost)."""
    c, f = cfg.hidden_size, cfg.intermediate_size
    layer = (3 * c * c + 3 * c) + (c * c + c) + (c * f + f) + (f * c + c) + 4 * c
    llama = isinstance(cfg, LlamaConfig)
    layer = cfg.block_params() if llama else layer
    distinct = getattr(cfg, "num_groups", cfg.num_layers)
    specs = SPECS[family_of(cfg)](cfg, seq_length, masked_per_seq)
    return Shape(family, cfg.num_layers, c, cfg.num_heads, f, cfg.vocab_size, seq_length,
                 cfg.dropout > 0, cfg.num_params(), layer, distinct * layer,
                 cfg.flops_per_token(seq_length), *_end_params(cfg, family), tuple(specs),
                 uses_blockwise(cfg.attention, seq_length),
                 _layer_variables(cfg) * distinct + _end_variables(cfg, family),
                 cfg.num_kv_heads / cfg.num_heads if llama else 1.0, llama,
                 cfg.num_layers * cfg.expert_params() if llama else 0,
                 *((cfg.num_experts, cfg.experts_per_token) if llama and cfg.num_experts
                   else (0, 0)))


def family_of(cfg):
    """gpt | albert | bert | llama: the family of an architecture config."""
    for cls, name in ((GPTConfig, "gpt"), (AlbertConfig, "albert"), (BertConfig, "bert"),
                      (LlamaConfig, "llama")):
        if isinstance(cfg, cls):
            return name
    raise ValueError(f"no cost model for {type(cfg).__name__}; it knows GPTConfig, "
                     f"AlbertConfig and BertConfig (tfbig/models/shapes.py)")


def layer_specs(cfg, seq_length, masked_per_seq=None):
    """The LayerSpecs of a model config, in the order tfbig.pipeline.layers cuts it."""
    return list(shape_of(cfg, family_of(cfg), seq_length, masked_per_seq).pipe_layers)


def fine_tune_specs(cfg, seq_length):
    """Embedding and transformer layers of `cfg`, then the fine-tuning head in place of
    pretraining's: the pooler and a classifier or span head (scopes of whichever the model
    has; costs of a 2-output head: next to a block's, noise)."""
    h, t = cfg.hidden_size, seq_length
    head = LayerSpec("heads", ("pooler", "classifier_head", "span_head"),
                     (h * h + h) + (2 * h + 2), 6 * (h * h / t + 2 * h))
    return layer_specs(cfg, seq_length)[:-1] + [head]


LAYER_VARIABLES = 12  # 2 LayerNorms' scale and offset; QKV, output, MLP in and out: kernel, bias


def _layer_variables(cfg):
    """Trainable variables of one transformer layer (Llama: 2 RMSNorm scales, q, k, v, proj,
    gate, up and down kernels, Qwen 2's 3 biases, Qwen 3's 2 QK-norm scales)."""
    if not isinstance(cfg, LlamaConfig):
        return LAYER_VARIABLES
    return 9 + (3 if cfg.attention_bias else 0) + (2 if cfg.qk_norm else 0)


def _end_variables(cfg, family):
    """Trainable variables besides the transformer layers: GPT's token and position tables,
    final LayerNorm (pre-LN) and untied head; ALBERT's and BERT's three tables, embedding
    LayerNorm, (ALBERT's projection), pooler, masked-LM transform, its LayerNorm and output
    bias, and the sentence-pair head."""
    if family == "gpt":
        return 2 + (2 if cfg.pre_layer_norm else 0) + (0 if cfg.tie_embeddings else 1)
    if family == "llama":  # token table, final RMSNorm, untied head
        return 2 + (0 if cfg.tie_embeddings else 1)
    return 3 + 2 + (2 if family == "albert" else 0) + 2 + 2 + 2 + 1 + 2


def _end_params(cfg, family):
    """(first stage's, last stage's) weights besides their transformer layers."""
    v, c = cfg.vocab_size, cfg.hidden_size
    if family == "gpt":
        return (v + cfg.seq_length) * c, (2 * c if cfg.pre_layer_norm else 0) + v * c
    if family == "llama":  # the token table; the final RMSNorm and the output matrix
        return v * c, c + v * c
    # ALBERT: embedding and its projection; pooler, MLM and SOP heads. BERT: tables at H, no
    # projection; pooler, MLM and NSP heads.
    e = getattr(cfg, "embedding_size", c)
    projection = e * c + c if family == "albert" else 0
    first = (v + cfg.seq_length + cfg.type_vocab_size) * e + 2 * e + projection
    return first, cfg.num_params() - cfg.num_params(head=None) + c * c + c + v * e


# ---- pipeline layers: what each costs ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What the partitioner knows of a layer before the model exists: names and costs."""

    name: str
    scopes: tuple  # Keras name-scope components of the variables it owns (for placement)
    params: int  # weights owned (a tied table counts once, with its owner)
    flops_per_token: float  # training FLOPs (forward + backward) per token
    reads: tuple = ()  # name-scope paths of weights it reads but another layer owns (tied)


def _gpt_specs(cfg, seq_length, masked_per_seq=None):
    c, f, v, t = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, seq_length
    block_params = 4 * c + 3 * c * c + 3 * c + c * c + c + 2 * c * f + f + c
    # 6 FLOPs per matmul weight per token (2 forward, 4 backward) + attention scores and mix.
    block_flops = 6 * (4 * c * c + 2 * c * f) + 12 * c * t
    head_params = (2 * c if cfg.pre_layer_norm else 0) + (0 if cfg.tie_embeddings else c * v)
    names = ["embedding"] + [f"block_{i}" for i in range(cfg.num_layers)] + ["head"]
    return ([LayerSpec("embedding", ("embedding",), v * c + cfg.seq_length * c, 4 * c)]
            + [LayerSpec(n, (n,), block_params, block_flops) for n in names[1:-1]]
            + [LayerSpec("head", ("final_norm", "head"), head_params, 6 * c * v,
                         ("embedding/token",) if cfg.tie_embeddings else ())])


def _llama_specs(cfg, seq_length, masked_per_seq=None):
    """Llama: the token table (a lookup: no matmul FLOPs), the blocks (q, k, v, proj and
    SwiGLU's three matrices; attention over the query heads), the final RMSNorm and head."""
    c, v, t = cfg.hidden_size, cfg.vocab_size, seq_length
    block = cfg.block_params()
    block_flops = 6 * cfg.block_matmul_params() + 12 * cfg.num_heads * cfg.head_size * t
    names = [f"block_{i}" for i in range(cfg.num_layers)]
    return ([LayerSpec("embedding", ("embedding",), v * c, 0)]
            + [LayerSpec(n, (n,), block, block_flops) for n in names]
            + [LayerSpec("head", ("final_norm", "head"), c + (0 if cfg.tie_embeddings else c * v),
                         6 * c * v, ("embedding",) if cfg.tie_embeddings else ())])


def _albert_specs(cfg, seq_length, masked_per_seq=None):
    v, e, h, i, t = (cfg.vocab_size, cfg.embedding_size, cfg.hidden_size,
                     cfg.intermediate_size, seq_length)
    p = masked_per_seq or max(1, round(0.15 * t))  # MLM positions per sequence
    block = (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
    layer_flops = 6 * (4 * h * h + 2 * h * i) + 12 * h * t
    first = {cfg.group_of_layer(n): n for n in reversed(range(cfg.num_layers))}
    group = lambda n: f"group_{cfg.group_of_layer(n)}"  # noqa: E731
    owns = lambda n: first[cfg.group_of_layer(n)] == n  # noqa: E731
    layers = [LayerSpec(f"layer_{n}", (group(n),) if owns(n) else (), block if owns(n) else 0,
                        layer_flops, () if owns(n) else (group(n),))
              for n in range(cfg.num_layers)]
    embedding = LayerSpec("embedding", ("embedding", "projection"),
                          (v + cfg.seq_length + cfg.type_vocab_size) * e + 2 * e + e * h + h,
                          6 * e * h)
    heads = LayerSpec("heads", ("pooler", "mlm_head", "sop_head"),
                      (h * h + h) + (h * e + e) + 2 * e + v + (2 * h + 2),
                      6 * (h * h / t + (h * e + e * v) * p / t), ("embedding/word",))
    return [embedding] + layers + [heads]


def _bert_specs(cfg, seq_length, masked_per_seq=None):
    v, h, i, t = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, seq_length
    p = masked_per_seq or max(1, round(0.15 * t))  # MLM positions per sequence
    block = (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
    block_flops = 6 * (4 * h * h + 2 * h * i) + 12 * h * t
    embedding = LayerSpec("embedding", ("embedding",),
                          (v + cfg.seq_length + cfg.type_vocab_size) * h + 2 * h, 4 * h)
    blocks = [LayerSpec(f"block_{n}", (f"block_{n}",), block, block_flops)
              for n in range(cfg.num_layers)]
    heads = LayerSpec("heads", ("pooler", "mlm_head", "nsp_head"),
                      (h * h + h) + (h * h + h) + 2 * h + v + (2 * h + 2),
                      6 * (h * h / t + (h * h + h * v) * p / t), ("embedding/word",))
    return [embedding] + blocks + [heads]


# LayerSpecs (embedding, transformer layers, head) of each family, from (config, seq_length,
# masked positions per sequence)
SPECS = {"gpt": _gpt_specs, "albert": _albert_specs, "bert": _bert_specs,
         "llama": _llama_specs}
