"""`tfbig-classify`: fine-tune a converted BERT on sentence or sentence-pair labels (GLUE-style)
and report accuracy and F1.

    tfbig-classify --init_checkpoint=runs/bert-base --train_file=MNLI/train.tsv \\
        --eval_file=MNLI/dev_matched.tsv --text_a=sentence1 --text_b=sentence2 \\
        --label=gold_label --output_dir=runs/mnli

Data: TSV with a header row (GLUE's files) or JSON lines, one example per row/line; --text_b
empty for single sentences. Labels are the distinct values of the training file's --label
column, sorted. Or a TFDS dataset already prepared on disk (tfbig.glue; nothing is
downloaded): --tfds_name=glue/mnli --tfds_data_dir=DIR trains on its train split and scores
validation_matched and validation_mismatched; GLUE's own text features and ClassLabel names
are used. Features: [CLS] a [SEP] b [SEP], the longer text cut first to fit
--max_seq_length. Loss: cross-entropy of BertClassifier's logits on the pooled [CLS]; AdamW
with linear warmup and decay (as tfbig-squad). Writes eval_results.json (accuracy, F1: of the
second label for two classes, macro-averaged otherwise; "SPLIT/accuracy"... for TFDS splits),
predictions.jsonl (predictions_SPLIT.jsonl: {"idx", "label"} per example, idx being GLUE's
example index), labels.json, the fine-tuned checkpoint and
train_losses.json (the loss of each step).

Data parallel on --strategy=horovod (started by horovodrun) or multiworker
(MultiWorkerMirrored; TF_CONFIG, e.g. from tfbig-launch): every replica trains on its share of
each global batch of --train_batch_size and gradients are averaged (tfbig.distribute.finetune):
the run equals one process on the same global batches. The chief writes the files. On Horovod
the backbone may also be split (--tensor_parallel) or the model state sharded
(--zero_stage=1|2|3, --shard_degree; tfbig.distribute.finetune_parallel); the checkpoint
written is a single-device one either way. --strategy=pipeline cuts the model into stages on
this process's devices, the classifier and its loss on the last (--pipeline_stages,
--num_microbatches, --schedule; tfbig.distribute.finetune_pipeline).

    horovodrun -np 2 -H localhost:2 --gloo tfbig-classify --strategy=horovod ...
    horovodrun -np 4 -H localhost:4 --gloo tfbig-classify --strategy=horovod --tensor_parallel=2 ...
    tfbig-launch --workers=2 -- tfbig-classify --strategy=multiworker ...
    tfbig-classify --strategy=pipeline --pipeline_stages=4 --num_microbatches=4 ...
"""
import csv
import dataclasses
import json
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from tfbig.config import field  # noqa: E402
from tfbig.distribute.finetune_parallel import ParallelOptions  # noqa: E402
from tfbig.distribute.finetune_pipeline import PipelineOptions  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402


@dataclasses.dataclass
class ClassifyOptions(PipelineOptions, ParallelOptions):
    """What to fine-tune, on which files, and how (and how Horovod or the pipeline splits
    it)."""

    init_checkpoint: str = field("", "A tfbig-convert --output_dir holding a BERT.")
    train_file: str = field("", "Training examples: .tsv (header row) or .jsonl.")
    eval_file: str = field("", "Examples to score (same columns).")
    output_dir: str = field("runs/classify", "Where scores, predictions and the model go.")
    text_a: str = field("sentence1", "Column (JSON key, TFDS feature) of the first text; "
                                     "with --tfds_name=glue/* the default is the task's own.")
    text_b: str = field("sentence2", "Column of the second text; empty for single sentences.")
    label: str = field("label", "Column of the label (TFDS: a ClassLabel feature).")
    max_seq_length: int = field(128, "Tokens per example: [CLS] a [SEP] b [SEP].")
    train_batch_size: int = field(32, "Examples per training step.")
    learning_rate: float = field(2e-5, "Peak AdamW learning rate.")
    num_train_epochs: float = field(3.0, "Epochs over the training examples.")
    max_steps: int = field(0, "Training steps (0: from --num_train_epochs).")
    warmup_proportion: float = field(0.1, "Share of steps of linear warmup.")
    weight_decay: float = field(0.01, "AdamW weight decay (not on LayerNorm, biases).")
    seed: int = field(0, "Seed for the classifier head, dropout and data order.")
    xla: bool = field(True, "Compile the forward and backward pass (and prediction) with XLA.")
    tfds_name: str = field("", "A TFDS dataset prepared in --tfds_data_dir, e.g. glue/mnli "
                               "(instead of --train_file/--eval_file; never downloaded).")
    tfds_data_dir: str = field("", "TFDS data directory holding --tfds_name (empty: TFDS's "
                                   "default, ~/tensorflow_datasets).")
    tfds_split: str = field("train", "The TFDS split to train on.")
    tfds_eval_splits: str = field("", "Comma-separated TFDS splits to score (empty: validation, "
                                      "or every validation_* split: glue/mnli's matched and "
                                      "mismatched).")
    strategy: str = field("single", "single (one process) | horovod (one process per device, "
                                    "started by horovodrun) | multiworker (MultiWorkerMirrored, "
                                    "TF_CONFIG) | pipeline (stages on this process's "
                                    "devices); --train_batch_size is global.")
    precision: str = field("fp32", "fp32 | mixed_float16 (dynamic loss scaling, as tfbig-train; "
                                   "a step with non-finite gradients is skipped) | "
                                   "mixed_bfloat16.")


