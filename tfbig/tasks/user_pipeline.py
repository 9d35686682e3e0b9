"""A user task's model as pipeline layers: what its `Task.pipeline_layers` declares, checked.

Why it is built this way: docs/design/notes/tasks.md (tfbig.tasks.user_pipeline).
"""
import contextlib
import random

import keras
import numpy as np
import tensorflow as tf

from tfbig.errors import UsageError
from tfbig.models.shapes import LayerSpec
from tfbig.tasks import layer_paths

SEED_STATE = "seed_generator"  # a dropout's seed state: carried by the pipeline's stages


def named_layers(model, paths, owner):
    """[(name, layer)] at attribute paths below `model` (tfbig.tasks.layer_paths), each a
    Keras layer."""
    found = layer_paths.named_layers(model, paths, f"{owner}.pipeline_layers")
    for name, layer in found:
        if not isinstance(layer, keras.layers.Layer):
            raise UsageError(f"{owner}.pipeline_layers: {name!r} is a {type(layer).__name__}, "
                             "not a Keras layer")
    return found


@contextlib.contextmanager
def random_state_kept():
    """Python's, NumPy's and Keras' global random states as they were after the block: a
    model built inside draws nothing from the run's initial weights."""
    from keras.src.backend.common import global_state

    python, numpy = random.getstate(), np.random.get_state()
    generator = global_state.get_global_attribute("global_seed_generator")
    state = None if generator is None else generator.state.numpy()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        if generator is None:
            global_state.set_global_attribute("global_seed_generator", None)
        else:
            generator.state.assign(state)


def describe(task):
    """(LayerSpecs, variable paths in creation order) of `task`'s (a UserTask) model, its
    declared pipeline_layers checked (see the module docstring)."""
    created = []

    def record(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        created.append(id(variable))
        return variable

    with random_state_kept(), tf.variable_creator_scope(record):
        model = task.build_model()
    path_of = {id(getattr(v, "_value", v)): v.path for v in model.variables}
    order = [path_of.get(i) for i in created]
    layers = named_layers(model, task.user.pipeline_layers, task.user_name)
    _check_weights(model, layers, task.user_name)
    _check_composition(task, model, layers)
    return [_spec(name, layer) for name, layer in layers], order


def _check_weights(model, layers, owner):
    """Each trainable weight in exactly one layer; no non-trainable state but dropout seeds."""
    where = {}
    for name, layer in layers:
        for v in layer.trainable_variables:
            if id(v) in where:
                raise UsageError(f"{owner}.pipeline_layers: the weight {v.path!r} belongs to "
                                 f"both {where[id(v)]!r} and {name!r}; a weight shared between "
                                 "pipeline layers is not supported for a user model: declare "
                                 "the layers using it as one")
            where[id(v)] = name
        state = [v.path for v in layer.non_trainable_variables if SEED_STATE not in v.path]
        if state:
            raise UsageError(f"{owner}.pipeline_layers: {name!r} keeps non-trainable state "
                             f"({', '.join(state[:3])}) that pipeline stages would not update "
                             "(only dropout seeds are carried); this model cannot be pipelined")
    left = [v.path for v in model.trainable_variables if id(v) not in where]
    if left:
        raise UsageError(f"{owner}.pipeline_layers: {', '.join(left[:3])} belong(s) to none "
                         f"of the layers {[name for name, _ in layers]}; name every layer of "
                         "the model's forward, in order")


def _check_composition(task, model, layers):
    """The layers called in order on the first training batch's inputs give the model's
    outputs (inference mode), and the loss of those outputs is a float scalar."""
    batch = task.first_batch()
    inputs = task.model_inputs(batch)
    expected = model(inputs, training=False)
    task.check_model_losses(model)  # the stages' losses would not reach the last stage's loss
    x = inputs
    for name, layer in layers:
        try:
            x = layer(x, training=False)
        except Exception as error:  # the user's layer on the previous one's output
            raise UsageError(
                f"{task.user_name}.pipeline_layers: {name!r} fails on the output of the layer "
                f"before it ({type(error).__name__}: {error}); the layers, called in order, "
                "must compute the model's forward") from error
    same = _same_values(expected, x)
    if same is not True:
        raise UsageError(f"{task.user_name}.pipeline_layers {[n for n, _ in layers]}: called in "
                         f"order on the first batch they do not give the model's outputs "
                         f"({same}); list every layer of the forward in order, and keep the "
                         "model's call to exactly that composition")
    task.loss_from_outputs(x, batch)  # a float scalar, or refused by name


def _same_values(expected, got):
    """True, or why the two output nests differ."""
    try:
        tf.nest.assert_same_structure(expected, got)
    except (ValueError, TypeError):
        return f"their structure differs: {tf.nest.map_structure(lambda t: t.shape, got)}"
    for a, b in zip(tf.nest.flatten(expected), tf.nest.flatten(got)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            return f"shape {b.shape} instead of {a.shape}"
        if not np.allclose(a, b, rtol=1e-5, atol=1e-5):
            return f"largest difference {np.max(np.abs(a - b)):.3g}"
    return True


def _spec(name, layer):
    """The LayerSpec of one user layer (see the module docstring for its FLOPs)."""
    tables = {id(v) for sub in layer._flatten_layers(include_self=True)
              if isinstance(sub, keras.layers.Embedding) for v in sub.trainable_variables}
    params = sum(int(np.prod(v.shape)) for v in layer.trainable_variables)
    matmul = sum(int(np.prod(v.shape)) for v in layer.trainable_variables
                 if id(v) not in tables)
    return LayerSpec(name, tuple(v.path for v in layer.variables), params, 6.0 * matmul)


@contextlib.contextmanager
def placed_by_order(order, device_of):
    """Variables created in the block go, the i-th to the device `device_of` gives the path
    `order[i]` (None or an unknown path: the current device)."""
    count = [0]

    def creator(next_creator, **kwargs):
        index, count[0] = count[0], count[0] + 1
        device = device_of.get(order[index]) if index < len(order) else None
        if device is None:
            return next_creator(**kwargs)
        with tf.device(device):
            return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield
