"""Sentence and sentence-pair classification (GLUE-style) as a task of the one Trainer.

The single-replica view, like tasks.gpt: the examples (TSV with a header row or JSON lines, or
a TFDS `glue/*` dataset prepared on disk: tfbig.data.glue), the model (the backbone of
--init_checkpoint and a new classifier: BertClassifier on the pooled [CLS] of a tfbig-convert
BERT; LlamaClassifier on the last token of a Llama-family run, tfbig-train --model=llama or
tfbig-convert of a Hugging Face one), the loss (cross-entropy), and a validation step
returning class logits with labels. The metric
runs once over the gathered outputs: accuracy, F1 (of the second class for two classes, else
macro-averaged) and Matthews correlation, as GLUE scores its tasks.

Features: [CLS] a [SEP] b [SEP] (BERT) or a </s> b </s> (Llama: the run tokenizer's
end-of-document token), the longer text cut first to fit --max_seq_length. The
inputs, training order and steps around the loss are every fine-tuning task's
(tasks.fine_tuning).

    # ClassifyData: tfbig.tasks.options
    task = ClassifyTask(train_config, ClassifyData(init_checkpoint="runs/bert",
                                                   train_file="train.tsv", eval_file="dev.tsv"))
"""
import csv
import json
import os

import numpy as np
import tensorflow as tf

from tfbig.errors import UsageError
from tfbig.tasks.fine_tuning import INPUTS, Examples, FineTuningTask, tokenizer_path


class ClassifyTask(FineTuningTask):
    """BertClassifier or LlamaClassifier fine-tuning on labelled examples; splits "train",
    "validation" (the first eval set) and each eval set by name ("" for --eval_file, TFDS
    split names)."""

    format = "classify"

    def __init__(self, train, options):
        from tfbig.convert import run_dir

        self.train, self.options = train, options
        check_sources(options)
        if not options.init_checkpoint:
            raise UsageError("--init_checkpoint: give a tfbig-convert --output_dir holding a "
                             "BERT or a Llama-family model, or a tfbig-train --model=llama "
                             "--model_dir (its config.json, tokenizer and checkpoint)")
        config, saved = run_dir.read_config(options.init_checkpoint, families=("bert", "llama"))
        self.decoder = saved["model_format"] == "llama"
        self.set_model_config(config, options.max_seq_length)
        tokenizer = _tokenizer(options.init_checkpoint, config, saved, self.decoder)
        examples, evals, self.names = read_data(options)
        label_ids = {name: i for i, name in enumerate(self.names)}
        self.examples = {"train": examples, **evals}
        self.arrays = {name: encode(rows, tokenizer, self.seq_length, label_ids, self.decoder)
                       for name, rows in self.examples.items()}
        self.eval_names = list(evals)
        if evals:
            self.arrays["validation"] = self.arrays[self.eval_names[0]]
        self.manifest = Examples(tokenizer_path(tokenizer),
                                 {k: len(v["labels"]) for k, v in self.arrays.items()})

    def build_model(self):
        """BertClassifier or LlamaClassifier, built; its backbone from --init_checkpoint, its
        head fresh."""
        from tfbig.convert import run_dir

        if self.decoder:
            from tfbig.models.llama_heads import LlamaClassifier

            model = LlamaClassifier(self.model_config, num_classes=len(self.names),
                                    name="llama_classifier")
        else:
            from tfbig.models.bert import BertClassifier

            model = BertClassifier(self.model_config, num_classes=len(self.names),
                                   name="bert_classifier")
        model.build()
        run_dir.restore_backbone(model, self.options.init_checkpoint,
                                 stored="" if self.decoder else "backbone/")
        return model

    def loss_from_outputs(self, outputs, batch):
        """Mean cross-entropy of the class logits (float32) and its metrics."""
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            batch["labels"], tf.cast(outputs["logits"], tf.float32)))
        return loss, {"loss": loss}

    def validation_outputs(self, outputs, batch):
        return {"logits": tf.cast(outputs["logits"], tf.float32), "labels": batch["labels"]}

    def reduce_aggregated_logs(self, outputs):
        """Accuracy, F1 and Matthews correlation of the gathered logits."""
        return scores(outputs["labels"], outputs["logits"].argmax(-1), len(self.names))


def _tokenizer(init_checkpoint, config, saved, decoder):
    """A BERT run's WordPiece vocabulary, or the tokenizer a Llama-family run carries
    (tfbig.data.tokenizer.for_run); an MoE Llama is refused before anything is read."""
    if not decoder:
        from tfbig.data.wordpiece import WordPieceTokenizer

        return WordPieceTokenizer.from_run(init_checkpoint, saved["tokenizer"])
    from tfbig.data.tokenizer import for_run
    from tfbig.models.llama_heads import check_backbone

    check_backbone(config, f"--init_checkpoint={init_checkpoint}")
    return for_run(init_checkpoint)


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
        from tfbig.data.glue import read_tfds

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


def encode(examples, tokenizer, max_seq_length, label_ids, decoder=False):
    """{input_ids, segment_ids, input_mask (N, T), labels (N,)} numpy arrays: [CLS] a [SEP]
    b [SEP], or for a `decoder` a </s> b </s> (no [CLS]: its classifier reads the last
    token; </s> is the tokenizer's end-of-document id)."""
    if decoder:
        cls, sep = [], tokenizer.eos_id
    else:
        cls, sep = [tokenizer.piece_id("[CLS]")], tokenizer.piece_id("[SEP]")
    arrays = {k: np.zeros((len(examples), max_seq_length), np.int32) for k in INPUTS}
    for row, (a, b, *_) in enumerate(examples):
        a, b = tokenizer.encode(a), tokenizer.encode(b) if b is not None else []
        room = max_seq_length - len(cls) - (2 if b else 1)
        while len(a) + len(b) > room:  # cut the longer text first (BERT's run_classifier)
            (a if len(a) >= len(b) else b).pop()
        tokens = [*cls, *a, sep] + ([*b, sep] if b else [])
        arrays["input_ids"][row, :len(tokens)] = tokens
        arrays["segment_ids"][row, len(cls) + len(a) + 1:len(tokens)] = 1
        arrays["input_mask"][row, :len(tokens)] = 1
    arrays["labels"] = np.array([label_ids.get(label, -1) for _, _, label, _ in examples],
                                np.int32)
    return arrays


def scores(labels, predicted, num_classes):
    """Accuracy, F1 (of class 1 for two classes, else macro-averaged over classes) and
    Matthews correlation (GLUE's CoLA metric; its multi-class form)."""
    f1s = []
    for c in range(num_classes):
        tp = np.sum((predicted == c) & (labels == c))
        fp, fn = np.sum((predicted == c) & (labels != c)), np.sum((predicted != c) & (labels == c))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    f1 = f1s[1] if num_classes == 2 else float(np.mean(f1s))
    return {"accuracy": float(np.mean(predicted == labels)), "f1": float(f1),
            "mcc": matthews(labels, predicted, num_classes)}


def matthews(labels, predicted, num_classes):
    """Matthews correlation coefficient (Gorodkin's R_K for more than two classes)."""
    confusion = np.zeros((num_classes, num_classes))
    np.add.at(confusion, (labels, predicted), 1)
    t, p, c, s = confusion.sum(1), confusion.sum(0), np.trace(confusion), confusion.sum()
    denominator = np.sqrt((s * s - p @ p) * (s * s - t @ t))
    return float((c * s - t @ p) / denominator) if denominator else 0.0
