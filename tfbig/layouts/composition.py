"""Which parallelisms compose: the one table of the pairs tfbig-train refuses.

Every pair of layout flags not in REFUSED composes under --strategy=horovod (one mesh, the
backends stacked as docs/design/notes/distribute.md says). The backends refuse a run from this
table before anything is written (`check`), tfbig-plan never plans a layout in it and refuses
fixed flags in it with the same message (`refusal`), and docs/guides/scale-out.md lists every
row (tests/distribute/test_composition.py checks all three). `model_losses_refused`: the
layouts that cannot add a user model's own losses (add_loss, regularizers) exactly.
"""
from tfbig.config import pipeline_stages
from tfbig.errors import UsageError

# flag -> whether a value means the flag is in use
IN_USE = {
    "tensor_parallel": lambda v: v > 1,
    "pipeline_stages": lambda v: v > 1,
    "context_parallel": lambda v: v > 1,
    "expert_parallel": lambda v: v > 1,
    "sequence_parallel": bool,
    "zero_stage": lambda v: v > 0,
    "shard_degree": lambda v: v > 0,
    "elastic": bool,
}

# (flag, flag, why): refused when both are in use; the first flag leads the message. A flag
# written `name>=N` is in use from the value N on (`--zero_stage>=2`: stages 2 and 3); flags
# joined by `+` are in use when each is (a pair that composes, refused with a third flag).
REFUSED = (
    ("pipeline_stages", "zero_stage>=2",
     "each stage accumulates its gradients whole over the schedule's micro-batches and "
     "holds its weights whole for them; use --zero_stage=1 (the optimizer state sharded "
     "over each stage's data ranks) with --pipeline_stages"),
    ("expert_parallel", "tensor_parallel+zero_stage>=3",
     "expert and tensor parallelism compose with ZeRO-1 and -2 (the optimizer state sliced), "
     "not yet with stage 3's weights gathered per layer; use --zero_stage=1 or 2"),
    ("expert_parallel", "pipeline_stages+tensor_parallel",
     "expert parallelism composes with each of these, not yet with both at once; drop one "
     "of them"),
    # --sequence_parallel needs --tensor_parallel: refused with it, as below
)
# The flags whose groups are Horovod process sets: under --elastic such a layout changes worlds
# by restarting (tfbig.distribute.elastic.with_restarts), the others in the process.
GROUPED = ("tensor_parallel", "pipeline_stages", "context_parallel", "expert_parallel",
           "shard_degree")


def grouped(values):
    """The GROUPED flags in use in `values` ({flag: value}), in table order."""
    return [flag for flag in GROUPED if flag in values and IN_USE[flag](values[flag])]


def values_of(cfg):
    """{flag: value} of an ExperimentConfig's layout flags (those REFUSED names)."""
    parallel = cfg.parallel
    return {"tensor_parallel": parallel.tensor_parallel,
            "pipeline_stages": pipeline_stages(cfg),
            "context_parallel": parallel.context_parallel,
            "expert_parallel": parallel.expert_parallel,
            "sequence_parallel": parallel.sequence_parallel,
            "zero_stage": parallel.zero_stage,
            "shard_degree": parallel.shard_degree,
            "elastic": bool(getattr(getattr(cfg, "horovod", None), "elastic", False))}


def flag_names(spec):
    """The flags a REFUSED entry names (['zero_stage'] of 'zero_stage>=2',
    ['tensor_parallel', 'zero_stage'] of 'tensor_parallel+zero_stage')."""
    return [part.partition(">=")[0] for part in spec.split("+")]


def _in_use(spec, values):
    for part in spec.split("+"):
        name, _, least = part.partition(">=")
        if not (name in values and IN_USE[name](values[name])
                and (not least or values[name] >= int(least))):
            return False
    return True


def _shown(spec, values):
    return " and ".join(f"--{name}" if isinstance(values[name], bool)
                        else f"--{name}={values[name]}" for name in flag_names(spec))


def pairs_in_use(values):
    """The REFUSED rows (first, second, why) that `values` ({flag: value}; a flag left out is
    not in use) holds, in table order."""
    return [(first, second, why) for first, second, why in REFUSED
            if _in_use(first, values) and _in_use(second, values)]


def refusal(values):
    """The message of the first REFUSED pair `values` holds, or None when every pair in use
    composes."""
    pairs = pairs_in_use(values)
    if not pairs:
        return None
    first, second, why = pairs[0]
    return f"{_shown(first, values)} with {_shown(second, values)} is not supported: {why}"


def check(values):
    """Raise UsageError naming the first refused pair `values` holds (see `refusal`)."""
    message = refusal(values)
    if message:
        raise UsageError(message)


def model_losses_refused(config):
    """Why this layout cannot add a model's own losses (`model.losses`: add_loss calls and
    weight regularizers) to the task's loss exactly, naming the flag; None where it can (one
    device, data parallelism, ZeRO-1/2: each replica holds every weight whole)."""
    held = {"tensor_parallel": "each tensor rank holds slices of the split weights",
            "expert_parallel": "each expert rank holds some of the experts",
            "context_parallel": "each context rank's loss is a part of the sequence's, the "
                                "model's losses would count once per rank",
            "pipeline_stages": "the last stage computes the loss without the others' layers"}
    values = values_of(config)
    for flag, why in held.items():
        if IN_USE[flag](values[flag]):
            return f"--{flag}={values[flag]}: {why}"
    if values["zero_stage"] == 3:
        return "--zero_stage=3: the weights are gathered only inside their layers' calls"
    if config.pipeline.activation_checkpointing:
        return ("--activation_checkpointing: the recomputed layers' own losses stay in the "
                "recomputation")
    return None
