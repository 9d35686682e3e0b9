"""The fine-tuning commands (tfbig-classify, tfbig-squad) on the one Strategy surface.

Fine-tuning is data parallel only: each replica trains on its rows of every global batch, the
gradients and the loss are averaged over replicas in one place (`train_step`), and the run
equals one process on the same global batches whatever the backend:

    strategy = fine_tune_strategy("multiworker", "tfbig-classify")
    with strategy.scope():
        model, optimizer = ...
    step = train_step(strategy, forward_backward, optimizer, variables)
    batches = replica_batches(strategy, make_examples, global_batch)
    losses = [float(step(next(batches))) for _ in range(steps)]
    write_checkpoint(strategy, model, output_dir)
"""
import os

import tensorflow as tf

from tfbig.errors import UsageError

STRATEGIES = ("single", "horovod", "multiworker")


def fine_tune_strategy(name, command):
    """The backend of --strategy=`name` for fine-tuning command `command` (for the message).

    --strategy=multiworker waits for the chief's evaluation without a collective timeout: the
    other workers sit in the closing collective while the chief scores the eval set, which can
    take longer than a training collective's 600 s (a dead worker is still reported by TF's
    coordination service)."""
    from tfbig.config import ExperimentConfig
    from tfbig.distribute import get_strategy

    if name not in STRATEGIES:
        raise UsageError(
            f"--strategy={name!r}: {command} runs on {' | '.join(STRATEGIES)}; pipeline and "
            "tensor-parallel fine-tuning are not supported (a BERT-large fits one device: "
            "use data parallelism)")
    cfg = ExperimentConfig()
    cfg.multiworker.collective_timeout = 0.0
    return get_strategy(name, cfg)


def check_batch(strategy, global_batch, flag="--train_batch_size"):
    """Refuse a global batch the replicas cannot share equally."""
    if global_batch % strategy.num_replicas:
        raise UsageError(f"{flag}={global_batch} is not divisible by the "
                         f"{strategy.num_replicas} replicas of --strategy={strategy.name}")


def train_step(strategy, forward_backward, optimizer, variables):
    """A tf.function: one optimizer step on this process's batch, returning the loss averaged
    over replicas. `forward_backward(batch) -> (mean loss, gradients)` is single-replica code
    (it may be XLA-compiled; the all-reduce runs outside it: Horovod ops have no XLA kernels)."""
    def replica_step(batch):
        loss, grads = forward_backward(batch)
        grads = [tf.convert_to_tensor(g) for g in grads]  # dense word-table gradient
        # Horovod / tf.distribute: average gradients and loss over replicas, then update
        strategy.apply_gradients(optimizer, strategy.all_reduce_gradients(grads), variables)
        return strategy.all_reduce_mean(loss)

    return tf.function(lambda batch: strategy.local_result(strategy.run(replica_step, (batch,))))


def replica_batches(strategy, make_examples, global_batch):
    """Iterator of this process's per-replica batches of every global batch of `global_batch`.

    `make_examples()` builds the tf.data.Dataset of single examples, in the same (seeded) order
    on every process; input pipeline i of n takes rows [i, i + 1) * global_batch / n of each
    global batch, cut into per-replica batches for its local replicas in turn.
    """
    def dataset_fn(context):
        per_pipeline = global_batch // context.num_input_pipelines
        start = context.input_pipeline_id * per_pipeline
        rows = make_examples().batch(global_batch, drop_remainder=True).map(
            lambda batch: {k: v[start:start + per_pipeline] for k, v in batch.items()})
        per_replica = global_batch // context.num_replicas_in_sync
        return rows.unbatch().batch(per_replica, drop_remainder=True).prefetch(2)

    return iter(strategy.distribute_dataset(dataset_fn))


def write_checkpoint(strategy, model, output_dir, name="finetuned"):
    """Write the model's weights to OUTPUT_DIR/`name` (the chief's copy). Every process calls
    this: under tf.distribute saving is collective and the other workers write a temporary
    copy that is deleted at once; under Horovod only the chief writes."""
    from tfbig.checkpoint import model_variables

    directory = strategy.checkpoint_dir(output_dir)
    if directory is None:
        return
    os.makedirs(directory, exist_ok=True)
    tf.train.Checkpoint(model=model_variables(model)).write(os.path.join(directory, name))
    strategy.after_checkpoint(directory)
