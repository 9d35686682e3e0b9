"""ZeRO stage 3: the parameters are sharded too and gathered per layer, from outside the model.

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.zero3).
"""
import math

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state  # Keras' deferred-init registry: no public API
from keras.src.backend.common.variables import AutocastScope, get_autocast_scope
from tensorflow.python.eager import record  # stop_recording: no public equivalent

from tfbig.distribute import recompute
from tfbig.distribute.horovod_keras import hvd
from tfbig.layouts.tensor_plan import resolve_plan_layers
from tfbig.models.layout import layout_of


def user_plan(model, blocks):
    """A user model's plan: the layers its task names (`checkpoint_layers`) per call; every
    other trainable variable per step. A variable belongs to the named layer that holds it,
    also when an enclosing layer tracks it too (a functional keras-hub backbone tracks its
    transformer layers' variables): only what no named layer holds is gathered per step."""
    if not blocks:
        raise ValueError(f"--zero_stage=3: the task of {type(model).__name__} names no layers "
                         "to gather one at a time; set its checkpoint_layers (e.g. "
                         "(\"blocks.*\",)) or use --zero_stage=2")
    named = {id(v) for layer in blocks for v in layer.trainable_variables}
    return list(blocks), [v for v in model.trainable_variables if id(v) not in named]


def plan_layers(model, blocks=None):
    """(per-call layers, per-step variables) of `model`; every trainable variable in exactly
    one. `blocks`: a user task's named layers; else the model's declared layout (its
    `layout()`: gather_per_call, gather_per_step, tfbig.models.layout)."""
    declared = layout_of(model)
    if blocks is not None:
        per_call, per_step = user_plan(model, blocks)
    elif not declared.gather_per_call:
        raise ValueError(f"--zero_stage=3: no gather plan for {type(model).__name__} (GPT, "
                         f"Llama, ALBERT and BERT pretraining, BERT classification and "
                         f"BERT/ALBERT span fine-tuning declare one in their layout(), "
                         f"tfbig.models.layout); use --zero_stage=2")
    else:
        per_call = [layer for p in declared.gather_per_call
                    for layer in resolve_plan_layers(model, p)]
        per_step = [v for p in declared.gather_per_step
                    for layer in resolve_plan_layers(model, p) for v in layer.trainable_variables]
    owners = {}
    for layer in per_call:
        for v in layer.trainable_variables:
            owners.setdefault(id(v), []).append(layer.path)
    for v in per_step:
        owners.setdefault(id(v), []).append("the step (gathered once per call of the model)")
    bad = [(v.path, owners.get(id(v))) for v in model.trainable_variables
           if len(owners.get(id(v), [])) != 1]
    if bad:
        shown = "; ".join(f"{path}: {', '.join(held) if held else 'none'}"
                          for path, held in bad[:4]) + ("; ..." if len(bad) > 4 else "")
        raise ValueError(f"--zero_stage=3: every trainable variable of {type(model).__name__} "
                         f"must be gathered by exactly one layer; {len(bad)} are not (a named "
                         f"layer inside another named one, or one no layer gathers): {shown}")
    return per_call, per_step