def read_examples(path, options):
    """[(text_a, text_b or None, label string, idx)] of a .tsv or .jsonl file; idx is the row's
    "idx" (JSON lines) or "index" (GLUE's TSV files) value, else its 0-based row number."""
    if not os.path.isfile(path):
        raise UsageError(f"{path}: file not found")
    with open(path, encoding="utf-8") as file:
        rows = [json.loads(line) for line in file if line.strip()] if path.endswith(".jsonl") \
            else list(csv.DictReader(file, delimiter="\t", quoting=csv.QUOTE_NONE))
    columns = [options.text_a, options.label] + ([options.text_b] if options.text_b else [])
    missing = [c for c in columns if rows and c not in rows[0]]
    if missing or not rows:
        raise UsageError(f"{path}: no examples or no column {missing}; columns: "
                         f"{sorted(rows[0]) if rows else []} (--text_a/--text_b/--label)")
    return [(row[options.text_a], row[options.text_b] if options.text_b else None,
             str(row[options.label]), example_index(row, number))
            for number, row in enumerate(rows)]


def example_index(row, number):
    """A row's GLUE index: its "idx" or "index" field (an int when it spells one), else
    `number`, so predictions files carry the column GLUE submissions are keyed on."""
    value = row.get("idx", row.get("index", number))
    return int(value) if str(value).isdigit() else value


def encode(examples, tokenizer, max_seq_length, label_ids):
    """{input_ids, segment_ids, input_mask (N, T), labels (N,)} numpy arrays."""
    import numpy as np

    cls_id, sep_id = tokenizer.piece_id("[CLS]"), tokenizer.piece_id("[SEP]")
    arrays = {k: np.zeros((len(examples), max_seq_length), np.int32)
              for k in ("input_ids", "segment_ids", "input_mask")}
    for row, (a, b, *_) in enumerate(examples):
        a, b = tokenizer.encode(a), tokenizer.encode(b) if b is not None else []
        room = max_seq_length - (3 if b else 2)
        while len(a) + len(b) > room:  # cut the longer text first (BERT's run_classifier)
            (a if len(a) >= len(b) else b).pop()
        tokens = [cls_id, *a, sep_id] + ([*b, sep_id] if b else [])
        arrays["input_ids"][row, :len(tokens)] = tokens
        arrays["segment_ids"][row, len(a) + 2:len(tokens)] = 1
        arrays["input_mask"][row, :len(tokens)] = 1
    arrays["labels"] = np.array([label_ids.get(label, -1) for _, _, label, _ in examples],
                                np.int32)
    return arrays


def scores(labels, predicted, num_classes):
    """Accuracy and F1 (of class 1 for two classes, else macro-averaged over classes)."""
    import numpy as np

    f1s = []
    for c in range(num_classes):
        tp = np.sum((predicted == c) & (labels == c))
        fp, fn = np.sum((predicted == c) & (labels != c)), np.sum((predicted != c) & (labels == c))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    f1 = f1s[1] if num_classes == 2 else float(np.mean(f1s))
    return {"accuracy": float(np.mean(predicted == labels)), "f1": float(f1)}


def fine_tune(options):
    """Train on --train_file (or --tfds_name), score the eval data; returns the scores dict."""
    from tfbig.distribute.finetune import precision_policy

    with precision_policy(options.precision):  # the model computes in float16 / bfloat16
        return _fine_tune(options)


