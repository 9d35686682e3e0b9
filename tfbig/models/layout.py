"""How a model may be split, declared as data next to the model (keras-hub's `get_layout_map`,
torchtitan's parallelize plans): each family's `layout()` returns a `ModelLayout` of attribute
paths below the model ("*": every element of a list). Nothing here distributes anything; the
backends read the declaration (tfbig.layouts.tensor_plan, tfbig.distribute.zero3, .recompute,
.context_parallel), so no backend keeps a table of model classes.
"""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Split:
    """How one layer is split over a tensor group of T ranks. kind: heads | width (an
    attention's heads / an MLP's intermediate width shrink to 1/T), grouped_heads (a
    grouped-query attention's query and key/value heads both shrink to 1/T), column (a Dense's
    output columns; `sections` equal blocks such as q, k, v each split), region_input (a layer
    whose output enters the split region once for the several shared_column layers reading
    it), shared_column (a column split adding no collective of its own), row (a Dense's
    input rows), vocab (an Embedding's rows), vocab_column (the untied output head's
    columns), vocab_input (the activation entering the vocabulary projection: copied into the
    region after this layer), vocab_bias (a head's per-token bias, split like the
    vocabulary), own_mask (a dropout inside a split region: its seed state offset by the
    tensor rank), shared_norm (a norm every rank applies to its own heads with one replicated
    scale, Qwen 3's QK-norm: the scale's gradient summed over the group). With
    --sequence_parallel:
    positions, segments (embedding outputs kept for the rank's sequence chunk), sequence_mask
    (a dropout of the sequence-split region), sequence_output (a backbone output gathered
    whole), sequence_first (position 0 of the chunk, from tensor rank 0), whole_sequence (a
    layer after the backbone that sees the whole sequence). `sequence=False` marks a layer of
    the replicated region after the backbone. A user task's declared layout adds keras_heads,
    vocab_logits, and einsum_column / einsum_row (an EinsumDense's kernel split on `axis`)
    (tfbig.layouts.tensor_layout.split_declared_model). Each kind's meaning at length:
    docs/design/notes/layouts.md."""

    kind: str
    sections: int = 1
    sequence: bool = True  # in the region split along the sequence by --sequence_parallel
    axis: int = None  # einsum_column / einsum_row (a LayoutMap's split): the kernel axis


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """A model's declared layout; an empty field means "not declared" (refused by name by the
    parallelism that needs it)."""

    tensor: tuple = ()  # ((path, Split), ...): --tensor_parallel
    gather_per_call: tuple = ()  # paths gathered around each call: --zero_stage=3
    gather_per_step: tuple = ()  # paths gathered once per step (a tied table read twice)
    blocks: str = ""  # path of the list of transformer blocks: --activation_checkpointing
    context: tuple = ()  # ((path, what), ...): --context_parallel (inputs, tokens, positions,
    #                      rope_positions, attention, whole_sequence, first_row,
    #                      routing_sums: an MoE layer's router statistics over the group)
    local_loss: bool = False  # the loss runs on each context rank's own tokens (a causal LM)
    experts: tuple = ()  # paths of the MoE layers (tfbig.models.moe.SparseMoE): --expert_parallel
    # (sequence, argument): the layers --pipeline_stages cuts (tfbig.pipeline.layers.SEQUENCES):
    # ("decoder", path of the word table a tied head reads), ("albert" | "bert", the heads:
    # "pretraining_heads:sop" | "pretraining_heads:nsp" | "span_head" | "classifier_head")
    pipeline: tuple = ()


def masked_lm_tensor(blocks, pair_head):
    """ALBERT's and BERT's tensor plan: transformer blocks at `backbone.<blocks>` (ALBERT's
    shared groups, split once so every call of one uses the same slices; BERT's own layers),
    the sentence-pair head `pair_head`. ALBERT's embedding projection E -> H stays replicated."""
    blocks = f"backbone.{blocks}.*"
    return (
        (f"{blocks}.attn", Split("heads")),
        (f"{blocks}.attn.qkv", Split("column", sections=3)),
        (f"{blocks}.attn.proj", Split("row")),
        (f"{blocks}.attn.attn_dropout", Split("own_mask")),
        (f"{blocks}.ffn", Split("width")),
        (f"{blocks}.ffn.fc", Split("column")),
        (f"{blocks}.ffn.proj", Split("row")),
        ("backbone.embedding.word", Split("vocab")),
        ("mlm_head", Split("vocab_bias", sequence=False)),
        ("mlm_head.norm", Split("vocab_input", sequence=False)),
        ("backbone.embedding.position", Split("positions")),
        ("backbone.embedding.segment", Split("segments")),
        ("backbone.embedding.drop", Split("sequence_mask")),
        (f"{blocks}.drop", Split("sequence_mask")),
        ("backbone", Split("sequence_output")),
        ("backbone.pooler", Split("sequence_first", sequence=False)),
        ("mlm_head.dense", Split("whole_sequence", sequence=False)),
        (pair_head, Split("whole_sequence", sequence=False)),
    )


def masked_lm_layout(blocks, pair_head, projection=False):
    """Pretraining BERT (`blocks`) or ALBERT (`groups`, with its embedding projection)."""
    return ModelLayout(
        pipeline=("albert" if projection else "bert",
                  f"pretraining_heads:{pair_head.split('_')[0]}"),
        tensor=masked_lm_tensor(blocks, pair_head),
        gather_per_call=(("backbone.projection",) if projection else ()) + (
            f"backbone.{blocks}.*", "backbone.pooler", pair_head),
        gather_per_step=("backbone.embedding", "mlm_head"),  # the word table, read twice
        blocks=f"backbone.{blocks}",
        context=(("backbone.embedding", "inputs"), ("backbone.embedding.position", "positions"),
                 (f"backbone.{blocks}.*.attn", "attention"), ("backbone", "whole_sequence"),
                 ("backbone.pooler", "first_row")))


def fine_tune_layout(blocks, head, projection=False):
    """A fine-tuning model (classifier on the pooled [CLS], span head on every position): the
    backbone's tensor entries of pretraining; the small task `head` stays replicated, in the
    region after the backbone; no head reads the word table, so the embedding is gathered
    around its own call."""
    backbone = tuple(entry for entry in masked_lm_tensor(blocks, head)
                     if entry[0].startswith("backbone"))
    return ModelLayout(
        pipeline=("albert" if projection else "bert", head),
        tensor=backbone + ((head, Split("whole_sequence", sequence=False)),),
        gather_per_call=("backbone.embedding",) + (
            ("backbone.projection",) if projection else ()) + (
            f"backbone.{blocks}.*", "backbone.pooler", head),
        blocks=f"backbone.{blocks}")


def layout_of(model):
    """`model.layout()` for a model that declares one; an empty ModelLayout otherwise."""
    declared = getattr(model, "layout", None)
    return declared() if callable(declared) else ModelLayout()
