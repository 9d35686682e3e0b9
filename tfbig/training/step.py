"""One optimizer step of one replica, and how much of it is one XLA program.

    forward/backward (loss-scaled for fp16)          -> strategy.make_forward_backward
    average gradients and metrics over replicas      -> strategy.all_reduce_gradients / _mean
    unscale, clip by global norm, loss-scale update,
    apply (a non-finite step is skipped)             -> strategy.apply_gradients (optimizer.apply)

With --xla and --compile_update (the defaults) the backend's `compiled_step` decides what is
compiled together: "whole" (single device: the whole step above is one program), "update"
(Horovod, whose ops have no XLA kernels: the forward/backward is one program, the update
after the all-reduce another, instead of a dozen ops per variable) or None (a backend whose
update itself communicates: ZeRO's and tensor parallelism's norms over slices, the
pipelines', tf.distribute's merge_call inside Keras' `apply`: tfbig.distribute.multiworker).
Outside XLA every op of the update runs on its own, which costs tens of microseconds per
variable on a CPU whatever its size (the doctor's optimizer probe,
tfbig.doctor.probes.update_seconds_per_variable).
"""
import tensorflow as tf

from tfbig.optim import loss_scale

WHOLE, UPDATE = "whole", "update"


def micro_batch_size(batch_size, num_replicas, grad_accum_steps):
    """Per-replica micro-batch size; the global batch must split evenly."""
    parts = num_replicas * grad_accum_steps
    if grad_accum_steps < 1 or batch_size % parts or batch_size < parts:
        raise ValueError(f"--batch_size={batch_size} must be a positive multiple of "
                         f"replicas ({num_replicas}) x --grad_accum_steps ({grad_accum_steps})")
    return batch_size // parts


def compiled_parts(strategy, xla, compile_update):
    """What is one XLA program besides the forward/backward (--xla): "whole" (all of the
    step), "update" or None (--xla=false compiles nothing, --compile_update=false only the
    forward/backward)."""
    return strategy.compiled_step if xla and compile_update else None


def make_update(strategy, optimizer, variables):
    """grads (averaged over replicas, still loss-scaled) -> (global norm of the unscaled
    gradients, loss scale of this step); applies them to `variables`."""
    def update(grads):
        scale = tf.cast(loss_scale(optimizer), tf.float32)  # read before apply changes it
        grad_norm = strategy.global_norm(grads) / scale
        strategy.apply_gradients(optimizer, grads, variables)
        return grad_norm, scale
    return update


def make_replica_step(strategy, forward_backward, optimizer, variables, parts):
    """batch -> {metrics..., grad_norm, loss_scale, communication_seconds}: one optimizer
    step of this replica, with `parts` (compiled_parts) one XLA program each."""
    update = make_update(strategy, optimizer, variables)
    if parts == UPDATE:
        update = tf.function(update, jit_compile=True, autograph=False)

    def replica_step(batch):
        _, grads, metrics = forward_backward(batch)
        if parts == WHOLE:  # tf.timestamp has no XLA kernel; one replica communicates nothing
            grads, communication_seconds = (strategy.all_reduce_gradients(grads),
                                            tf.constant(0.0, tf.float64))
        else:
            grads, communication_seconds = strategy.all_reduce_gradients_timed(grads)
        metrics = strategy.all_reduce_mean(metrics)
        grad_norm, scale = update(grads)
        return {**metrics, "grad_norm": grad_norm, "loss_scale": scale,
                "communication_seconds": communication_seconds}

    if parts == WHOLE:
        return tf.function(replica_step, jit_compile=True, autograph=False)
    return replica_step