def _fine_tune(options):
    import keras
    import numpy as np

    from tfbig.distribute.finetune import (check_batch, current_loss_scale, fine_tune_strategy,
                                           replica_batches, skipped_steps, write_checkpoint)
    from tfbig.distribute.finetune_parallel import assembled_model
    from tfbig.squad.finetune import pretrained_config

    check_sources(options)
    strategy = fine_tune_strategy(options.strategy, "tfbig-classify", options,
                                  options.init_checkpoint)
    check_batch(strategy, options.train_batch_size)
    config, tokenizer = pretrained_config(options.init_checkpoint)
    if type(config).__name__ != "BertConfig":
        raise UsageError(f"--init_checkpoint={options.init_checkpoint}: tfbig-classify "
                         "fine-tunes BERT (a tfbig-convert run)")
    config.check_inputs(seq_length=options.max_seq_length)
    train, evals, names = read_data(options)
    label_ids = {name: i for i, name in enumerate(names)}
    data = encode(train, tokenizer, options.max_seq_length, label_ids)
    steps = options.max_steps or max(1, math.ceil(
        options.num_train_epochs * len(train) / options.train_batch_size))
    keras.utils.set_random_seed(options.seed)
    model, optimizer, step = build_classifier(config, len(names), options, steps, strategy)
    batches = replica_batches(strategy, lambda: _examples(data, options.seed),
                              options.train_batch_size)
    losses, scales = [], [current_loss_scale(optimizer)]  # fp16: the scale before each step
    for _ in range(steps):
        losses.append(float(step(next(batches))))
        scales.append(current_loss_scale(optimizer))
    print(f"{steps} steps on {strategy.num_replicas} replica(s) (rank {strategy.rank}), loss "
          f"{losses[0]:.4f} -> {np.mean(losses[-10:]):.4f}" + (
              f", {skipped_steps(scales)} skipped (non-finite gradients), loss scale "
              f"{scales[-1]:g}" if options.precision == "mixed_float16" else ""))
    model = assembled_model(strategy, model)  # --tensor_parallel: the chief joins the slices
    write_checkpoint(strategy, model, options.output_dir)  # a collective under tf.distribute
    result = _write_outputs(model, tokenizer, options, evals, names, losses, scales) \
        if strategy.is_chief else {}
    strategy.shutdown()  # every process waits for the chief's files, then stops
    return result


def check_sources(options):
    """One source of examples: files or a TFDS dataset."""
    files = [f"--{flag}={getattr(options, flag)}" for flag in ("train_file", "eval_file")
             if getattr(options, flag)]
    if options.tfds_name and files:
        raise UsageError(f"--tfds_name={options.tfds_name} and {' '.join(files)}: give one "
                         "source of examples")
    if not options.tfds_name and not options.train_file:
        raise UsageError("no training examples: give --train_file (.tsv or .jsonl) or "
                         "--tfds_name (e.g. glue/mnli, prepared in --tfds_data_dir)")


def read_data(options):
    """(train examples, {eval name: examples}, class names) of the files or of --tfds_name;
    the eval name is "" for --eval_file. File labels are the training file's, sorted."""
    if options.tfds_name:
        from tfbig.glue import read_tfds

        return read_tfds(options)
    train = read_examples(options.train_file, options)
    evals = {"": read_examples(options.eval_file, options)} if options.eval_file else {}
    names = sorted({label for _, _, label, _ in train})
    for examples in evals.values():
        unknown = sorted({label for _, _, label, _ in examples} - set(names))
        if unknown:
            raise UsageError(f"{options.eval_file}: labels {unknown[:5]} are not in "
                             f"{options.train_file} ({names})")
    return train, evals, names


def _examples(data, seed):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(data).shuffle(
        len(data["labels"]), seed=seed).repeat()


def training_settings(options, steps):
    """The TrainConfig of the optimizer: AdamW, linear warmup and decay, clipping at 1."""
    from tfbig.config import TrainConfig

    return TrainConfig(optimizer="adamw", learning_rate=options.learning_rate,
                       max_steps=steps, warmup_steps=int(options.warmup_proportion * steps),
                       lr_schedule="linear", min_lr_ratio=0.0,
                       weight_decay=options.weight_decay, beta_2=0.999, epsilon=1e-6,
                       grad_clip_norm=1.0, precision=options.precision)


def classification_loss(outputs, batch):
    """Mean cross-entropy of BertClassifier's logits against batch["labels"] (float32)."""
    import tensorflow as tf

    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        batch["labels"], outputs["logits"]))  # logits: float32 under mixed precision


