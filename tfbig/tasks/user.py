"""Your own Keras model as a task of the one Trainer: the public Task protocol.

A `Task` is the single-replica view of training (TF Model Garden's): it builds the model, reads
one replica's batches, and computes the loss; it knows nothing of devices or ranks. The Trainer
gives every backend (single, horovod with ZeRO 1-3 and MiCS groups, multiworker, mirrored) and
its machinery (checkpoints and exact resume, preemption, precision and loss scaling,
accumulation, clipping, profiling, TensorBoard, time budget) to any Keras 3 model,
subclassed or functional.

    class MyTask(tfbig.Task):
        def build_model(self):                    # inside the backend's scope: create it here
            model = MyModel(); model.build((None, 64)); return model
        def dataset(self, shard):                 # this replica's (inputs, targets) batches
            return examples.shard(shard.count, shard.index).batch(shard.batch_size)
        def loss(self, targets, outputs):         # a float scalar: the mean over the batch
            return keras.losses.sparse_categorical_crossentropy(targets, outputs, True).mean()

    summary = tfbig.train(MyTask(), max_steps=100, batch_size=32, model_dir="runs/mine")

A task that declares its `tensor_layout` or `pipeline_layers` (data: which Dense layers are
split, between which layers the stages are cut) also runs under --tensor_parallel, and under
--strategy=pipeline or --pipeline_stages=K (tfbig.tasks.user_pipeline).

What the Trainer reads of a task is tfbig.tasks.user_adapter; the declarations are checked by
tfbig.tasks.user_layout.
"""
import dataclasses

import numpy as np
import tensorflow as tf

from tfbig.errors import UsageError

__all__ = ["DataShard", "FunctionTask", "Task"]


@dataclasses.dataclass(frozen=True)
class DataShard:
    """What `Task.dataset` is asked for.

    Training (`training` True): this replica's batches of `batch_size` rows, repeated without
    end, shuffled with `seed` if at all; replica `index` of `count` reads its share of each
    global batch, e.g. `examples.shard(count, index).batch(batch_size, drop_remainder=True)`,
    so the `count` replicas' batches together make the global batch one process reads.
    The same order on every start: a resumed run skips the batches it already trained on.
    Evaluation (`training` False, index 0 of 1): every example once, in order, not repeated,
    in batches of `batch_size` (the last one may be short); tfbig spreads them over replicas.
    """

    split: str  # "train", "validation" or a split name given to predict()
    batch_size: int  # rows per batch to yield
    index: int = 0  # this replica's index among `count`
    count: int = 1  # data-parallel replicas reading different rows
    training: bool = True
    seed: int = 0  # --seed: for a shuffle


