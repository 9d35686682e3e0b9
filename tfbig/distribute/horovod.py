"""Horovod data parallelism (`--strategy=horovod`): one process per device, launched by
`horovodrun` or `mpirun`, gradients averaged with an allreduce.

The post's six steps, each done once, here:
    1. hvd.init()                                   -> HorovodStrategy.__init__
    2. one GPU per process (local_rank), memory growth -> horovod_keras.pin_gpu_to_local_rank
    3. learning rate x world size (--scale_lr)      -> learning_rate_scale
    4. average gradients, once per optimizer step   -> all_reduce_gradients
    5. broadcast model, optimizer, step counters     -> broadcast_variables (the trainer calls it
       after building the optimizer's slots and restoring a checkpoint)
    6. only rank 0 writes checkpoints, logs, events -> is_chief

Everything else is the single-device loop: each process reads its own shard of the data
(`input_context`), runs the same XLA-compiled forward/backward with gradient accumulation inside
it, and the allreduce runs outside XLA (Horovod ops have no XLA kernels).

Example:
    horovodrun -np 2 -H localhost:2 --gloo tfbig-train --strategy=horovod --preset=tiny
"""
import contextlib

import tensorflow as tf

from tfbig.config import HorovodConfig
from tfbig.distribute import horovod_keras  # first: a clear error if Horovod is missing
from tfbig.distribute.horovod_keras import hvd
from tfbig.distribute.base import Strategy


class HorovodStrategy(Strategy):
    """Data parallel over all Horovod processes (or over `process_set`).

    Args:
      cfg: the ExperimentConfig; its `horovod` section gives --scale_lr, --hvd_fp16_allreduce.
      process_set: the processes that average gradients (default: all). A pipeline backend
        passes the data-parallel group of one stage.
    """

    name = "horovod"

    def __init__(self, cfg=None, process_set=hvd.global_process_set):
        super().__init__(cfg)
        self.options = getattr(cfg, "horovod", None) or HorovodConfig()
        if not hvd.is_initialized():
            horovod_keras.init()  # Horovod: initialise, pin one GPU per process
        self.process_set = process_set
        self._scale_loss = None
        # SIGTERM agreement without an extra collective: each step's gradient allreduce also
        # averages this process's stop request; a non-zero average stops every process.
        self._stop_requested = tf.Variable(0.0, trainable=False, name="stop_requested")
        self._stop_agreed = tf.Variable(0.0, trainable=False, name="stop_agreed")

    @property
    def num_replicas(self):
        return self.process_set.size()

    @property
    def rank(self):
        return self.process_set.rank()

    @property
    def is_chief(self):
        return hvd.rank() == 0  # Horovod: only global rank 0 writes checkpoints and logs

    @property
    def learning_rate_scale(self):
        # Horovod: with --scale_lr the peak learning rate grows with the number of processes.
        return float(self.num_replicas) if self.options.scale_lr else 1.0

    def make_forward_backward(self, loss_fn, variables, scale_loss, jit_compile):
        self._scale_loss = scale_loss  # all_reduce_gradients unscales with it
        return super().make_forward_backward(loss_fn, variables, scale_loss, jit_compile)

    def _loss_scale(self):
        """The fp16 loss scale of this step, or None when the loss is not scaled."""
        if self._scale_loss is None:
            return None
        scale = tf.convert_to_tensor(self._scale_loss(tf.constant(1.0)))
        return None if tf.get_static_value(scale) == 1.0 else scale  # 1.0: loss not scaled

    def all_reduce_gradients(self, grads):
        """Average gradients over processes: one grouped allreduce per optimizer step.

        fp16 loss scaling: gradients are unscaled before averaging and scaled back after, so
        the LossScaleOptimizer sees what it expects; the scale is a power of two, so this is
        exact in float32. What is averaged then does not depend on the loss scale: with
        --hvd_fp16_allreduce, loss-scaled values (2**15 x the gradient) would overflow
        float16 on the wire (the price: unscaled entries below ~6e-5 lose precision there).
        A non-finite gradient on any process makes the average non-finite on all of them,
        so every process skips that step and lowers its loss scale identically.
        """
        scale = self._loss_scale()
        if scale is not None:
            grads = [g / tf.cast(scale, g.dtype) for g in grads]
        # Horovod: average gradients across processes (outside XLA).
        *grads, stop = horovod_keras.average_gradients(
            list(grads) + [self._stop_requested.read_value()], self.options.hvd_fp16_allreduce,
            self.process_set)
        self._stop_agreed.assign(stop)
        if scale is not None:
            grads = [g * tf.cast(scale, g.dtype) for g in grads]
        return grads

    @contextlib.contextmanager
    def watch_preemption(self):
        self._stop_requested.assign(0.0)
        self._stop_agreed.assign(0.0)
        with super().watch_preemption():
            yield

    def should_stop(self):
        """True on every process after the same step once any process got a SIGTERM."""
        if super().should_stop():
            self._stop_requested.assign(1.0)  # sent with the next step's gradients
        return bool(self._stop_agreed.numpy() > 0)

    def all_reduce_mean(self, values):
        return horovod_keras.average_values(values, self.process_set)

    def broadcast_variables(self, variables):
        # Horovod: every process starts from the first process's model and optimizer state
        # (root_rank is a global rank, also with a process set).
        root = self.process_set.ranks[0] if self.process_set.ranks else 0
        horovod_keras.broadcast_variables(variables, root_rank=root, process_set=self.process_set)

    def shutdown(self):
        """Wait for every process (the chief may still be saving), then stop Horovod."""
        hvd.join()  # Horovod: a barrier; an early exit would make horovodrun end the job
        hvd.shutdown()