# ---- the slices ---------------------------------------------------------------------------
class Partition:
    """Slice j of N of every variable (flattened, zero-padded), over a partition group."""

    def __init__(self, process_set, num_shards, index):
        self.process_set, self.num_shards, self.index = process_set, num_shards, index

    def slice_size(self, shape):
        return math.ceil(math.prod(shape) / self.num_shards)

    def padded(self, tensor, shape):
        size = math.prod(shape)  # static also where the value's shape is not (a gradient)
        flat = tf.reshape(tf.cast(tf.convert_to_tensor(tensor), tf.float32), [size])
        return tf.pad(flat, [[0, self.slice_size(shape) * self.num_shards - size]])

    def own(self, tensor, shape):
        """This position's slice (cut before padding: no second full-size copy)."""
        size, count = self.slice_size(shape), math.prod(shape)
        start = min(self.index * size, count)
        end = min(start + size, count)
        if isinstance(tensor, np.ndarray):  # numpy's view: a memory-mapped weight reads its part
            part = np.array(np.asarray(tensor).reshape(-1)[start:end], np.float32)
            return tf.pad(part, [[0, size - (end - start)]])
        if hasattr(tensor, "flat_range"):  # stacked experts read one at a time (bundle.Stacked)
            return tf.pad(tensor.flat_range(start, end), [[0, size - (end - start)]])
        flat = tf.reshape(tf.cast(tf.convert_to_tensor(tensor), tf.float32), [-1])
        piece = tf.pad(flat[start:end], [[0, size - (end - start)]])
        # A slice along the first axis shares the full tensor's buffer (so would a variable
        # made from it): copied, the full tensor is freed when the caller drops it.
        return tf.constant(np.array(piece)) if tf.executing_eagerly() else piece

    def gather(self, slices, shapes):
        """Full float32 tensors from every rank's slices (an all-gather of the group)."""
        slices = [tf.convert_to_tensor(s) for s in slices]
        if self.process_set is not None:  # Horovod: one grouped all-gather per layer
            slices = hvd.grouped_allgather(slices, process_set=self.process_set)
        return [tf.reshape(f[:math.prod(shape)], shape) for f, shape in zip(slices, shapes)]

    def scatter(self, grads, shapes):
        """This rank's slices of full gradients, averaged over the group (a reduce-scatter)."""
        padded = [self.padded(g, shape) for g, shape in zip(grads, shapes)]
        if self.process_set is None:
            return padded
        # Horovod: one grouped reduce-scatter per layer (hop 1 of the 2-hop sync).
        return hvd.grouped_reducescatter(padded, op=hvd.Average, process_set=self.process_set)


# ---- delayed initialisation ---------------------------------------------------------------
def build_unmaterialised(task):
    """The task's model with its trainable variables created but never given a value; the
    non-trainable ones (dropout generator states, a few bytes) are initialised as usual.
    Returns (model, {id(variable): initialiser}).

    Values the task's `build_model` assigns (a fine-tuning task's --init_checkpoint backbone)
    are caught by the StatelessScope and become those variables' initialisers: each rank cuts
    its slices from them, so the loaded weights are whole once per rank, at the start."""
    with keras.StatelessScope(initialize_variables=False) as scope:
        model = task.build_model()
    mine = {id(v) for v in model.variables}
    pending = global_state.get_global_attribute("uninitialized_variables") or []
    global_state.set_global_attribute("uninitialized_variables",
                                      [v for v in pending if id(v) not in mine])
    for v in model.non_trainable_variables:
        v._deferred_initialize()
        if scope.get_current_value(v) is not None:
            v.assign(scope.get_current_value(v))
    initialisers = {}
    for v in model.trainable_variables:
        loaded = scope.get_current_value(v)
        initialisers[id(v)] = v._initializer if loaded is None else _loaded(loaded)
        v._initializer = _not_gathered(v.path)  # Keras calls it for a read without a value
    return model, initialisers


def release_values(model, keep=lambda variable: False):
    """`build_unmaterialised`'s (model, {id(variable): initialiser}) of a model built whole
    (a tensor rank's split model): each trainable variable's value becomes its initialiser (a
    host copy, cut into slices and dropped by the strategy) and the variable holds none; but
    those `keep` names (an expert rank's experts: held whole, never sliced)."""
    initialisers = {}
    for v in model.trainable_variables:
        if keep(v):
            continue
        initialisers[id(v)] = _loaded(v.numpy())
        v._value = None  # Keras: a variable without a value (as made in a StatelessScope)
        v._initializer = _not_gathered(v.path)
    return model, initialisers


def _loaded(value):
    return lambda shape, dtype=None: value


