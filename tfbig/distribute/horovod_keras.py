"""Horovod for Keras 3 models: the calls of the Horovod TF2 recipe, in a form that works today.

With Keras 3, two calls of Horovod's own recipe fail: `hvd.DistributedGradientTape(tape)` (it
calls `.ref()` on Keras variables, which have none) and `hvd.broadcast_variables(model.variables)`
(Horovod's broadcast cannot read a Keras variable). Keras 3 variables wrap a `tf.Variable`
(`v.value` outside a layer call), so both are done here on plain TensorFlow objects:
gradients from a plain tape are averaged with one `hvd.grouped_allreduce`, and broadcasts go to
the underlying `tf.Variable`s. Horovod ops have no XLA kernels: call these outside
`tf.function(jit_compile=True)` (compile the forward/backward alone with XLA).

tfbig's `--strategy=horovod` backend is built on these functions; a script of your own in the
style of the Horovod examples uses them directly:

    import horovod.tensorflow as hvd
    from tfbig.distribute import horovod_keras as hk

    hk.init()                                   # hvd.init() + one GPU per process
    model, optimizer = ..., ...                 # any tfbig / Keras 3 model and optimizer

    @tf.function
    def train_step(batch, first_batch):
        with tf.GradientTape() as tape:
            loss = task.loss(model, batch, training=True)[0]
        grads = hk.average_gradients(tape.gradient(loss, model.trainable_variables))
        optimizer.apply(grads, model.trainable_variables)
        if first_batch:                         # optimizer slots exist after the first step
            hk.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
        return loss

    if hvd.rank() == 0:
        checkpoint.save(...)                    # only rank 0 writes

Every collective takes a `process_set` (default: all processes), so a caller can average over
one group of ranks only, e.g. the data-parallel replicas of one pipeline stage; None stands
for a group of one process (the input comes back unchanged).
"""
import os

import tensorflow as tf

try:
    import horovod.tensorflow as hvd
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(
        "--strategy=horovod and tfbig.distribute.horovod_keras need Horovod built for "
        "TensorFlow: run ./install.sh (it builds Horovod 0.28.1 against TF 2.20), or "
        "HOROVOD_WITH_TENSORFLOW=1 pip install horovod[tensorflow]") from error


__all__ = ["THREAD_POLICIES", "average_gradients", "average_values", "background_threads",
           "broadcast_variables", "check_thread_policy", "compression", "gather_values", "init",
           "pin_gpu_to_local_rank", "set_thread_policy", "tf_variables"]

THREAD_POLICIES = ("auto", "batch", "normal")
_background_threads = set()  # ids of the threads the last init() saw Horovod start


def init(pin_gpu=True, thread_policy="auto", **init_kwargs):
    """`hvd.init()`, then (with GPUs) make this process see only GPU `hvd.local_rank()`, and
    schedule the threads Horovod started with `thread_policy` (see `set_thread_policy`)."""
    check_thread_policy(thread_policy)
    before = _thread_ids()
    hvd.init(**init_kwargs)
    _background_threads.clear()
    _background_threads.update(_thread_ids() - before)
    if pin_gpu:
        pin_gpu_to_local_rank(hvd.local_rank())
    set_thread_policy(_background_threads, thread_policy)


def check_thread_policy(policy):
    if policy not in THREAD_POLICIES:
        raise ValueError(f"--hvd_thread_policy={policy!r}: expected one of {THREAD_POLICIES}")


