"""BERT pretraining through the common Trainer: MLM + NSP loss falls, exact resume, the
task from the experiment config, and flags that do not apply to BERT refused."""
import numpy as np
import pytest

from tfbig.config import ExperimentConfig, check_applicable
from tfbig.tasks import get_task
from tfbig.tasks.bert import BertTask
from tfbig.training.trainer import Trainer


def make_cfg(data_dir, model_dir, **train):
    cfg = ExperimentConfig()
    defaults = dict(model="bert", data_dir=data_dir, model_dir=str(model_dir), preset="tiny",
                    hidden_size=32, num_heads=4, batch_size=16, max_steps=4,
                    learning_rate=2e-2, warmup_steps=5, weight_decay=0.01, beta_2=0.999,
                    epsilon=1e-6, log_every=1000, checkpoint_every=1000, eval_steps=4,
                    deterministic=True, xla=False, dropout=0.0)
    for key, value in {**defaults, **train}.items():
        setattr(cfg.train, key, value)
    return cfg


@pytest.mark.slow  # 60 steps with XLA: ~15 s idle
def test_mlm_and_nsp_losses_fall(bert_data_dir, tmp_path):
    trainer = Trainer(make_cfg(bert_data_dir, tmp_path, max_steps=60, xla=True))
    assert isinstance(trainer.task, BertTask) and trainer.model.name == "bert"
    first = trainer.evaluate()
    final = trainer.fit()["eval"]
    assert set(final) == {"loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"}
    assert final["mlm_loss"] < first["mlm_loss"] - 0.8  # from ~ln(1000) = 6.9
    assert final["loss"] == pytest.approx(final["mlm_loss"] + final["nsp_loss"], rel=1e-5)
    assert final["mlm_accuracy"] > first["mlm_accuracy"] + 0.05
    assert final["nsp_loss"] < first["nsp_loss"]


@pytest.mark.slow  # three BERT trainings; exact resume is checked on GPT in the default run, BERT trains there under PP x TP
def test_resume_is_exact(bert_data_dir, tmp_path):
    whole = Trainer(make_cfg(bert_data_dir, tmp_path / "whole", max_steps=6))
    whole.fit()
    # the run carries the data's vocab.txt as a converted BERT does: the fine-tuning commands
    # (and the Hugging Face export) read it from config.json's "tokenizer" entry
    import filecmp
    import json

    from tfbig.tasks.squad_model import pretrained_config

    assert filecmp.cmp(tmp_path / "whole" / "vocab.txt", f"{bert_data_dir}/vocab.txt",
                       shallow=False)
    saved = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert saved["tokenizer"] == {"vocab_file": "vocab.txt", "lowercase": True}
    config, tokenizer = pretrained_config(str(tmp_path / "whole"))
    assert config.hidden_size == 32 and tokenizer.lowercase
    Trainer(make_cfg(bert_data_dir, tmp_path / "resumed", max_steps=3, checkpoint_every=3)).fit()
    resumed = Trainer(make_cfg(bert_data_dir, tmp_path / "resumed", max_steps=6))
    resumed.fit()
    for a, b in zip(whole.model.weights, resumed.model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)


def test_task_reads_the_data_and_the_masking_section(bert_data_dir, tmp_path):
    cfg = make_cfg(bert_data_dir, tmp_path, num_layers=3)
    cfg.albert.dynamic_masking = True
    check_applicable(cfg)
    task = get_task(cfg.train, cfg)
    assert task.max_predictions_per_seq == 12 and task._masking is not None
    assert (task.model_config.num_layers, task.model_config.vocab_size) == (3, 1000)
    cfg.albert.num_groups = 2
    with pytest.raises(ValueError, match="--num_groups=2 has no effect with --model=bert"):
        check_applicable(cfg)


def test_albert_data_is_refused_for_bert(albert_data, tmp_path):
    with pytest.raises(ValueError, match="format is 'albert' but 'bert' was expected"):
        BertTask(make_cfg(albert_data, tmp_path).train)


@pytest.mark.parametrize("section,field,value", [
    ("train", "strategy", "pipeline"), ("parallel", "tensor_parallel", 2),
    ("parallel", "zero_stage", 3), ("pipeline", "pipeline_stages", 2),
    ("pipeline", "activation_checkpointing", True)])
def test_every_layout_with_a_bert_plan_is_accepted(tmp_path, section, field, value):
    """BERT's plans (its layout(): tensor, gathers, blocks; pipeline/layers.py)
    exist; the runs are compared with one device in tests/distribute and tests/pipeline."""
    cfg = make_cfg("unused", tmp_path, strategy="horovod", model="bert")
    if field == "strategy":
        cfg.train.strategy = value
    else:
        setattr(getattr(cfg, section), field, value)
    check_applicable(cfg)
