"""Pipeline fine-tuning (--strategy=pipeline of tfbig-classify and tfbig-squad; stages on the
logical CPU devices of tests/pipeline/conftest.py) against one device on the same global
batches, fp32:

- tfbig-classify on a converted BERT (--init_checkpoint): embedding | block_0 | block_1 |
  classifier on 4 stages, GPipe, 2 micro-batches: per-step losses, every weight of the written
  checkpoint, the predictions and scores, and the first step's per-variable gradients.
- tfbig-squad on the converted BERT: embedding + block_0 | block_1 | span head on 3 stages
  cut by --stage_boundaries, 1F1B, 4 micro-batches: losses, every trained weight
  (tests/equality.py's rule), predictions and scores, and a predict-only run in one process
  reading the stages' checkpoint back; slow: 2 stages, every stage recomputed in the backward.
- tfbig-train --strategy=pipeline --init_checkpoint: the stages hold the converted weights
  (slow: the first step's loss is the converted model's own).
Bad input (stages, boundaries, micro-batches, unbuilt combinations) fails before training,
naming the flags, as tfbig-train's.
"""
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "distribute"))
from equality import RecordedGradients  # noqa: E402
from test_finetune_parallel import BERT, assert_same_checkpoints, write_files  # noqa: E402

from tfbig.checkpoints.checkpoint import model_variables  # noqa: E402
from tfbig.commands.classify import ClassifyOptions  # noqa: E402
from tfbig.commands.classify import fine_tune as classify  # noqa: E402
from tfbig.convert import run_dir  # noqa: E402
from tfbig.commands.squad import SquadOptions  # noqa: E402
from tfbig.commands.squad import fine_tune as squad  # noqa: E402

STEPS = dict(max_steps=4, train_batch_size=8, learning_rate=3e-3, max_seq_length=24, xla=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A random BERT run directory (tfbig-convert's layout) and classification/SQuAD files."""
    return write_files(tmp_path_factory.mktemp("finetune_pipeline"))


def _classify_options(files, **flags):
    return ClassifyOptions(init_checkpoint=str(files / "run"), train_file=str(files /
                           "train.jsonl"), eval_file=str(files / "dev.jsonl"), **STEPS, **flags)


def assert_same_gradients(ours, reference):
    assert list(ours) == list(reference) and len(ours) > 20
    for path, grad in reference.items():
        assert np.abs(grad).max() > 0, path
        np.testing.assert_allclose(ours[path], grad, rtol=1e-5, atol=1e-7, err_msg=path)


PIPELINE = dict(pipeline_stages=4, num_microbatches=2, schedule="gpipe")  # Trainer flags


@pytest.mark.slow  # fine-tuning on pipeline stages: test_squad_stages_equal_one_device (default), the same stage machinery with a span head
def test_classifier_stages_equal_one_device(files, tmp_path, capsys):
    """tfbig-classify --strategy=pipeline on the Trainer: the first step's per-variable
    gradients equal one device's; the run's losses, checkpoint, predictions and scores too."""
    from tfbig.training import finetune
    from tfbig.tasks.classify import ClassifyTask
    from tfbig.training.trainer import Trainer

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


SQUAD = dict(doc_stride=8, max_query_length=8, **STEPS, log_every=1)


@pytest.mark.slow  # SQuAD fine-tuned on pipeline stages (~50 s); stages equal one device by default for GPT and ALBERT, SQuAD on two workers in test_bert_squad
def test_squad_stages_equal_one_device(files, tmp_path, capsys):
    """tfbig-squad --strategy=pipeline on the Trainer (embedding + block_0 | block_1 | heads
    cut by --stage_boundaries, 1F1B, 4 micro-batches): losses, every trained weight
    (tests/equality.py's rule), the predictions and scores equal one device's; a predict-only
    run in one process reads the stages' checkpoint back to the same answers."""
    common = dict(init_checkpoint=str(files / "run"), train_file=str(files / "train.json"),
                  predict_file=str(files / "dev.json"), **SQUAD)
    squad(SquadOptions(**common, output_dir=str(tmp_path / "pipe"), strategy="pipeline"),
          pipeline_stages=3, num_microbatches=4, schedule="1f1b",
          stage_boundaries="block_1,heads", peak_tflops=1.0)
    printed = capsys.readouterr().out
    assert "pipeline: 3 stages, --schedule=1f1b, 4 micro-batches" in printed
    recorded = []
    squad(SquadOptions(**common, output_dir=str(tmp_path / "one")), peak_tflops=1.0,
          before_fit=lambda trainer: recorded.append(RecordedGradients(trainer)))
    runs = [tmp_path / "pipe", tmp_path / "one"]
    losses = [json.loads((run / "train_losses.json").read_text()) for run in runs]
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(runs[0])))
    from tfbig.checkpoints.checkpoint import reader_key
    from tfbig.models.bert import BertConfig
    from tfbig.tasks.squad_model import build_model

    whole = build_model(BertConfig(**BERT))
    by_path = {v.path: v for v in whole.trainable_variables}
    recorded[0].assert_equal({p: reader.get_tensor(reader_key(whole, by_path[p]))
                              for p in recorded[0].paths})
    for output in ("predictions.json", "eval_results.json"):
        assert (runs[0] / output).read_text() == (runs[1] / output).read_text(), output
    predict_only = {k: v for k, v in common.items() if k not in ("train_file", "init_checkpoint")}
    squad(SquadOptions(**predict_only, output_dir=str(runs[0])), peak_tflops=1.0)
    assert (runs[0] / "predictions.json").read_text() == \
        (runs[1] / "predictions.json").read_text()


