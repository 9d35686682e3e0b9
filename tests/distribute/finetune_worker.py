"""Runs under `horovodrun -np 4` for tests/distribute/test_finetune_parallel.py: fine-tune the
scenarios of a plan with --strategy=horovod --tensor_parallel / --zero_stage, through the
commands themselves, and record the first-step gradients.

    horovodrun -np 4 -H localhost:4 --gloo python finetune_worker.py PLAN_JSON

PLAN_JSON is a list of scenarios {"name", "command": classify | squad | albert, "options"
(ClassifyOptions / SquadOptions fields; albert: tfbig.squad.finetune.train arguments plus
"config" and "parallel"), "out"}. Each scenario:
  1. gradients: this rank's slice of the model (tfbig.distribute.finetune_parallel.build_model),
     the gradients of its data replica's rows of one global batch, averaged by the strategy
     and assembled whole (tensor group's slices joined, ZeRO slices gathered); rank 0 also
     computes the single-device model's gradients on the whole batch: OUT/NAME.gradients.npz
     (ours/PATH, reference/PATH; bytes/NAME: the model state rank 0 holds, state_bytes(), and
     held/PATH: the elements of each variable it trains; frozen/PATH: of each it holds
     untrained, ZeRO-3).
  1b. with --precision=mixed_float16, instead of 1: one overflowing gradient slice on rank 3
     in the first step (skipped_step): OUT/NAME.skip.rankR.npz; mixed_bfloat16: neither.
  2. unless the scenario has "skip_only": the command (classify: tfbig.classify.fine_tune;
     squad: tfbig.squad.cli.fine_tune; albert: tfbig.squad.finetune.train on synthetic
     features, then the chief writes the assembled model with
     tfbig.distribute.finetune.write_checkpoint and its losses).
Horovod stays up between scenarios (HOROVOD_DYNAMIC_PROCESS_SETS=1; a command's closing
`shutdown` is a barrier here), so one launch runs them all: each start of TensorFlow costs
seconds.
"""
import dataclasses
import json
import os
import sys
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfbig.config import TrainConfig  # noqa: E402
from tfbig.distribute import finetune_parallel  # noqa: E402
from tfbig.distribute.finetune import (fine_tune_strategy, make_forward_backward,  # noqa: E402
                                       precision_policy, write_checkpoint)
from tfbig.distribute.finetune_parallel import ParallelOptions  # noqa: E402
from tfbig.distribute.horovod import HorovodStrategy  # noqa: E402


class Features:
    """The two things tfbig.squad.finetune.train reads of SQuAD features."""

    def __init__(self, arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays["input_ids"])


