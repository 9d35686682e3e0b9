"""ALBERT pretraining through the common Trainer: the loss falls, metrics, dynamic masking,
resume, mixed precision, and the task built from the experiment config."""
import numpy as np
import pytest

from tfbig.config import ExperimentConfig
from tfbig.tasks import get_task
from tfbig.tasks.albert import AlbertTask
from tfbig.training.trainer import Trainer


def make_cfg(data_dir, model_dir, **train):
    cfg = ExperimentConfig()
    defaults = dict(model="albert", data_dir=data_dir, model_dir=str(model_dir), preset="tiny",
                    hidden_size=32, num_heads=4, batch_size=16, max_steps=4, optimizer="lamb",
                    learning_rate=5e-2, warmup_steps=5, weight_decay=0.01, beta_2=0.999,
                    epsilon=1e-6, log_every=1000, checkpoint_every=1000, eval_steps=4,
                    deterministic=True, xla=False)
    for key, value in {**defaults, **train}.items():
        setattr(cfg.train, key, value)
    return cfg


def trainer_for(cfg):
    return Trainer(cfg, task=get_task(cfg.train, cfg))


@pytest.mark.slow  # 60 ALBERT steps; ALBERT's loss and metrics are checked against one device in tests/pipeline/test_pipeline_albert.py
def test_loss_falls_and_metrics_are_reported(albert_data_dir, tmp_path):
    trainer = trainer_for(make_cfg(albert_data_dir, tmp_path, max_steps=60, xla=True))
    first = trainer.evaluate()
    summary = trainer.fit()
    final = summary["eval"]
    assert set(final) == {"loss", "mlm_loss", "sop_loss", "mlm_accuracy", "sop_accuracy"}
    assert final["mlm_loss"] < first["mlm_loss"] - 0.8  # from ~ln(1000) = 6.9
    assert final["loss"] == pytest.approx(final["mlm_loss"] + final["sop_loss"], rel=1e-5)
    assert final["mlm_accuracy"] > first["mlm_accuracy"] + 0.05
    assert 0.0 <= final["sop_accuracy"] <= 1.0 and np.isfinite(summary["train"]["loss"])


def test_get_task_passes_the_albert_section(albert_data_dir, tmp_path):
    cfg = make_cfg(albert_data_dir, tmp_path, max_steps=3)
    cfg.albert.embedding_size, cfg.albert.num_groups, cfg.train.num_layers = 8, 2, 4
    task = get_task(cfg.train, cfg)
    assert isinstance(task, AlbertTask) and task.max_predictions_per_seq == 12
    assert (task.model_config.embedding_size, task.model_config.num_groups) == (8, 2)
    assert task.model_config.vocab_size == 1000 and task.seq_length == 64


def test_trainer_from_the_config_alone_takes_the_albert_section(albert_data_dir, tmp_path):
    # As tfbig-train builds it: Trainer(cfg), no task handed in.
    cfg = make_cfg(albert_data_dir, tmp_path, max_steps=1)
    cfg.albert.embedding_size, cfg.albert.num_groups, cfg.train.num_layers = 8, 2, 4
    trainer = Trainer(cfg)
    assert (trainer.task.model_config.embedding_size, trainer.task.model_config.num_groups) \
        == (8, 2)
    assert len(trainer.model.backbone.groups) == 2


@pytest.mark.slow  # three ALBERT trainings; the masking's statistics and determinism: test_albert_data (default)
def test_dynamic_masking_trains_and_resumes_exactly(albert_data_dir, tmp_path):
    cfg = make_cfg(albert_data_dir, tmp_path / "whole", max_steps=6)
    cfg.albert.dynamic_masking = True
    whole = trainer_for(cfg).fit()
    cfg_a = make_cfg(albert_data_dir, tmp_path / "resumed", max_steps=3, checkpoint_every=3)
    cfg_a.albert.dynamic_masking = True
    trainer_for(cfg_a).fit()
    cfg_b = make_cfg(albert_data_dir, tmp_path / "resumed", max_steps=6)
    cfg_b.albert.dynamic_masking = True
    resumed = trainer_for(cfg_b).fit()
    assert resumed["train"]["loss"] == pytest.approx(whole["train"]["loss"], rel=1e-5)
    static = get_task(make_cfg(albert_data_dir, tmp_path).train, ExperimentConfig())
    dynamic = get_task(cfg.train, cfg)
    first = [next(iter(task.dataset("train", 8, shuffle=False))) for task in (static, dynamic)]
    assert (first[0]["masked_lm_positions"].numpy() != first[1]["masked_lm_positions"].numpy()).any()


@pytest.mark.slow  # bf16 steps are checked on GPT in the default run
def test_mixed_precision_step_stays_finite(albert_data_dir, tmp_path):
    trainer = trainer_for(make_cfg(albert_data_dir, tmp_path, precision="mixed_bfloat16",
                                   max_steps=2))
    assert np.isfinite(trainer.fit()["train"]["loss"])
    assert trainer.model.backbone.group_0.attn.qkv.compute_dtype == "bfloat16"


def test_gpt_data_is_refused_with_a_clear_error(tmp_path, albert_data_dir):
    import json
    import shutil

    other = tmp_path / "gpt_like"
    shutil.copytree(albert_data_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "format": "gpt"}))
    with pytest.raises(ValueError, match="format is 'gpt' but 'albert' was expected"):
        AlbertTask(make_cfg(str(other), tmp_path / "run").train)
