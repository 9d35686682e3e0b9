"""Model families seen as a sequence of pipeline layers: the only model-specific pipeline code.

The pipeline cuts a model into stages at layer boundaries, so it needs the model as a list of
`PipeLayer`s: what each layer computes on the activation coming from the layer before, which
Keras modules own its weights (to place them on the stage's device), and what it costs (to
balance the stages). The model itself stays unaware of all this.

GPT is `embedding, block_0 .. block_{L-1}, head` where `head` is the final LayerNorm and the
vocabulary projection (`model.logits`); with tied embeddings the head also reads the token table
that lives with the embedding on the first stage. ALBERT is `embedding, layer_0 .. layer_{L-1},
heads`, its layers reusing num_groups shared blocks, possibly across stages. BERT is
`embedding, block_0 .. block_{L-1}, heads`, ALBERT's heads on blocks of their own.

Example:
    layers = layer_sequence(model)            # [PipeLayer("embedding"), PipeLayer("block_0"), ...]
    specs = layer_specs(model_config, seq_length=128)
"""
import dataclasses
from typing import Callable

from keras import ops

from tfbig.models.albert import AlbertConfig, AlbertForPretraining
from tfbig.models.bert import BertConfig, BertForPretraining
from tfbig.models.gpt import GPT, GPTConfig
from tfbig.plan import estimate
from tfbig.plan import models as plan_models


@dataclasses.dataclass
class PipeLayer:
    """One cut-able unit of a model: `call(x, training) -> y`, the modules owning its weights."""

    name: str  # also the Keras name-scope component of the variables it creates
    call: Callable
    modules: list  # Keras layers whose variables this layer owns (placed on its stage)
    shared: list = dataclasses.field(default_factory=list)  # variables owned by another layer
    random: bool = True  # draws dropout masks (False: no seed states to carry)
    calls: list = None  # modules it runs whose seed states it advances (default: `modules`)

    @property
    def variables(self):
        return [v for m in self.modules for v in m.trainable_variables] + list(self.shared)

    @property
    def rng_state(self):
        """Dropout seed-generator states: restored when the layer is recomputed."""
        modules = self.modules if self.calls is None else self.calls
        return [v for m in modules for v in m.non_trainable_variables
                if self.random and "seed_generator" in v.path]


@dataclasses.dataclass
class LayerSpec:
    """What the partitioner knows of a layer before the model exists: names and costs."""

    name: str
    scopes: tuple  # Keras name-scope components of the variables it owns (for placement)
    params: int  # weights owned (a tied table counts once, with its owner)
    flops_per_token: float  # training FLOPs (forward + backward) per token
    activation_bytes_per_token: float  # fp32 bytes kept for backward per token
    output_bytes_per_token: float  # fp32 bytes per token handed to the next layer
    reads: tuple = ()  # name-scope paths of weights it reads but another layer owns (tied)


def _keras_call(layer):
    return lambda x, training: layer(x, training=training)


# ---- GPT -------------------------------------------------------------------------------------
def _gpt_layers(model):
    def head(x, training):
        return model.logits(x)

    head_modules = [m for m in (model.final_norm, model.head) if m is not None]
    tied = [] if model.head is not None else [model.embedding.token.embeddings]
    random = model.config.dropout > 0
    return ([PipeLayer("embedding", _keras_call(model.embedding), [model.embedding],
                       random=random)]
            + [PipeLayer(block.name, _keras_call(block), [block], random=random)
               for block in model.blocks]
            + [PipeLayer("head", head, head_modules, tied, random=False)])


def _layer_bytes(cfg, family, seq_length):
    """fp32 bytes per token one transformer layer keeps for its backward (the planner's
    count: tfbig.plan.estimate.layer_activation_bytes)."""
    shape = plan_models.shape_of(cfg, family, seq_length)
    return estimate.layer_activation_bytes(shape, estimate.Layout(), "fp32")


