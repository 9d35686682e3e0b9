"""`--plan_only` for a user task (tfbig.api): the plan of what is known of a model tfbig did
not write.

Always known: the built model's variables, counted (`count_variables`), so the weights,
gradients and optimizer slots each rank holds under the run's data layout and ZeRO stage
(`estimate.state_memory`, the closed forms tfbig-train's plan uses). Known only when the task
declares its `transformer_shape` ({hidden_size, num_layers, num_heads, seq_length,
vocab_size[, intermediate_size]}): the activation memory and the step time, from the planner's
closed forms for tfbig's GPT of that shape (`estimate`), its parameter count replaced by the
counted one. Without it the plan says which parts are unknown rather than guess them.

Example:
    plan = user_plan("my_task", count_variables(model), None, cfg, device, world_size=2)
    plan.memory["optimizer"], plan.unknown        # bytes per rank, ("activations", ...)
"""
import dataclasses

from tfbig.plan import estimate, models, report, search
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
    """The Layout of a user task's run: data parallel over `world_size` ranks, its ZeRO stage,
    partition group and accumulation steps."""
    fixed = search.layout_from_config(cfg)
    zero = fixed["zero_stage"] if world_size > 1 else 0
    return estimate.Layout(world_size, 1, 1, zero, fixed["shard_degree"] if zero else 0,
                           fixed["num_microbatches"], fixed["activation_checkpointing"])


def user_plan(name, counts, transformer_shape, cfg, device, world_size):
    """The UserPlan of a task named `name` whose built model holds `counts` = (trainable,
    other) values, trained with ExperimentConfig `cfg` on `world_size` ranks of `device`."""
    params, other = counts
    layout = data_layout(cfg, world_size)
    lines = [f"{name}: a user task, {params:,} trainable parameters counted on the built model"
             + (f", {other:,} other values (not sharded)" if other else "")]
    if transformer_shape is None:
        return _state_plan(lines, params, other, layout, device, world_size)
    shape, gpt_params = declared_shape(name, transformer_shape, params)
    if gpt_params != params:
        lines.append(f"note: tfbig's GPT of this transformer_shape holds {gpt_params:,}; "
                     f"the state below counts the built model, activations and FLOPs are "
                     f"that GPT's closed forms")
    fixed = {**search.layout_from_config(cfg), "tensor_parallel": 1, "context_parallel": 1,
             "sequence_parallel": False, "zero_stage": layout.zero_stage}
    cluster = Cluster(device, world_size, 1, device.local_bandwidth)
    best = search.search(shape, cluster, cfg.train.precision, cfg.train.batch_size,
                         fixed=fixed)[0]
    text = report.text(shape, cluster, cfg.train.precision, 300e9, [best], top=1)
    return UserPlan("\n".join(lines) + "\n" + text, params, other, best.memory, (), best)


def _state_plan(lines, params, other, layout, device, world_size):
    """The plan of a model without a declared shape: its state per rank, the rest unknown."""
    memory = estimate.state_memory(params, layout)
    memory["parameters"] += 4 * other  # every rank keeps its own statistics
    zero = (f"ZeRO stage {layout.zero_stage} over {layout.partition} rank(s)"
            if layout.zero_stage else "no ZeRO")
    total = sum(memory.values())
    lines += [f"layout: {world_size} data-parallel rank(s), {zero}, "
              f"{layout.num_microbatches} micro-batch(es) per step",
              f"state per rank: {_bytes(total)} of {_bytes(device.memory_bytes)} ("
              + ", ".join(f"{k} {_bytes(memory[k])}" for k in STATE) + ")",
              f"unknown: {', '.join(UNKNOWN_WITHOUT_SHAPE)} (they depend on the model's "
              f"layers, which tfbig cannot read from a model it did not write): declare the "
              f"task's transformer_shape ({', '.join(SHAPE_FIELDS)}) for the planner's "
              f"closed forms"]
    return UserPlan("\n".join(lines), params, other, memory, UNKNOWN_WITHOUT_SHAPE)


def _bytes(n):
    """78.7kB, 1.3GB."""
    return report._human(n, "G") + "B"
