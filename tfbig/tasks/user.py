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

`UserTask` adapts a `Task` to what the Trainer reads of tfbig's own tasks (tasks.gpt); its
`preflight` refuses, before anything is written to the run directory, a model built outside
the backend's scope, a loss that is not a float scalar and batches of the wrong size.
"""
import collections
import contextlib
import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfbig.errors import UsageError
from tfbig.tasks import layer_paths

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
        tfbig averages it over replicas and accumulation steps)."""
        raise NotImplementedError(f"{type(self).__name__}.loss")

    def validation_outputs(self, targets, outputs):
        """{name: (rows, ...) tensor} of one validation batch that `compute_metrics` needs;
        tfbig gathers them from every replica in dataset order, padding dropped.
        Default: each example's own loss."""
        def one(row):
            target, output = row
            expand = lambda t: tf.expand_dims(t, 0)  # noqa: E731 - a batch of one
            return tf.cast(self.loss(tf.nest.map_structure(expand, target),
                                     tf.nest.map_structure(expand, output)), tf.float32)

        return {"loss": tf.map_fn(one, (targets, outputs), fn_output_signature=tf.float32)}

    def compute_metrics(self, gathered):
        """{metric: float} of the gathered validation outputs ({name: numpy array}), computed
        once over the whole split. Default: the mean of each."""
        return {name: float(np.mean(values)) for name, values in gathered.items()}


class FunctionTask(Task):
    """A Task of three functions: `tfbig.train(model_fn, loss_fn, dataset_fn, ...)`."""

    def __init__(self, model_fn, loss_fn=None, dataset_fn=None, name="task", tokens_per_example=1,
                 checkpoint_layers=(), metrics_fn=None, tensor_layout=None,
                 transformer_shape=None, pipeline_layers=()):
        self.model_fn, self.loss_fn, self.dataset_fn = model_fn, loss_fn, dataset_fn
        self.pipeline_layers = tuple(pipeline_layers)
        self.name, self.tokens_per_example = name, tokens_per_example
        self.checkpoint_layers, self.metrics_fn = tuple(checkpoint_layers), metrics_fn
        self.tensor_layout = dict(tensor_layout or {})
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


# ---- what the Trainer reads: the adapter ---------------------------------------------------
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


def resolve_layers(model, paths, what="checkpoint_layers"):
    """The layers at attribute paths below `model` ("blocks.*": each element of model.blocks;
    "ffn.layers.0": the first element of the list model.ffn.layers)."""
    return [layer for _, layer in layer_paths.named_layers(model, paths, what)]


@contextlib.contextmanager
def fresh_layer_names():
    """Keras names layers "dense", "dense_1", ... by a process-wide counter; within this the
    counter starts afresh, so a model's layer names, and with them its checkpoint keys
    (tfbig.checkpoints.checkpoint), are the same in every process and for every build (a resume, an
    evaluate after a train in one notebook)."""
    from keras.src.backend.common import global_state

    previous = global_state.get_global_attribute("object_name_uids")
    global_state.set_global_attribute("object_name_uids", collections.defaultdict(int))
    try:
        yield
    finally:
        global_state.set_global_attribute("object_name_uids", previous)


# kind -> the Keras layers it splits (tfbig.layouts.tensor_layout.split_declared_model)
LAYOUT_KINDS = {"column": ("Dense",), "row": ("Dense",), "vocab": ("Embedding", "Dense"),
                "heads": ("MultiHeadAttention",)}
_WEIGHTS = {"Dense": "kernel", "Embedding": "embeddings"}  # a layer's own weight, by type


def _splittable(model):
    """{layer path: (type name, layer)} of the built Dense, Embedding and MultiHeadAttention
    layers of `model` (subclasses count as their base)."""
    import keras

    types = {"Dense": keras.layers.Dense, "Embedding": keras.layers.Embedding,
             "MultiHeadAttention": keras.layers.MultiHeadAttention}
    return {layer.path: (name, layer) for layer in model._flatten_layers(include_self=False)
            for name, base in types.items() if isinstance(layer, base) and layer.built}


def declared_layout(model, layout, owner):
    """[(layer, kind)] of a task's `tensor_layout` ({layer path pattern: kind}) on its built
    `model`: "column" / "row" for a keras.layers.Dense, "heads" for a
    keras.layers.MultiHeadAttention, "vocab" for a keras.layers.Embedding (its rows) or the
    output Dense (its columns, the logits gathered). Refused, naming the entry, when a kind is
    unknown or does not fit the layer it names, a pattern names no such layer, a layer is
    named twice, or a row or vocab Dense has an activation."""
    import fnmatch

    layers = _splittable(model)
    chosen = {}
    for pattern, kind in layout.items():
        where = f"{owner}.tensor_layout[{pattern!r}]"
        if kind not in LAYOUT_KINDS:
            raise UsageError(f"{where} = {kind!r}: the kinds are 'column' and 'row' (a Dense), "
                             "'heads' (a MultiHeadAttention) and 'vocab' (an Embedding or the "
                             "output Dense)")
        if "/" in pattern or any(fnmatch.fnmatchcase(path, pattern) for path in layers):
            # a layer's or weight's path (a functional model's layers: "dense_1")
            matched = [path for path, (name, _) in layers.items()
                       if fnmatch.fnmatchcase(path, pattern) or
                       fnmatch.fnmatchcase(f"{path}/{_WEIGHTS.get(name)}", pattern)]
            if not matched:
                raise UsageError(f"{where}: {_no_layer(model, pattern, layers)}")
        else:  # an attribute path, as checkpoint_layers
            found = resolve_layers(model, [pattern], where)
            paths = {id(layer): path for path, (_, layer) in layers.items()}
            strays = [layer for layer in found if id(layer) not in paths]
            if strays:
                raise UsageError(f"{where}: names {type(strays[0]).__name__} "
                                 f"{getattr(strays[0], 'name', '')!r}, not a built "
                                 "keras.layers.Dense, MultiHeadAttention or Embedding; only "
                                 "those are split")
            matched = [paths[id(layer)] for layer in found]
        for path in matched:
            if chosen.get(path, kind) != kind:
                raise UsageError(f"{where}: {path!r} is declared both {chosen[path]!r} and "
                                 f"{kind!r}")
            _check_kind(where, path, kind, *layers[path])
            chosen[path] = kind
    return [(layers[path][1], kind) for path, kind in chosen.items()]


