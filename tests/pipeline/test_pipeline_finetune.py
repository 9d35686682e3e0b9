"""Pipeline fine-tuning (--strategy=pipeline of tfbig-classify and tfbig-squad; stages on the
logical CPU devices of tests/pipeline/conftest.py) against one device on the same global
batches, fp32:

- tfbig-classify on a converted BERT (--init_checkpoint): embedding | block_0 | block_1 |
  classifier on 4 stages, GPipe, 2 micro-batches: per-step losses, every weight of the written
  checkpoint, the predictions and scores, and the first step's per-variable gradients.
- SQuAD's span head on ALBERT (one block shared by both layers, on different stages: its
  gradient is summed over them), 3 stages cut by --stage_boundaries, 1F1B, through
  tfbig.squad.finetune.train: losses, weights, gradients, the assembled single-device model's
  checkpoint and start/end logits.
- slow: tfbig-squad itself on the converted BERT (2 stages, every stage recomputed in the
  backward), predictions and a predict-only run reading the written checkpoint back.
- tfbig-train --strategy=pipeline --init_checkpoint: the stages hold the converted weights
  (slow: the first step's loss is the converted model's own).
Bad input (stages, boundaries, micro-batches, unbuilt combinations) fails before training,
naming the flags.
"""
import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "distribute"))
from test_finetune_parallel import assert_same_checkpoints, write_files  # noqa: E402

from tfbig.checkpoint import model_variables  # noqa: E402
from tfbig.classify import ClassifyOptions  # noqa: E402
from tfbig.classify import fine_tune as classify  # noqa: E402
from tfbig.config import TrainConfig  # noqa: E402
from tfbig.convert import run_dir  # noqa: E402
from tfbig.distribute import finetune_parallel  # noqa: E402
from tfbig.distribute.finetune import (fine_tune_strategy, make_forward_backward,  # noqa: E402
                                       write_checkpoint)
from tfbig.distribute.finetune_pipeline import PipelineOptions  # noqa: E402
from tfbig.models.albert import AlbertConfig  # noqa: E402
from tfbig.squad import finetune as squad_finetune  # noqa: E402
from tfbig.squad.cli import SquadOptions  # noqa: E402
from tfbig.squad.cli import fine_tune as squad  # noqa: E402

ALBERT = dict(vocab_size=32, embedding_size=16, hidden_size=32, num_layers=2, num_heads=2,
              intermediate_size=48, seq_length=16, dropout=0.0)
