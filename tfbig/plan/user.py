"""`--plan_only` for a user task (tfbig.api): the plan of what is known of a model tfbig did
not write.

Why it is built this way: docs/design/notes/plan.md (tfbig.plan.user).
"""
import dataclasses

from tfbig.models import shapes as models
from tfbig.plan import calibration as calibration_lib
from tfbig.plan import estimate, report, search
from tfbig.plan.hardware import Cluster

SHAPE_FIELDS = ("hidden_size", "num_layers", "num_heads", "seq_length", "vocab_size")
# intermediate_size: default 4 x hidden_size; dropout: default 0 (its masks are kept)
OPTIONAL_SHAPE_FIELDS = ("intermediate_size", "dropout")
UNKNOWN_WITHOUT_SHAPE = ("activations", "step time")
STATE = ("parameters", "gradients", "optimizer")


@dataclasses.dataclass
class UserPlan:
    """What `tfbig.train(..., plan_only=True)` returns (and prints as `text`)."""

    text: str
    parameters: int  # trainable weights, counted on the built model
    other_values: int  # non-trainable variables' values (statistics, RNG states): not sharded
    memory: dict  # bytes per rank by kind; without a transformer_shape only the STATE kinds
    unknown: tuple  # what the plan cannot say (empty with a transformer_shape)
    estimate: object = None  # the planner's search.Estimate, with a transformer_shape


def count_variables(model):
    """(trainable weights, other variables' values) of a built Keras model."""
    return (sum(_product(v.shape) for v in model.trainable_variables),
            sum(_product(v.shape) for v in model.non_trainable_variables))


def count_split(model, splits, tensor):
    """((trainable weights, other variables' values) of the whole model, trainable weights one
    rank holds) of tensor rank 0's `model` as split_declared_model returns it with `splits`
    ({variable path: (axis, sections)}): each split variable holds 1/`tensor` of its values."""
    held, other = count_variables(model)
    sliced = sum(_product(v.shape) for v in model.trainable_variables if v.path in splits)
    return (held + (tensor - 1) * sliced, other), held


def _product(shape):
    total = 1
    for n in shape:
        total *= int(n)
    return total


def check_shape(name, transformer_shape):
    """Refuse, by name, a missing or unknown key of a task's `transformer_shape`."""
    given = dict(transformer_shape)
    missing = [k for k in SHAPE_FIELDS if k not in given]
    unknown = [k for k in given if k not in SHAPE_FIELDS + OPTIONAL_SHAPE_FIELDS]
    if missing or unknown:
        raise ValueError(f"{name}.transformer_shape {given}: "
                         + (f"missing {', '.join(missing)}" if missing else
                            f"unknown key(s) {', '.join(unknown)}")
                         + f"; it names {', '.join(SHAPE_FIELDS)} and optionally "
                           f"{', '.join(OPTIONAL_SHAPE_FIELDS)}")
    return given


def declared_shape(name, transformer_shape, params):
    """(the planner's Shape of a task's `transformer_shape`: tfbig's GPT of those sizes, with
    the counted `params`; that GPT's parameter count)."""
    given = check_shape(name, transformer_shape)
    config = models.GPTConfig(**{k: float(v) if k == "dropout" else int(v)
                                 for k, v in given.items()})
    shape = models.shape_of(config, "gpt", config.seq_length)
    return dataclasses.replace(shape, family=name, params=params), config.num_params()


def data_layout(cfg, world_size):
    """The Layout of a user task's run on `world_size` ranks: --tensor_parallel x
    --context_parallel ranks per model copy, data parallel over the copies, its ZeRO stage,
    partition group and accumulation steps."""
    fixed = search.layout_from_config(cfg)
    tensor, context = fixed["tensor_parallel"], fixed["context_parallel"]
    if world_size % (tensor * context):
        raise ValueError(f"--tensor_parallel={tensor} x --context_parallel={context} = "
                         f"{tensor * context} ranks per model copy does not divide the "
                         f"{world_size} rank(s) planned: plan under the launch that will train "
                         f"(horovodrun -np N ...), or give tfbig.api.plan world_size=N")
    data = world_size // (tensor * context)
    zero = fixed["zero_stage"] if data > 1 else 0
    return estimate.Layout(data, 1, tensor, zero, fixed["shard_degree"] if zero else 0,
                           fixed["num_microbatches"], fixed["activation_checkpointing"],
                           context=context)


