"""Tensor-parallel plans as data: which part of tfbig's GPT, BERT and ALBERT (and their
fine-tuning heads) is split how. A plan maps attribute paths below the model ("*" matches every
element of a list) to a `Split`; `TensorGroup` is one rank's place in its tensor group.
"""
import dataclasses


# ---- the plan: which part of a model is split how (data) -------------------------------------
@dataclasses.dataclass(frozen=True)
class Split:
    """How one layer is split. kind: heads | width (an attention's heads / an MLP's
    intermediate width shrink to 1/T), column (a Dense's output columns; `sections` equal
    blocks such as q, k, v each split), row (a Dense's input rows), vocab (an Embedding's rows),
    vocab_column (the untied output head's columns), vocab_input (the activation entering the
    vocabulary projection: copied into the region after this layer), vocab_bias (a head's
    per-token bias: its `vocab_size` entries split like the vocabulary), own_mask (a dropout
    inside a split region: its seed-generator state is offset by the tensor rank). With
    --sequence_parallel more act: positions (the position table's output: each rank keeps
    the rows of its sequence chunk), segments (the segment table's (B, T, C) output: the same
    along axis 1), sequence_mask (a dropout of the LayerNorm/dropout region: each rank holds
    other positions, so it draws its own mask like own_mask; without sequence parallelism the
    region is replicated and the mask shared), sequence_output (a backbone whose sequence
    output leaves the split region: gathered whole, its gradient cut back to the chunk) and
    sequence_first (a layer reading position 0 of the chunk, ALBERT's pooler: tensor rank 0's,
    which holds the [CLS] token, goes to every rank). `sequence=False` marks a layer of the
    replicated region after the backbone (ALBERT's heads read the [CLS] token and masked
    positions anywhere in the sequence): it sees the whole sequence on every rank, so its
    replicated weights' gradients are complete there, not summed over the group.
    A user task's declared layout (split_declared_model) adds two: keras_heads (a Keras
    MultiHeadAttention keeping 1/T of its heads: its input copied into the region, its output
    projection's partial sums reduced before the bias) and vocab_logits (a column-split output
    Dense whose logits are gathered whole for the task's own loss)."""

    kind: str
    sections: int = 1
    sequence: bool = True  # in the region split along the sequence by --sequence_parallel


# Attribute paths below the model ("*" matches every element of a list).
GPT_PLAN = (
    ("blocks.*.attn", Split("heads")),
    ("blocks.*.attn.qkv", Split("column", sections=3)),
    ("blocks.*.attn.proj", Split("row")),
    ("blocks.*.attn.attn_dropout", Split("own_mask")),
    ("blocks.*.mlp", Split("width")),
    ("blocks.*.mlp.fc", Split("column")),
    ("blocks.*.mlp.proj", Split("row")),
    ("embedding.token", Split("vocab")),
    ("head", Split("vocab_column")),
    ("final_norm", Split("vocab_input")),
    ("embedding.position", Split("positions")),
    ("embedding.drop", Split("sequence_mask")),
    ("blocks.*.attn.resid_dropout", Split("sequence_mask")),
    ("blocks.*.mlp.drop", Split("sequence_mask")),
)


def masked_lm_plan(blocks, pair_head):
    """ALBERT's and BERT's plan: transformer blocks at `backbone.<blocks>` (ALBERT's shared
    groups, split once so every call of one uses the same slices; BERT's own layers), the
    sentence-pair head `pair_head`. ALBERT's embedding projection E -> H stays replicated."""
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


def fine_tune_plan(blocks, head):
    """A fine-tuning model's plan (tfbig.tasks.classify, tfbig.tasks.squad): the backbone's entries
    of masked_lm_plan; the task `head` (classifier on the pooled [CLS], span head on every
    position) is small and stays replicated, in the region after the backbone."""
    backbone = tuple(entry for entry in masked_lm_plan(blocks, head)
                     if entry[0].startswith("backbone"))
    return backbone + ((head, Split("whole_sequence", sequence=False)),)


ALBERT_PLAN = masked_lm_plan("groups", "sop_head")


BERT_PLAN = masked_lm_plan("blocks", "nsp_head")


PLANS = {"GPT": GPT_PLAN, "AlbertForPretraining": ALBERT_PLAN, "BertForPretraining": BERT_PLAN,
         "AlbertForQuestionAnswering": fine_tune_plan("groups", "span_head"),
         "BertForQuestionAnswering": fine_tune_plan("blocks", "span_head"),
         "BertClassifier": fine_tune_plan("blocks", "classifier_head")}


def whole_sequence_paths(model):
    """Paths of the weights of layers outside the sequence-split region (`sequence=False`)."""
    return {v.path for pattern, split in plan_for(model) if not split.sequence
            for layer in resolve_plan_layers(model, pattern) for v in layer.trainable_variables}


def plan_for(model):
    plan = PLANS.get(type(model).__name__)
    if plan is None:
        raise ValueError(f"--tensor_parallel: no tensor-parallel plan for "
                         f"{type(model).__name__} yet (GPT, ALBERT and BERT pretraining, BERT "
                         f"and ALBERT fine-tuning have one); run it with --tensor_parallel=1")
    return plan


def resolve_plan_layers(model, pattern):
    """The layers at attribute path `pattern` (None attributes are skipped)."""
    found = [model]
    for part in pattern.split("."):
        nxt = []
        for obj in found:
            if part == "*":
                nxt.extend(obj)
            else:
                value = getattr(obj, part, None)
                if value is not None:
                    nxt.append(value)
        found = nxt
    return found


@dataclasses.dataclass(frozen=True)
class TensorGroup:
    """This rank's place in its tensor-parallel group."""

    process_set: object
    rank: int
    size: int
    sequence_parallel: bool = False  # LayerNorm/dropout regions split along the sequence
