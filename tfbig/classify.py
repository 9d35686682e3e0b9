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
predictions.jsonl (predictions_SPLIT.jsonl), labels.json, the fine-tuned checkpoint and
train_losses.json (the loss of each step).

Data parallel on --strategy=horovod (started by horovodrun) or multiworker
(MultiWorkerMirrored; TF_CONFIG, e.g. from tfbig-launch): every replica trains on its share of
each global batch of --train_batch_size and gradients are averaged (tfbig.distribute.finetune):
the run equals one process on the same global batches. The chief writes the files.

    horovodrun -np 2 -H localhost:2 --gloo tfbig-classify --strategy=horovod ...
    tfbig-launch --workers=2 -- tfbig-classify --strategy=multiworker ...
"""
import csv
import dataclasses
import json
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from tfbig.config import field  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402


@dataclasses.dataclass
class ClassifyOptions:
    """What to fine-tune, on which files, and how."""

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
                                    "TF_CONFIG); --train_batch_size is global.")


def read_examples(path, options):
    """[(text_a, text_b or None, label string)] of a .tsv or .jsonl file."""
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
             str(row[options.label])) for row in rows]


def encode(examples, tokenizer, max_seq_length, label_ids):
    """{input_ids, segment_ids, input_mask (N, T), labels (N,)} numpy arrays."""
    import numpy as np

    cls_id, sep_id = tokenizer.piece_id("[CLS]"), tokenizer.piece_id("[SEP]")
    arrays = {k: np.zeros((len(examples), max_seq_length), np.int32)
              for k in ("input_ids", "segment_ids", "input_mask")}
    for row, (a, b, _) in enumerate(examples):
        a, b = tokenizer.encode(a), tokenizer.encode(b) if b is not None else []
        room = max_seq_length - (3 if b else 2)
        while len(a) + len(b) > room:  # cut the longer text first (BERT's run_classifier)
            (a if len(a) >= len(b) else b).pop()
        tokens = [cls_id, *a, sep_id] + ([*b, sep_id] if b else [])
        arrays["input_ids"][row, :len(tokens)] = tokens
        arrays["segment_ids"][row, len(a) + 2:len(tokens)] = 1
        arrays["input_mask"][row, :len(tokens)] = 1
    arrays["labels"] = np.array([label_ids.get(label, -1) for *_, label in examples], np.int32)
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
    import keras
    import numpy as np

    from tfbig.distribute.finetune import (check_batch, fine_tune_strategy, replica_batches,
                                           write_checkpoint)
    from tfbig.squad.finetune import pretrained_config

    check_sources(options)
    strategy = fine_tune_strategy(options.strategy, "tfbig-classify")
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
    model, step = build_classifier(config, len(names), options, steps, strategy)
    batches = replica_batches(strategy, lambda: _examples(data, options.seed),
                              options.train_batch_size)
    losses = [float(step(next(batches))) for _ in range(steps)]
    print(f"{steps} steps on {strategy.num_replicas} replica(s) (rank {strategy.rank}), loss "
          f"{losses[0]:.4f} -> {np.mean(losses[-10:]):.4f}")
    write_checkpoint(strategy, model, options.output_dir)  # a collective under tf.distribute
    result = _write_outputs(model, tokenizer, options, evals, names, losses) \
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
    names = sorted({label for *_, label in train})
    for examples in evals.values():
        unknown = sorted({label for *_, label in examples} - set(names))
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
                       grad_clip_norm=1.0)


def build_classifier(config, num_classes, options, steps, strategy):
    """(BertClassifier, train step): the model (backbone from --init_checkpoint if given) and
    its optimizer built in the strategy's scope; step(batch) -> loss averaged over replicas."""
    import tensorflow as tf

    from tfbig.convert import run_dir
    from tfbig.distribute.finetune import train_step
    from tfbig.models.bert import BertClassifier

    with strategy.scope():
        model = BertClassifier(config, num_classes=num_classes, name="bert_classifier")
        model.build()
        if options.init_checkpoint:
            run_dir.restore_backbone(model, options.init_checkpoint)
        variables = model.trainable_variables
        optimizer = strategy.build_optimizer(training_settings(options, steps), variables)
    strategy.broadcast_variables(model.variables)  # every replica starts from the chief's

    @tf.function(jit_compile=options.xla)
    def forward_backward(batch):
        with tf.GradientTape() as tape:
            logits = model(batch, training=True)["logits"]
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                batch["labels"], logits))
        return loss, tape.gradient(loss, variables)

    return model, train_step(strategy, forward_backward, optimizer, variables)


def _write_outputs(model, tokenizer, options, evals, names, losses):
    """The chief's files: losses, labels, and the scores of each eval set."""
    os.makedirs(options.output_dir, exist_ok=True)
    with open(os.path.join(options.output_dir, "train_losses.json"), "w") as file:
        json.dump(losses, file)
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
        for index in predicted:
            file.write(json.dumps({"label": names[index]}) + "\n")
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
    cli.run_app("tfbig-classify", main, __doc__, [
        ("classify", [f.name for f in dataclasses.fields(ClassifyOptions)])])


if __name__ == "__main__":
    run()
