"""Optimizers and learning-rate schedules: AdamW or LAMB, warmup then decay, fp16 loss scaling."""
import math

import keras
from keras import ops

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
        if self.kind == "linear":
            shape = 1.0 - progress
        elif self.kind == "cosine":
            shape = 0.5 * (1.0 + ops.cos(math.pi * progress))
        else:
            shape = (1.0 - progress) ** self.power
        decayed = self.peak * (self.min_ratio + (1.0 - self.min_ratio) * shape)
        return ops.where(step < self.warmup_steps, warm, decayed)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "kind": self.kind,
                "min_ratio": self.min_ratio, "power": self.power}


def no_decay_variables(variables):
    """LayerNorm scales/offsets, biases (all rank < 2) and embedding tables."""
    return [v for v in variables if len(v.shape) < 2 or "embedding" in v.path]


def build_optimizer(train, variables):
    """The optimizer for TrainConfig `train`, wrapped in a LossScaleOptimizer for fp16.

    Weight decay skips `no_decay_variables(variables)`; clipping is by global norm of the
    unscaled, already averaged gradients (Keras clips inside `apply`, after unscaling).
    """
    if train.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer={train.optimizer!r}: expected one of {OPTIMIZERS}")
    schedule = WarmupDecay(train.learning_rate, train.warmup_steps, train.max_steps,
                           train.lr_schedule, train.min_lr_ratio)
    cls = keras.optimizers.AdamW if train.optimizer == "adamw" else keras.optimizers.Lamb
    optimizer = cls(learning_rate=schedule, weight_decay=train.weight_decay,
                    beta_1=train.beta_1, beta_2=train.beta_2, epsilon=train.epsilon,
                    global_clipnorm=train.grad_clip_norm or None)
    optimizer.exclude_from_weight_decay(var_list=no_decay_variables(variables))
    if train.precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(variables)
    return optimizer


def loss_scale(optimizer):
    """The current loss scale (1.0 without loss scaling)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.dynamic_scale
    return ops.convert_to_tensor(1.0)


def learning_rate(optimizer, step):
    """The learning rate of update number `step` (0-based)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    schedule = inner._learning_rate  # Keras keeps the schedule here; .learning_rate evaluates it
    return schedule(step) if callable(schedule) else schedule