def _gpt_specs(cfg, seq_length, masked_per_seq=None):
    c, f, v, t = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, seq_length
    block_params = 4 * c + 3 * c * c + 3 * c + c * c + c + 2 * c * f + f + c
    # 6 FLOPs per matmul weight per token (2 forward, 4 backward) + attention scores and mix.
    block_flops = 6 * (4 * c * c + 2 * c * f) + 12 * c * t
    block_bytes = _layer_bytes(cfg, "gpt", seq_length)
    head_params = (2 * c if cfg.pre_layer_norm else 0) + (0 if cfg.tie_embeddings else c * v)
    names = ["embedding"] + [f"block_{i}" for i in range(cfg.num_layers)] + ["head"]
    return ([LayerSpec("embedding", ("embedding",), v * c + cfg.seq_length * c, 4 * c, 4 * c,
                       4 * c)]
            + [LayerSpec(n, (n,), block_params, block_flops, block_bytes, 4 * c)
               for n in names[1:-1]]
            # the head keeps the loss's float32 softmax gradient: V floats per token
            + [LayerSpec("head", ("final_norm", "head"), head_params, 6 * c * v, 4 * c + 4 * v,
                         4 * v, ("embedding/token",) if cfg.tie_embeddings else ())])


# ---- ALBERT and BERT --------------------------------------------------------------------------
def _pretraining_heads(model, pair, random):
    """The `heads` layer of ALBERT/BERT pretraining (`pair`: "sop" | "nsp"): the model's call
    after the backbone, on the carry (hidden states, model inputs); reads the word table."""
    backbone = model.backbone
    pair_head, pair_dropout = getattr(model, f"{pair}_head"), getattr(model, f"{pair}_dropout")

    def heads(carry, training):
        x, inputs = carry
        pooled = backbone.pooler(x[:, 0])
        positions = ops.cast(inputs["masked_lm_positions"], "int32")[:, :, None]  # (B, P, 1)
        masked = ops.take_along_axis(x, positions, axis=1)  # (B, P, H)
        logits = pair_head(pair_dropout(pooled, training=training))
        return {"mlm_logits": model.mlm_head(masked, backbone.embedding.word.embeddings),
                f"{pair}_logits": ops.cast(logits, "float32")}

    return PipeLayer("heads", heads, [backbone.pooler, model.mlm_head, pair_head, pair_dropout],
                     [backbone.embedding.word.embeddings], random)


def _block_call(block):
    """A post-LN encoder block on the carry (hidden states, model inputs)."""
    return lambda carry, training: (block(carry[0], carry[1]["input_mask"], training=training),
                                    carry[1])


def _albert_layers(model):
    """embedding (+ projection), layer_0 .. layer_{L-1}, heads. Layer i runs shared block
    group_of_layer(i); the first layer running a block owns it, later ones (maybe on other
    stages) read it as a shared weight. The activation is (hidden states, model inputs)."""
    backbone, cfg = model.backbone, model.config
    random = cfg.dropout > 0

    def embed(inputs, training):
        x = backbone.embedding(inputs["input_ids"], inputs["segment_ids"], training=training)
        return backbone.projection(x), inputs  # (B, T, H)

    layers = [PipeLayer("embedding", embed, [backbone.embedding, backbone.projection],
                        random=random)]
    owned = set()
    for i in range(cfg.num_layers):
        block = backbone.groups[cfg.group_of_layer(i)]
        owner = id(block) not in owned
        owned.add(id(block))
        layers.append(PipeLayer(f"layer_{i}", _block_call(block), [block] if owner else [],
                                [] if owner else list(block.trainable_variables), random,
                                calls=[block]))
    layers.append(_pretraining_heads(model, "sop", random))
    return layers


