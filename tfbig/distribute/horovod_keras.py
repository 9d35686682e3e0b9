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
import tensorflow as tf

try:
    import horovod.tensorflow as hvd
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(
        "--strategy=horovod and tfbig.distribute.horovod_keras need Horovod built for "
        "TensorFlow: run ./install.sh (it builds Horovod 0.28.1 against TF 2.20), or "
        "HOROVOD_WITH_TENSORFLOW=1 pip install horovod[tensorflow]") from error


def init(pin_gpu=True, **init_kwargs):
    """`hvd.init()`, then (with GPUs) make this process see only GPU `hvd.local_rank()`."""
    hvd.init(**init_kwargs)
    if pin_gpu:
        pin_gpu_to_local_rank(hvd.local_rank())


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