class Task:
    """The protocol of a user task; subclass it and override `build_model`, `dataset`, `loss`.

    Attributes:
        name: recorded in the run's config.json; a resume refuses another name.
        tokens_per_example: what one example counts for throughput (tokens/s, MFU): its
            sequence length for a language model, 1 to count samples.
        checkpoint_layers: attribute paths below the model ("blocks.*": every element of the
            list `model.blocks`) of the layers `--activation_checkpointing` recomputes in the
            backward and `--zero_stage=3` gathers one at a time; empty: those flags are
            refused by name.
        tensor_layout: how `--tensor_parallel=T` splits the model's layers (data; the model
            stays distribution-free): {layer: kind}, the layer named by its attribute path
            below the model as in checkpoint_layers ("transformer_blocks.*.att"; a number
            indexes a list) or by its path (`layer.path`, or a Dense's `kernel.path`, e.g.
            "my_model/block/fc"; shell wildcards allowed). Kinds, Megatron's:
            "column" (a keras.layers.Dense keeps 1/T of its output units on each rank) and
            "row" (the Dense after it keeps 1/T of its input rows; the ranks' outputs are
            summed, one all-reduce, its bias added once); "heads" (a
            keras.layers.MultiHeadAttention keeps 1/T of its heads: query, key, value and
            output projections sliced on the heads axis, the outputs summed, the output bias
            added once); "vocab" (a keras.layers.Embedding keeps 1/T of its rows and looks up
            the ids it holds, the ranks' rows summed; or the output Dense keeps 1/T of its
            vocabulary columns and its logits are gathered whole for `loss`). T must divide
            the units, heads and vocabulary split. Empty: --tensor_parallel is refused by name.
        pipeline_layers: attribute paths below the model, in order, of the layers whose
            sequential composition is the model's forward (`("embedding", "blocks.*",
            "head")`: model.embedding, every element of model.blocks, model.head, each
            called on the previous one's output, the first on the batch's inputs, the last
            giving the outputs the loss reads). `--strategy=pipeline` and
            `--pipeline_stages=K` under --strategy=horovod cut the model between them
            (`--stage_boundaries` names them "blocks.1" ...). Checked on the first batch
            before anything is written: every path names a layer, the composition gives the
            model's outputs, each trainable weight belongs to exactly one layer (no weight
            shared between layers), no layer keeps non-trainable state besides dropout seeds.
            Empty: those flags are refused by name.
        context_layout: how `--context_parallel=C` cuts every sequence over C ranks (data, as
            tensor_layout; attribute paths): {layer: kind}, kinds "tokens" (a
            keras.layers.Embedding of the token ids looks up this rank's positions only),
            "positions" (an Embedding of positions reads this rank's positions, whatever it is
            called with), "attention" (a keras.layers.MultiHeadAttention, causal through
            use_causal_mask=True or unmasked, attends from this rank's positions over the keys
            and values gathered from the group; no other mask) and "output" (the layer whose
            output the loss reads: gathered whole, so `loss` runs on the whole sequence on
            every context rank). Each rank holds chunks i and 2C-1-i of 2C. Empty:
            --context_parallel is refused by name.
        transformer_shape: for `--plan_only`, the sizes of a transformer the model is, as
            {"hidden_size", "num_layers", "num_heads", "seq_length", "vocab_size"} and
            optionally "intermediate_size" (default 4 x hidden_size): the plan then gives the
            activation memory and step time of tfbig's GPT of that shape (tfbig.plan.user).
            None: the plan gives the weights, gradients and optimizer slots per rank (counted
            on the built model) and says the rest is unknown.
    """

    name = "task"
    tokens_per_example = 1
    checkpoint_layers = ()
    tensor_layout = {}
    context_layout = {}
    pipeline_layers = ()
    transformer_shape = None

    def build_model(self):
        """A built Keras model (its variables created: `model.build(shape)` or one call).
        tfbig calls it inside the backend's scope; never return a model made earlier."""
        raise NotImplementedError(f"{type(self).__name__}.build_model")

    def dataset(self, shard):
        """A tf.data.Dataset of `(inputs, targets)` batches for `shard` (a DataShard), or None
        when there is no such split (no validation split: training without evaluation)."""
        raise NotImplementedError(f"{type(self).__name__}.dataset")

    def loss(self, targets, outputs):
        """The float scalar to minimise: the mean loss of one batch (single-replica code;
        tfbig averages it over replicas and accumulation steps). Or (loss, {name: float
        scalar}): more figures of the batch, averaged the same way and written beside the loss
        (TensorBoard's train scalars); the progress line shows the expert loads of
        tfbig.models.moe.routing_metrics. The model's own losses (`model.losses`: add_loss,
        weight regularizers) are added to it where the layout allows (docs: own-model)."""
        raise NotImplementedError(f"{type(self).__name__}.loss")

    def validation_outputs(self, targets, outputs):
        """{name: (rows, ...) tensor} of one validation batch that `compute_metrics` needs;
        tfbig gathers them from every replica in dataset order, padding dropped.
        Default: each example's own loss."""
        def one(row):
            target, output = row
            expand = lambda t: tf.expand_dims(t, 0)  # noqa: E731 - a batch of one
            loss = self.loss(tf.nest.map_structure(expand, target),
                             tf.nest.map_structure(expand, output))
            return tf.cast(loss[0] if isinstance(loss, (tuple, list)) else loss, tf.float32)

        return {"loss": tf.map_fn(one, (targets, outputs), fn_output_signature=tf.float32)}

    def compute_metrics(self, gathered):
        """{metric: float} of the gathered validation outputs ({name: numpy array}), computed
        once over the whole split. Default: the mean of each."""
        return {name: float(np.mean(values)) for name, values in gathered.items()}


class FunctionTask(Task):
    """A Task of three functions: `tfbig.train(model_fn, loss_fn, dataset_fn, ...)`."""

    def __init__(self, model_fn, loss_fn=None, dataset_fn=None, name="task", tokens_per_example=1,
                 checkpoint_layers=(), metrics_fn=None, tensor_layout=None,
                 transformer_shape=None, pipeline_layers=(), context_layout=None):
        self.model_fn, self.loss_fn, self.dataset_fn = model_fn, loss_fn, dataset_fn
        self.pipeline_layers = tuple(pipeline_layers)
        self.name, self.tokens_per_example = name, tokens_per_example
        self.checkpoint_layers, self.metrics_fn = tuple(checkpoint_layers), metrics_fn
        self.tensor_layout = dict(tensor_layout or {})
        self.context_layout = dict(context_layout or {})
        self.transformer_shape = transformer_shape

    def build_model(self):
        return self.model_fn()

    def dataset(self, shard):
        return self.dataset_fn(shard)

    def loss(self, targets, outputs):
        if self.loss_fn is None:
            raise UsageError("loss_fn: give one to train or evaluate (predict needs none)")
        return self.loss_fn(targets, outputs)

    def compute_metrics(self, gathered):
        return self.metrics_fn(gathered) if self.metrics_fn else super().compute_metrics(gathered)