def _thread_ids():
    """Ids of this process's threads (Linux); empty where /proc is missing."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except FileNotFoundError:
        return set()


def background_threads():
    """Ids of the threads Horovod started in the last `init()` (its background loop, Gloo's)."""
    return set(_background_threads)


def set_thread_policy(threads, policy="auto"):
    """Schedule Horovod's background `threads` with Linux policy `policy`.

    Horovod's background thread negotiates with the other ranks every HOROVOD_CYCLE_TIME (1 ms),
    even when no tensor is queued: on a CPU-only host each cycle wakes that thread and Gloo's
    on every rank, and each wake preempts the thread computing the step (measured on a 2-core
    VM: ~0.1 core per rank, ~3000 context switches/s). "batch" (SCHED_BATCH, same priority)
    keeps their share of the CPU but stops their wakes from preempting a running thread, so
    they run when a core is free: the computing thread is no longer interrupted, and once a
    rank waits for its allreduce its core is free and the collective is not delayed. "normal"
    leaves Linux's default; "auto" is "batch" when this process sees no GPU (there the step's
    compute and Horovod's cycles share the cores) and "normal" otherwise. Threads Horovod
    starts later from its background thread (process sets added at run time) inherit it.
    """
    check_thread_policy(policy)
    if policy == "auto":
        cpu_only = not tf.config.list_physical_devices("GPU")
        policy = "batch" if cpu_only and hasattr(os, "SCHED_BATCH") else "normal"
    if policy == "normal" or not threads:
        return policy
    if not hasattr(os, "SCHED_BATCH"):
        raise ValueError("--hvd_thread_policy=batch needs Linux's SCHED_BATCH; use normal")
    for tid in threads:
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:  # the thread has ended
            pass
    return policy


def pin_gpu_to_local_rank(local_rank):
    """Make GPU `local_rank` this process's only GPU, with memory growth; no-op without GPUs.

    Must run before TensorFlow initialises its devices (before any op or variable).
    Returns the pinned physical device or None.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    if local_rank >= len(gpus):
        raise ValueError(
            f"Horovod local rank {local_rank} has no GPU: this host has {len(gpus)}. Start at "
            f"most {len(gpus)} processes on it (horovodrun -H host:{len(gpus)}).")
    try:
        tf.config.experimental.set_memory_growth(gpus[local_rank], True)
        tf.config.set_visible_devices(gpus[local_rank], "GPU")
    except RuntimeError as error:  # devices were initialised by an earlier TensorFlow call
        raise RuntimeError(
            "cannot pin a GPU per Horovod process: TensorFlow already initialised its devices. "
            "Call horovod_keras.init() (or build the horovod strategy) before creating any "
            "variable or running any op.") from error
    return gpus[local_rank]


def tf_variables(variables):
    """The `tf.Variable`s behind Keras 3 variables (plain tf.Variables pass through).

    Accepts a list of variables, or anything with a `.variables` list (model, optimizer).
    """
    variables = getattr(variables, "variables", variables)
    out = []
    for v in variables:
        value = v if isinstance(v, tf.Variable) else v.value
        if not isinstance(value, tf.Variable):
            raise TypeError(f"{getattr(v, 'path', v)!r} is not backed by a tf.Variable "
                            f"(got {type(value).__name__}); is the Keras backend tensorflow?")
        out.append(value)
    return out


def broadcast_variables(variables, root_rank=0, process_set=hvd.global_process_set):
    """Set every process's `variables` to `root_rank`'s values (Keras 3 or tf.Variables).

    Pass model AND optimizer variables, once the optimizer has its slots (Keras 3 builds them in
    `optimizer.build`, or at the first `apply`), and again after restoring a checkpoint.
    """
    variables = tf_variables(variables)
    if variables and process_set is not None:  # None: a group of one process
        return hvd.broadcast_variables(variables, root_rank=root_rank, process_set=process_set)
    return None


def compression(fp16):
    """Horovod's gradient compression: float16 on the wire (`fp16=True`) or none."""
    return hvd.Compression.fp16 if fp16 else hvd.Compression.none


def average_gradients(grads, fp16=False, process_set=hvd.global_process_set):
    """Average a list of gradients over processes with one grouped allreduce.

    Sparse gradients (embedding lookups give `tf.IndexedSlices`) are made dense first, so every
    gradient is in the one group. `fp16=True` sends them as float16 (half the bytes).
    """
    dense = [tf.convert_to_tensor(g) for g in grads]
    if process_set is None:  # a group of one process: nothing to average
        return dense
    return hvd.grouped_allreduce(dense, op=hvd.Average, compression=compression(fp16),
                                 process_set=process_set)


def average_values(values, process_set=hvd.global_process_set):
    """Average a nest (dict, list) of tensors over processes, uncompressed (metrics)."""
    flat = tf.nest.flatten(values)
    if not flat or process_set is None:
        return values
    reduced = hvd.grouped_allreduce([tf.convert_to_tensor(v) for v in flat], op=hvd.Average,
                                    process_set=process_set)
    return tf.nest.pack_sequence_as(values, reduced)


def gather_values(values, process_set=hvd.global_process_set):
    """Concatenate a nest of (rows, ...) tensors over processes along rows, in rank order
    (evaluation outputs gathered to every rank)."""
    flat = tf.nest.flatten(values)
    if not flat or process_set is None:
        return values
    # Horovod: one allgather per tensor; ranks of the set in increasing global rank.
    gathered = [hvd.allgather(tf.convert_to_tensor(v), process_set=process_set,
                              name=f"tfbig.gather.{i}", ignore_name_scope=True)
                for i, v in enumerate(flat)]
    return tf.nest.pack_sequence_as(values, gathered)