def _check_kind(where, path, kind, type_name, layer):
    """Refuse a kind that does not fit the layer, and a row or vocab Dense's activation."""
    if type_name not in LAYOUT_KINDS[kind]:
        fits = [k for k, names in LAYOUT_KINDS.items() if type_name in names]
        raise UsageError(f"{where} = {kind!r}: {path!r} ({type_name}) is split by "
                         f"{_either([repr(k) for k in fits])}; {kind!r} splits "
                         f"{_either(LAYOUT_KINDS[kind])} layers")
    activation = getattr(getattr(layer, "activation", None), "__name__", "")
    if type_name == "Dense" and kind in ("row", "vocab") and activation not in ("linear", ""):
        what = "each rank's partial sum" if kind == "row" else "each rank's slice of the logits"
        raise UsageError(f"{where}: the {kind}-split Dense {path!r} has activation "
                         f"{activation!r}, which would act on {what}; give it none and apply "
                         "it after the layer")


def _either(words):
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


def _no_layer(model, pattern, layers):
    """Why `pattern` names no layer tfbig splits in `model`."""
    import fnmatch

    weights = [v.path for v in model.variables if fnmatch.fnmatchcase(v.path, pattern)
               or fnmatch.fnmatchcase(v.path.rsplit("/", 1)[0], pattern)]
    if weights:
        return (f"names {weights[0]!r}, not the weights of a keras.layers.Dense, "
                "MultiHeadAttention or Embedding; only those are split (a MultiHeadAttention "
                "as a whole, by 'heads')")
    return (f"names no weight of {type(model).__name__}; the layers it could split are "
            f"{', '.join(sorted(layers)) or 'none'}")


KEYS = "x{:03d}"  # the flat batch's keys: leaf i of the (inputs, targets) structure


class UserTask:
    """A public `Task` as the Trainer reads tfbig's own tasks (tfbig.tasks.gpt.GPTTask): flat
    {key: tensor} batches (the evaluation padding adds a row mask to them), the loss as
    (loss, metrics), throughput from `tokens_per_example`."""

    format = "user"
    data_dir = ""

    def __init__(self, task, predicting=False):
        if not isinstance(task, Task):
            raise UsageError(f"{task!r}: expected a tfbig.Task (or use tfbig.train(model_fn, "
                             f"loss_fn, dataset_fn, ...))")
        self.user, self.user_name = task, type(task).__name__
        self.predicting = predicting
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
        """The task's declared {layer path pattern: kind} ({}: none; kinds: LAYOUT_KINDS)."""
        return dict(self.user.tensor_layout or {})

    def declared_layout(self, model):
        """[(layer, kind)] the task's tensor_layout names in `model` (declared_layout)."""
        return declared_layout(model, self.tensor_layout, self.user_name)

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
        loss = self.user.loss(self.unflatten(batch)[1], outputs)
        check_loss(loss, self.user_name)
        loss = tf.cast(loss, tf.float32)
        return loss, {"loss": loss}

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
        loss = self.user.loss(targets, model(inputs, training=training))
        check_loss(loss, self.user_name)
        loss = tf.cast(loss, tf.float32)
        return loss, {"loss": loss}

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
        traced = tf.function(self._unchecked_loss).get_concrete_function(model, spec)
        check_loss(traced.structured_outputs, self.user_name)  # outside the trace: its own error

    def _unchecked_loss(self, model, batch):
        inputs, targets = self.unflatten(batch)
        return self.user.loss(targets, model(inputs, training=True))


def _layer_call(layer):
    return lambda x, training: layer(x, training=training)


def check_loss(loss, owner):
    """Refuse a loss that is not a float scalar (a per-example vector, an integer)."""
    if not isinstance(loss, (tf.Tensor, tf.Variable)):
        loss = tf.convert_to_tensor(loss)
    if not loss.dtype.is_floating:
        raise UsageError(f"{owner}.loss returned a {loss.dtype.name} tensor; the loss must be a "
                         "float scalar (cast it, e.g. tf.cast(loss, tf.float32))")
    if loss.shape.rank != 0:
        raise UsageError(f"{owner}.loss returned shape {loss.shape}; the loss must be a scalar: "
                         "the mean over the batch (e.g. tf.reduce_mean(per_example_losses))")

