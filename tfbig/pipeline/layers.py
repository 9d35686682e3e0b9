"""Model families seen as a sequence of pipeline layers: the only model-specific pipeline code.

Why it is built this way: docs/design/notes/pipeline.md (tfbig.pipeline.layers).
"""
import dataclasses
import functools
from typing import Callable

from keras import ops

from tfbig.models.layout import layout_of


@dataclasses.dataclass
class PipeLayer:
    """One cut-able unit of a model: `call(x, training) -> y`, the modules owning its weights."""

    name: str  # also the Keras name-scope component of the variables it creates
    call: Callable
    modules: list  # Keras layers whose variables this layer owns (placed on its stage)
    shared: list = dataclasses.field(default_factory=list)  # variables owned by another layer
    random: bool = True  # draws dropout masks (False: no seed states to carry)
    calls: list = None  # modules it runs whose seed states it advances (default: `modules`)
    # Reads positions anywhere in the sequence ([CLS], masked positions); its carry is
    # (hidden states, model inputs). A stage whose activations are split along the sequence
    # (tfbig.pipeline.tensor_stage) gathers the hidden states whole before it.
    whole_sequence: bool = False

    @property
    def variables(self):
        return [v for m in self.modules for v in m.trainable_variables] + list(self.shared)

    @property
    def rng_state(self):
        """Dropout seed-generator states: restored when the layer is recomputed."""
        modules = self.modules if self.calls is None else self.calls
        return [v for m in modules for v in m.non_trainable_variables
                if self.random and "seed_generator" in v.path]


def _keras_call(layer):
    return lambda x, training: layer(x, training=training)


# ---- GPT and Llama ---------------------------------------------------------------------------
def _decoder_layers(model, table):
    """embedding, the blocks, head (final norm and the vocabulary projection; a tied model's
    head reads the word table `table` as a shared weight)."""
    def head(x, training):
        return model.logits(x)

    head_modules = [m for m in (model.final_norm, model.head) if m is not None]
    tied = [] if model.head is not None else [table]
    random = model.config.dropout > 0
    return ([PipeLayer("embedding", _keras_call(model.embedding), [model.embedding],
                       random=random)]
            + [PipeLayer(block.name, _keras_call(block), [block], random=random)
               for block in model.blocks]
            + [PipeLayer("head", head, head_modules, tied, random=False)])


def _moe_decoder_layers(model, table):
    """An MoE Llama's: the carry is (hidden states, routing sums): each block adds its
    router's losses and, in its layer's row, its per-expert token counts and dropped tokens;
    the head returns (logits, routing) as the model's call with return_routing does (the
    losses' means over the layers), for the task's loss. The sums travel with the hidden
    states, so the routers of every stage get their losses' gradients back through them."""
    layers = _decoder_layers(model, table)
    num_layers, num_experts = model.config.num_layers, model.config.num_experts

    def embed(inputs, training):
        x = model.embedding(inputs, training=training)
        # computed from the data: a constant would be folded out of the transport's collectives
        zero = ops.sum(ops.cast(inputs[:1, :1], "float32")) * 0.0
        return x, {"aux_loss": zero, "z_loss": zero,
                   "tokens_per_expert": ops.zeros((num_layers, num_experts)) + zero,
                   "dropped_tokens": ops.zeros((num_layers,)) + zero}

    def block_call(block, index):
        def call(carry, training):
            x, sums = carry
            x, routing = block(x, training=training)
            row = ops.one_hot(index, num_layers)  # (L,): this layer's row of the counts
            tokens, dropped = routing["tokens_per_expert"], routing["dropped_tokens"]
            return x, {"aux_loss": sums["aux_loss"] + routing["aux_loss"],
                       "z_loss": sums["z_loss"] + routing["z_loss"],
                       "tokens_per_expert": sums["tokens_per_expert"]
                       + row[:, None] * tokens[None, :],
                       "dropped_tokens": sums["dropped_tokens"] + row * dropped}
        return call

    def head(carry, training):
        x, sums = carry
        return model.logits(x), {**sums, "aux_loss": sums["aux_loss"] / num_layers,
                                 "z_loss": sums["z_loss"] / num_layers}

    first, *blocks, last = layers
    return ([dataclasses.replace(first, call=embed)]
            + [dataclasses.replace(layer, call=block_call(block, i))
               for i, (layer, block) in enumerate(zip(blocks, model.blocks, strict=True))]
            + [dataclasses.replace(last, call=head)])


def _decoders(model, table):
    """GPT's and Llama's (an MoE model's: its routing sums travel with the hidden states)."""
    table = functools.reduce(getattr, table.split("."), model)
    return (_moe_decoder_layers if layout_of(model).experts else _decoder_layers)(model, table)


