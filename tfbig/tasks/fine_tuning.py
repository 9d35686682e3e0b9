"""What the fine-tuning tasks share (tasks.classify, tasks.squad): BERT-style inputs held as
numpy arrays per split, one seeded example order, the head's layer specs, and a loss and a
validation step over the model's outputs.

A subclass sets `format`, its model (`set_model_config`), `arrays` ({split: {name: (N, ...)}})
and `manifest` (an `Examples`), and defines `build_model()`, `loss_from_outputs(outputs,
batch)` (the pipeline's last stage calls it too) and `validation_outputs(outputs, batch)`.

Training order: one seeded shuffle per epoch, the same on every process; global batch s is
examples [s x B, (s + 1) x B) of it whatever the layout, each replica taking its rows
(`example_batches`).
"""
import dataclasses

import tensorflow as tf

INPUTS = ("input_ids", "segment_ids", "input_mask")  # (B, T) int32 each: the model's inputs


def tokenizer_path(tokenizer):
    """The file a fine-tuning tokenizer is loaded from (a WordPiece vocab.txt, a SentencePiece
    model, a tokenizer.json): what the run directory copies."""
    return getattr(tokenizer, "vocab_file", None) or tokenizer.path


class Examples:
    """What the Trainer reads of a task's data (a prepared manifest's role): the tokenizer file
    copied into the run directory and the records of each split."""

    def __init__(self, tokenizer_path, records):
        self.tokenizer_path = tokenizer_path
        self.splits = {name: _Split(count) for name, count in records.items()}


@dataclasses.dataclass
class _Split:
    records: int


class FineTuningTask:
    """The single-replica pieces every fine-tuning task has alike (see the module docstring)."""

    data_dir = ""

    def set_model_config(self, config, seq_length):
        """The model's config (--dropout applied when given) and its tokens per example,
        checked against each other."""
        if self.train.dropout >= 0:
            config = dataclasses.replace(config, dropout=self.train.dropout)
        config.check_inputs(seq_length=seq_length)
        self.model_config, self.seq_length = config, seq_length

    def layer_specs(self):
        """The layers the pipeline cuts the model by (the task's head on the last stage)."""
        from tfbig.models.shapes import fine_tune_specs

        return fine_tune_specs(self.model_config, self.seq_length)

    def dataset(self, split, batch_size, input_context=None, *, seed=0, repeat=True,
                shuffle=True, start=0, drop_remainder=True):
        """Batches of the split's arrays ({input_ids, segment_ids, input_mask (B, T)} and the
        task's labels) for one input pipeline: of every `batch_size x replicas` examples in
        the seeded order, this pipeline's rows, cut into per-replica batches of `batch_size`;
        from global example `start` on (a resumed run)."""
        return example_batches(self.arrays[split], batch_size, input_context, seed=seed,
                               repeat=repeat, shuffle=shuffle, start=start,
                               drop_remainder=drop_remainder)

    def flops_per_token(self):
        return self.model_config.flops_per_token(self.seq_length)

    def model_inputs(self, batch):
        return {name: batch[name] for name in INPUTS}

    def loss(self, model, batch, training=False):
        return self.loss_from_outputs(model(self.model_inputs(batch), training=training), batch)

    def validation_step(self, model, batch):
        return self.validation_outputs(model(self.model_inputs(batch), training=False), batch)


def example_batches(arrays, batch_size, input_context=None, *, seed=0, repeat=True,
                    shuffle=True, start=0, drop_remainder=True):
    """Batches of `arrays` ({name: (N, ...)}) for one input pipeline (see
    FineTuningTask.dataset), from global example `start` (a multiple of the global batch) on."""
    pipelines = input_context.num_input_pipelines if input_context else 1
    pipeline = input_context.input_pipeline_id if input_context else 0
    replicas = input_context.num_replicas_in_sync if input_context else 1
    chunk = batch_size * replicas  # one micro-step of every replica
    share = chunk // pipelines
    examples = tf.data.Dataset.from_tensor_slices(arrays)
    if shuffle:
        examples = examples.shuffle(len(next(iter(arrays.values()))), seed=seed,
                                    reshuffle_each_iteration=True)
    if repeat:
        examples = examples.repeat()
    if pipelines == 1 and replicas == 1:
        return examples.batch(batch_size, drop_remainder=drop_remainder).skip(
            start // batch_size).prefetch(2)
    rows = examples.batch(chunk, drop_remainder=True).skip(start // chunk).map(
        lambda b: {k: v[pipeline * share:(pipeline + 1) * share] for k, v in b.items()})
    return rows.unbatch().batch(batch_size, drop_remainder=True).prefetch(2)