def albert_features(config, count, seq_length, seed):
    rng = np.random.default_rng(seed)
    return Features({
        "input_ids": rng.integers(5, config.vocab_size, (count, seq_length)).astype(np.int32),
        "segment_ids": (np.arange(seq_length) >= seq_length // 2).astype(np.int32)[None]
        .repeat(count, 0), "input_mask": np.ones((count, seq_length), np.int32),
        "start_positions": rng.integers(1, seq_length // 2, count).astype(np.int32),
        "end_positions": rng.integers(seq_length // 2, seq_length, count).astype(np.int32)})


# ---- what each command trains: (model builder, config, loss, variables, one global batch) -----
def classify_setup(options):
    from tfbig.tasks import classify
    from tfbig.convert import run_dir
    from tfbig.models.bert import BertClassifier
    from tfbig.squad.finetune import pretrained_config

    config, tokenizer = pretrained_config(options.init_checkpoint)
    train, _, names = classify.read_data(options)
    data = classify.encode(train, tokenizer, options.max_seq_length,
                           {n: i for i, n in enumerate(names)})

    def build():
        import keras

        keras.utils.set_random_seed(options.seed)
        model = BertClassifier(config, num_classes=len(names), name="bert_classifier")
        model.build()
        run_dir.restore_backbone(model, options.init_checkpoint)
        return model

    def loss(model, batch):
        logits = model(batch, training=True)["logits"]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            batch["labels"], logits))

    batch = {k: v[:options.train_batch_size] for k, v in data.items()}
    return build, config, loss, lambda model: model.trainable_variables, batch


def squad_setup(options):
    from tfbig.squad import cli

    config, tokenizer = cli._model_config_and_tokenizer(options)
    _, features, _ = cli._read(options.train_file, options.version, tokenizer, options)
    return _span_setup(config, features, options.train_batch_size, options.init_checkpoint,
                       options.seed)


def _span_setup(config, features, batch_size, init, seed):
    from tfbig.squad import finetune

    def loss(model, batch):
        return finetune.span_loss(model({k: batch[k] for k in finetune.INPUTS},
                                        training=True), batch)

    def variables(model):  # as finetune.train: the pooler is unused by the span head
        unused = {id(v) for v in model.backbone.pooler.weights}
        return [v for v in model.trainable_variables if id(v) not in unused]

    names = finetune.INPUTS + ("start_positions", "end_positions")
    batch = {k: features.arrays[k][:batch_size] for k in names}
    return (lambda: finetune.build_model(config, init or None, seed=seed), config, loss,
            variables, batch)


def albert_setup(run):
    from tfbig.models.albert import AlbertConfig

    config = AlbertConfig(**run["options"]["config"])
    features = albert_features(config, 64, config.seq_length, 0)
    return (*_span_setup(config, features, run["options"]["batch_size"], None, 0), features)


# ---- 1. first-step gradients ----------------------------------------------------------------
def whole_gradients(strategy, variables, grads):
    """The averaged gradients as full arrays: a tensor group's slices joined, ZeRO's gathered."""
    if hasattr(strategy, "splits"):  # TP (with ZeRO-1: slices gathered, then pieces joined)
        return strategy.gather_full(variables, grads)
    return [t.numpy() for t in strategy.partition.gather(grads, [v.shape for v in variables])]


def gradients(strategy, setup, seq_length, out):
    build, config, loss, variables_of, batch = setup
    with strategy.scope():
        model = finetune_parallel.build_model(strategy, build, seq_length, config)
    variables = variables_of(model)
    optimizer = strategy.build_optimizer(TrainConfig(optimizer="adamw", max_steps=4), variables)
    rows = replica_rows(strategy, batch)
    # the commands' own forward/backward (ZeRO-2: it gives this rank's gradient slices)
    forward_backward = make_forward_backward(strategy, lambda rows: loss(model, rows), optimizer,
                                             variables, jit_compile=False)

    @tf.function
    def averaged(rows):
        grads = [tf.convert_to_tensor(g) for g in forward_backward(rows)[1]]
        return strategy.all_reduce_gradients(grads)

    ours = whole_gradients(strategy, variables, averaged(rows))
    if hvd.rank() != 0:
        return
    full = build()
    reference_variables = variables_of(full)
    with tf.GradientTape() as tape:
        value = loss(full, batch)
    reference = tape.gradient(value, reference_variables)
    arrays = {f"ours/{v.path}": g for v, g in zip(variables, ours, strict=True)}
    arrays.update({f"bytes/{k}": v for k, v in strategy.state_bytes().items()})
    arrays.update({f"held/{v.path}": v.shape.num_elements() for v in variables})
    arrays.update({f"frozen/{v.path}": v.shape.num_elements()  # ZeRO-3: squad's pooler
                   for v in getattr(strategy, "frozen_variables", [])})
    arrays.update({f"reference/{v.path}": np.asarray(tf.convert_to_tensor(g))
                   for v, g in zip(reference_variables, reference, strict=True)})
    np.savez(out, **arrays)


# ---- 1b. fp16: one rank's overflow skips the step on every rank ------------------------------
def whole_weights(strategy, model):
    """Every weight of `model` as full arrays (tensor parallelism: the tensor group's slices
    joined, a collective; ZeRO stages 1-2 hold them whole)."""
    if hasattr(strategy, "splits"):
        return strategy.gather_full(model.trainable_variables)
    return [np.asarray(v) for v in model.trainable_variables]


def skipped_step(strategy, setup, seq_length, out):
    """mixed_float16, the commands' own step: in the first step one gradient of rank 3 only
    (a tensor-split variable's slice with --tensor_parallel, a ZeRO slice with --zero_stage)
    is made infinite; every rank must skip that step (weights unchanged, loss scale halved),
    then train the next one alike. Writes OUT (this rank's .rankR.npz): the loss scales
    before and after each step and the whole weights before, after the skipped step and
    after the next."""
    from tfbig.distribute.finetune import current_loss_scale, train_step

    build, config, loss, variables_of, batch = setup
    with strategy.scope():
        model = finetune_parallel.build_model(strategy, build, seq_length, config)
    variables = variables_of(model)
    settings = TrainConfig(optimizer="adamw", max_steps=4, learning_rate=3e-3, warmup_steps=0,
                           precision="mixed_float16")
    optimizer = strategy.build_optimizer(settings, variables)
    splits = getattr(strategy, "splits", None)
    target = next(i for i, v in enumerate(variables) if splits is None or v.path in splits)
    poison = tf.Variable(1.0, trainable=False)
    forward_backward = make_forward_backward(strategy, lambda rows: loss(model, rows),
                                             optimizer, variables, jit_compile=False)

    def poisoned(rows):
        value, grads = forward_backward(rows)
        grads = list(grads)
        grads[target] = grads[target] * poison
        return value, grads

    step = train_step(strategy, poisoned, optimizer, variables)
    rows = replica_rows(strategy, batch)
    arrays = {"scales": [current_loss_scale(optimizer)]}
    arrays.update({f"before/{i}": w for i, w in enumerate(whole_weights(strategy, model))})
    poison.assign(float("inf") if hvd.rank() == 3 else 1.0)
    for name in ("skipped", "next"):
        step(rows)
        poison.assign(1.0)
        arrays["scales"].append(current_loss_scale(optimizer))
        arrays.update({f"{name}/{i}": w for i, w in enumerate(whole_weights(strategy, model))})
    np.savez(f"{out}.rank{hvd.rank()}.npz", **arrays)


def replica_rows(strategy, batch):
    """This data replica's rows of the global `batch`."""
    per_replica = len(batch["input_ids"]) // strategy.num_replicas
    return {k: v[strategy.rank * per_replica:(strategy.rank + 1) * per_replica]
            for k, v in batch.items()}


# ---- 2. the command ---------------------------------------------------------------------------
def run_albert(run, features):
    """tfbig.squad.finetune.train on the split ALBERT; the chief writes the assembled model."""
    from tfbig.models.albert import AlbertConfig
    from tfbig.squad import finetune

    opts = run["options"]
    config = AlbertConfig(**opts["config"])
    strategy = fine_tune_strategy("horovod", "tfbig-squad", ParallelOptions(**opts["parallel"]))
    with strategy.scope():
        model = finetune_parallel.build_model(
            strategy, lambda: finetune.build_model(config, None, seed=0), config.seq_length,
            config)
    losses = finetune.train(model, features, batch_size=opts["batch_size"],
                            learning_rate=opts["learning_rate"], max_steps=opts["max_steps"],
                            xla=False, log=None, strategy=strategy)
    model = finetune_parallel.assembled_model(strategy, model)
    out = os.path.join(run["out"], run["name"])
    write_checkpoint(strategy, model, out)
    if strategy.is_chief:
        with open(os.path.join(out, "train_losses.json"), "w") as file:
            json.dump(losses, file)


def scenario(run):
    from tfbig import classify
    from tfbig.squad import cli

    os.makedirs(run["out"], exist_ok=True)
    grads_path = os.path.join(run["out"], f"{run['name']}.gradients.npz")
    if run["command"] == "albert":
        *setup, features = albert_setup(run)
        strategy = fine_tune_strategy("horovod", "tfbig-squad",
                                      ParallelOptions(**run["options"]["parallel"]))
        gradients(strategy, setup, run["options"]["config"]["seq_length"], grads_path)
        run_albert(run, features)
        return
    out = os.path.join(run["out"], run["name"])
    if run["command"] == "classify":  # on the Trainer: the split flags are its own
        own = {f.name for f in dataclasses.fields(classify.ClassifyOptions)}
        command_options = classify.ClassifyOptions(
            **{k: v for k, v in run["options"].items() if k in own}, output_dir=out)
        split = {k: v for k, v in run["options"].items() if k not in own}
        kind = (None, classify_setup, lambda o: classify.fine_tune(command_options, **split))
        # the first-step gradients and fp16 skip through the backends' fine-tuning adapters
        from tfbig.distribute.finetune_pipeline import PipelineOptions

        options = types.SimpleNamespace(**{
            **dataclasses.asdict(ParallelOptions()), **dataclasses.asdict(PipelineOptions()),
            **dataclasses.asdict(command_options), **run["options"], "output_dir": out})
    else:
        kind = (cli.SquadOptions, squad_setup, cli.fine_tune)
        options = kind[0](**run["options"], output_dir=out)
    strategy = fine_tune_strategy(options.strategy, "test", options)
    with precision_policy(options.precision):
        if options.precision == "fp32":
            gradients(strategy, kind[1](options), options.max_seq_length, grads_path)
        elif options.precision == "mixed_float16":
            skipped_step(strategy, kind[1](options), options.max_seq_length,
                         os.path.join(run["out"], f"{run['name']}.skip"))
    if not run.get("skip_only"):
        kind[2](options)


def main(plan_path):
    with open(plan_path) as f:
        plan = json.load(f)
    # The commands end with strategy.shutdown(); the next scenario needs Horovod still running.
    HorovodStrategy.shutdown = lambda self: hvd.join()
    for run in plan:
        scenario(run)
    # Horovod: wait for every rank, then stop (the commands' shutdown was a barrier only).
    hvd.join()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
