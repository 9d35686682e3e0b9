"""`tfbig-classify`: fine-tune a converted BERT on sentence or sentence-pair labels (GLUE-style)
and report accuracy and F1.

    tfbig-classify --init_checkpoint=runs/bert-base --train_file=MNLI/train.tsv \\
        --eval_file=MNLI/dev_matched.tsv --text_a=sentence1 --text_b=sentence2 \\
        --label=gold_label --output_dir=runs/mnli

Data: TSV with a header row (GLUE's files) or JSON lines, one example per row/line; --text_b
empty for single sentences. Labels are the distinct values of the training file's --label
column, sorted. Features: [CLS] a [SEP] b [SEP], the longer text cut first to fit
--max_seq_length. Loss: cross-entropy of BertClassifier's logits on the pooled [CLS]; AdamW
with linear warmup and decay (as tfbig-squad). Writes eval_results.json (accuracy, F1: of the
second label for two classes, macro-averaged otherwise), predictions.jsonl, labels.json and
the fine-tuned checkpoint, and train_losses.json (the loss of each step).

Under Horovod (--strategy=horovod, started by horovodrun) every process reads its share of each
global batch of --train_batch_size and gradients are averaged (the tfbig.distribute Strategy
surface): the run equals one process on the same global batches. The chief writes the files.

    horovodrun -np 2 -H localhost:2 --gloo tfbig-classify --strategy=horovod ...
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
    text_a: str = field("sentence1", "Column (or JSON key) of the first text.")
    text_b: str = field("sentence2", "Column of the second text; empty for single sentences.")
    label: str = field("label", "Column of the label.")
    max_seq_length: int = field(128, "Tokens per example: [CLS] a [SEP] b [SEP].")
    train_batch_size: int = field(32, "Examples per training step.")
    learning_rate: float = field(2e-5, "Peak AdamW learning rate.")
    num_train_epochs: float = field(3.0, "Epochs over the training examples.")
    max_steps: int = field(0, "Training steps (0: from --num_train_epochs).")
    warmup_proportion: float = field(0.1, "Share of steps of linear warmup.")
    weight_decay: float = field(0.01, "AdamW weight decay (not on LayerNorm, biases).")
    seed: int = field(0, "Seed for the classifier head, dropout and data order.")
    strategy: str = field("single", "single (one process) | horovod (one process per device, "
                                    "started by horovodrun; --train_batch_size is global).")


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
    """Train on --train_file, score --eval_file; returns the scores dict."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfbig.config import TrainConfig
    from tfbig.convert import run_dir
    from tfbig.distribute import get_strategy
    from tfbig.models.bert import BertClassifier
    from tfbig.optim import build_optimizer
    from tfbig.squad.finetune import pretrained_config

    if options.strategy not in ("single", "horovod"):
        raise UsageError(f"--strategy={options.strategy!r}: tfbig-classify runs on single | "
                         "horovod")
    strategy = get_strategy(options.strategy)
    replicas, rank = strategy.num_replicas, strategy.rank
    if options.train_batch_size % replicas:
        raise UsageError(f"--train_batch_size={options.train_batch_size} is not divisible by "
                         f"the {replicas} processes")
    config, tokenizer = pretrained_config(options.init_checkpoint)
    if type(config).__name__ != "BertConfig":
        raise UsageError(f"--init_checkpoint={options.init_checkpoint}: tfbig-classify "
                         "fine-tunes BERT (a tfbig-convert run)")
    config.check_inputs(seq_length=options.max_seq_length)
    train = read_examples(options.train_file, options)
    names = sorted({label for *_, label in train})
    label_ids = {name: i for i, name in enumerate(names)}
    data = encode(train, tokenizer, options.max_seq_length, label_ids)
    keras.utils.set_random_seed(options.seed)
    model = BertClassifier(config, num_classes=len(names), name="bert_classifier")
    model.build()
    run_dir.restore_backbone(model, options.init_checkpoint)
    steps = options.max_steps or max(1, math.ceil(
        options.num_train_epochs * len(train) / options.train_batch_size))
    settings = TrainConfig(optimizer="adamw", learning_rate=options.learning_rate,
                           max_steps=steps, warmup_steps=int(options.warmup_proportion * steps),
                           lr_schedule="linear", min_lr_ratio=0.0,
                           weight_decay=options.weight_decay, beta_2=0.999, epsilon=1e-6,
                           grad_clip_norm=1.0)
    variables = model.trainable_variables
    optimizer = build_optimizer(settings, variables)
    strategy.broadcast_variables(model.variables)  # Horovod: every process starts from rank 0

    @tf.function
    def step(batch):
        with tf.GradientTape() as tape:
            logits = model(batch, training=True)["logits"]
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                batch["labels"], logits))
        # Horovod: average the gradients and the loss over processes (equal shares)
        optimizer.apply(strategy.all_reduce_gradients(tape.gradient(loss, variables)),
                        variables)
        return strategy.all_reduce_mean(loss)

    share = options.train_batch_size // replicas  # this process's rows of each global batch
    batches = iter(tf.data.Dataset.from_tensor_slices(data).shuffle(
        len(train), seed=options.seed).repeat().batch(options.train_batch_size, True).map(
        lambda batch: {k: v[rank * share:(rank + 1) * share] for k, v in batch.items()}))
    losses = [float(step(next(batches))) for _ in range(steps)]
    print(f"{steps} steps on {replicas} process(es) (rank {rank}), loss {losses[0]:.4f} -> "
          f"{np.mean(losses[-10:]):.4f}")
    result = _write_outputs(model, tokenizer, options, label_ids, names, losses) \
        if strategy.is_chief else {}
    strategy.shutdown()  # Horovod: wait for the chief's files, then stop
    return result