def _albert_specs(cfg, seq_length, masked_per_seq=None):
    v, e, h, i, t = (cfg.vocab_size, cfg.embedding_size, cfg.hidden_size,
                     cfg.intermediate_size, seq_length)
    p = masked_per_seq or max(1, round(0.15 * t))  # MLM positions per sequence
    block = (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
    layer_flops = 6 * (4 * h * h + 2 * h * i) + 12 * h * t
    layer_bytes = _layer_bytes(cfg, "albert", seq_length)
    first = {cfg.group_of_layer(n): n for n in reversed(range(cfg.num_layers))}
    group = lambda n: f"group_{cfg.group_of_layer(n)}"  # noqa: E731
    owns = lambda n: first[cfg.group_of_layer(n)] == n  # noqa: E731
    layers = [LayerSpec(f"layer_{n}", (group(n),) if owns(n) else (), block if owns(n) else 0,
                        layer_flops, layer_bytes, 4 * h, () if owns(n) else (group(n),))
              for n in range(cfg.num_layers)]
    embedding = LayerSpec("embedding", ("embedding", "projection"),
                          (v + cfg.seq_length + cfg.type_vocab_size) * e + 2 * e + e * h + h,
                          6 * e * h, 4 * (3 * e + h), 4 * h)
    heads = LayerSpec("heads", ("pooler", "mlm_head", "sop_head"),
                      (h * h + h) + (h * e + e) + 2 * e + v + (2 * h + 2),
                      6 * (h * h / t + (h * e + e * v) * p / t), 4 * (e + 2 * v) * p / t, 4 * v,
                      ("embedding/word",))
    return [embedding] + layers + [heads]


def _bert_layers(model):
    """embedding, block_0 .. block_{L-1}, heads: ALBERT's sequence with a block of its own per
    layer and no projection. The activation is (hidden states, model inputs)."""
    backbone = model.backbone
    random = model.config.dropout > 0

    def embed(inputs, training):
        x = backbone.embedding(inputs["input_ids"], inputs["segment_ids"], training=training)
        return x, inputs  # (B, T, H)

    return ([PipeLayer("embedding", embed, [backbone.embedding], random=random)]
            + [PipeLayer(block.name, _block_call(block), [block], random=random)
               for block in backbone.blocks]
            + [_pretraining_heads(model, "nsp", random)])


def _bert_specs(cfg, seq_length, masked_per_seq=None):
    v, h, i, t = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, seq_length
    p = masked_per_seq or max(1, round(0.15 * t))  # MLM positions per sequence
    block = (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
    block_flops = 6 * (4 * h * h + 2 * h * i) + 12 * h * t
    block_bytes = _layer_bytes(cfg, "bert", seq_length)
    embedding = LayerSpec("embedding", ("embedding",),
                          (v + cfg.seq_length + cfg.type_vocab_size) * h + 2 * h, 4 * h,
                          4 * 3 * h, 4 * h)
    blocks = [LayerSpec(f"block_{n}", (f"block_{n}",), block, block_flops, block_bytes, 4 * h)
              for n in range(cfg.num_layers)]
    heads = LayerSpec("heads", ("pooler", "mlm_head", "nsp_head"),
                      (h * h + h) + (h * h + h) + 2 * h + v + (2 * h + 2),
                      6 * (h * h / t + (h * h + h * v) * p / t), 4 * (h + 2 * v) * p / t, 4 * v,
                      ("embedding/word",))
    return [embedding] + blocks + [heads]


FAMILIES = {GPT: _gpt_layers, AlbertForPretraining: _albert_layers,
            BertForPretraining: _bert_layers}
SPECS = {GPTConfig: _gpt_specs, AlbertConfig: _albert_specs, BertConfig: _bert_specs}


def layer_sequence(model):
    """The model as a list of PipeLayers, in the order activations flow."""
    for cls, layers in FAMILIES.items():
        if isinstance(model, cls):
            return layers(model)
    raise ValueError(f"--strategy=pipeline does not know how to cut a {type(model).__name__}; "
                     f"it knows {sorted(c.__name__ for c in FAMILIES)} (tfbig/pipeline/layers.py)")


def layer_specs(model_config, seq_length, masked_per_seq=None):
    """LayerSpecs in the same order as `layer_sequence`, from the config alone
    (`masked_per_seq`: ALBERT's masked-LM positions per sequence, for the head's cost)."""
    for cls, specs in SPECS.items():
        if isinstance(model_config, cls):
            return specs(model_config, seq_length, masked_per_seq)
    raise ValueError(f"no pipeline cost model for {type(model_config).__name__}; it knows "
                     f"{sorted(c.__name__ for c in SPECS)} (tfbig/pipeline/layers.py)")
