"""Megatron-style tensor parallelism on Horovod (`--tensor_parallel=T`), applied from outside.

The model file knows nothing of it. A *plan* (data, tfbig.layouts.tensor_layout: attribute
path -> how that part is split) says which Dense layers are column- or row-parallel, which
attention/MLP widths shrink, which embedding is split over the vocabulary. `split_model` builds
each rank's slice of the single-device model; this module wraps the split layers' `call`s with
the collectives. What runs on rank t of a tensor group of T:

    attention   heads t*nh/T .. (t+1)*nh/T: QKV column-parallel (q, k and v blocks each split),
                output projection row-parallel
    MLP         first Dense column-parallel (intermediate/T columns), second row-parallel
    embedding   vocabulary rows t*V/T ..: ids outside the slice look up zeros, then a sum
    logits      the tied table (or untied head) gives this slice's V/T logits; the loss is
                the vocabulary-parallel cross-entropy: no rank forms (batch, seq, V) logits

A user task's declared layout (tfbig.tasks.user, tensor_layout.split_declared_model) uses the
same collectives on Keras layers: column/row Dense pairs, a MultiHeadAttention's heads (its
inputs copied into the region once, its output projection's partial sums reduced before the
bias), an Embedding's vocabulary rows, and an output Dense's vocabulary columns whose logits are
all-gathered (the task's own loss reads whole logits, so no vocabulary-parallel loss there).

The collectives are the conjugate pair: `copy_to_region` (identity forward, all-reduce of the
gradient backward) before every column-parallel layer and before the vocabulary projection,
`reduce_from_region` (all-reduce forward, identity backward) after every row-parallel layer and
the vocabulary embedding. So each transformer sub-layer costs one all-reduce forward and one
backward, over the Horovod process set of the tensor group. LayerNorms, position embeddings and
the biases of row-parallel layers are replicated: their inputs and output gradients are the
same on all T ranks, so are their gradients (no extra collective). Gradient clipping and the
logged gradient norm sum split variables' squares over the group and count replicated ones once.

Dropout: a region whose activations are replicated (embeddings, after each row-parallel layer)
draws the same mask on all T ranks (every rank starts from the same seed-generator states,
copied from the single-device model); a split region (attention probabilities of this rank's
heads) draws its own (its generator state is offset by the tensor rank).

Horovod's collectives have no XLA kernels, so the forward/backward of a tensor-parallel step
runs as a TensorFlow graph, not XLA-compiled (--xla is ignored with a notice).

Checkpoints: each rank of the first data-parallel replica writes what it holds (tensor rank 0
in --model_dir, rank t in MODEL_DIR/tensor/rank-t) and MODEL_DIR/tensor.json records the
layout. `python -m tfbig.commands.consolidate MODEL_DIR OUT_DIR` assembles the full variables (weights
and optimizer slots) into a single-device checkpoint; a tensor-parallel run started on a
single-device checkpoint slices it on load (`restore_from_single_device`), so a run moves from
one degree to another through one consolidation. tfbig-generate and tfbig-export read the
pieces directly.

Example:
    horovodrun -np 4 -H localhost:4 --gloo tfbig-train --strategy=horovod --tensor_parallel=2
"""
import json
import math
import os

import numpy as np
import tensorflow as tf
from keras import ops

from tfbig.checkpoints.checkpoint import piece_dir, write_layout
from tfbig.distribute import recompute
from tfbig.distribute.base import Strategy
from tfbig.distribute.horovod import HorovodStrategy
from tfbig.distribute.horovod_keras import hvd
from tfbig.layouts.tensor_layout import (LAYOUT_FILE, TensorGroup, join_slices, own_mask_states,
    split_model, state_arrays, state_variables, take_slice, whole_sequence_paths)


# ---- the conjugate collectives (Megatron's mappings) -----------------------------------------
def _all_reduce_sum(x, process_set):
    # Horovod's Gloo path has no bfloat16 sum: carry it in float32 (float16 and float32 as is).
    if x.dtype == tf.bfloat16:
        return tf.cast(hvd.allreduce(tf.cast(x, tf.float32), op=hvd.Sum,
                                     process_set=process_set), tf.bfloat16)
    return hvd.allreduce(x, op=hvd.Sum, process_set=process_set)


