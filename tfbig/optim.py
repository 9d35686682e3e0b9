"""Optimizers and learning-rate schedules: AdamW or LAMB, warmup then decay, fp16 loss scaling."""
import math

import keras
import tensorflow as tf
from keras import ops
from keras.src.utils import tracking

SCHEDULES = ("linear", "cosine", "polynomial")
OPTIMIZERS = ("adamw", "lamb")


@keras.saving.register_keras_serializable(package="tfbig")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak` over `warmup_steps`, then decay to `peak * min_ratio` at
    `total_steps` (linear, cosine or polynomial of `power`), constant after."""

    def __init__(self, peak, warmup_steps, total_steps, kind="cosine", min_ratio=0.1, power=2.0):
        if kind not in SCHEDULES:
            raise ValueError(f"--lr_schedule={kind!r}: expected one of {SCHEDULES}")
        self.peak = peak
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.kind = kind
        self.min_ratio = min_ratio
        self.power = power

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warm = self.peak * (step + 1.0) / max(1, self.warmup_steps)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = ops.clip((step - self.warmup_steps) / span, 0.0, 1.0)
        return ops.where(step < self.warmup_steps, warm, self._decayed(progress))

    def _decayed(self, progress):
        """The rate at `progress` (0 to 1) through the decay."""
        if self.kind == "linear":
            shape = 1.0 - progress
        elif self.kind == "cosine":
            shape = 0.5 * (1.0 + ops.cos(math.pi * progress))
        else:
            shape = (1.0 - progress) ** self.power
        return self.peak * (self.min_ratio + (1.0 - self.min_ratio) * shape)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "kind": self.kind,
                "min_ratio": self.min_ratio, "power": self.power}


@keras.saving.register_keras_serializable(package="tfbig")
class WarmupStableDecay(WarmupDecay):
    """Linear warmup to `peak` over `warmup_steps`, `peak` until update `decay_start`, then
    WarmupDecay's decay to `total_steps`: the schedule of a time-budgeted run (tfbig.training.budget),
    which decides `decay_start` and `total_steps` while the rate is constant (`total_steps`
    0: not decided, `peak` after the warmup).

    Both live in a variable the traced training step reads, so deciding them retraces
    nothing (a retrace took seconds of the budget's last steps that no estimate had counted).
    The variable is not in checkpoints: MODEL_DIR/config.json records the decision.

    Example:
        schedule = WarmupStableDecay(3e-3, 60)   # warmup, then 3e-3 ...
        schedule.decide(800, 1000)               # ... until update 800, decaying to 1000
    """

    def __init__(self, peak, warmup_steps, kind="cosine", min_ratio=0.1, power=2.0,
                 decay_start=0, total_steps=0):
        super().__init__(peak, warmup_steps, total_steps, kind, min_ratio, power)
        self.decay_start = decay_start
        self.ends = tf.Variable([decay_start, total_steps], dtype=tf.int64, trainable=False,
                                name="schedule_ends")

    def decide(self, decay_start, total_steps):
        """Decay after update `decay_start` (0 or inside the warmup: from its end) to
        `total_steps`."""
        self.decay_start, self.total_steps = decay_start, total_steps
        self.ends.assign([decay_start, total_steps])

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warm = self.peak * (step + 1.0) / max(1, self.warmup_steps)
        start = ops.cast(ops.maximum(self.ends[0], self.warmup_steps), "float32")
        total = ops.cast(self.ends[1], "float32")
        progress = ops.clip((step - start) / ops.maximum(1.0, total - start), 0.0, 1.0)
        rate = ops.where(total > 0, self._decayed(progress), self.peak)
        return ops.where(step < self.warmup_steps, warm, rate)

    def get_config(self):
        return {**super().get_config(), "decay_start": self.decay_start}


def no_decay_variables(variables):
    """LayerNorm scales/offsets, biases (all rank < 2) and embedding tables."""
    return [v for v in variables if len(v.shape) < 2 or "embedding" in v.path]


def build_optimizer(train, variables, no_decay=None, sum_over_shards=None, replicated=None,
                    adapt=None, sum_replicated=None, sum_for=None):
    """The optimizer for TrainConfig `train`, wrapped in a LossScaleOptimizer for fp16.

    Weight decay skips `no_decay` (default: `no_decay_variables(variables)`); clipping is by
    global norm of the unscaled, already averaged gradients (Keras clips inside `apply`, after
    unscaling). `sum_over_shards(x)`, for variables that are slices of larger ones (ZeRO),
    sums a tensor over the ranks holding the other slices: global-norm clipping and LAMB's
    per-layer trust ratio then see whole variables. `replicated` (booleans in the order of
    `variables`; tensor parallelism) marks variables every rank holds whole: their squares
    are counted once, outside `sum_over_shards` (through `sum_replicated` if given: ZeRO slices
    of replicated tensor-parallel variables). `sum_for` (one function per variable, in the
    order of `variables`) replaces both where a layout has slices of more than one kind (an
    expert's over the expert group, a tensor slice's over the tensor group). `adapt(cls) ->
    cls` lets a backend change the optimizer class (the cross-rank pipeline's global norm over
    stages).
    """
    if train.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer={train.optimizer!r}: expected one of {OPTIMIZERS}")
    if train.max_steps:
        schedule = WarmupDecay(train.learning_rate, train.warmup_steps, train.max_steps,
                               train.lr_schedule, train.min_lr_ratio)
    else:  # --max_steps=0: a time budget decides the decay (tfbig.training.budget)
        schedule = WarmupStableDecay(train.learning_rate, train.warmup_steps,
                                     train.lr_schedule, train.min_lr_ratio)
    cls = keras.optimizers.AdamW if train.optimizer == "adamw" else keras.optimizers.Lamb
    if sum_over_shards is not None or sum_for is not None:
        cls = sharded_class(cls, sum_over_shards, replicated, sum_replicated, sum_for)
    if adapt is not None:
        cls = adapt(cls)
    optimizer = cls(learning_rate=schedule, weight_decay=train.weight_decay,
                    beta_1=train.beta_1, beta_2=train.beta_2, epsilon=train.epsilon,
                    global_clipnorm=train.grad_clip_norm or None)
    optimizer.exclude_from_weight_decay(
        var_list=no_decay_variables(variables) if no_decay is None else no_decay)
    if train.precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(variables)
    return optimizer


def rebuild_optimizer(optimizer, variables, no_decay):
    """`optimizer` (built by build_optimizer) made to update `variables` instead, with new,
    zero slots and weight decay skipping `no_decay`; its step count, schedule and loss scale
    are kept (elastic ZeRO: the same model variables' slices, of another size, in a new world).
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    kept = {id(inner._iterations), id(getattr(inner, "_learning_rate", None))}
    # Keras: the slots are what `build` added after the step count and the learning rate. A
    # new list: TensorFlow saves only a tracked list that was never cut; Keras' tracker adds
    # the new slots to it.
    with tracking.DotNotTrackScope():  # a list Keras' tracker only appends to
        inner._variables = [v for v in inner._variables if id(v) in kept]
    is_variable, _ = inner._tracker.config["variables"]
    inner._tracker.config["variables"] = (is_variable, inner._variables)
    inner._tracker.stored_ids["variables"] = {id(v) for v in inner._variables}
    inner._trainable_variables_indices = {}
    inner.built = False
    inner.exclude_from_weight_decay(var_list=no_decay)
    inner.build(variables)
    if optimizer is not inner:  # a LossScaleOptimizer tracks (and saves) what it updates
        with tracking.DotNotTrackScope():
            optimizer._trainable_variables = variables[:]
        optimizer._trainable_variables_indices = {
            optimizer._var_key(v): i for i, v in enumerate(variables)}


def sharded_class(cls, sum_over_shards, replicated=None, sum_replicated=None, sum_for=None):
    """`cls` (AdamW or Lamb) for variables that are slices: norms are summed over slices
    (except those of the variables `replicated` marks, in the order of the optimizer's: those
    through `sum_replicated`, default none). `sum_for`: each variable's own sum instead (the
    squares of the variables sharing one are summed first, then it is applied once)."""
    sum_replicated = sum_replicated or (lambda x: x)

    def sum_of(index):
        if sum_for is not None:
            return sum_for[index]
        whole = replicated is not None and replicated[index]
        return sum_replicated if whole else sum_over_shards

    class Sharded(cls):
        def _clip_gradients(self, grads):
            if not (self.global_clipnorm and self.global_clipnorm > 0):
                return super()._clip_gradients(grads)
            kinds = {}  # the sum -> its variables' squares, in the order first met (each
            for i, g in enumerate(grads):  # rank meets them alike: collectives pair up)
                kinds.setdefault(sum_of(i), []).append(ops.sum(ops.square(g)))
            squares = None
            for total, found in kinds.items():
                part = total(ops.sum(ops.stack(found)))
                squares = part if squares is None else squares + part
            norm = ops.sqrt(squares)  # the same formula as keras' clip_by_global_norm
            scale = self.global_clipnorm * ops.minimum(1.0 / norm, 1.0 / self.global_clipnorm)
            return [g * (scale + (norm - norm)) for g in grads]

        if issubclass(cls, keras.optimizers.Lamb):
            def update_step(self, gradient, variable, learning_rate):
                """Keras' LAMB step with the weight and update norms of the whole variable."""
                lr = ops.cast(learning_rate, variable.dtype)
                gradient = ops.cast(gradient, variable.dtype)
                local_step = ops.cast(self.iterations + 1, variable.dtype)
                beta_1_power = ops.power(ops.cast(self.beta_1, variable.dtype), local_step)
                beta_2_power = ops.power(ops.cast(self.beta_2, variable.dtype), local_step)
                m = self._momentums[self._get_variable_index(variable)]
                v = self._velocities[self._get_variable_index(variable)]
                self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
                self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v),
                                                1 - self.beta_2))
                m_t_hat = ops.divide(m, (1.0 - beta_1_power))
                v_sqrt = ops.add(ops.sqrt(ops.divide(v, (1.0 - beta_2_power))), self.epsilon)
                update = ops.divide(m_t_hat, v_sqrt)
                squares = ops.stack([ops.sum(ops.power(variable, 2)),
                                     ops.sum(ops.power(update, 2))])
                squares = sum_of(self._get_variable_index(variable))(squares)
                w_norm, g_norm = ops.sqrt(squares[0]), ops.sqrt(squares[1])
                ratio = ops.where(ops.greater(w_norm, 0),
                                  ops.where(ops.greater(g_norm, 0), (w_norm / g_norm), 1.0),
                                  1.0)
                self.assign_sub(variable, ratio * lr * update)

    Sharded.__name__ = f"Sharded{cls.__name__}"
    return Sharded


def loss_scale(optimizer):
    """The current loss scale (1.0 without loss scaling)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.dynamic_scale
    return ops.convert_to_tensor(1.0)


def decide_schedule(optimizer, decay_start, total_steps):
    """Give a time-budgeted run's WarmupStableDecay its decay start and its end."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    inner._learning_rate.decide(decay_start, total_steps)


def learning_rate(optimizer, step):
    """The learning rate of update number `step` (0-based)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    schedule = inner._learning_rate  # Keras keeps the schedule here; .learning_rate evaluates it
    return schedule(step) if callable(schedule) else schedule
