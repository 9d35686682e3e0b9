"""Context parallelism on Horovod (`--context_parallel=C`): every sequence split over C ranks.

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.context_parallel).
"""
import keras
import numpy as np
import tensorflow as tf

from tfbig.distribute import horovod_keras
from tfbig.distribute.context_layers import ContextGroup, apply_plan, check_sequence


# ---- the strategy: a mixin over any Horovod data backend -------------------------------------
class ContextParallel:
    """Context parallelism over the context axis of the rank grid, mixed in before a Horovod
    backend (HorovodStrategy, ZeroStrategy, TensorParallelStrategy..., or a cross-rank
    pipeline: each stage's sequences split over its context group) by `with_context`: the
    backend underneath sees one replica per data rank, as without it."""

    # Its forward/backward runs without XLA (collectives inside); the update stays op by op
    # too: no test has compiled it with the context axis (tfbig.training.step).
    compiled_step = None

    def __init__(self, cfg=None, mesh=None):
        super().__init__(cfg, mesh)
        self.context = None  # the ContextGroup, once the task's sequence length is known

    @property
    def num_devices(self):
        return self.mesh.mesh.size  # MFU: every rank's device works on the one step

    @property
    def _context_set(self):
        return self.mesh.process_set("context")

    def build_model(self, task):
        size = self.mesh.mesh.context
        check_sequence(task.seq_length, size, user=bool(getattr(task, "context_layout", None)))
        self.context = ContextGroup(self._context_set, self.mesh.coords["context"], size,
                                    task.seq_length)
        model = super().build_model(task)
        # a pipeline stage's model (tfbig.pipeline.stage_model.StageModel, not a Keras model)
        # holds the whole Keras model, whose layers its stage calls
        apply_plan(model if isinstance(model, keras.Model) else model.model, task, self.context)
        self._context_model = model  # the variables this rank holds
        if self.is_chief:
            print(self.describe_context(), flush=True)
        return model

    def describe_context(self):
        """What each context rank holds (printed at the start of a run)."""
        c, size = self.context.chunk, self.context.size
        return (f"{self.mesh.mesh.describe()}\ncontext parallel: {size} ranks per sequence of "
                f"{self.context.seq_length}, {2 * size} chunks of {c}; context rank i holds "
                f"chunks i and {2 * size - 1}-i: "
                + ", ".join(f"rank {r} positions {r * c}..{(r + 1) * c - 1} and "
                            f"{(2 * size - 1 - r) * c}..{(2 * size - r) * c - 1}"
                            for r in range(size)))

    def all_reduce_gradients(self, grads):
        # Horovod: average over the context group first (every context rank holds the whole
        # model), then the data backend's own sync over data ranks.
        grads = horovod_keras.average_gradients(list(grads), self.options.hvd_fp16_allreduce,
                                                self._context_set)
        return super().all_reduce_gradients(grads)

    def all_reduce_gradients_timed(self, grads):
        from tensorflow.python.framework import config as op_config

        if op_config.is_op_determinism_enabled():
            return self.all_reduce_gradients(grads), tf.constant(0.0, tf.float64)
        from tfbig.profiling.timing import timed

        return timed(self.all_reduce_gradients, grads)

    def all_reduce_mean(self, values):
        return super().all_reduce_mean(horovod_keras.average_values(values, self._context_set))

    def all_gather(self, values):
        """Floating outputs averaged over the context group first (GPT's per-sequence loss is
        a mean over this rank's tokens; the masked-LM outputs are equal on all of them), then
        gathered over data ranks."""
        flat = tf.nest.flatten(values)
        floats = [i for i, v in enumerate(flat) if v.dtype.is_floating]
        averaged = horovod_keras.average_values([flat[i] for i in floats], self._context_set)
        for i, value in zip(floats, averaged):
            flat[i] = value
        return super().all_gather(tf.nest.pack_sequence_as(values, flat))

    def broadcast_variables(self, variables):
        """The data backend's broadcast, then context rank 0's state to its context peers (only
        it restored a checkpoint); then each rank's dropout states offset by its context rank."""
        super().broadcast_variables(variables)
        root = self.mesh.mesh.group("context", self.mesh.rank)[0]
        horovod_keras.broadcast_variables(self.held(variables), root_rank=root,
                                          process_set=self._context_set)
        offset = self.mesh.coords["context"]
        for v in self._context_model.variables if offset else ():
            if "seed_generator" in v.path:
                v.assign(v + np.asarray([offset << 16, 0], v.dtype))

    def checkpoint_dir(self, model_dir):
        if self.mesh.coords["context"] != 0:
            return None  # context rank 0 of the replica writes what its peers hold too
        return super().checkpoint_dir(model_dir)

    def make_forward_backward(self, loss_fn, variables, scale_loss, jit_compile):
        # Horovod ops have no XLA kernels: the collectives sit inside the forward/backward.
        return super().make_forward_backward(loss_fn, variables, scale_loss, False)

    def make_validation_step(self, task, model, jit_compile):
        return super().make_validation_step(task, model, False)


_CLASSES = {}


def with_context(backend):
    """`backend` (a Horovod strategy class) with context parallelism mixed in (one class per
    backend, made once)."""
    if backend not in _CLASSES:
        _CLASSES[backend] = type(f"Context{backend.__name__}", (ContextParallel, backend),
                                 {"__doc__": f"{backend.__name__} with --context_parallel."})
    return _CLASSES[backend]