def copy_to_region(x, process_set):
    """Identity forward; the gradient is summed over the tensor group backward."""
    @tf.custom_gradient
    def copy(x):
        return tf.identity(x), lambda dy: _all_reduce_sum(dy, process_set)

    return copy(x)


def reduce_from_region(x, process_set):
    """Sum over the tensor group forward; the gradient passes unchanged backward."""
    @tf.custom_gradient
    def reduce(x):
        return _all_reduce_sum(x, process_set), lambda dy: tf.identity(dy)

    return reduce(x)


# ---- sequence parallelism: the same regions, split along the sequence (axis 1) ---------------
def _on_sequence_axis(collective, x):
    """Apply a Horovod collective that works along axis 0 to axis 1 of (B, T, ...)."""
    perm = [1, 0] + list(range(2, len(x.shape)))
    wide = x.dtype == tf.bfloat16  # Gloo: no bfloat16 sums, carried in float32
    y = collective(tf.transpose(tf.cast(x, tf.float32) if wide else x, perm))
    y = tf.transpose(y, perm)
    return tf.cast(y, tf.bfloat16) if wide else y


def gather_sequence(x, process_set):
    """(B, T/t, C) chunks -> (B, T, C) forward; backward the gradient is summed over the group
    and each rank keeps its chunk's rows (a reduce-scatter). Replaces copy_to_region."""
    @tf.custom_gradient
    def gather(x):
        def grad(dy):
            return _on_sequence_axis(lambda t: hvd.reducescatter(
                t, op=hvd.Sum, process_set=process_set), dy)

        return _on_sequence_axis(lambda t: hvd.allgather(t, process_set=process_set), x), grad

    return gather(x)


def scatter_sequence(x, process_set):
    """(B, T, C) partial sums -> this rank's (B, T/t, C) chunk of their sum (a reduce-scatter)
    forward; backward the chunks' gradients are gathered. Replaces reduce_from_region."""
    @tf.custom_gradient
    def scatter(x):
        def grad(dy):
            return _on_sequence_axis(lambda t: hvd.allgather(t, process_set=process_set), dy)

        return _on_sequence_axis(lambda t: hvd.reducescatter(
            t, op=hvd.Sum, process_set=process_set), x), grad

    return scatter(x)


def gather_whole_sequence(x, group):
    """(B, T/t, C) chunks -> (B, T, C) forward, for a replicated region after the split one
    (its gradient is complete on every rank): backward each rank keeps its chunk's rows."""
    chunk = x.shape[1]
    rows = tf.range(group.rank * chunk, (group.rank + 1) * chunk)

    @tf.custom_gradient
    def gather(x):
        y = _on_sequence_axis(lambda t: hvd.allgather(t, process_set=group.process_set), x)
        # Horovod leaves the gathered axis' length unknown: it is the chunks' sum.
        y = tf.ensure_shape(y, [x.shape[0], chunk * group.size] + list(x.shape[2:]))
        return y, lambda dy: tf.gather(dy, rows, axis=1)

    return gather(x)


def from_first_rank(x, group):
    """Tensor rank 0's `x` on every rank forward (the others' are dropped); backward the
    (replicated) gradient goes to rank 0's `x` only."""
    keep = tf.cast(group.rank == 0, x.dtype)
    return reduce_from_region(x * keep, group.process_set)


def sequence_chunk(x, group, axis=0):
    """This rank's equal chunk of `x` along `axis` (no communication)."""
    length = x.shape[axis]
    if length % group.size:
        raise ValueError(f"--sequence_parallel: sequence length {length} is not a multiple of "
                         f"--tensor_parallel={group.size}")
    size = length // group.size
    return tf.gather(x, tf.range(group.rank * size, (group.rank + 1) * size), axis=axis)


def vocab_parallel_cross_entropy(labels, logits, group):
    """Per-token cross-entropy of labels (...) against this rank's vocabulary slice of the
    logits (..., V/T): the max, the sum of exponentials and the target's logit are each
    combined over the group, so the full (..., V) logits never exist on any rank."""
    ps, rank = group.process_set, group.rank
    logits = tf.cast(logits, tf.float32)
    width = logits.shape[-1]
    local_max = tf.stop_gradient(tf.reduce_max(logits, axis=-1))
    # The max only keeps exp() in range; any value equal on all ranks works. No gradient.
    peak = tf.reduce_max(hvd.allgather(local_max[None], process_set=ps), axis=0)
    shifted = logits - peak[..., None]
    sum_exp = reduce_from_region(tf.reduce_sum(tf.exp(shifted), axis=-1), ps)
    local = tf.cast(labels, tf.int32) - rank * width
    inside = (local >= 0) & (local < width)
    index = tf.where(inside, local, 0)[..., None]
    picked = tf.gather(shifted, index, batch_dims=len(labels.shape))[..., 0]
    target = reduce_from_region(tf.where(inside, picked, 0.0), ps)
    return tf.math.log(sum_exp) - target


