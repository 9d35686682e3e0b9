"""The one strategy surface every training backend implements.

The trainer calls only what `Strategy` defines, so it has no `if backend == ...` branches. A
backend changes where variables live (`scope`), which slice of the data a process reads
(`input_context`, `distribute_dataset`), how a replica step runs (`run`, `local_result`), how one
optimizer step's gradients are computed (`make_forward_backward`; the pipeline backend replaces
it with its schedules), how gradients and metrics are averaged (`all_reduce_gradients`,
`all_reduce_mean`), how state is made equal (`broadcast_variables`) and who writes files
(`is_chief`, `checkpoint_dir`).

`SingleDevice` is the reference every other backend is tested against.
"""
import contextlib
import os
import signal
import socket
import threading

import tensorflow as tf
from tensorflow.python.framework import config as op_config  # no public determinism query

from tfbig.distribute import recompute


def _unstack_micro(batch, index):
    return tf.nest.map_structure(lambda t: t[index], batch)


def accumulate_gradients(loss_fn, variables, batch, scale_loss):
    """Average loss, gradients and metrics over the leading (micro-batch) axis of `batch`.

    `loss_fn(micro_batch, training=True) -> (loss, metrics)` is single-replica code giving the
    mean loss of one micro-batch. Gradients are of `scale_loss(loss)` (fp16 loss scaling) and
    are summed in float32 over micro-batches, then divided by their number, so N micro-batches
    give the update of one N-times-larger batch.
    """
    num_micro = tf.nest.flatten(batch)[0].shape[0]

    def micro_step(micro):
        with tf.GradientTape() as tape:
            loss, metrics = loss_fn(micro, training=True)
            scaled = scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        # Dense float32 sums: embedding gradients arrive as IndexedSlices.
        return loss, [tf.cast(tf.convert_to_tensor(g), tf.float32) for g in grads], metrics

    loss, grads, metrics = micro_step(_unstack_micro(batch, 0))
    if num_micro == 1:
        return loss, grads, metrics

    def body(i, loss_sum, grad_sums, metric_sums):
        loss_i, grads_i, metrics_i = micro_step(_unstack_micro(batch, i))
        return (i + 1, loss_sum + loss_i, [a + g for a, g in zip(grad_sums, grads_i)],
                {k: metric_sums[k] + metrics_i[k] for k in metric_sums})

    _, loss, grads, metrics = tf.while_loop(
        lambda i, *_: i < num_micro, body, (tf.constant(1), loss, grads, metrics))
    scale = 1.0 / num_micro
    return (loss * scale, [g * scale for g in grads],
            {k: v * scale for k, v in metrics.items()})