def _write_outputs(model, tokenizer, options, label_ids, names, losses):
    """The chief's files: losses, checkpoint, labels, and the scores of --eval_file."""
    import tensorflow as tf

    from tfbig.convert import run_dir

    os.makedirs(options.output_dir, exist_ok=True)
    with open(os.path.join(options.output_dir, "train_losses.json"), "w") as file:
        json.dump(losses, file)
    tf.train.Checkpoint(model=run_dir.model_variables(model)).write(
        os.path.join(options.output_dir, "finetuned"))
    with open(os.path.join(options.output_dir, "labels.json"), "w") as file:
        json.dump(names, file)
    return evaluate(model, tokenizer, options, label_ids, names) if options.eval_file else {}


def evaluate(model, tokenizer, options, label_ids, names):
    import numpy as np
    import tensorflow as tf

    examples = read_examples(options.eval_file, options)
    data = encode(examples, tokenizer, options.max_seq_length, label_ids)
    unknown = sorted({label for *_, label in examples if label not in label_ids})
    if unknown:
        raise UsageError(f"{options.eval_file}: labels {unknown[:5]} are not in "
                         f"{options.train_file} ({names})")
    forward = tf.function(lambda batch: model(batch, training=False)["logits"])
    inputs = {k: v for k, v in data.items() if k != "labels"}
    logits = np.concatenate([forward(batch).numpy() for batch in
                             tf.data.Dataset.from_tensor_slices(inputs).batch(64)])
    predicted = logits.argmax(-1)
    result = scores(data["labels"], predicted, len(names))
    with open(os.path.join(options.output_dir, "predictions.jsonl"), "w") as file:
        for index in predicted:
            file.write(json.dumps({"label": names[index]}) + "\n")
    with open(os.path.join(options.output_dir, "eval_results.json"), "w") as file:
        json.dump(result, file, indent=1)
    return result


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    options = ClassifyOptions(**{f.name: flags.FLAGS[f.name].value
                                 for f in dataclasses.fields(ClassifyOptions)})
    for key, value in fine_tune(options).items():
        print(f"{key}: {value:.4f}")


def run():
    from tfbig import cli

    definers = {int: flags.DEFINE_integer, float: flags.DEFINE_float, str: flags.DEFINE_string}
    for f in dataclasses.fields(ClassifyOptions):
        if f.name not in flags.FLAGS:
            definers[f.type](f.name, f.default, f.metadata["help"])
    cli.run_app("tfbig-classify", main, __doc__, [
        ("classify", [f.name for f in dataclasses.fields(ClassifyOptions)])])


if __name__ == "__main__":
    run()
