"""BERT classification fine-tuning: tfbig-classify's step vs keras-hub's BertTextClassifier.

Both sides get a randomly initialised BERT of the same dimensions (--preset base: 110M
parameters; --num_layers to shorten it), the same batches (random WordPiece ids with padding,
two segments, --num_classes labels; the same arrays through the same tf.data pipeline), the
same optimizer (tfbig-classify's: AdamW, linear warmup and decay, weight decay off norms and
biases, clipping at 1), dropout 0.1 (BERT's) and XLA. tfbig trains the way tfbig-classify does
(the Trainer's step on tfbig.tasks.classify, one device: forward, backward and optimizer
update in one XLA program, tfbig.training.step); keras-hub the way its users do, `BertTextClassifier.compile(jit_compile=True)` +
`fit`. Each trains 1 + --steps steps; the first (compilation) is left out and sequences/s
covers the --steps after it, in wall time and per CPU-second of the process (`ratio_cpu`:
robust to other processes on a shared machine). The sides alternate for --repeats rounds
(order swapped each round) and the best round of each is reported.

    nice -n 15 python benchmarks/finetune_bert.py --preset=base --batch_size=8 --seq_length=128

Prints one JSON line last: sequences/s of each, `ratio` = tfbig / keras-hub, the CPU model and
the load average before and after.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import dataclasses
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

import _timing  # noqa: E402
from sharded_memory import cpu_model  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "base", "BERT preset giving the dimensions: tiny | base | large.")
flags.DEFINE_integer("num_layers", 0, "Override the preset's number of layers (0: keep).")
flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
flags.DEFINE_integer("seq_length", 128, "Tokens per sequence (--max_seq_length).")
flags.DEFINE_integer("num_classes", 3, "Labels (MNLI: 3).")
flags.DEFINE_integer("steps", 3, "Timed steps per run (after the compiling first step).")
flags.DEFINE_integer("repeats", 2, "Rounds; each trains both once, the order alternating.")


def bert_config():
    from tfbig.models.bert import BertConfig

    overrides = {"num_layers": FLAGS.num_layers} if FLAGS.num_layers else {}
    return BertConfig.from_preset(FLAGS.preset, **overrides)


def options(output_dir="runs/classify"):
    from tfbig.commands.classify import ClassifyOptions

    return ClassifyOptions(max_seq_length=FLAGS.seq_length, train_batch_size=FLAGS.batch_size,
                           xla=True, output_dir=output_dir)


def batches(config, count=4, seed=0):
    """`count` batches of examples: {input_ids, segment_ids, input_mask, labels} arrays."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows, length = count * FLAGS.batch_size, FLAGS.seq_length
    lengths = rng.integers(length // 2, length + 1, rows)
    positions = np.arange(length)[None, :]
    mask = (positions < lengths[:, None]).astype(np.int32)
    return {"input_ids": rng.integers(5, config.vocab_size, (rows, length)).astype(np.int32)
            * mask, "segment_ids": ((positions >= lengths[:, None] // 2) * mask).astype(
                np.int32), "input_mask": mask,
            "labels": rng.integers(0, FLAGS.num_classes, rows).astype(np.int32)}


def examples(data):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices(data).repeat()


def trainer_of(data, steps):
    """tfbig-classify's Trainer (tfbig.tasks.classify on one device) over `data`, with a
    randomly initialised BERT of bert_config()."""
    import tempfile

    from tfbig.training import finetune
    from tfbig.models.bert import BertClassifier
    from tfbig.tasks.classify import ClassifyTask
    from tfbig.tasks.fine_tuning import Examples
    from tfbig.training.trainer import Trainer

    class RandomBert(ClassifyTask):  # the command's task without a run directory
        def __init__(self, train):
            self.train, self.model_config, self.seq_length = train, bert_config(), \
                FLAGS.seq_length
            self.names = [str(i) for i in range(FLAGS.num_classes)]
            self.arrays, self.eval_names = {"train": data}, []
            self.examples = {"train": [None] * len(data["labels"])}
            vocab = os.path.join(tempfile.mkdtemp(prefix="finetune_bert-vocab-"), "vocab.txt")
            with open(vocab, "w") as file:
                file.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]) + "\n")
            self.manifest = Examples(vocab, {"train": len(data["labels"])})

        def build_model(self):
            model = BertClassifier(self.model_config, num_classes=FLAGS.num_classes,
                                   name="bert_classifier")
            model.build()
            return model

    directory = tempfile.mkdtemp(prefix="finetune_bert-")
    cfg = finetune.experiment(options(directory), "classify", peak_tflops=1.0,
                              monitor_interval_ms=0, checkpoint_every=10**6)
    cfg.train.max_steps = steps
    return Trainer(cfg, task=RandomBert(cfg.train))