class Strategy:
    """Single device: the reference backend and the base class of the others."""

    name = "single"
    whole_model = True  # this process holds every weight (the chief samples text from it)
    # What of one optimizer step can be one XLA program with --xla (tfbig.training.step):
    # "whole" (forward, backward, all-reduce, clipping, loss scale and apply: no collective
    # or XLA kernels for them), "update" (the update after the all-reduce; its collectives
    # run outside XLA) or None (the update itself communicates, or spans devices).
    compiled_step = "whole"

    def __init__(self, cfg=None):
        self.cfg = cfg

    @property
    def num_replicas(self):
        """Data-parallel replicas that each see a different slice of the global batch."""
        return 1

    @property
    def num_devices(self):
        """Devices one optimizer step runs on; MFU divides by their summed peak."""
        return self.num_replicas

    @property
    def rank(self):
        """This process's data-parallel rank (its input pipeline id)."""
        return 0

    @property
    def is_chief(self):
        """Whether this process writes logs, TensorBoard events and the checkpoint."""
        return True

    @property
    def restores_checkpoint(self):
        """Whether this process restores --model_dir's checkpoint itself (else it receives
        the restored state through `broadcast_variables`)."""
        return True

    @property
    def checkpoint_pieces(self):
        """How many ranks' files make one checkpoint (ZeRO shards x tensor ranks x stages):
        --async_checkpoint=auto writes beside training only when it is one (a death during
        the writes could leave the pieces' newest checkpoints at different steps)."""
        return 1

    @property
    def learning_rate_scale(self):
        """Factor on the peak learning rate (Horovod's --scale_lr: the number of processes)."""
        return 1.0

    def scope(self):
        """Context in which the model and optimizer variables are created."""
        return contextlib.nullcontext()

    def build_model(self, task):
        """The task's model, built inside `scope()`; a backend that places parts of the model
        itself (the pipeline, one stage per device) overrides this.
        --activation_checkpointing recomputes each transformer block in the backward
        (tfbig.distribute.recompute), --offload_activations keeps its input on the host."""
        model = task.build_model()
        memory = getattr(self.cfg, "pipeline", None)
        if memory is not None and memory.activation_checkpointing:
            recompute.check_offload(memory.offload_activations, self.cfg.train.xla)
            recompute.checkpoint_blocks(model, offload=memory.offload_activations,
                                        blocks=recompute.task_blocks(task, model))
        return model

    def input_context(self):
        return tf.distribute.InputContext(num_input_pipelines=self.num_replicas,
                                          input_pipeline_id=self.rank,
                                          num_replicas_in_sync=self.num_replicas)

    def distribute_dataset(self, dataset_fn):
        """An iterable of this process's batches; `dataset_fn(input_context) -> tf.data`."""
        return dataset_fn(self.input_context())

    def run(self, fn, args):
        """Run the replica step `fn(*args)` (on every local replica for tf.distribute)."""
        return fn(*args)

    def local_result(self, value):
        """A replica step's (already all-reduced) output as plain tensors."""
        return value

    def make_forward_backward(self, loss_fn, variables, scale_loss, jit_compile):
        """A function batch -> (mean loss, gradients, metrics) over the micro-batch axis."""
        return tf.function(
            lambda batch: accumulate_gradients(loss_fn, variables, batch, scale_loss),
            jit_compile=jit_compile, autograph=False)

    def make_validation_step(self, task, model, jit_compile):
        """A function batch -> the task's per-example validation outputs ({name: (rows, ...)}:
        `task.validation_step`); a backend that splits the model (the pipeline) runs its own
        forward and hands the model's outputs to `task.validation_outputs`."""
        return tf.function(lambda batch: task.validation_step(model, batch),
                           jit_compile=jit_compile, autograph=False)

    def all_gather(self, values):
        """Concatenate a nest of per-replica (rows, ...) tensors over data-parallel replicas
        along rows, in replica (= input pipeline) order; every replica gets the whole."""
        return values

    def all_reduce_gradients(self, grads):
        """Average gradients over data-parallel replicas (called once per optimizer step)."""
        return grads

    def all_reduce_gradients_timed(self, grads):
        """(all_reduce_gradients(grads), seconds it took) for the step-time breakdown.

        Timed in the graph around `all_reduce_gradients`; one replica communicates nothing
        (0). A backend that communicates elsewhere (e.g. inside its forward/backward)
        overrides this to report that time.
        """
        # tf.timestamp is refused under op determinism (--deterministic): report 0 there too.
        if self.num_replicas == 1 or op_config.is_op_determinism_enabled():
            return self.all_reduce_gradients(grads), tf.constant(0.0, tf.float64)
        from tfbig.profiling.timing import timed

        return timed(self.all_reduce_gradients, grads)

    def all_reduce_mean(self, values):
        """Average a nest of scalars over data-parallel replicas."""
        return values

    def _prepare_optimizer(self, optimizer):
        """The optimizer adapted to this backend (default: unchanged), before training."""
        return optimizer

    def build_optimizer(self, train, variables):
        """The optimizer of TrainConfig `train` for the model's trainable `variables` (a
        sharded backend builds it over the slices this process owns instead)."""
        from tfbig.optim import build_optimizer

        return self._prepare_optimizer(build_optimizer(train, variables))

    def global_norm(self, grads):
        """The global norm of what `all_reduce_gradients` returned (all of the model's)."""
        return tf.linalg.global_norm(grads)

    def apply_gradients(self, optimizer, grads, variables):
        """One optimizer update of the model's `variables` with the averaged `grads`."""
        optimizer.apply(grads, variables)

    def gather_over_processes(self, values):
        """[the floats `values` of process 0, of process 1, ...] (a collective)."""
        return [[float(v) for v in values]]

    def process_hosts(self):
        """The host name of each process, in the order of `gather_over_processes` (a
        collective)."""
        return [socket.gethostname()]

    def broadcast_variables(self, variables):
        """Make every replica's copy of `variables` equal to the chief's."""

    def checkpoint_model(self, model):
        """{key: variable} of the model's weights in this process's checkpoint (ZeRO-3: its
        slices under the same keys)."""
        from tfbig.checkpoints.checkpoint import model_variables

        return model_variables(model)

    def weight_pieces(self, model):
        """{single-device checkpoint key: [holder, cut, full shape]} of every weight of the
        model: this rank holds `cut(full array)` (cut None: the whole array) in variable
        `holder` (None: another rank holds it, a pipeline stage's). --init_checkpoint reads a
        layout's weights through it, one whole weight at a time; a split backend adds its cut
        to those of the backends it builds on."""
        from tfbig.checkpoints.checkpoint import model_key

        return {model_key(model, v): [v, None, tuple(v.shape)] for v in model.variables
                if "seed_generator" not in v.path}

    def restore_dir(self, model_dir):
        """Where this process finds the checkpoint it restores (when `restores_checkpoint`)."""
        return model_dir

    def restore(self, trainer, path):
        """Restore checkpoint `path` into the trainer's state (a split backend may slice; a
        ZeRO backend may re-shard a checkpoint of another layout)."""
        from tfbig.layouts.zero_checkpoint import LAYOUT_FILE

        if os.path.exists(os.path.join(os.path.dirname(path), LAYOUT_FILE)):
            raise ValueError(
                f"{os.path.dirname(path)} holds a --zero_stage checkpoint (its {LAYOUT_FILE}): "
                f"resume it with --strategy=horovod --zero_stage=1|2|3 (any number of "
                f"processes, re-sharded on load) or write a single-device copy with "
                f"python -m tfbig.commands.consolidate MODEL_DIR OUT_DIR")
        if os.path.exists(os.path.join(os.path.dirname(path), "expert.json")):
            raise ValueError(
                f"{os.path.dirname(path)} holds an --expert_parallel checkpoint (its "
                f"expert.json: each rank's experts in a piece of their own); resume it with "
                f"--strategy=horovod and the same --expert_parallel")
        trainer.checkpoint.restore(path).assert_existing_objects_matched()

    def checkpoint_dir(self, model_dir):
        """Where this process writes checkpoints, or None if it writes none."""
        return model_dir if self.is_chief else None

    def after_checkpoint(self, directory):
        """Clean up after a save to `directory` (e.g. a worker's temporary copy)."""

    @contextlib.contextmanager
    def watch_preemption(self):
        """Within this context a SIGTERM (spot preemption, Kubernetes, Slurm) does not kill the
        process; it makes `should_stop()` true so the loop saves a checkpoint and stops."""
        self._sigterm = threading.Event()
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: self._sigterm.set())
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def should_stop(self):
        """Whether every process should save and stop after this step; called by all processes
        after every step, and multi-process backends make them agree."""
        sigterm = getattr(self, "_sigterm", None)
        return bool(sigterm and sigterm.is_set())

    def shutdown(self):
        """Release backend resources at the end of the run."""

    def train_batches(self, task, micro_batch, grad_accum_steps, seed, start):
        """Iterator of this process's (grad_accum_steps, micro_batch, ...) training batches: its
        contiguous slice of each global batch from global example `start` on (a resumed run),
        cut into micro-batches. The data layer fixes the global order (tfbig.data.order)."""
        def dataset_fn(ctx):
            ds = task.dataset("train", grad_accum_steps * micro_batch, ctx, seed=seed, start=start)
            return ds.map(lambda batch: tf.nest.map_structure(  # (accum * micro, ...) -> (accum, micro, ...)
                lambda t: tf.reshape(t, [grad_accum_steps, micro_batch, *t.shape[1:]]), batch))

        return iter(self.distribute_dataset(dataset_fn))

    def run_training(self, loop):
        """Run the training loop `loop()` and return its result (elastic Horovod re-runs it
        from the last commit when ranks come and go)."""
        return loop()

    def after_step(self, step):
        """Called by every process after each optimizer step (elastic Horovod commits here)."""


SingleDevice = Strategy
