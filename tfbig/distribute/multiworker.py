"""tf.distribute backends: MultiWorkerMirroredStrategy and MirroredStrategy.

`--strategy=multiworker`: one process per worker (host), each with its local devices; the
cluster comes from TF_CONFIG (tfbig-launch, Kubernetes TFJob), from Slurm (srun, see
launch/slurm_multiworker.sbatch) or, with neither, is this process alone.
`--strategy=mirrored`: one process driving all local GPUs (or all logical CPU devices).

Both keep the trainer's single-replica step: `run` calls it on every local replica, the data
comes through `distribute_datasets_from_function` (tfbig.data shards by the InputContext), and
gradients are averaged over all replicas in exactly one place, `all_reduce_gradients`, before
the optimizer clips them by global norm. Keras' TF optimizer would sum gradients over replicas
again inside `apply`; `_prepare_optimizer` turns that second reduction off.

Example (two local workers):
    tfbig-launch --workers=2 -- tfbig-train --strategy=multiworker --preset=tiny
"""
import json
import os
import shutil
import tempfile

import tensorflow as tf

from tfbig.distribute.base import Strategy

IMPLEMENTATIONS = {"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
                   "ring": tf.distribute.experimental.CommunicationImplementation.RING,
                   "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}
RESOLVERS = ("auto", "tf_config", "slurm")
MEAN = tf.distribute.ReduceOp.MEAN
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000


def _check_choice(flag, value, choices):
    if value not in choices:
        raise ValueError(f"--{flag}={value!r}: expected one of {sorted(choices)}")


def _require_gpus(flag_value):
    if not tf.config.list_physical_devices("GPU"):
        raise ValueError(f"--collective={flag_value} needs GPUs and this process sees none; "
                         "use --collective=auto or ring on CPU")


class _SlurmCPUResolver(tf.distribute.cluster_resolver.SlurmClusterResolver):
    """SlurmClusterResolver for nodes without GPUs. TF's lays tasks out one per slice of a
    node's GPUs, which fails with zero GPUs; here each task gets a nominal slot of one, and
    the resolver reports no accelerators, so every worker uses its CPU."""

    def __init__(self, port_base):
        super().__init__(port_base=port_base, gpus_per_node=1 << 12, gpus_per_task=1,
                         auto_set_gpu=False)

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        return {}


def slurm_resolver():
    """The cluster of this srun job step: one worker per task, GPUs split among a node's tasks.

    Ports are SLURM_PORT_BASE + the task's index on its node, where the base comes from the job
    id, so two jobs sharing a node do not collide.
    """
    port_base = SLURM_PORT_BASE + int(os.environ.get("SLURM_JOB_ID", "0")) % SLURM_PORT_SPAN
    if "CUDA_VISIBLE_DEVICES" in os.environ or shutil.which("nvidia-smi"):
        return tf.distribute.cluster_resolver.SlurmClusterResolver(port_base=port_base)
    return _SlurmCPUResolver(port_base)


def cluster_resolver(kind):
    """The cluster of --cluster_resolver=`kind` (auto: TF_CONFIG, then Slurm, then local)."""
    _check_choice("cluster_resolver", kind, RESOLVERS)
    under_srun = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1
    if kind == "slurm" or (kind == "auto" and "TF_CONFIG" not in os.environ and under_srun):
        return slurm_resolver()
    if kind == "tf_config" and "TF_CONFIG" not in os.environ:
        raise ValueError("--cluster_resolver=tf_config but TF_CONFIG is not set; start the "
                         "workers with tfbig-launch or set TF_CONFIG (see launch/k8s/tfjob.yaml)")
    if "TF_CONFIG" in os.environ:
        try:
            json.loads(os.environ["TF_CONFIG"])
        except json.JSONDecodeError as error:
            raise ValueError(f"TF_CONFIG is not valid JSON ({error}): "
                             f"{os.environ['TF_CONFIG'][:200]!r}") from None
    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def _worker_index(resolver):
    """(this worker's index over chief + workers, number of workers); the chief is 0."""
    jobs = resolver.cluster_spec().as_dict() if resolver else {}
    if not jobs:
        return 0, 1
    num_chiefs = len(jobs.get("chief", []))
    offset = num_chiefs if resolver.task_type == "worker" else 0
    return offset + int(resolver.task_id), num_chiefs + len(jobs.get("worker", []))


def restored_from(train):
    """The flags of TrainConfig `train` naming what every worker reads its weights from:
    --model_dir (tfbig-train) and/or --init_checkpoint (a fresh tfbig-train run, the
    fine-tuning commands, which have no --model_dir)."""
    flags = [f"--{name}={value}" for name, value in (
        ("model_dir", train.model_dir), ("init_checkpoint", train.init_checkpoint)) if value]
    return " and ".join(flags) or "initial weights"


class MultiWorker(Strategy):
    """MultiWorkerMirroredStrategy: synchronous data parallelism over worker processes."""

    name = "multiworker"
    # tf.distribute: the update runs op by op. On CPU, XLA refuses collectives ("Collectives
    # are not yet implemented for CPU devices when compiling with XLA"), and Keras' optimizer
    # synchronises replicas inside `apply` (merge_call), which a compiled function nested in
    # the replica step cannot hold ("`merge_call` called while defining a new graph").
    compiled_step = None

    def __init__(self, cfg):
        super().__init__(cfg)
        options = cfg.multiworker
        _check_choice("collective", options.collective, IMPLEMENTATIONS)
        if options.collective_timeout < 0:
            raise ValueError(f"--collective_timeout={options.collective_timeout}: expected "
                             "seconds >= 0 (0 waits forever)")
        self.resolver = self._resolver(options)
        # Resolving first: SlurmClusterResolver picks the task's GPUs (CUDA_VISIBLE_DEVICES)
        # and the GPU check below would freeze the visible set.
        self._rank, self.num_workers = _worker_index(self.resolver)
        if options.collective == "nccl":
            _require_gpus(options.collective)
        self.communication = tf.distribute.experimental.CommunicationOptions(
            implementation=IMPLEMENTATIONS[options.collective],
            timeout_seconds=options.collective_timeout or None)
        self.tf_strategy = self._make_strategy(options)
        self._temp_dir = None
        self._min_max = None
        self._gather = None

    def _resolver(self, options):
        return cluster_resolver(options.cluster_resolver)

    def _make_strategy(self, options):
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=self.resolver, communication_options=self.communication)

    @property
    def num_replicas(self):
        return self.tf_strategy.num_replicas_in_sync

    @property
    def rank(self):
        return self._rank

    @property
    def is_chief(self):
        return self.tf_strategy.extended.should_checkpoint

    def scope(self):
        return self.tf_strategy.scope()

    def input_context(self):
        return tf.distribute.InputContext(num_input_pipelines=self.num_workers,
                                          input_pipeline_id=self.rank,
                                          num_replicas_in_sync=self.num_replicas)

    def distribute_dataset(self, dataset_fn):
        # tf.distribute: one pipeline per worker, each element goes to one local replica.
        return self.tf_strategy.distribute_datasets_from_function(dataset_fn)

    def run(self, fn, args):
        return self.tf_strategy.run(fn, args=args)

    def local_result(self, value):
        return tf.nest.map_structure(
            lambda v: self.tf_strategy.experimental_local_results(v)[0], value)

    def all_reduce_gradients(self, grads):
        # tf.distribute: the one average of gradients over all replicas (the optimizer then
        # clips the averaged gradients; see _prepare_optimizer).
        return tf.distribute.get_replica_context().all_reduce(MEAN, grads, self.communication)

    def all_reduce_mean(self, values):
        return tf.distribute.get_replica_context().all_reduce(MEAN, values, self.communication)

    def all_gather(self, values):
        # tf.distribute: replicas in global order (worker by worker, then local replica), the
        # order in which distribute_datasets_from_function hands out a global batch's rows.
        # tf.identity: a replica input passed straight through has no device, and the
        # gather would find no destination for it ("destinations can not be empty").
        values = tf.nest.map_structure(tf.identity, values)
        return tf.distribute.get_replica_context().all_gather(values, axis=0)

    def _prepare_optimizer(self, optimizer):
        """Stop Keras from summing the already averaged gradients over replicas again.

        Keras 3's TF optimizer all-reduce-sums gradients inside `apply` when it runs in a
        replica context, after clipping them; gradients here are averaged once, before
        clipping, by `all_reduce_gradients`, so that second reduction must not happen.
        """
        inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
        if not hasattr(inner, "_all_reduce_sum_gradients"):
            raise TypeError(f"{type(inner).__name__} is not Keras' TensorFlow optimizer; "
                            "cannot turn off its gradient all-reduce")
        inner._all_reduce_sum_gradients = list  # noqa: SLF001 - grads_and_vars unchanged
        return optimizer

    def broadcast_variables(self, variables):
        """Variables start equal (MWMS broadcasts initial values); check the restored state is
        equal too, e.g. that every worker could read the checkpoint in --model_dir."""
        total = tf.add_n([tf.reduce_sum(tf.cast(tf.convert_to_tensor(v), tf.float64))
                         for v in variables])
        low, high = self._all_workers_min_max(total)
        if not low == high:
            raise RuntimeError(
                f"workers hold different weights after restoring (sums {low} vs {high}): "
                f"every worker must see the same {restored_from(self.cfg.train)} "
                "(shared storage)")

    def _all_workers_min_max(self, value):
        """(min, max) of a float over all workers (a collective: every worker must call it)."""
        if self._min_max is None:
            def min_max(x):
                per_replica = self.tf_strategy.run(lambda: x[None])
                values = self.tf_strategy.gather(per_replica, axis=0)  # (num_replicas,)
                return tf.reduce_min(values), tf.reduce_max(values)
            self._min_max = tf.function(min_max, autograph=False)
        low, high = self._min_max(tf.cast(value, tf.float64))
        return float(low), float(high)

    def checkpoint_dir(self, model_dir):
        """The chief writes to --model_dir; the others (saving is collective) to a temporary
        directory deleted after each save."""
        if self.is_chief:
            return model_dir
        if self._temp_dir is None:
            self._temp_dir = tempfile.mkdtemp(prefix=f"tfbig-worker{self.rank}-")
        return self._temp_dir

    def after_checkpoint(self, directory):
        if not self.is_chief:
            shutil.rmtree(directory, ignore_errors=True)

    def should_stop(self):
        """True on every worker as soon as any one of them got SIGTERM."""
        local = tf.constant(1.0 if super().should_stop() else 0.0)
        return self._all_workers_min_max(local)[1] > 0

    def gather_over_processes(self, values):
        if self._gather is None:  # one row per replica, worker by worker: a worker's first
            self._gather = tf.function(lambda x: self.tf_strategy.gather(
                self.tf_strategy.run(lambda: x[None]), axis=0), autograph=False)
        rows = self._gather(tf.constant(values, tf.float64)).numpy()
        return rows[::len(rows) // self.num_workers].tolist()

    def process_hosts(self):
        jobs = self.resolver.cluster_spec().as_dict() if self.resolver else {}
        addresses = jobs.get("chief", []) + jobs.get("worker", [])  # _worker_index's order
        return [a.rsplit(":", 1)[0] for a in addresses] or super().process_hosts()

    def shutdown(self):
        """Leave together: a worker that exits while another still works (the chief writing
        a sample) is reported by the coordination service as crashed."""
        self._all_workers_min_max(0.0)
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)


class Mirrored(MultiWorker):
    """MirroredStrategy: one process, one replica per local GPU (else per logical CPU)."""

    name = "mirrored"

    def _resolver(self, options):
        if options.collective == "ring":
            raise ValueError("--collective=ring applies to --strategy=multiworker; "
                             "--strategy=mirrored takes auto or nccl")
        return None

    def _make_strategy(self, options):
        devices = [d.name for d in tf.config.list_logical_devices("GPU")]
        devices = devices or [d.name for d in tf.config.list_logical_devices("CPU")]
        cross_device_ops = tf.distribute.NcclAllReduce() if options.collective == "nccl" else None
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)

    @property
    def is_chief(self):
        return True

    def should_stop(self):
        return Strategy.should_stop(self)
