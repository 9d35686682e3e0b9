"""What the Trainer reads of a user's `Task`: `UserTask` adapts the public protocol
(tfbig.tasks.user) to the interface of tfbig's own tasks (tasks.gpt): flat batches, the loss
from outputs, evaluation and the declared layouts. Its `preflight` refuses, before anything is
written to the run directory, a model built outside the backend's scope, a loss that is not a
float scalar and batches of the wrong size.
"""
import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfbig.errors import UsageError
from tfbig.tasks.user import DataShard, Task
from tfbig.tasks.layout_map import is_layout_entry, mesh_degree
from tfbig.tasks.user_layout import declared_layout, fresh_layer_names, resolve_layers


@dataclasses.dataclass
class UserModelConfig:
    """The run's model in config.json: the task's name (a resume must train the same)."""

    task: str


class _Splits:
    """{split: record count}, counted by reading the task's evaluation dataset once."""

    def __init__(self, task):
        self.task, self.counts = task, {}

    def get(self, split, default=None):
        if split not in self.counts:
            records = self.task.count_records(split)
            self.counts[split] = None if records is None else _Count(records)
        return self.counts[split] or default

    def __getitem__(self, split):
        found = self.get(split)
        if found is None:
            raise UsageError(f"{self.task.user_name}.dataset returned None for split {split!r}")
        return found


@dataclasses.dataclass
class _Count:
    records: int


class _Examples:
    """The Trainer's view of a manifest: no tokenizer file, the splits' record counts."""

    tokenizer_path = ""

    def __init__(self, task):
        self.splits = _Splits(task)


KEYS = "x{:03d}"  # the flat batch's keys: leaf i of the (inputs, targets) structure


