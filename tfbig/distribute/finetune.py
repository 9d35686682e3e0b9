"""tfbig-squad's own training loop on the one Strategy surface (tfbig-classify runs the
Trainer instead: tfbig.finetune, tfbig.tasks.classify; this loop goes once SQuAD does too).

Fine-tuning is data parallel (on Horovod also split or sharded: --tensor_parallel, --zero_stage,
tfbig.distribute.finetune_parallel; or pipelined over this process's devices: --strategy=pipeline,
tfbig.distribute.finetune_pipeline): each replica trains on its rows of every global batch, the
gradients and the loss are averaged over replicas in one place (`train_step`), and the run
equals one process on the same global batches whatever the backend:

    strategy = fine_tune_strategy("multiworker", "tfbig-classify")
    with strategy.scope():
        model, optimizer = ...
    forward_backward = make_forward_backward(strategy, loss_fn, optimizer, variables, xla)
    step = train_step(strategy, forward_backward, optimizer, variables)
    batches = replica_batches(strategy, make_examples, global_batch)
    losses = [float(step(next(batches))) for _ in range(steps)]
    write_checkpoint(strategy, model, output_dir)
"""
import contextlib
import os

import tensorflow as tf

from tfbig.errors import UsageError

STRATEGIES = ("single", "horovod", "multiworker", "pipeline")


def fine_tune_strategy(name, command, parallel=None, init_checkpoint=""):
    """The backend of --strategy=`name` for fine-tuning command `command` (for the message),
    whose weights come from --init_checkpoint=`init_checkpoint` (named by the backend's errors);
    `parallel` (finetune_parallel.ParallelOptions fields) may split or shard it on Horovod, and
    sets --strategy=pipeline's stages and micro-batches (finetune_pipeline.PipelineOptions).

    --strategy=multiworker waits for the chief's evaluation without a collective timeout: the
    other workers sit in the closing collective while the chief scores the eval set, which can
    take longer than a training collective's 600 s (a dead worker is still reported by TF's
    coordination service)."""
    from tfbig.distribute import finetune_pipeline, get_strategy

    if name not in STRATEGIES:
        raise UsageError(f"--strategy={name!r}: {command} runs on {' | '.join(STRATEGIES)}")
    cfg = fine_tune_config(init_checkpoint)
    finetune_pipeline.configure(name, parallel, cfg, command)  # --pipeline_stages, ...
    if parallel is not None:  # --tensor_parallel, --zero_stage: tfbig.distribute.finetune_parallel
        from tfbig.distribute.finetune_parallel import split_strategy

        return split_strategy(name, command, parallel, cfg) or get_strategy(name, cfg)
    return get_strategy(name, cfg)


def fine_tune_config(init_checkpoint=""):
    """The ExperimentConfig a fine-tuning backend is built from: no collective timeout, no
    --model_dir, the weights from --init_checkpoint (what a backend's errors name)."""
    from tfbig.config import ExperimentConfig

    cfg = ExperimentConfig()
    cfg.multiworker.collective_timeout = 0.0
    cfg.train.model_dir, cfg.train.init_checkpoint = "", init_checkpoint
    return cfg


@contextlib.contextmanager
def precision_policy(precision):
    """Keras' global dtype policy of --precision=`precision` (tfbig-train's set_precision:
    fp32 | mixed_float16 | mixed_bfloat16) while the model is built and trained; the previous
    policy afterwards, so a caller's later models are not built in float16."""
    import keras

    from tfbig.trainer import set_precision

    previous = keras.mixed_precision.global_policy()
    set_precision(precision)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def check_batch(strategy, global_batch, flag="--train_batch_size"):
    """Refuse a global batch the replicas cannot share equally."""
    if global_batch % strategy.num_replicas:
        raise UsageError(f"{flag}={global_batch} is not divisible by the "
                         f"{strategy.num_replicas} replicas of --strategy={strategy.name}")


def make_forward_backward(strategy, loss_fn, optimizer, variables, jit_compile):
    """`batch -> (mean loss, gradients)` for `train_step`, through the trainer's own
    single-replica forward/backward (`strategy.make_forward_backward`, one micro-batch), so
    --precision=mixed_float16 scales the loss where tfbig-train does: gradients are of the loss
    times the optimizer's dynamic scale (tfbig.optim wraps it in Keras' LossScaleOptimizer,
    which unscales them, and skips the step and halves the scale when the averaged gradients
    are not finite: on every replica alike, since all see the same average).
    `loss_fn(batch) -> float32 mean loss` is single-replica code (XLA-compiled when
    `jit_compile`)."""
    step = strategy.make_forward_backward(lambda batch, training=True: (loss_fn(batch), {}),
                                          variables, optimizer.scale_loss, jit_compile)

    def run(batch):
        loss, grads, _ = step(tf.nest.map_structure(lambda t: t[None], batch))  # 1 micro-batch
        return loss, grads

    return run


def current_loss_scale(optimizer):
    """The optimizer's fp16 loss scale now, as a float (1.0 without loss scaling); read through
    a tensor, which works for tf.distribute's mirrored variables too."""
    from tfbig.optim import loss_scale

    return float(tf.convert_to_tensor(loss_scale(optimizer)))


def skipped_steps(scales):
    """Steps the LossScaleOptimizer skipped (non-finite gradients), from `scales`: the loss
    scale before each step and after the last (current_loss_scale); it halves on a skip."""
    return sum(after < before for before, after in zip(scales, scales[1:]))


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
