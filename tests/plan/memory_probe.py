"""Bytes actually held on this machine beside what tfbig.plan predicts for the same case.

One row per case: the model state (bytes of the variables a rank holds: weights and optimizer
slots) and the transient peak of one training step (the CPU allocator's peak during the step
above what was allocated before it: gradients, activations, temporaries). The step is the
trainer's: forward and backward of the task's loss (XLA-compiled or not) and the optimizer's
apply. Rows for other layouts (ZeRO partitions, tensor-parallel slices, pipeline stages) plug in
as further `Case`s whose `measure` runs that layout's step on its rank.
"""
import dataclasses

import tensorflow as tf

from tfbig.config import TrainConfig
from tfbig.models.gpt import GPT, GPTConfig
from tfbig.optim import build_optimizer
from tfbig.plan import estimate, hardware, models


@dataclasses.dataclass
class Case:
    name: str
    model: dict  # GPTConfig fields
    batch_size: int
    xla: bool = True
    layout: estimate.Layout = estimate.Layout()


CPU = hardware.Device("cpu", 1e11, 2 ** 40, 1e10, 1e10, 1.0, 0.0)


def predicted(case):
    """The plan's bytes for the case: model state and the step's transient peak."""
    cfg = models.model_config("gpt", "tiny", **case.model)
    shape = models.shape_of(cfg, "gpt", cfg.seq_length)
    micro = case.batch_size // (case.layout.data * case.layout.num_microbatches)
    mem = estimate.memory(shape, case.layout, micro, "fp32", CPU, last=True)
    return {"model_state": mem["parameters"] + mem["optimizer"],
            "step_peak": mem["gradients"] + mem["activations"]}


def measure(case):
    """Bytes held by this process (single device) for the case."""
    config = GPTConfig.from_preset("tiny", **case.model)
    model = GPT(config)
    model.build()
    train = TrainConfig(max_steps=10, warmup_steps=1)
    optimizer = build_optimizer(train, model.trainable_variables)
    ids = tf.random.uniform((case.batch_size, config.seq_length + 1), 0, config.vocab_size,
                            tf.int32)

    @tf.function(jit_compile=case.xla)
    def forward_backward(batch):
        with tf.GradientTape() as tape:
            logits = model(batch[:, :-1], training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                batch[:, 1:], logits))
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def step(batch):
        optimizer.apply(forward_backward(batch), model.trainable_variables)

    step(ids)  # compile, create slots
    state = sum(v.numpy().nbytes for v in model.variables + optimizer.variables)
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    step(ids)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    return {"model_state": state, "step_peak": peak}