def build_classifier(config, num_classes, options, steps, strategy):
    """(BertClassifier, optimizer, train step): the model (backbone from --init_checkpoint if
    given) and its optimizer (a LossScaleOptimizer for mixed_float16) built in the strategy's
    scope, under the global dtype policy of --precision; step(batch) -> loss averaged over
    replicas."""
    from tfbig.convert import run_dir
    from tfbig.distribute import finetune_parallel
    from tfbig.distribute.finetune import make_forward_backward, train_step
    from tfbig.models.bert import BertClassifier

    def build():  # the single-device model (--tensor_parallel: split; pipeline: staged)
        model = BertClassifier(config, num_classes=num_classes, name="bert_classifier")
        model.build()
        if options.init_checkpoint:
            run_dir.restore_backbone(model, options.init_checkpoint)
        return model

    with strategy.scope():  # --strategy=pipeline: the loss on the last stage
        model = finetune_parallel.build_model(strategy, build, options.max_seq_length, config,
                                              classification_loss)
        variables = model.trainable_variables
        optimizer = strategy.build_optimizer(training_settings(options, steps), variables)
    strategy.broadcast_variables(model.variables)  # every replica starts from the chief's

    def loss_fn(batch):
        return classification_loss(model(batch, training=True), batch)

    forward_backward = make_forward_backward(  # not XLA with --tensor_parallel
        strategy, loss_fn, optimizer, variables, finetune_parallel.compiled(strategy, options.xla))
    return model, optimizer, train_step(strategy, forward_backward, optimizer, variables)


def _write_outputs(model, tokenizer, options, evals, names, losses, scales):
    """The chief's files: losses (mixed_float16: loss scales), labels, and the scores of each
    eval set."""
    os.makedirs(options.output_dir, exist_ok=True)
    with open(os.path.join(options.output_dir, "train_losses.json"), "w") as file:
        json.dump(losses, file)
    if options.precision == "mixed_float16":  # before each step and after the last
        with open(os.path.join(options.output_dir, "loss_scales.json"), "w") as file:
            json.dump(scales, file)
    with open(os.path.join(options.output_dir, "labels.json"), "w") as file:
        json.dump(names, file)
    result = {}
    for name, examples in evals.items():
        result.update(evaluate(model, tokenizer, options, examples, names, name))
    if result:
        with open(os.path.join(options.output_dir, "eval_results.json"), "w") as file:
            json.dump(result, file, indent=1)
    return result


def evaluate(model, tokenizer, options, examples, names, split=""):
    """Scores of `examples` ({"accuracy", "f1"}; keys "SPLIT/accuracy"... for a TFDS split)
    and their predictions in predictions.jsonl (predictions_SPLIT.jsonl)."""
    import numpy as np
    import tensorflow as tf

    data = encode(examples, tokenizer, options.max_seq_length,
                  {name: i for i, name in enumerate(names)})
    forward = tf.function(lambda batch: model(batch, training=False)["logits"],
                          jit_compile=options.xla)
    inputs = {k: v for k, v in data.items() if k != "labels"}
    logits = np.concatenate([forward(batch).numpy() for batch in
                             tf.data.Dataset.from_tensor_slices(inputs).batch(64)])
    predicted = logits.argmax(-1)
    result = scores(data["labels"], predicted, len(names))
    suffix = f"_{split}" if split else ""
    with open(os.path.join(options.output_dir, f"predictions{suffix}.jsonl"), "w") as file:
        for (*_, idx), index in zip(examples, predicted):  # idx: GLUE's submission key
            file.write(json.dumps({"idx": idx, "label": names[index]}) + "\n")
    return {f"{split}/{k}" if split else k: v for k, v in result.items()}


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    options = ClassifyOptions(**{f.name: flags.FLAGS[f.name].value
                                 for f in dataclasses.fields(ClassifyOptions)})
    for key, value in fine_tune(options).items():
        print(f"{key}: {value:.4f}")


def run():
    from tfbig import cli

    definers = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
                float: flags.DEFINE_float, str: flags.DEFINE_string}
    for f in dataclasses.fields(ClassifyOptions):
        if f.name not in flags.FLAGS:
            definers[f.type](f.name, f.default, f.metadata["help"])
    parallel = [f.name for f in dataclasses.fields(ParallelOptions)]
    pipeline = [f.name for f in dataclasses.fields(PipelineOptions)]
    cli.run_app("tfbig-classify", main, __doc__, [
        ("classify", [f.name for f in dataclasses.fields(ClassifyOptions)
                      if f.name not in parallel + pipeline]), ("parallel", parallel),
        ("pipeline", pipeline)])


if __name__ == "__main__":
    run()
