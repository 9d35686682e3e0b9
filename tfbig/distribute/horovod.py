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

Everything else is the single-device loop: each process reads its slice of every global batch
of one global order of examples (`input_context`, tfbig.data.order), runs the same XLA-compiled
forward/backward with gradient accumulation inside it, and the allreduce runs outside XLA
(Horovod ops have no XLA kernels).

Example:
    horovodrun -np 2 -H localhost:2 --gloo tfbig-train --strategy=horovod --preset=tiny
"""
import contextlib
import dataclasses
import socket

import tensorflow as tf

from tfbig.config import HorovodConfig, ParallelConfig
from tfbig.distribute import horovod_keras  # first: a clear error if Horovod is missing
from tfbig.distribute.base import Strategy
from tfbig.distribute.horovod_keras import hvd
from tfbig.distribute.mesh import HorovodMesh, Mesh, launcher_world_size
from tfbig.layouts import composition

ZERO_STAGES = (0, 1, 2, 3)


def build_mesh(parallel, world_size):
    """The rank grid for ParallelConfig `parallel` over `world_size` ranks (errors name flags)."""
    if parallel.zero_stage not in ZERO_STAGES:
        raise ValueError(f"--zero_stage={parallel.zero_stage}: expected 0 (no sharding), 1 "
                         f"(optimizer slots), 2 (+ gradients) or 3 (+ parameters)")
    if parallel.sequence_parallel and parallel.tensor_parallel < 2:
        raise ValueError(f"--sequence_parallel needs --tensor_parallel >= 2 (it splits the "
                         f"tensor group's replicated regions along the sequence); got "
                         f"--tensor_parallel={parallel.tensor_parallel}")
    composition.check(dataclasses.asdict(parallel))  # the pairs that do not compose
    if parallel.shard_degree and not parallel.zero_stage:
        raise ValueError(f"--shard_degree={parallel.shard_degree} needs --zero_stage=1, 2 or 3 "
                         f"(it sizes the groups the model state is sharded over)")
    return Mesh.build(world_size, tensor=parallel.tensor_parallel,
                      shard_degree=parallel.shard_degree, placement=parallel.placement,
                      context=parallel.context_parallel, expert=parallel.expert_parallel)


class HorovodStrategy(Strategy):
    """Data parallel over the data axis of the rank grid (tfbig.distribute.mesh).

    Args:
      cfg: the ExperimentConfig; its `horovod` section gives --scale_lr, --hvd_fp16_allreduce,
        its `parallel` section the layout of the grid.
      mesh: a HorovodMesh built by the caller (default: built here from `cfg`, which also
        initialises Horovod and pins one GPU per process).
    """

    name = "horovod"
    compiled_step = "update"  # Horovod: its ops have no XLA kernels; the update is local math

    def __init__(self, cfg=None, mesh=None):
        super().__init__(cfg)
        self.options = getattr(cfg, "horovod", None) or HorovodConfig()
        self.parallel = getattr(cfg, "parallel", None) or ParallelConfig()
        size = hvd.size() if hvd.is_initialized() else launcher_world_size()
        # Horovod: initialise with every process set of the grid, pin one GPU per process; its
        # background threads do not preempt the step's compute (--hvd_thread_policy).
        self.mesh = mesh or HorovodMesh(build_mesh(self.parallel, size),
                                        thread_policy=self.options.hvd_thread_policy)
        self.process_set = self.mesh.process_set("data")  # None: one data-parallel replica
        self._scale_loss = None
        # SIGTERM agreement without an extra collective: each step's gradient allreduce also
        # averages this process's stop request; a non-zero average stops every process.
        self._stop_requested = tf.Variable(0.0, trainable=False, name="stop_requested")
        self._stop_agreed = tf.Variable(0.0, trainable=False, name="stop_agreed")

    @property
    def num_replicas(self):
        return self.mesh.mesh.data

    @property
    def rank(self):
        return self.mesh.coords["data"]

    @property
    def is_chief(self):
        return hvd.rank() == 0  # Horovod: only global rank 0 writes checkpoints and logs

    @property
    def restores_checkpoint(self):
        return self.is_chief  # Horovod: rank 0 restores, broadcast_variables gives it to all

    @property
    def checkpoint_pieces(self):
        return self.mesh.mesh.pipeline * self.mesh.mesh.tensor  # a stage's tensor ranks each

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
        agreed = self._stop_agreed.read_value()
        if self._beyond_data_group:  # tensor, context, expert or stage ranks: the whole world
            agreed = hvd.allreduce(agreed, op=hvd.Sum, process_set=hvd.global_process_set,
                                   name="stop_agreed", ignore_name_scope=True)
        return bool(agreed.numpy() > 0)

    @property
    def _beyond_data_group(self):
        """Whether ranks outside this rank's data group train the same step (each group's
        gradients carry its stop request; the groups must agree too)."""
        return self.mesh.mesh.data < hvd.size()

    def all_reduce_mean(self, values):
        return horovod_keras.average_values(values, self.process_set)

    def all_gather(self, values):
        # Horovod: the data-parallel group's rows, in data rank order.
        return horovod_keras.gather_values(values, self.process_set)

    def gather_over_processes(self, values):
        # Horovod: one row per rank of the job, in rank order.
        return hvd.allgather(tf.constant([values], tf.float64)).numpy().tolist()

    def process_hosts(self):
        return hvd.allgather_object(socket.gethostname())

    def broadcast_variables(self, variables):
        # Horovod: every process starts from the first process's model and optimizer state
        # (root_rank is a global rank, also with a process set).
        root = self.mesh.mesh.group("data", self.mesh.rank)[0]
        horovod_keras.broadcast_variables(variables, root_rank=root, process_set=self.process_set)

    def held(self, variables):
        """The variables this rank holds values of for `variables` (ZeRO-3: their slices)."""
        return list(variables)

    def shutdown(self):
        """Wait for every process (the chief may still be saving), then stop Horovod."""
        hvd.join()  # Horovod: a barrier; an early exit would make horovodrun end the job
        hvd.shutdown()