def gather_last_axis(x, group):
    """(..., V/T) slices -> (..., V) forward, in tensor-rank order (a declared vocab Dense's
    logits, whole for the task's own loss); backward each rank keeps its slice of the
    gradient, which is the same on every rank of the group (the loss is replicated)."""
    width, rank = x.shape[-1], len(x.shape)
    columns = tf.range(group.rank * width, (group.rank + 1) * width)
    first = [rank - 1] + list(range(rank - 1))  # Horovod gathers along axis 0

    @tf.custom_gradient
    def gather(x):
        wide = x.dtype == tf.bfloat16  # Gloo: no bfloat16 collectives, carried in float32
        y = hvd.allgather(tf.transpose(tf.cast(x, tf.float32) if wide else x, first),
                          process_set=group.process_set)
        y = tf.ensure_shape(y, [width * group.size, *x.shape[:-1]])
        y = tf.transpose(y, list(range(1, rank)) + [0])
        return (tf.cast(y, tf.bfloat16) if wide else y), lambda dy: tf.gather(dy, columns,
                                                                                axis=-1)

    return gather(x)


def _entering_attention(call, enter, process_set):
    """A Keras MultiHeadAttention's call with its query, value and key entering the split
    region once each (self-attention passes one tensor: one all-reduce backward), their Keras
    masks kept."""
    from keras.src import backend

    def attention_call(query, value, key=None, *args, **kwargs):
        entered = {}

        def into(x):
            if x is not None and id(x) not in entered:
                entered[id(x)] = enter(x, process_set)
                mask = backend.get_keras_mask(x)
                if mask is not None:
                    backend.set_keras_mask(entered[id(x)], mask)
            return None if x is None else entered[id(x)]

        return call(into(query), into(value), into(key), *args, **kwargs)

    return attention_call


def _reduced_projection(layer, leave, process_set):
    """An EinsumDense's call (a MultiHeadAttention's output projection over this rank's heads)
    with its partial sums reduced over the group before its bias is added, once."""
    def projection_call(x, *args, **kwargs):
        y = leave(ops.einsum(layer.equation, x, layer.kernel), process_set)
        y = y if layer.bias is None else ops.add(y, layer.bias)
        return y if layer.activation is None else layer.activation(y)

    return projection_call


def _wrap(layer, split, group):
    kind, ps = split.kind, group.process_set
    call = layer.call
    if group.sequence_parallel and split.sequence:
        # into the split region: all-gather; out of it: reduce-scatter
        enter, leave = gather_sequence, scatter_sequence
    else:  # into it: identity (all-reduce backward); out of it: all-reduce
        enter, leave = copy_to_region, reduce_from_region
    if kind == "column":
        layer.call = lambda x, *args, **kwargs: call(enter(x, ps), *args, **kwargs)
    elif kind == "row":
        def row_call(x, *args, **kwargs):
            y = leave(ops.matmul(x, layer.kernel), ps)
            return y + layer.bias if layer.use_bias else y

        layer.call = row_call
    elif kind == "vocab":
        def vocab_call(ids, *args, **kwargs):
            local = ops.cast(ids, "int32") - group.rank * layer.input_dim
            inside = (local >= 0) & (local < layer.input_dim)
            rows = call(ops.where(inside, local, 0), *args, **kwargs)
            return leave(rows * ops.cast(inside[..., None], rows.dtype), ps)

        layer.call = vocab_call
    elif kind == "keras_heads":  # a declared Keras MultiHeadAttention
        layer.call = _entering_attention(call, enter, ps)
        layer.output_dense.call = _reduced_projection(layer.output_dense, leave, ps)
    elif kind == "vocab_logits":  # a declared output Dense: the task's loss sees all logits
        layer.call = lambda x, *args, **kwargs: gather_last_axis(
            call(enter(x, ps), *args, **kwargs), group)
    elif kind == "vocab_input":
        layer.call = lambda *args, **kwargs: enter(call(*args, **kwargs), ps)
    elif kind == "positions" and group.sequence_parallel:
        layer.call = lambda *args, **kwargs: sequence_chunk(call(*args, **kwargs), group)
    elif kind == "segments" and group.sequence_parallel:
        layer.call = lambda *args, **kwargs: sequence_chunk(call(*args, **kwargs), group, 1)
    elif kind == "sequence_output" and group.sequence_parallel:
        def whole_call(*args, **kwargs):
            sequence, *rest = call(*args, **kwargs)
            return (gather_whole_sequence(sequence, group), *rest)

        layer.call = whole_call
    elif kind == "sequence_first" and group.sequence_parallel:
        layer.call = lambda x, *args, **kwargs: call(from_first_rank(x, group), *args, **kwargs)



