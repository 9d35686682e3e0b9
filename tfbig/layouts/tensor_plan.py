"""A model's tensor-parallel plan, read from the layout it declares (tfbig.models.layout: each
family's `layout().tensor`, attribute paths -> `Split`), the layers it names, and
`TensorGroup`, one rank's place in its tensor group.
"""
import dataclasses

from tfbig.models.layout import layout_of


def whole_sequence_paths(model):
    """Paths of the weights of layers outside the sequence-split region (`sequence=False`)."""
    return {v.path for pattern, split in plan_for(model) if not split.sequence
            for layer in resolve_plan_layers(model, pattern) for v in layer.trainable_variables}


def plan_for(model):
    """The tensor entries of the model's declared layout (its `layout()`, tfbig.models.layout)."""
    plan = layout_of(model).tensor
    if not plan:
        raise ValueError(f"--tensor_parallel: no tensor-parallel plan for "
                         f"{type(model).__name__} yet (GPT, ALBERT and BERT pretraining, BERT "
                         f"and ALBERT fine-tuning declare one in their layout(), tfbig.models.layout); "
                         f"run it with --tensor_parallel=1")
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