# ---- ALBERT and BERT --------------------------------------------------------------------------
def _pretraining_heads(model, random):
    """The `heads` layer of ALBERT/BERT pretraining (sentence order for ALBERT, next sentence
    for BERT): the model's call after the backbone, on the carry (hidden states, model
    inputs); reads the word table."""
    backbone = model.backbone
    pair = model.layout().pipeline[1].split(":")[1]  # "sop" (ALBERT) or "nsp" (BERT)
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
                     [backbone.embedding.word.embeddings], random, whole_sequence=True)


def _classifier_head(model, random):
    """BertClassifier's `heads`: pooler on [CLS], dropout, Dense(num_classes) (its call after
    the backbone)."""
    backbone = model.backbone

    def heads(carry, training):
        pooled = backbone.pooler(carry[0][:, 0])  # (B, H)
        logits = model.classifier_head(model.classifier_dropout(pooled, training=training))
        return {"logits": ops.cast(logits, "float32")}  # (B, num_classes)

    return PipeLayer("heads", heads, [backbone.pooler, model.classifier_dropout,
                                      model.classifier_head], random=random, whole_sequence=True)


def _span_head(model, random):
    """The SQuAD models' `heads`: start and end logits of every token (no dropout; the
    backbone's pooler is unused)."""
    def heads(carry, training):
        logits = ops.cast(model.span_head(carry[0]), "float32")  # (B, T, 2)
        return {"start_logits": logits[..., 0], "end_logits": logits[..., 1]}

    return PipeLayer("heads", heads, [model.span_head], random=False)


def _block_call(block):
    """A post-LN encoder block on the carry (hidden states, model inputs)."""
    return lambda carry, training: (block(carry[0], carry[1]["input_mask"], training=training),
                                    carry[1])


def _albert_layers(model, heads):
    """embedding (+ projection), layer_0 .. layer_{L-1}, `heads(model, random)`. Layer i runs
    shared block group_of_layer(i); the first layer running a block owns it, later ones (maybe
    on other stages) read it as a shared weight. The activation is (hidden states, model
    inputs)."""
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
    layers.append(heads(model, random))
    return layers


def _bert_layers(model, heads):
    """embedding, block_0 .. block_{L-1}, `heads(model, random)`: ALBERT's sequence with a
    block of its own per layer and no projection. The activation is (hidden states, model
    inputs)."""
    backbone = model.backbone
    random = model.config.dropout > 0

    def embed(inputs, training):
        x = backbone.embedding(inputs["input_ids"], inputs["segment_ids"], training=training)
        return x, inputs  # (B, T, H)

    return ([PipeLayer("embedding", embed, [backbone.embedding], random=random)]
            + [PipeLayer(block.name, _block_call(block), [block], random=random)
               for block in backbone.blocks]
            + [heads(model, random)])


HEADS = {"pretraining_heads": _pretraining_heads, "span_head": _span_head,
         "classifier_head": _classifier_head}
SEQUENCES = {  # a model's layout().pipeline[0]: its layer sequence, given the argument
    "decoder": _decoders,
    "albert": lambda model, heads: _albert_layers(model, HEADS[heads.split(":")[0]]),
    "bert": lambda model, heads: _bert_layers(model, HEADS[heads.split(":")[0]]),
}


def layer_sequence(model, task=None):
    """The model as a list of PipeLayers, in the order activations flow: those the task
    declares (`task.pipe_layers(model)`: [(name, call, modules)], a user task's
    pipeline_layers, tfbig.tasks.user_pipeline), or the sequence the model's layout() declares
    (`pipeline`: SEQUENCES)."""
    layout = layout_of(model)
    declared = getattr(task, "pipe_layers", None)
    if layout.experts and (declared is not None or layout.pipeline[:1] != ("decoder",)):
        raise ValueError(f"--pipeline_stages: the model declares MoE layers ("
                         f"{', '.join(layout.experts)}), whose routers' losses the pipeline "
                         f"carries between stages for tfbig's Llama only; train it without "
                         f"--pipeline_stages")
    if declared is not None:
        return [PipeLayer(name, call, modules) for name, call, modules in declared(model)]
    if layout.pipeline[:1] and layout.pipeline[0] in SEQUENCES:
        return SEQUENCES[layout.pipeline[0]](model, *layout.pipeline[1:])
    raise ValueError(f"--strategy=pipeline does not know how to cut a {type(model).__name__}: "
                     f"its layout() declares no pipeline sequence (tfbig.models.layout."
                     f"ModelLayout.pipeline, one of {sorted(SEQUENCES)}) and its task no "
                     f"pipe_layers")