@pytest.mark.slow  # ~25 s idle: two runs of tfbig-squad
def test_squad_recomputed_stages_equal_one_device(files, tmp_path):
    """2 stages, GPipe, every stage recomputed in the backward: losses and checkpoint."""
    common = dict(init_checkpoint=str(files / "run"), train_file=str(files / "train.json"),
                  **SQUAD)
    squad(SquadOptions(**common, output_dir=str(tmp_path / "pipe"), strategy="pipeline"),
          pipeline_stages=2, num_microbatches=2, activation_checkpointing=True,
          peak_tflops=1.0)
    squad(SquadOptions(**common, output_dir=str(tmp_path / "one")), peak_tflops=1.0)
    runs = [tmp_path / "pipe", tmp_path / "one"]
    losses = [json.loads((run / "train_losses.json").read_text()) for run in runs]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


@pytest.mark.parametrize("strategy, flags, message", [
    ("single", dict(num_microbatches=2),
     r"--num_microbatches=2 has no effect with --strategy=single"),
    ("pipeline", dict(num_microbatches=3), r"does not split into --num_microbatches=3"),
    ("pipeline", dict(tensor_parallel=2),
     r"--tensor_parallel=2 has no effect with --strategy=pipeline"),
    ("pipeline", dict(pipeline_stages=3, stage_boundaries="block_1"),
     r"--stage_boundaries='block_1' gives 1 boundaries; --pipeline_stages=3 needs 2"),
    ("pipeline", dict(pipeline_stages=2, stage_boundaries="block_7"),
     r"--stage_boundaries='block_7': 'block_7' is neither a layer index nor a layer name"),
])
@pytest.mark.parametrize("command", ["classify", pytest.param("squad", marks=pytest.mark.slow)])
def test_bad_pipeline_flags_of_the_commands_are_the_trainers_errors(command, strategy, flags,
                                                                     message, files, tmp_path):
    """tfbig-classify and tfbig-squad run the Trainer: their pipeline flags are checked as
    tfbig-train's, before any step."""
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=message):
        if command == "classify":
            classify(_classify_options(files, output_dir=str(out), strategy=strategy), **flags)
        else:
            squad(SquadOptions(init_checkpoint=str(files / "run"), strategy=strategy,
                               train_file=str(files / "train.json"), output_dir=str(out),
                               **SQUAD), **flags)
    assert not list(out.glob("ckpt-*"))


def test_more_stages_than_layers_is_refused_naming_the_flag():
    """A 1-layer ALBERT with the span head has 3 pipeline layers (embedding, layer_0, heads):
    4 stages cannot each get one."""
    from tfbig.models.albert import AlbertConfig
    from tfbig.layouts.partition import partition
    from tfbig.models.shapes import fine_tune_specs

    config = AlbertConfig(vocab_size=32, embedding_size=16, hidden_size=32, num_layers=1,
                          num_heads=2, intermediate_size=48, seq_length=16)
    with pytest.raises(ValueError, match=r"--pipeline_stages=4: the model has 3 layers "
                                         r"\(embedding \.\. heads\), so 1\.\.3 stages"):
        partition(fine_tune_specs(config, 16), 4)


def _pipeline_trainer(gpt2_bpe, model_dir):
    from test_init_checkpoint import _cfg

    from tfbig.training.trainer import Trainer

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

    from tfbig.convert.run_dir import load_model

    trainer = _pipeline_trainer(gpt2_bpe, tmp_path / "continued")
    loss, expected = _first_step_loss_and_reference(trainer, load_model(gpt2_bpe["run"])[0])
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