def run_tfbig(data):
    steps = 1 + FLAGS.steps
    trainer = trainer_of(data, steps)
    inputs = trainer._train_iterator()  # noqa: SLF001 - the Trainer's own input and step
    marks = []
    for _ in range(steps):
        float(trainer._train_step(next(inputs))["loss"])  # noqa: SLF001 - read: step done
        marks.append(_timing.clock())
    return {**_timing.rates(marks, FLAGS.batch_size), "params": trainer.model.count_params()}


def run_keras_hub(data):
    import keras
    import keras_hub

    from tfbig.training import finetune
    from tfbig.optim import build_optimizer

    config, steps = bert_config(), 1 + FLAGS.steps
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=config.vocab_size, num_layers=config.num_layers,
        num_heads=config.num_heads, hidden_dim=config.hidden_size,
        intermediate_dim=config.intermediate_size, dropout=config.dropout,
        max_sequence_length=config.seq_length, num_segments=config.type_vocab_size)
    model = keras_hub.models.BertTextClassifier(backbone, FLAGS.num_classes, preprocessor=None,
                                                dropout=config.dropout)
    cfg = finetune.experiment(options(), "classify")
    finetune.set_steps(cfg, dataclasses.replace(options(), max_steps=steps), steps)
    model.compile(optimizer=build_optimizer(cfg.train, model.trainable_variables),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[], weighted_metrics=[], jit_compile=True)
    dataset = examples(data).batch(FLAGS.batch_size, drop_remainder=True).map(
        lambda b: ({"token_ids": b["input_ids"], "segment_ids": b["segment_ids"],
                    "padding_mask": b["input_mask"]}, b["labels"])).prefetch(2)

    class Clock(keras.callbacks.Callback):  # the clock read at the end of every step
        marks = []

        def on_train_batch_end(self, batch, logs=None):
            self.marks.append(_timing.clock())

    clock = Clock()
    model.fit(dataset, epochs=1, steps_per_epoch=steps, callbacks=[clock], shuffle=False,
              verbose=0)
    return {**_timing.rates(clock.marks, FLAGS.batch_size), "params": model.count_params()}


def _release():
    import gc

    import keras

    keras.backend.clear_session()
    gc.collect()


def main(argv):
    del argv
    load_before = os.getloadavg()
    data = batches(bert_config())
    sides = {"tfbig": run_tfbig, "keras_hub": run_keras_hub}
    rounds = {name: [] for name in sides}
    for index in range(FLAGS.repeats):
        for name in (list(sides) if index % 2 == 0 else list(sides)[::-1]):
            result = sides[name](data)
            _release()  # a BERT-base pair (weights, Adam slots, XLA buffers) is ~2 GB
            rounds[name].append(result)
            print(f"round {index} {name}: {result['tokens_per_sec']:.2f} seq/s, "
                  f"{result['tokens_per_cpu_sec']:.2f} seq/CPU-s ({result['params']:,} params)",
                  flush=True)
    params = {name: runs[0]["params"] for name, runs in rounds.items()}
    if params["tfbig"] != params["keras_hub"]:
        raise SystemExit(f"the two models differ in size: {params}; the comparison is void")
    # _timing.rates counts "tokens" per step; here a step's unit is a sequence
    best = {n: max(r["tokens_per_sec"] for r in runs) for n, runs in rounds.items()}
    best_cpu = {n: max(r["tokens_per_cpu_sec"] for r in runs) for n, runs in rounds.items()}
    config = bert_config()
    _record.emit({
        "benchmark": "finetune_bert", "preset": FLAGS.preset, "num_layers": config.num_layers,
        "hidden_size": config.hidden_size, "batch_size": FLAGS.batch_size,
        "seq_length": FLAGS.seq_length, "num_classes": FLAGS.num_classes, "xla": True,
        "timed_steps": FLAGS.steps, "repeats": FLAGS.repeats, "params": params["tfbig"],
        "tfbig_sequences_per_sec": round(best["tfbig"], 3),
        "keras_hub_sequences_per_sec": round(best["keras_hub"], 3),
        "rounds_sequences_per_sec": {n: [round(r["tokens_per_sec"], 3) for r in runs]
                                     for n, runs in rounds.items()},
        "tfbig_sequences_per_cpu_sec": round(best_cpu["tfbig"], 3),
        "keras_hub_sequences_per_cpu_sec": round(best_cpu["keras_hub"], 3),
        "ratio_cpu": round(best_cpu["tfbig"] / best_cpu["keras_hub"], 3),
        "ratio": round(best["tfbig"] / best["keras_hub"], 3),
        "cpu": cpu_model(), "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()]})


if __name__ == "__main__":
    app.run(main)
