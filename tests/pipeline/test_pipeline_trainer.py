"""--strategy=pipeline through the one training loop, against the single-device run."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from equality import RecordedGradients  # noqa: E402
from test_trainer import assert_weights_close, make_cfg, weights  # noqa: E402

from tfbig.training.trainer import Trainer  # noqa: E402

# Clipping at 0.5 is active, so a gradient summed instead of averaged over micro-batches
# (or a micro-batch counted twice) would change the weights.
RUN = dict(max_steps=4, batch_size=8, grad_clip_norm=0.5, dropout=0.0, hidden_size=16,
           num_heads=2, eval_steps=2)


def pipeline_trainer(gpt_data, model_dir, pipeline=None, **train):
    cfg = make_cfg(gpt_data, model_dir, strategy="pipeline", **{**RUN, **train})
    for key, value in (pipeline or {}).items():
        setattr(cfg.pipeline, key, value)
    return Trainer(cfg)


@pytest.fixture(scope="module")
def single(gpt_data, tmp_path_factory):
    """The single-device reference run: (its gradients and weights, summary)."""
    trainer = Trainer(make_cfg(gpt_data, tmp_path_factory.mktemp("single"), **RUN))
    recorded = RecordedGradients(trainer)
    summary = trainer.fit()
    return recorded, summary


@pytest.mark.parametrize("pipeline,train", [
    (dict(pipeline_stages=2, num_microbatches=4, schedule="1f1b"), {}),
    # 9 s: 4 recomputed GPipe stages equal the unsplit model in the default run
    # (test_pipeline_equivalence), gradient accumulation around cross-rank stages too
    # (test_cross_rank's grad_accum_steps=2)
    pytest.param(dict(pipeline_stages=4, num_microbatches=8, schedule="gpipe",
                      activation_checkpointing=True), dict(grad_accum_steps=2),
                 marks=pytest.mark.slow),
], ids=["2x4-1f1b", "4x8-gpipe-recompute-accum2"])
def test_training_matches_the_single_device_weights(gpt_data, tmp_path, single, capsys,
                                                    pipeline, train):
    trainer = pipeline_trainer(gpt_data, tmp_path, pipeline, **train)
    summary = trainer.fit()
    reference, single_summary = single
    assert summary["step"] == RUN["max_steps"]
    assert summary["train"]["grad_norm"] > RUN["grad_clip_norm"]  # clipping is active
    assert summary["train"]["loss"] == pytest.approx(single_summary["train"]["loss"], rel=1e-5)
    reference.assert_equal(weights(trainer))
    if "grad_accum_steps" not in train:  # same eval batches (of batch_size / accum)
        assert summary["eval"]["loss"] == pytest.approx(single_summary["eval"]["loss"],
                                                        rel=1e-5)
    plan = capsys.readouterr().out
    assert f"pipeline: {pipeline['pipeline_stages']} stages" in plan and "est. memory" in plan


@pytest.mark.slow
def test_resumed_pipeline_run_equals_uninterrupted(gpt_data, tmp_path):
    options = dict(pipeline_stages=2, num_microbatches=2, schedule="1f1b")
    straight = pipeline_trainer(gpt_data, tmp_path / "straight", options, dropout=0.1)
    straight.fit()
    first = pipeline_trainer(gpt_data, tmp_path / "resumed", options, dropout=0.1)
    first.fit(steps=2)
    second = pipeline_trainer(gpt_data, tmp_path / "resumed", options, dropout=0.1)
    assert int(second.step.numpy()) == 2
    second.fit()
    assert_weights_close(weights(straight), weights(second), rtol=1e-6)


def test_a_batch_size_not_divisible_by_microbatches_fails_before_training(gpt_data, tmp_path):
    with pytest.raises(ValueError, match=r"a batch of 8 sequences per replica does not split "
                                         r"into --num_microbatches=3"):
        pipeline_trainer(gpt_data, tmp_path, dict(pipeline_stages=2, num_microbatches=3))


def test_too_many_stages_for_the_devices_names_the_flag(gpt_data, tmp_path):
    with pytest.raises(RuntimeError, match=r"--pipeline_stages=16 needs 16 logical CPU devices"):
        pipeline_trainer(gpt_data, tmp_path, dict(pipeline_stages=16))


@pytest.mark.slow  # fp16 loss scaling under XLA stays by default on one device (test_trainer) and Horovod (test_horovod)
def test_fp16_xla_stages_scale_the_loss_and_stay_finite(gpt_data, tmp_path):
    """fp16's loss scale is a variable on another device than the last stage, which XLA
    cannot read there: it enters the stage as a tensor."""
    trainer = pipeline_trainer(gpt_data, tmp_path, dict(pipeline_stages=2, num_microbatches=2),
                               precision="mixed_float16", xla=True, max_steps=3)
    summary = trainer.fit()
    assert np.isfinite(summary["train"]["loss"]) and summary["train"]["skipped_steps"] == 0
    assert trainer.model.blocks[0].attn.qkv.compute_dtype == "float16"
    assert summary["train"]["loss_scale"] > 1.0