def vocab_parallel_argmax(logits, group, output_type=tf.int64):
    """tf.argmax over the vocabulary from this rank's slice (ties: the lowest index)."""
    ps, width = group.process_set, logits.shape[-1]
    local_max = tf.reduce_max(logits, axis=-1)
    local_arg = tf.argmax(logits, axis=-1, output_type=output_type) + \
        tf.cast(group.rank * width, output_type)
    maxes = hvd.allgather(local_max[None], process_set=ps)  # (T, ...)
    args = hvd.allgather(local_arg[None], process_set=ps)
    winner = tf.argmax(maxes, axis=0, output_type=tf.int32)  # the first rank holding the max
    return tf.experimental.numpy.take_along_axis(args, winner[None], axis=0)[0]


# ---- the strategy ----------------------------------------------------------------------------
def skip_everywhere(grads, process_set):
    """`grads`, all made NaN when any rank of `process_set` holds a non-finite one, so fp16's
    LossScaleOptimizer skips the step (and halves its scale) on every rank alike."""
    finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads]))
    # Horovod: count the ranks of the group with a non-finite gradient
    count = hvd.allreduce(1.0 - tf.cast(finite, tf.float32), op=hvd.Sum,
                          process_set=process_set)
    poison = tf.where(count > 0, float("nan"), 0.0)
    return [g + tf.cast(poison, g.dtype) for g in grads]


def restore_from_single_device(trainer, path, group, splits):
    """Restore single-device checkpoint `path` into tensor rank `group.rank`'s slices.

    The full model and its optimizer are built on this process for the duration of the restore
    (P parameters and their slots, as one device of the single-device run held them), restored,
    and every variable's slice assigned; dropout states as `split_model` offsets them. So a run
    consolidated from any layout (tfbig.training.consolidate) resumes under any --tensor_parallel."""
    from types import SimpleNamespace

    from tfbig.checkpoints.checkpoint import model_variables, rng_variables

    full = trainer.task.build_model()
    optimizer = Strategy(trainer.cfg).build_optimizer(trainer.cfg.train, full.trainable_variables)
    counters = {name: tf.Variable(0, dtype=tf.int64, trainable=False, name=name)
                for name in ("step", "batches_consumed", "nonfinite_steps")}
    tf.train.Checkpoint(model=model_variables(full), rng_state=rng_variables(full),
                        optimizer=optimizer, **counters).restore(
        path).assert_existing_objects_matched()
    source = state_arrays(SimpleNamespace(model=full, optimizer=optimizer, **counters), splits)
    own = own_mask_states(trainer.model, group, trainer.task)
    own_rng = {f"rng/{i}" for i, v in enumerate(
        v for v in trainer.model.variables if "seed_generator" in v.path) if id(v) in own}
    for name, variable in state_variables(trainer).items():
        if name not in source:
            raise ValueError(f"{path}: no {name} to restore (a checkpoint of another model?)")
        value, piece = source[name]
        if piece is not None:
            value = take_slice(value, *piece, group.rank, group.size)
        elif name in own_rng:
            value = value + np.asarray(group.rank, value.dtype)
        variable.assign(value)


