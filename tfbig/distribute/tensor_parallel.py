"""Megatron-style tensor parallelism on Horovod (`--tensor_parallel=T`), applied from outside.

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.tensor_parallel).
"""
import json
import math
import os

import numpy as np
import tensorflow as tf

from tfbig.checkpoints.checkpoint import piece_dir, state_arrays, state_variables, write_layout
from tfbig.distribute import recompute
from tfbig.distribute.base import Strategy
from tfbig.distribute.horovod import HorovodStrategy
from tfbig.distribute.horovod_keras import hvd
from tfbig.distribute.tensor_collectives import (all_reduce_sum, vocab_parallel_argmax,
                                                 vocab_parallel_cross_entropy)
from tfbig.distribute.tensor_layers import wrap
from tfbig.layouts.tensor_layout import (LAYOUT_FILE, cut_pieces, join_slices, own_mask_states,
                                         split_model, take_slice)
from tfbig.layouts.tensor_plan import TensorGroup, whole_sequence_paths


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


def restore_from_single_device(trainer, path, group, splits, own_rng=True):
    """Restore single-device checkpoint `path` into tensor rank `group.rank`'s slices.

    The full model and its optimizer are built on this process for the duration of the restore
    (P parameters and their slots, as one device of the single-device run held them), restored,
    and every variable's slice assigned; dropout states as `split_model` offsets them (none
    without `own_rng`: expert parallelism's ranks share them). A split (axis, sections, group)
    is cut for that group's rank instead (an expert's, under tensor and expert parallelism).
    So a run consolidated from any layout (tfbig.training.consolidate) resumes under any
    --tensor_parallel."""
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
    own = own_mask_states(trainer.model, group, trainer.task) if own_rng else set()
    own_rng = {f"rng/{i}" for i, v in enumerate(
        v for v in trainer.model.variables if "seed_generator" in v.path) if id(v) in own}
    for name, variable in state_variables(trainer).items():
        if name not in source:
            raise ValueError(f"{path}: no {name} to restore (a checkpoint of another model?)")
        value, piece = source[name]
        if piece is not None:
            axis, sections, *cut = piece
            cut = cut[0] if cut else group
            value = take_slice(value, axis, sections, cut.rank, cut.size)
        elif name in own_rng:
            value = value + np.asarray(group.rank, value.dtype)
        variable.assign(value)


class TensorParallelStrategy(HorovodStrategy):
    """Horovod data parallelism over the data axis, each replica split over a tensor group."""

    name = "horovod"
    compiled_step = None  # the global norm sums over the tensor group (Horovod ops)

    def __init__(self, cfg=None, mesh=None):
        super().__init__(cfg, mesh)
        self.group = TensorGroup(self.mesh.process_set("tensor"), self.mesh.coords["tensor"],
                                 self.mesh.mesh.tensor, self.parallel.sequence_parallel)
        self.splits = {}  # variable path -> (axis, sections) of the variables held in pieces

    @property
    def num_devices(self):
        return self.mesh.mesh.size  # MFU: every rank's device works on the one model

    def build_model(self, task):
        model = self._split_model(task)
        memory = getattr(self.cfg, "pipeline", None)
        if memory is not None and memory.activation_checkpointing:
            # The recompute runs the block's collectives again in the backward, on every rank
            # of the group alike (Horovod matches collectives by name, not by order).
            recompute.check_offload(memory.offload_activations, False)
            recompute.checkpoint_blocks(model, offload=memory.offload_activations,
                                        blocks=recompute.task_blocks(task, model))
        return model

    def _split_model(self, task):
        """This tensor rank's model: its slices, their collectives, the vocabulary-parallel
        loss and argmax on the task."""
        model, self.splits = split_model(task, self.group, wrap=wrap)
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

    def make_validation_step(self, task, model, jit_compile):
        return super().make_validation_step(task, model, False)  # collectives inside

    def _sum_split_squares(self, squares):
        return all_reduce_sum(squares, self.group.process_set)

    def build_optimizer(self, train, variables):
        from tfbig.optim import build_optimizer

        replicated = [v.path not in self.splits for v in variables]
        return self._prepare_optimizer(build_optimizer(
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
    def weight_pieces(self, model):
        return cut_pieces(super().weight_pieces(model), model, self.splits, self.group)

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