def user_plan(name, counts, transformer_shape, cfg, device, world_size, held=None):
    """The UserPlan of a task named `name` whose built model holds `counts` = (trainable,
    other) values, trained with ExperimentConfig `cfg` on `world_size` ranks of `device`;
    `held`: the trainable values one rank holds under --tensor_parallel (`count_split`;
    default: all of them)."""
    params, other = counts
    held = params if held is None else held
    layout = data_layout(cfg, world_size)
    lines = [f"{name}: a user task, {params:,} trainable parameters counted on the built model"
             + (f", {other:,} other values (not sharded)" if other else "")]
    if layout.tensor > 1:
        lines.append(f"tensor parallel: each of {layout.tensor} ranks holds {held:,} of them "
                     f"(the weights the tensor_layout splits 1/{layout.tensor} each, every "
                     f"other weight whole)")
    if transformer_shape is None:
        return _state_plan(lines, (params, held, other), layout, device, cfg.train.calibration)
    shape, gpt_params = declared_shape(name, transformer_shape, params)
    if gpt_params != params:
        lines.append(f"note: tfbig's GPT of this transformer_shape holds {gpt_params:,}; "
                     f"the state below counts the built model, activations and FLOPs are "
                     f"that GPT's closed forms")
    lines += _shape_notes(layout)
    best, cluster, spec = _search(shape, held, layout, cfg, device, world_size)
    text = report.text(shape, cluster, cfg.train.precision, 300e9, [best], top=1, spec=spec)
    return UserPlan("\n".join(lines) + "\n" + text, params, other, best.memory, (), best)


def _shape_notes(layout):
    """What the planner's closed forms assume of a user model under tensor or context
    parallelism."""
    notes = []
    if layout.tensor > 1:
        notes.append(f"note: activations and step time are tfbig's GPT's of this shape split "
                     f"{layout.tensor} ways (attention heads and MLP width, Megatron's pair); "
                     f"a layout that splits fewer layers keeps more activations")
    if layout.context > 1:
        notes.append("note: --context_parallel trains only models with a context plan "
                     "(tfbig's own, or a task's context_layout: "
                     "tfbig.distribute.context_parallel); this is the plan of tfbig's GPT of "
                     "the declared shape, whose logits stay cut (a context_layout's \"output\" "
                     "gathers them whole)")
    return notes


def _search(shape, held, layout, cfg, device, world_size):
    """(the planner's Estimate of `layout` for `shape`, the cluster it is on, the same layout
    on the spec `device` when --calibration gives the measured one, else None). The planner
    divides a shape's weights by T; a declared layout splits only its Dense layers, so it is
    given T x what one rank holds."""
    planned = dataclasses.replace(shape, params=held * layout.tensor)
    fixed = {**search.layout_from_config(cfg), "sequence_parallel": False,
             "zero_stage": layout.zero_stage}
    precision = cfg.train.precision
    cluster = spec = Cluster(device, world_size, 1, device.local_bandwidth)
    if cfg.train.calibration:
        cluster = calibration_lib.cluster(calibration_lib.load(cfg.train.calibration),
                                          precision, world_size, 1, 0.0)
    best = search.search(planned, cluster, precision, cfg.train.batch_size, fixed=fixed)[0]
    beside = cfg.train.calibration and search.evaluate(planned, best.layout, best.batch_size,
                                                       precision, spec, 300e9)
    return best, cluster, beside or None


def _state_plan(lines, counts, layout, device, calibration):
    """The plan of a model without a declared shape: its state per rank, the rest unknown (a
    `calibration` file, read, changes none of it)."""
    params, held, other = counts
    memory = estimate.state_memory(held, layout)
    memory["parameters"] += 4 * other  # every rank keeps its own statistics
    zero = (f"ZeRO stage {layout.zero_stage} over {layout.partition} rank(s)"
            if layout.zero_stage else "no ZeRO")
    tensor = f" x {layout.tensor} tensor-parallel ranks" if layout.tensor > 1 else ""
    total = sum(memory.values())
    lines += [f"layout: {layout.data} data-parallel replica(s){tensor}, {zero}, "
              f"{layout.num_microbatches} micro-batch(es) per step",
              f"state per rank: {_bytes(total)} of {_bytes(device.memory_bytes)} ("
              + ", ".join(f"{k} {_bytes(memory[k])}" for k in STATE) + ")",
              f"unknown: {', '.join(UNKNOWN_WITHOUT_SHAPE)} (they depend on the model's "
              f"layers, which tfbig cannot read from a model it did not write): declare the "
              f"task's transformer_shape ({', '.join(SHAPE_FIELDS)}) for the planner's "
              f"closed forms"]
    if calibration:
        calibration_lib.load(calibration)  # a bad file is refused all the same
        lines.append(f"calibration: {calibration} changes nothing this plan gives: the state "
                     f"per rank is counted, not timed; its measured speeds apply to the step "
                     f"time, which needs the task's transformer_shape")
    return UserPlan("\n".join(lines), params, other, memory, UNKNOWN_WITHOUT_SHAPE)


def _bytes(n):
    """78.7kB, 1.3GB."""
    return report._human(n, "G") + "B"