class UserTask:
    """A public `Task` as the Trainer reads tfbig's own tasks (tfbig.tasks.gpt.GPTTask): flat
    {key: tensor} batches (the evaluation padding adds a row mask to them), the loss as
    (loss, metrics), throughput from `tokens_per_example`."""

    format = "user"
    data_dir = ""

    def __init__(self, task, predicting=False, model_losses_refused=None):
        """`model_losses_refused`: why the layout cannot add the model's own losses (its
        add_loss calls and weight regularizers, `model.losses`) exactly, or None: they are
        added to the task's loss."""
        if not isinstance(task, Task):
            raise UsageError(f"{task!r}: expected a tfbig.Task (or use tfbig.train(model_fn, "
                             f"loss_fn, dataset_fn, ...))")
        self.user, self.user_name = task, type(task).__name__
        self.predicting = predicting
        self.model_losses_refused = model_losses_refused
        self.model_config = UserModelConfig(task=task.name)
        self.seq_length = int(task.tokens_per_example)
        self.manifest = _Examples(self)
        self.structure = None  # the (inputs, targets) nest of the batches, from the first dataset
        self._described = None  # (LayerSpecs, variable creation order) of pipeline_layers

    # ---- the model -----------------------------------------------------------------------------
    def build_model(self):
        """The user's model; refused if its variables were not created by this call (a model
        built outside the backend's scope) or it has none (not built)."""
        from keras.src.backend.common import global_state  # Keras' deferred variables

        created, pending = set(), {id(v) for v in global_state.get_global_attribute(
            "uninitialized_variables") or []}

        def creator(next_creator, **kwargs):
            variable = next_creator(**kwargs)
            created.add(id(variable))
            return variable

        with tf.variable_creator_scope(creator), fresh_layer_names():
            model = self.user.build_model()
        deferred = {id(v) for v in global_state.get_global_attribute(
            "uninitialized_variables") or []} - pending
        if not model.trainable_variables:  # (a Dropout's seed state exists unbuilt)
            raise UsageError(f"{self.user_name}.build_model returned {type(model).__name__} "
                             "without variables: build it there (model.build(input_shape) or "
                             "call it once on a batch)")
        outside = [v.path for v in model.variables if id(v) not in deferred
                   and id(getattr(v, "_value", None)) not in created]
        if outside:
            raise UsageError(f"{self.user_name}.build_model returned a model whose variables "
                             f"({', '.join(outside[:3])}) were made before it was called, "
                             "outside the backend's scope (they would not be mirrored or "
                             "sharded): create the model inside build_model / model_fn")
        return model

    def blocks(self, model):
        """The layers --activation_checkpointing and --zero_stage=3 treat one at a time."""
        return resolve_layers(model, self.user.checkpoint_layers)

    @property
    def tensor_layout(self):
        """The task's declared {layer path pattern: kind} ({}: none; kinds: LAYOUT_KINDS),
        or the entries of a keras.distribution.LayoutMap ({regex: TensorLayout})."""
        return dict(self.user.tensor_layout or {})

    @property
    def context_layout(self):
        """The task's declared {layer path: kind} for --context_parallel ({}: none)."""
        return dict(getattr(self.user, "context_layout", None) or {})

    def declared_layout(self, model, degree=None):
        """[(layer, kind, kernel axis)] the task's tensor_layout names in `model`
        (declared_layout); with `degree` (--tensor_parallel), a LayoutMap's mesh must have a
        tensor axis of that size."""
        layout = self.tensor_layout
        if degree is not None and layout and all(map(is_layout_entry, layout.values())):
            if mesh_degree(layout) != degree:
                raise UsageError(f"{self.user_name}.tensor_layout: the LayoutMap's mesh has a "
                                 f"tensor axis of {mesh_degree(layout)} and "
                                 f"--tensor_parallel={degree}; build the map on "
                                 f"tfbig.device_mesh(tensor_parallel={degree})")
        return declared_layout(model, layout, self.user_name)

    # ---- the pipeline: the layers the task declares (tfbig.tasks.user_pipeline) -----------------
    # A stage rank builds the whole model, then holds its stage's weights (no placeholders:
    # a user's build may run the model, which empty weights would not survive).
    builds_whole_model = True

    def _pipeline(self):
        if not self.user.pipeline_layers:
            raise UsageError(f"{self.user_name} declares no pipeline_layers: pipeline "
                             "parallelism needs them (Task docs)")
        if self._described is None:
            from tfbig.tasks import user_pipeline

            self._described = user_pipeline.describe(self)
        return self._described

    def layer_specs(self):
        """The LayerSpecs the pipeline cuts the model by (one per declared layer)."""
        return self._pipeline()[0]

    def pipe_layers(self, model):
        """[(name, call(x, training), [layer])] of the declared layers of `model`."""
        from tfbig.tasks import user_pipeline

        return [(name, _layer_call(layer), [layer]) for name, layer in
                user_pipeline.named_layers(model, self.user.pipeline_layers, self.user_name)]

    def placed(self, device_of):
        """A context in which build_model creates each weight on `device_of[its path]`."""
        from tfbig.tasks import user_pipeline

        return user_pipeline.placed_by_order(self._pipeline()[1], device_of)

    def model_inputs(self, batch):
        return self.unflatten(batch)[0]

    def loss_from_outputs(self, outputs, batch):
        """(float32 loss, {"loss": loss}) of the model's outputs on a flat batch; 0 when
        predicting (a pipeline's last stage asks for it; predict needs no loss_fn)."""
        if self.predicting:
            zero = tf.constant(0.0)
            return zero, {"loss": zero}
        return loss_and_metrics(self.user.loss(self.unflatten(batch)[1], outputs),
                                self.user_name)

    def validation_outputs(self, outputs, batch):
        """What validation_step gives, from the model's outputs on a flat batch."""
        if self.predicting:
            return outputs if isinstance(outputs, dict) else {"outputs": outputs}
        return self.user.validation_outputs(self.unflatten(batch)[1], outputs)

    # ---- batches ---------------------------------------------------------------------------------
    def _user_dataset(self, shard):
        dataset = self.user.dataset(shard)
        if dataset is None:
            return None
        if not isinstance(dataset, tf.data.Dataset):
            raise UsageError(f"{self.user_name}.dataset returned {type(dataset).__name__}; "
                             "expected a tf.data.Dataset of (inputs, targets) batches")
        spec = dataset.element_spec
        if not (isinstance(spec, tuple) and len(spec) == 2):
            raise UsageError(f"{self.user_name}.dataset: elements are {spec}; expected "
                             "(inputs, targets) pairs")
        self.structure = spec
        flat = tf.nest.flatten(spec)
        scalar = [s for s in flat if s.shape.rank == 0]
        if scalar:
            raise UsageError(f"{self.user_name}.dataset for {shard.split!r}: an element has no "
                             f"batch dimension ({scalar[0]}); batch it with "
                             f"dataset.batch(shard.batch_size)")
        return dataset.map(lambda *pair: {KEYS.format(i): t for i, t in
                                          enumerate(tf.nest.flatten(pair))})

    def dataset(self, split, batch_size, input_context=None, *, seed=0, repeat=True,
                shuffle=True, start=0, drop_remainder=True):
        """Flat batches of this input pipeline: training ones from global example `start` on
        (whole global batches skipped), or every example of `split` in order."""
        training = repeat and shuffle
        count = input_context.num_input_pipelines if input_context else 1
        index = input_context.input_pipeline_id if input_context else 0
        shard = DataShard(split, batch_size, index, count, training, seed)
        dataset = self._user_dataset(shard)
        if dataset is None:
            raise UsageError(f"{self.user_name}.dataset returned None for split {split!r}")
        if training and start:
            dataset = dataset.skip(start // (batch_size * count))
        return dataset

    def first_batch(self, rows=2):
        """The first flat training batch of `rows` rows (one replica of one)."""
        dataset = self._user_dataset(DataShard("train", rows))
        if dataset is None:
            raise UsageError(f"{self.user_name}.dataset returned None for the 'train' split")
        return next(iter(dataset.take(1)))

    def count_records(self, split):
        """Examples in the evaluation dataset of `split` (None: the task has none)."""
        dataset = self._user_dataset(DataShard(split, 256, training=False))
        if dataset is None:
            return None
        rows = dataset.map(lambda b: tf.shape(tf.nest.flatten(b)[0])[0])
        return int(rows.reduce(np.int64(0), lambda total, n: total + tf.cast(n, tf.int64)))

    def unflatten(self, batch):
        keys = sorted(k for k in batch if k.startswith("x"))
        return tf.nest.pack_sequence_as(self.structure, [batch[k] for k in keys])

    # ---- loss and validation ----------------------------------------------------------------------
    def loss(self, model, batch, training=False):
        inputs, targets = self.unflatten(batch)
        loss, metrics = loss_and_metrics(
            self.user.loss(targets, model(inputs, training=training)), self.user_name)
        if not model.losses:
            return loss, metrics
        # the model's own losses of this call (add_loss) and its weight regularizers', as
        # Keras' fit adds them (preflight refused them where a layout cannot)
        extra = tf.add_n([tf.cast(x, tf.float32) for x in model.losses])
        return loss + extra, {**metrics, "loss": loss + extra, "model_losses": extra}

    def check_model_losses(self, model):
        """Refuse the model's own losses (after a call: `model.losses`) where the layout
        cannot add them exactly (`model_losses_refused`)."""
        if not self.model_losses_refused:
            return
        # a regularizer is named without reading its weight (ZeRO-3 holds slices only)
        regularized = [v.path for v in model.weights if getattr(v, "regularizer", None)]
        if regularized:
            raise UsageError(
                f"{self.user_name}'s model has weight regularizers ({', '.join(regularized[:3])}"
                f"{', ...' if len(regularized) > 3 else ''}): {self.model_losses_refused}; "
                "drop them or add the penalty in the task's loss")
        if model.losses:
            raise UsageError(
                f"{self.user_name}'s model adds {len(model.losses)} loss(es) of its own in its "
                f"call (add_loss): {self.model_losses_refused}; return them among the outputs "
                "and add them in the task's loss")

    def validation_step(self, model, batch):
        return self.validation_outputs(model(self.model_inputs(batch), training=False), batch)

    def reduce_aggregated_logs(self, gathered):
        return self.user.compute_metrics(gathered)

    # ---- before anything is written ------------------------------------------------------------
    def preflight(self, model, micro_batch, grad_accum_steps, input_context, seed):
        """Refuse batches of another size than asked for and a loss that is not a float scalar
        (traced on the first batch's shapes, nothing run) before the run directory is written.
        The declared tensor_layout is checked against the model under every backend.
        Prediction reads no training batches and needs no loss: nothing else to check."""
        if self.tensor_layout:  # (a pipeline rank's stage: on its whole Keras model)
            self.declared_layout(model if isinstance(model, keras.Model) else model.model)
        if self.predicting:
            return
        rows = grad_accum_steps * micro_batch
        shard = DataShard("train", rows, input_context.input_pipeline_id,
                          input_context.num_input_pipelines, True, seed)
        dataset = self._user_dataset(shard)
        if dataset is None:
            raise UsageError(f"{self.user_name}.dataset returned None for the 'train' split")
        first = next(iter(dataset.take(1)))
        sizes = {int(t.shape[0]) for t in first.values()}
        if sizes != {rows}:
            raise UsageError(
                f"{self.user_name}.dataset gave batches of {sorted(sizes)} rows to replica "
                f"{shard.index} of {shard.count}; expected shard.batch_size={rows} (--batch_size "
                f"split over {shard.count} replica(s) x --grad_accum_steps={grad_accum_steps}): "
                "batch each replica's share with dataset.batch(shard.batch_size)")
        if not isinstance(model, keras.Model):  # a pipeline rank's stage: its layers were
            return  # checked with the loss on the whole model (tfbig.tasks.user_pipeline)
        spec = {k: tf.TensorSpec([micro_batch, *t.shape[1:]], t.dtype) for k, t in first.items()}
        traced = tf.function(self._unchecked_loss, autograph=False).get_concrete_function(
            model, spec)
        checked_loss(traced.structured_outputs, self.user_name)  # outside the trace: its error
        self.check_model_losses(model)

    def _unchecked_loss(self, model, batch):
        inputs, targets = self.unflatten(batch)
        return self.user.loss(targets, model(inputs, training=True))


def _layer_call(layer):
    return lambda x, training: layer(x, training=training)


def loss_and_metrics(returned, owner):
    """(float32 loss, {"loss": loss, name: float32 scalar...}) of what `owner`.loss returned:
    the loss, or (loss, {name: scalar}) with more figures of the batch to log beside it."""
    loss, metrics = checked_loss(returned, owner)
    loss = tf.cast(loss, tf.float32)
    return loss, {**{k: tf.cast(v, tf.float32) for k, v in metrics.items()}, "loss": loss}


def checked_loss(returned, owner):
    """(loss, {name: scalar}) of what `owner`.loss returned, each checked (`check_loss`)."""
    metrics = {}
    if isinstance(returned, (tuple, list)):
        if len(returned) != 2 or not isinstance(returned[1], dict):
            raise UsageError(f"{owner}.loss returned a {type(returned).__name__} of "
                             f"{len(returned)}; expected the loss, or (loss, {{name: scalar}})")
        returned, metrics = returned
    for name, value in metrics.items():
        if name == "loss" or not isinstance(name, str):
            raise UsageError(f"{owner}.loss returned the metric name {name!r}; expected a "
                             "string other than 'loss' (the loss is logged as 'loss')")
        check_loss(value, owner, f"metric {name!r}")
    check_loss(returned, owner)
    return returned, metrics


def check_loss(loss, owner, what="loss"):
    """Refuse a loss (or a metric beside it: `what`) that is not a float scalar (a
    per-example vector, an integer)."""
    if not isinstance(loss, (tf.Tensor, tf.Variable)):
        loss = tf.convert_to_tensor(loss)
    if not loss.dtype.is_floating:
        raise UsageError(f"{owner}.loss returned a {loss.dtype.name} tensor as its {what}; it "
                         "must be a float scalar (cast it, e.g. tf.cast(loss, tf.float32))")
    if loss.shape.rank != 0:
        raise UsageError(f"{owner}.loss returned shape {loss.shape} as its {what}; it must be "
                         "a scalar: the mean over the batch (e.g. "
                         "tf.reduce_mean(per_example_losses))")