def _not_gathered(path):
    def refuse(*args, **kwargs):
        raise ValueError(f"--zero_stage=3: {path} was read outside the layer that gathers it "
                         f"(the model's layout().gather_per_call and gather_per_step say which layer gathers what)")
    return refuse


def initial_slice(variable, initialiser, partition):
    """This rank's slice of `variable`'s single-device initial value (built whole, then cut:
    one variable at a time is ever full)."""
    return partition.own(initialiser(variable.shape, dtype=variable._dtype), variable.shape)


# ---- gathering around calls ---------------------------------------------------------------
def _shapes(variables):
    return [tuple(v.shape) for v in variables]


def _raw(variable):
    """A variable's stored float32 value (not cast to a layer's compute dtype)."""
    with AutocastScope(None):
        return tf.convert_to_tensor(variable.value)


def _split_whole(variables, whole):
    return [id(v) in whole for v in variables]


def gather_values(partition, shards, variables, whole=frozenset()):
    """Full parameters from the slice variables (not differentiable); a variable whose id is
    in `whole` is its own shard (an expert rank's experts), read as it is."""
    kept = _split_whole(variables, whole)
    gathered = iter(partition.gather(
        [tf.convert_to_tensor(s.value) for s, k in zip(shards, kept) if not k],
        [tuple(v.shape) for v, k in zip(variables, kept) if not k]))
    return [_raw(s) if k else next(gathered) for s, k in zip(shards, kept)]


def differentiable_gather(partition, shards, variables, whole=frozenset()):
    """Full parameters from the slice variables; the gradient is reduce-scattered back. A
    variable whose id is in `whole` is its own shard, read as it is (its gradient whole)."""
    kept = _split_whole(variables, whole)
    if any(kept):
        gathered = iter(differentiable_gather(
            partition, [s for s, k in zip(shards, kept) if not k],
            [v for v, k in zip(variables, kept) if not k]))
        return [_raw(s) if k else next(gathered) for s, k in zip(shards, kept)]
    shapes = _shapes(variables)
    if not variables:
        return []

    @tf.custom_gradient
    def gather(*slices):
        def grad(*full_grads):
            full_grads = [tf.zeros(s) if g is None else tf.convert_to_tensor(g)
                          for g, s in zip(full_grads, shapes)]
            return partition.scatter(full_grads, shapes)
        return partition.gather(slices, shapes), grad

    return list(gather(*[tf.convert_to_tensor(s.value) for s in shards]))


def _read_states(states):
    return [tf.identity(tf.convert_to_tensor(v.value)) for v in states]


def run_with(variables, values, states, state_values, fn):
    """fn() with `variables` reading `values` and the dropout `states` starting at
    `state_values`; returns (fn's result, the states' values after it)."""
    mapping = list(zip(variables, values)) + list(zip(states, state_values))
    with keras.StatelessScope(mapping, initialize_variables=False) as scope:
        out = fn()
    return out, [scope.get_current_value(v) for v in states]


