"""Evaluation and prediction on every data-parallel replica, gathered in dataset order.

Hugging Face's Trainer and PyTorch's DistributedSampler, in tf.data: the records are read in
one fixed order and cut into global batches of `global_batch` rows; the last one is padded
(rows repeated) to full size and each row carries `valid` (1 real, 0 padding). Input pipeline
i of n takes rows [i, i + 1) x global_batch / n of every global batch, cut into per-replica
batches for its local replicas in turn, so replica r holds rows [r, r + 1) x micro of it.
Every replica runs the task's validation step on its rows; `Strategy.all_gather` joins them in
replica order, which is dataset order; `drop_padding` keeps each record once.

    dataset_fn = padded_batches(lambda: task.dataset("validation", 16, shuffle=False,
                                                      repeat=False, drop_remainder=False),
                                global_batch=16, num_batches=1)
    # 12 records: one global batch, rows 12..15 repeat rows 0..3 with valid = 0
"""
import numpy as np
import tensorflow as tf

VALID = "valid"  # the per-row mask added to every evaluation batch


def num_batches(records, global_batch, limit=0):
    """Global batches covering `records` (the last one padded), at most `limit` (0: all)."""
    available = -(-records // global_batch)
    return min(available, limit or available)


def _pad(batch, global_batch):
    """A batch of n <= global_batch rows -> global_batch rows (rows repeated) + VALID."""
    rows = tf.shape(tf.nest.flatten(batch)[0])[0]
    index = tf.range(global_batch) % rows
    padded = {k: tf.gather(v, index) for k, v in batch.items()}
    padded[VALID] = tf.cast(tf.range(global_batch) < rows, tf.int32)
    return padded


def padded_batches(make_batches, global_batch, num_batches):
    """`dataset_fn(input_context)` for Strategy.distribute_dataset: this pipeline's per-replica
    batches of the first `num_batches` global batches of `make_batches()` (a dataset of
    global batches in dataset order, the last one possibly short)."""
    def dataset_fn(context):
        pipelines = context.num_input_pipelines if context else 1
        pipeline = context.input_pipeline_id if context else 0
        replicas = context.num_replicas_in_sync if context else 1
        share, micro = global_batch // pipelines, global_batch // replicas
        start = pipeline * share
        batches = make_batches().take(num_batches).map(lambda b: _pad(b, global_batch))
        rows = batches.map(lambda b: {k: v[start:start + share] for k, v in b.items()})
        return rows.unbatch().batch(micro, drop_remainder=True).prefetch(2)

    return dataset_fn


def drop_padding(gathered):
    """[{name: array (global_batch, ...), VALID: ...} per global batch] -> {name: array} of
    the real rows in dataset order."""
    if not gathered:
        return {}
    keep = np.concatenate([g[VALID] for g in gathered]).astype(bool)
    return {k: np.concatenate([g[k] for g in gathered])[keep]
            for k in gathered[0] if k != VALID}
