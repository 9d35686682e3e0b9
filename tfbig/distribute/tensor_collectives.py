"""Tensor parallelism's collectives, Megatron's mappings, over a Horovod process set.

`copy_to_region` (identity forward, all-reduce of the gradient backward) goes before every
column-parallel layer; `reduce_from_region` (all-reduce forward, identity backward) after every
row-parallel one. The sequence-parallel pair scatters and gathers along the sequence axis; the
vocabulary-parallel cross-entropy and argmax never form whole logits. Why each is where it is:
docs/design/tensor-parallel.md.
"""
import tensorflow as tf

from tfbig.distribute.horovod_keras import hvd


# ---- the conjugate collectives (Megatron's mappings) -----------------------------------------
def all_reduce_sum(x, process_set):
    # Horovod's Gloo path has no bfloat16 sum: carry it in float32 (float16 and float32 as is).
    if x.dtype == tf.bfloat16:
        return tf.cast(hvd.allreduce(tf.cast(x, tf.float32), op=hvd.Sum,
                                     process_set=process_set), tf.bfloat16)
    return hvd.allreduce(x, op=hvd.Sum, process_set=process_set)


def copy_to_region(x, process_set):
    """Identity forward; the gradient is summed over the tensor group backward."""
    @tf.custom_gradient
    def copy(x):
        return tf.identity(x), lambda dy: all_reduce_sum(dy, process_set)

    return copy(x)


def reduce_from_region(x, process_set):
    """Sum over the tensor group forward; the gradient passes unchanged backward."""
    @tf.custom_gradient
    def reduce(x):
        return all_reduce_sum(x, process_set), lambda dy: tf.identity(dy)

    return reduce(x)


# ---- sequence parallelism: the same regions, split along the sequence (axis 1) ---------------
def on_sequence_axis(collective, x):
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
            return on_sequence_axis(lambda t: hvd.reducescatter(
                t, op=hvd.Sum, process_set=process_set), dy)

        return on_sequence_axis(lambda t: hvd.allgather(t, process_set=process_set), x), grad

    return gather(x)


def scatter_sequence(x, process_set):
    """(B, T, C) partial sums -> this rank's (B, T/t, C) chunk of their sum (a reduce-scatter)
    forward; backward the chunks' gradients are gathered. Replaces reduce_from_region."""
    @tf.custom_gradient
    def scatter(x):
        def grad(dy):
            return on_sequence_axis(lambda t: hvd.allgather(t, process_set=process_set), dy)

        return on_sequence_axis(lambda t: hvd.reducescatter(
            t, op=hvd.Sum, process_set=process_set), x), grad

    return scatter(x)


def gather_whole_sequence(x, group):
    """(B, T/t, C) chunks -> (B, T, C) forward, for a replicated region after the split one
    (its gradient is complete on every rank): backward each rank keeps its chunk's rows."""
    chunk = x.shape[1]
    rows = tf.range(group.rank * chunk, (group.rank + 1) * chunk)

    @tf.custom_gradient
    def gather(x):
        y = on_sequence_axis(lambda t: hvd.allgather(t, process_set=group.process_set), x)
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
