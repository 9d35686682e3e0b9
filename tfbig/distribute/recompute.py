"""Activation checkpointing (and offloading) per transformer block, applied from outside.

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.recompute).
"""
import contextlib

import tensorflow as tf
from tensorflow.python.eager import record  # stop_recording: no public equivalent

from tfbig.layouts.tensor_plan import resolve_plan_layers
from tfbig.models.layout import layout_of

HOST = "/device:CPU:0"
OFFLOAD_NAME = "offloaded_block_input"


def transformer_blocks(model):
    """The model's transformer blocks, at the path its layout declares (`layout().blocks`:
    GPT's blocks, ALBERT's shared groups, each wrapped once, BERT's blocks)."""
    path = layout_of(model).blocks
    if not path:
        raise ValueError(f"--activation_checkpointing: {type(model).__name__} declares no "
                         f"transformer blocks (its layout().blocks, tfbig.models.layout)")
    found = resolve_plan_layers(model, path)
    if not found:
        raise ValueError(f"--activation_checkpointing: {type(model).__name__} has no {path} "
                         f"(its layout().blocks); no transformer blocks to wrap")
    return list(found[0])


def seed_states(layer):
    """The dropout seed-generator state variables a layer (and its sublayers) advance."""
    return [v for v in layer.non_trainable_variables if "seed_generator" in v.path]


def check_offload(offload, jit_compile):
    """Refuse offloading where it would not move anything (GPUs with an XLA-compiled step)."""
    if offload and jit_compile and tf.config.list_physical_devices("GPU"):
        raise ValueError("--offload_activations with --xla on GPUs: XLA compiles the step for "
                         "one device and keeps the saved block inputs there; add --noxla")


def _to_host(x, offload):
    if not offload:
        return x
    with tf.device(HOST):
        return tf.identity(x, name=OFFLOAD_NAME)


def _from_host(saved, device, offload):
    if not offload:
        return saved
    with tf.device(device) if device else contextlib.nullcontext():
        return tf.identity(saved, name="reloaded_block_input")


def _read(states):
    return [tf.identity(v.value.read_value()) for v in states]


def _assign(states, values):
    for v, value in zip(states, values):
        v.assign(value)


def recompute(call, states, offload=False):
    """`call(x, *args, **kwargs)` that keeps only `x` for the backward and recomputes there.

    `states`: the seed-generator variables `call` advances (set back for the recompute).
    Other arguments (masks, `training`) are constants to the gradient. Calls without
    `training=True` (inference, generation with a cache) run `call` unchanged. `call` may
    return a nest of tensors (an MoE block: its output and the router's statistics, which
    reach the loss): each gets its gradient.
    """
    def wrapped(x, *args, **kwargs):
        if not kwargs.get("training") or kwargs.get("cache") is not None:
            return call(x, *args, **kwargs)
        start = _read(states)
        device = x.device
        structure = []  # the nest `call` returns, known once the forward has run

        @tf.custom_gradient
        def block(x):
            saved = _to_host(x, offload)
            with record.stop_recording():  # keep no intermediate for the outer tape
                out = call(x, *args, **kwargs)
            structure.append(out)

            def grad(*dys, variables=None):
                variables = list(variables or [])
                after = _read(states)  # what the rest of the step left: restored below
                _assign(states, start)
                with tf.GradientTape() as tape:
                    x_again = _from_host(saved, device, offload)
                    tape.watch([x_again] + variables)
                    with tf.control_dependencies([d for d in dys if d is not None]):
                        # recompute when the backward gets here
                        again = tf.nest.flatten(call(x_again, *args, **kwargs))
                _assign(states, after)
                dys = [tf.zeros_like(y) if d is None else d for y, d in zip(again, dys)]
                grads = tape.gradient(again, [x_again] + variables, output_gradients=dys,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
                return grads[0], grads[1:]

            return tf.nest.flatten(out), grad

        flat = block(x)
        return tf.nest.pack_sequence_as(structure[-1], flat)

    return wrapped


def task_blocks(task, model):
    """The layers a task names for recomputation (a user task's `checkpoint_layers`), or None
    for tfbig's own families (their `layout().blocks`). None named is refused by name."""
    if not hasattr(task, "blocks"):
        return None
    blocks = task.blocks(model)
    if not blocks:
        raise ValueError(f"--activation_checkpointing: {task.user_name} names no layers to "
                         "recompute; set its checkpoint_layers (e.g. (\"blocks.*\",))")
    return blocks


def checkpoint_blocks(model, offload=False, blocks=None):
    """Install `recompute` on every transformer block of `model` (or on `blocks`, the layers a
    user task names); returns them.

    Idempotent per block (a block already wrapped is left as is).
    """
    blocks = transformer_blocks(model) if blocks is None else blocks
    for block in blocks:
        if getattr(block, "_tfbig_recompute", False):
            continue
        block.call = recompute(block.call, seed_states(block), offload)
        block._tfbig_recompute = True
    return blocks