STEPS = dict(max_steps=4, train_batch_size=8, learning_rate=3e-3, max_seq_length=24, xla=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A random BERT run directory (tfbig-convert's layout) and classification/SQuAD files."""
    return write_files(tmp_path_factory.mktemp("finetune_pipeline"))


def _classify_options(files, **flags):
    return ClassifyOptions(init_checkpoint=str(files / "run"), train_file=str(files /
                           "train.jsonl"), eval_file=str(files / "dev.jsonl"), **STEPS, **flags)


def first_gradients(strategy, build, loss, variables_of, batch, config):
    """{path: gradient} of the mean loss on `batch` through the commands' own forward/backward
    (tfbig.distribute.finetune.make_forward_backward) on `strategy`, and the loss."""
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = finetune_parallel.build_model(strategy, build, len(batch["input_ids"][0]),
                                              config, loss)
    variables = variables_of(model)
    optimizer = strategy.build_optimizer(TrainConfig(optimizer="adamw", max_steps=4), variables)
    forward_backward = make_forward_backward(
        strategy, lambda rows: loss(model(rows, training=True), rows), optimizer, variables,
        jit_compile=False)
    value, grads = forward_backward({k: tf.constant(v) for k, v in batch.items()})
    return {v.path: np.asarray(tf.convert_to_tensor(g)) for v, g in zip(variables, grads)}, \
        float(value)


def reference_gradients(build, loss, variables_of, batch):
    """{path: gradient} of the single-device model's mean loss on the whole `batch` (eager)."""
    keras.utils.set_random_seed(0)
    model = build()
    variables = variables_of(model)
    with tf.GradientTape() as tape:
        value = loss(model(batch, training=True), batch)
    grads = tape.gradient(value, variables)
    return {v.path: np.asarray(tf.convert_to_tensor(g)) for v, g in zip(variables, grads)}, \
        float(value)


def assert_same_gradients(ours, reference):
    assert list(ours) == list(reference) and len(ours) > 20
    for path, grad in reference.items():
        assert np.abs(grad).max() > 0, path
        np.testing.assert_allclose(ours[path], grad, rtol=1e-5, atol=1e-7, err_msg=path)


PIPELINE = dict(pipeline_stages=4, num_microbatches=2, schedule="gpipe")  # Trainer flags


def test_classifier_stages_equal_one_device(files, tmp_path, capsys):
    """tfbig-classify --strategy=pipeline on the Trainer: the first step's per-variable
    gradients equal one device's; the run's losses, checkpoint, predictions and scores too."""
    from tfbig import finetune
    from tfbig.tasks.classify import ClassifyTask
    from tfbig.trainer import Trainer

    options = _classify_options(files, output_dir=str(tmp_path / "grads"), strategy="pipeline")
    cfg = finetune.experiment(options, "classify", **PIPELINE, peak_tflops=1.0)
    task = ClassifyTask(cfg.train, options)
    finetune.set_steps(cfg, options, len(task.examples["train"]))
    trainer = Trainer(cfg, task=task)
    batch = {k: tf.constant(v[:options.train_batch_size]) for k, v in task.arrays["train"].items()}
    loss, grads, _ = trainer.forward_backward(tf.nest.map_structure(lambda t: t[None], batch))
    ours = {v.path: np.asarray(g) for v, g in zip(trainer.model.trainable_variables, grads)}
    whole = task.build_model()  # one device, holding the stages' initial weights
    by_path = {v.path: v for v in trainer.model.variables}
    for v in whole.variables:
        v.assign(by_path[v.path])
    with tf.GradientTape() as tape:
        value = task.loss(whole, batch, training=True)[0]
    reference = {v.path: np.asarray(tf.convert_to_tensor(g)) for v, g in
                 zip(whole.trainable_variables, tape.gradient(value, whole.trainable_variables))}
    assert_same_gradients(ours, reference)
    assert float(loss) == pytest.approx(float(value), rel=1e-6)

    classify(_classify_options(files, output_dir=str(tmp_path / "pipe"), strategy="pipeline"),
             **PIPELINE, peak_tflops=1.0)
    printed = capsys.readouterr().out
    assert "pipeline: 4 stages, --schedule=gpipe, 2 micro-batches of 96 tokens" in printed
    for layer in ("embedding", "block_0", "block_1", "heads"):  # one layer per stage
        assert f" {layer} " in printed
    classify(_classify_options(files, output_dir=str(tmp_path / "one")), peak_tflops=1.0)
    runs = [tmp_path / "pipe", tmp_path / "one"]
    losses = [json.loads((run / "train_losses.json").read_text()) for run in runs]
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert_same_checkpoints(*[tf.train.latest_checkpoint(str(run)) for run in runs])
    for output in ("eval_results.json", "predictions.jsonl"):  # every stage predicted
        assert (runs[0] / output).read_text() == (runs[1] / output).read_text(), output


class Features:
    """What tfbig.squad.finetune.train reads of SQuAD features."""

    def __init__(self, arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays["input_ids"])


def albert_features(config, count, seed):
    """Random ALBERT inputs; the answer starts in the first half and ends in the second."""
    rng, t = np.random.default_rng(seed), config.seq_length
    return Features({
        "input_ids": rng.integers(5, config.vocab_size, (count, t)).astype(np.int32),
        "segment_ids": (np.arange(t) >= t // 2).astype(np.int32)[None].repeat(count, 0),
        "input_mask": np.ones((count, t), np.int32),
        "start_positions": rng.integers(1, t // 2, count).astype(np.int32),
        "end_positions": rng.integers(t // 2, t, count).astype(np.int32)})


ALBERT_PIPELINE = SquadOptions(train_batch_size=8, pipeline_stages=3, num_microbatches=4,
                               schedule="1f1b", stage_boundaries="layer_1,heads")


def _span_variables(model):  # as squad.finetune.train: the span head does not read the pooler
    unused = {id(v) for v in model.backbone.pooler.weights}
    return [v for v in model.trainable_variables if id(v) not in unused]


def test_albert_span_head_stages_equal_one_device(tmp_path, capsys):
    config = AlbertConfig(**ALBERT)
    features = albert_features(config, 64, 0)
    names = squad_finetune.INPUTS + ("start_positions", "end_positions")
    batch = {k: features.arrays[k][:8] for k in names}

    def build():
        return squad_finetune.build_model(config, None, seed=0)

    grads = [first_gradients(fine_tune_strategy("pipeline", "test", ALBERT_PIPELINE), build,
                             squad_finetune.span_loss, _span_variables, batch, config),
             reference_gradients(build, squad_finetune.span_loss, _span_variables, batch)]
    assert_same_gradients(grads[0][0], grads[1][0])  # group_0's: stages 0 and 1 summed

    runs = {}
    for name, options in (("pipe", ALBERT_PIPELINE), ("one", None)):
        strategy = fine_tune_strategy("pipeline" if options else "single", "test", options)
        with strategy.scope():
            model = finetune_parallel.build_model(strategy, build, config.seq_length, config,
                                                  squad_finetune.span_loss)
        losses = squad_finetune.train(model, features, batch_size=8, learning_rate=3e-3,
                                      max_steps=3, xla=False, log=None, strategy=strategy)
        model = finetune_parallel.assembled_model(strategy, model)
        write_checkpoint(strategy, model, str(tmp_path / name))
        runs[name] = losses, squad_finetune.predict(model, features, xla=False), strategy
    printed = capsys.readouterr().out
    assert "pipeline: 3 stages, --schedule=1f1b, 4 micro-batches of 32 tokens" in printed
    plan = runs["pipe"][2].plan
    assert [s.layer_names for s in plan] == [["embedding", "layer_0"], ["layer_1"], ["heads"]]
    assert len(runs["pipe"][0]) == 3 and runs["pipe"][0][0] != runs["pipe"][0][-1]
    np.testing.assert_allclose(runs["pipe"][0], runs["one"][0], rtol=1e-5)
    assert_same_checkpoints(tmp_path / "pipe" / "finetuned", tmp_path / "one" / "finetuned")
    for ours, theirs in zip(runs["pipe"][1], runs["one"][1]):  # start, end logits
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~25 s idle: two runs of tfbig-squad and a predict-only one
def test_squad_command_stages_equal_one_device(files, tmp_path):
    common = dict(init_checkpoint=str(files / "run"), train_file=str(files / "train.json"),
                  predict_file=str(files / "dev.json"), doc_stride=8, max_query_length=8,
                  **STEPS)
    squad(SquadOptions(**common, output_dir=str(tmp_path / "pipe"), strategy="pipeline",
                       pipeline_stages=2, num_microbatches=2, activation_checkpointing=True))
    squad(SquadOptions(**common, output_dir=str(tmp_path / "one")))
    runs = [tmp_path / "pipe", tmp_path / "one"]
    losses = [json.loads((run / "train_losses.json").read_text()) for run in runs]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert_same_checkpoints(*[run / "finetuned" for run in runs])
    for output in ("predictions.json", "eval_results.json"):
        assert (runs[0] / output).read_text() == (runs[1] / output).read_text(), output
    predict_only = {k: v for k, v in common.items() if k not in ("train_file", "init_checkpoint")}
    squad(SquadOptions(**predict_only, output_dir=str(runs[0])))  # reads the checkpoint back
    assert (runs[0] / "predictions.json").read_text() == \
        (runs[1] / "predictions.json").read_text()


@pytest.mark.parametrize("flags, message", [
    (dict(strategy="horovod", pipeline_stages=2),
     r"--pipeline_stages=2 needs --strategy=pipeline \(got --strategy=horovod\) \(stages on "
     r"different Horovod ranks are built for tfbig-train only\)"),
    (dict(num_microbatches=2), r"--num_microbatches=2 needs --strategy=pipeline \(got "
                               r"--strategy=single\)"),
    (dict(strategy="pipeline", num_microbatches=3),
     r"--train_batch_size=8 does not split into --num_microbatches=3 equal micro-batches"),
    (dict(strategy="pipeline", precision="mixed_float16"),
     r"--precision=mixed_float16 with --strategy=pipeline: tfbig-\w+ pipelines the model in "
     r"fp32 only"),
    (dict(strategy="pipeline", tensor_parallel=2),
     r"--tensor_parallel=2 needs --strategy=horovod \(got --strategy=pipeline\)"),
    (dict(strategy="pipeline", pipeline_stages=3, stage_boundaries="block_1"),
     r"--stage_boundaries='block_1' gives 1 boundaries; --pipeline_stages=3 needs 2"),
    (dict(strategy="pipeline", pipeline_stages=2, stage_boundaries="block_7"),
     r"--stage_boundaries='block_7': 'block_7' is neither a layer index nor a layer name; "
     r"layers are \['embedding', 'block_0', 'block_1', 'heads'\]"),
])
def test_bad_pipeline_flags_are_refused_before_training(flags, message, files, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=message):
        squad(SquadOptions(init_checkpoint=str(files / "run"), train_file=str(files / "train.json"),
                           doc_stride=8, max_query_length=8, output_dir=str(out), **STEPS,
                           **flags))
    assert not (out / "finetuned.index").exists()


@pytest.mark.parametrize("strategy, flags, message", [
    ("single", dict(num_microbatches=2),
     r"--num_microbatches=2 has no effect with --strategy=single"),
    ("pipeline", dict(num_microbatches=3), r"does not split into --num_microbatches=3"),
    ("pipeline", dict(tensor_parallel=2),
     r"--tensor_parallel=2 has no effect with --strategy=pipeline"),
    ("pipeline", dict(pipeline_stages=3, stage_boundaries="block_1"),
     r"--stage_boundaries='block_1' gives 1 boundaries; --pipeline_stages=3 needs 2"),
])
def test_bad_pipeline_flags_of_tfbig_classify_are_the_trainers_errors(strategy, flags, message,
                                                                      files, tmp_path):
    """tfbig-classify runs the Trainer: its pipeline flags are checked as tfbig-train's,
    before any step."""
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=message):
        classify(_classify_options(files, output_dir=str(out), strategy=strategy), **flags)
    assert not list(out.glob("ckpt-*"))


def test_more_stages_than_layers_is_refused_naming_the_flag():
    """A 1-layer ALBERT has 3 pipeline layers (embedding, layer_0, heads): 4 stages cannot
    each get one."""
    config = AlbertConfig(**{**ALBERT, "num_layers": 1})
    strategy = fine_tune_strategy("pipeline", "test", PipelineOptions(pipeline_stages=4))
    with pytest.raises(ValueError, match=r"--pipeline_stages=4: the model has 3 layers "
                                         r"\(embedding \.\. heads\), so 1\.\.3 stages"):
        finetune_parallel.build_model(strategy, lambda: squad_finetune.build_model(config),
                                      config.seq_length, config, squad_finetune.span_loss)


def _pipeline_trainer(gpt2_bpe, model_dir):
    from test_init_checkpoint import _cfg

    from tfbig.trainer import Trainer

    cfg = _cfg(init_checkpoint=gpt2_bpe["run"], data_dir=gpt2_bpe["data"], strategy="pipeline",
               model_dir=str(model_dir))
    cfg.pipeline.pipeline_stages, cfg.pipeline.num_microbatches = 2, 2
    return Trainer(cfg)


def test_tfbig_train_pipeline_starts_from_a_converted_checkpoint(gpt2_bpe, tmp_path):
    """tfbig-train --strategy=pipeline --init_checkpoint: the stages (one process, two devices)
    hold exactly the converted weights."""
    trainer = _pipeline_trainer(gpt2_bpe, tmp_path / "continued")
    assert len({v.value.device for v in trainer.model.trainable_variables}) == 2
    converted = run_dir.read_weights(gpt2_bpe["run"])
    ours = {k: v.numpy() for k, v in model_variables(trainer.model).items()}
    assert sorted(ours) == sorted(converted)
    assert all(np.array_equal(ours[k], converted[k]) for k in ours)


@pytest.mark.slow  # ~10 s idle: a pipeline training step
def test_tfbig_train_pipeline_first_step_is_the_converted_models(gpt2_bpe, tmp_path):
    """... and its first step's loss is the converted model's own on the same batch (as
    tfbig-generate loads it)."""
    from test_init_checkpoint import _first_step_loss_and_reference

    from tfbig.generate import load_model

    trainer = _pipeline_trainer(gpt2_bpe, tmp_path / "continued")
    loss, expected = _first_step_loss_and_reference(trainer, load_model(gpt2_bpe["run"])[0])
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