class Gatherer:
    """Installs the gathers of a model's plan and keeps the per-trace prefetch order."""

    def __init__(self, partition, shard_of, offload=False, whole=frozenset()):
        self.partition = partition
        self.shard_of = shard_of  # id(model variable) -> its slice variable
        self.offload = offload
        self.whole = whole  # ids of the model variables held whole (their own shard)
        self.reset()

    def reset(self):
        self.previous_input, self.previous_grad, self.forward_full = None, None, {}

    def install(self, model, blocks=None):
        per_call, per_step = plan_layers(model, blocks)
        for layer in per_call:
            if not getattr(layer, "_tfbig_gathered", False):
                layer.call = self._per_call(layer, layer.call)
                layer._tfbig_gathered = True
        model.call = self._per_step(model, per_step, model.call)
        return per_call, per_step

    def _shards(self, variables):
        return [self.shard_of[id(v)] for v in variables]

    def _after(self, tensor):
        return tf.control_dependencies([tensor] if tensor is not None else [])

    def _per_step(self, model, variables, call):
        states = recompute.seed_states(model)

        def wrapped(*args, **kwargs):
            self.reset()
            full = differentiable_gather(self.partition, self._shards(variables), variables,
                                         self.whole)
            start = _read_states(states)
            out, after = run_with(variables, full, states, start,
                                  lambda: call(*args, **kwargs))
            for v, value in zip(states, after):
                v.assign(value)
            return out

        return wrapped

    def _gather_for_forward(self, layer, x):
        """The layer's full parameters for this call: gathered after the previous layer
        started (prefetch), once per step for a layer called several times."""
        variables = layer.trainable_variables
        if id(layer) not in self.forward_full:
            with self._after(self.previous_input):
                self.forward_full[id(layer)] = differentiable_gather(
                    self.partition, self._shards(variables), variables, self.whole)
        self.previous_input = x
        return self.forward_full[id(layer)]

    def _per_call(self, layer, call):
        states = recompute.seed_states(layer)

        def wrapped(x, *args, **kwargs):
            if kwargs.get("cache") is not None:
                raise ValueError("--zero_stage=3 models do not decode with a cache; "
                                 "consolidate the run (python -m tfbig.commands.consolidate) first")
            full = self._gather_for_forward(layer, x)
            return self._run(layer, call, states, x, full, args, kwargs)

        return wrapped

    def _run(self, layer, call, states, x, full, args, kwargs):
        """The layer's call on its gathered parameters, recomputed in the backward. The call
        may return a nest of tensors (an MoE block: its output and the router's statistics,
        which reach the loss): each gets its gradient."""
        variables = layer.trainable_variables
        floating = x.dtype.is_floating
        start = _read_states(states)  # the enclosing scope's (a shared layer's second call)
        device = x.device
        autocast = get_autocast_scope()  # the layer's compute dtype, for the recompute too
        structure = []  # the nest `call` returns, known once the forward has run

        @tf.custom_gradient
        def gathered_layer(x, *full):
            saved = recompute._to_host(x, self.offload)
            with record.stop_recording():  # keep nothing of the layer for the outer tape
                y, after = run_with(variables, full, states, start,
                                    lambda: call(x, *args, **kwargs))
            for v, value in zip(states, after):
                v.assign(value)
            structure.append(y)

            def grad(*dys, variables=None):
                dy = dys[0]  # the layer's output (an MoE block's hidden states)
                # prefetch: after the later layer's backward started (its output gradient),
                # not after it ended (this layer's `dy`); the last layer waits for its `dy`
                with self._after(dy if self.previous_grad is None else self.previous_grad):
                    again = gather_values(self.partition, self._shards(layer_variables),
                                          layer_variables, self.whole)
                self.previous_grad = dy  # the next (earlier) layer's gather may start now
                with tf.GradientTape() as tape:
                    x_again = recompute._from_host(saved, device, self.offload)
                    watched = ([x_again] if floating else []) + again
                    tape.watch(watched)
                    with AutocastScope(autocast.dtype if autocast else None):
                        y_again, _ = run_with(layer_variables, again, states, start,
                                              lambda: call(x_again, *args, **kwargs))
                y_again = tf.nest.flatten(y_again)
                dys = [tf.zeros_like(y) if d is None else d for y, d in zip(y_again, dys)]
                grads = tape.gradient(y_again, watched, output_gradients=dys,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
                grads = [tf.convert_to_tensor(g) for g in grads]
                inputs = grads if floating else [None] + grads
                if variables is None:  # TF passes `variables` only when the forward read some
                    return inputs
                return inputs, [tf.zeros_like(v) for v in variables]

            return tf.nest.flatten(y), grad

        layer_variables = variables
        flat = gathered_layer(x, *full)
        return tf.nest.pack_sequence_as(structure[-1], flat)