class TensorParallelStrategy(HorovodStrategy):
    """Horovod data parallelism over the data axis, each replica split over a tensor group."""

    name = "horovod"

    def __init__(self, cfg=None, mesh=None):
        super().__init__(cfg, mesh)
        self.group = TensorGroup(self.mesh.process_set("tensor"), self.mesh.coords["tensor"],
                                 self.mesh.mesh.tensor, self.parallel.sequence_parallel)
        self.splits = {}  # variable path -> (axis, sections) of the variables held in pieces

    @property
    def num_devices(self):
        return self.mesh.mesh.size  # MFU: every rank's device works on the one model

    def build_model(self, task):
        model, self.splits = split_model(task, self.group, wrap=_wrap)
        memory = getattr(self.cfg, "pipeline", None)
        if memory is not None and memory.activation_checkpointing:
            # The recompute runs the block's collectives again in the backward, on every rank
            # of the group alike (Horovod matches collectives by name, not by order).
            recompute.check_offload(memory.offload_activations, False)
            recompute.checkpoint_blocks(model, offload=memory.offload_activations)
        self._model = model
        if self.is_chief:
            print(self.describe(task.model_config), flush=True)
        task.vocab_cross_entropy = lambda labels, logits: vocab_parallel_cross_entropy(
            labels, logits, self.group)
        task.vocab_argmax = lambda logits, output_type: vocab_parallel_argmax(
            logits, self.group, output_type)
        return model

    def describe(self, model_config):
        """The rank grid and what each tensor rank holds (printed at the start of a run)."""
        size = self.group.size
        split = [v for v in self._trainable if v.path in self.splits]
        held = sum(math.prod(v.shape) for v in self._trainable)
        if not hasattr(model_config, "num_heads"):  # a user task's declared layout
            return (f"{self.mesh.mesh.describe()}\ntensor parallel: each rank holds 1/{size} "
                    f"of {len(split)} variables of the declared layers (column/row Dense, "
                    f"attention heads, vocabulary) ({held:,} parameters on this rank); the "
                    f"rest replicated")
        heads = model_config.num_heads // size
        rows = model_config.vocab_size // size
        return (f"{self.mesh.mesh.describe()}\n"
                f"tensor parallel: each rank holds 1/{size} of {len(split)} variables "
                f"({held:,} parameters on this rank); tensor rank t: attention heads "
                f"t*{heads}..(t+1)*{heads}-1, vocabulary rows t*{rows}..(t+1)*{rows}-1; "
                f"LayerNorms, position table and row-parallel biases replicated"
                + (f"; sequence parallel: their activations split along the sequence, "
                   f"positions t*T/{size}.. on tensor rank t" if self.group.sequence_parallel
                   else ""))

    def all_reduce_gradients(self, grads):
        """Sequence parallelism: each rank's replicated weights (LayerNorms, position rows,
        row-parallel biases, ALBERT's embedding projection) saw only its chunk of the
        positions, so their gradients are summed over the tensor group first (one grouped
        all-reduce); then averaged over data. Weights after the split region (ALBERT's heads)
        saw the whole sequence: theirs are not summed. fp16: `skip_everywhere`."""
        grads = super().all_reduce_gradients(self._sequence_sums(grads))
        return self._skip_everywhere(grads)

    def _skip_everywhere(self, grads):
        """With fp16 loss scaling, `grads` made non-finite on every rank of the tensor group
        when any holds a non-finite value. The tensor ranks hold different slices, so an
        overflow in one rank's slice would make its LossScaleOptimizer skip a step the others
        apply, and their clipping norm (a sum over the tensor group) would wait for it
        forever. The data all-reduce spreads it over a data group only; this covers the rest."""
        if self._loss_scale() is None or self.group.size == 1:
            return grads
        return skip_everywhere(grads, self.group.process_set)

    def _sequence_sums(self, grads):
        """`grads` with the sequence-split replicated weights' summed over the tensor group."""
        if not self.group.sequence_parallel:
            return grads
        whole = whole_sequence_paths(self._model)  # ALBERT's heads: complete already
        replicated = [i for i, v in enumerate(self._trainable)
                      if v.path not in self.splits and v.path not in whole]
        summed = hvd.grouped_allreduce([tf.convert_to_tensor(grads[i]) for i in replicated],
                                       op=hvd.Sum, process_set=self.group.process_set)
        grads = list(grads)
        for i, g in zip(replicated, summed):
            grads[i] = g
        return grads

    def make_forward_backward(self, loss_fn, variables, scale_loss, jit_compile):
        # Horovod ops have no XLA kernels: the collectives sit inside the forward/backward.
        return super().make_forward_backward(loss_fn, variables, scale_loss, False)

    def make_forward(self, loss_fn, jit_compile):
        return super().make_forward(loss_fn, False)

    def make_validation_step(self, task, model, jit_compile):
        return super().make_validation_step(task, model, False)  # collectives inside

    def _sum_split_squares(self, squares):
        return _all_reduce_sum(squares, self.group.process_set)

    def build_optimizer(self, train, variables):
        from tfbig.optim import build_optimizer

        replicated = [v.path not in self.splits for v in variables]
        return self.prepare_optimizer(build_optimizer(
            train, variables, sum_over_shards=self._sum_split_squares, replicated=replicated))

    def global_norm(self, grads):
        """The norm of the whole model's gradient: split pieces summed over the group."""
        variables = self._trainable
        split = [tf.reduce_sum(tf.square(g)) for g, v in zip(grads, variables)
                 if v.path in self.splits]
        replicated = [tf.reduce_sum(tf.square(g)) for g, v in zip(grads, variables)
                      if v.path not in self.splits]
        squares = self._sum_split_squares(tf.add_n(split))
        return tf.sqrt(squares + tf.add_n(replicated) if replicated else squares)

    def state_bytes(self):
        """Bytes of parameters this rank holds, split and replicated."""
        nbytes = lambda v: math.prod(v.shape) * np.dtype(v.dtype).itemsize  # noqa: E731
        split = sum(nbytes(v) for v in self._trainable if v.path in self.splits)
        total = sum(nbytes(v) for v in self._trainable)
        return {"parameters": total, "split_parameters": split,
                "replicated_parameters": total - split}

    @property
    def _trainable(self):
        return self._model.trainable_variables

    def gather_full(self, variables, values=None):
        """[full numpy array] of each model variable (or of `values`, e.g. its gradients),
        assembled from the tensor group's pieces; a collective: every rank of it calls this."""
        out = []
        for i, v in enumerate(variables):
            value = tf.convert_to_tensor(v if values is None else values[i])
            piece = self.splits.get(v.path)
            if piece is None or self.group.size == 1:
                out.append(value.numpy())
                continue
            parts = hvd.allgather(value[None],
                                  process_set=self.group.process_set).numpy()
            out.append(join_slices(list(parts), *piece))
        return out

    # ---- checkpoints: each rank of the first replica writes its slices ---------------------
    @property
    def restores_checkpoint(self):
        return self.rank == 0  # the first replica's ranks; the broadcast gives it to the rest

    def _rank_dir(self, model_dir):
        return piece_dir(model_dir, "tensor", self.group.rank)

    def restore_dir(self, model_dir):
        if self._check_layout(model_dir) is None:
            return model_dir  # a single-device checkpoint: every rank slices it
        return self._rank_dir(model_dir)

    def restore(self, trainer, path):
        if self._check_layout(trainer.cfg.train.model_dir) is None:
            restore_from_single_device(trainer, path, self.group, self.splits)
        else:
            super().restore(trainer, path)

    def checkpoint_dir(self, model_dir):
        return self._rank_dir(model_dir) if self.rank == 0 else None

    def _layout(self):
        return {"tensor_parallel": self.group.size, "splits": {
            path: list(piece) for path, piece in sorted(self.splits.items())}}

    def _check_layout(self, model_dir):
        """The saved layout of --model_dir, or None (no checkpoint, or a single-device one)."""
        path = os.path.join(model_dir, LAYOUT_FILE)
        if os.path.exists(os.path.join(model_dir, "zero.json")):
            raise ValueError(f"--model_dir={model_dir} holds a --zero_stage checkpoint; resume "
                             f"it with the same --zero_stage, not --tensor_parallel")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            saved = json.load(f)
        if saved["tensor_parallel"] != self.group.size:
            raise ValueError(
                f"--model_dir={model_dir} was written with --tensor_parallel="
                f"{saved['tensor_parallel']}; this run has {self.group.size}. Resume with the "
                f"same degree, or assemble a single-device checkpoint first (it resumes with "
                f"any degree): python -m tfbig.commands.consolidate {model_dir} OUT_DIR")
        return saved

    def after_checkpoint(self, directory):
        if self.is_chief:
            write_layout(directory, LAYOUT_FILE, self._layout())
