"""BERT through the in-process pipeline (--strategy=pipeline): embedding | block_0 | block_1 |
heads on 4 devices, GPipe with every block recomputed in the backward, against the
single-device run on the same batches: first-batch gradients of every weight, losses over the
steps (clipping active), final weights and the validation loss.

Every sequence of the bert_data fixture has exactly 2 masked tokens, so the per-micro-batch
masked-LM means average to the batch's (the next-sentence loss is a mean over sequences).
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "distribute"))
from equality import RecordedGradients  # noqa: E402
from test_trainer import make_cfg, weights  # noqa: E402

from horovod_worker import RecordingLogger  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

# AdamW at make_cfg's peak lr 3e-3: a weight whose gradient is near zero moves by up to the lr
# whatever the gradient's last bits (at 1e-2 one position-table entry of 4096 differed by 1e-6).
RUN = dict(model="bert", seq_length=32, max_steps=3, batch_size=8, grad_clip_norm=0.5,
           dropout=0.0, weight_decay=0.01, epsilon=1e-6, eval_steps=1)
PIPELINE = dict(pipeline_stages=4, num_microbatches=4, schedule="gpipe",
                activation_checkpointing=True)


def trained(cfg):
    """(trainer after fit, per-step losses, first-batch gradients, summary); a single-device
    trainer's `recorded` holds the gradients of its updates (tests/equality.py)."""
    logger = RecordingLogger(cfg.train.model_dir, True, cfg.train.max_steps)
    trainer = Trainer(cfg, logger=logger)
    _, grads, _ = trainer.forward_backward(next(trainer._train_iterator()))
    grads = [g.numpy() for g in grads]
    if cfg.train.strategy == "single":
        trainer.recorded = RecordedGradients(trainer)
    summary = trainer.fit()
    return trainer, np.array([logger.losses[s][0] for s in sorted(logger.losses)]), grads, \
        summary


@pytest.mark.slow  # BERT's blocks in stages: SQuAD's BERT on stages (test_pipeline_finetune) and GPT/ALBERT stages stay in the default run
def test_bert_stages_equal_the_single_device_run(bert_data, tmp_path, capsys):
    cfg = make_cfg(bert_data, tmp_path / "pipeline", strategy="pipeline", **RUN)
    for key, value in PIPELINE.items():
        setattr(cfg.pipeline, key, value)
    staged, losses, grads, summary = trained(cfg)
    assert [s.layer_names for s in staged.strategy.plan] == [
        ["embedding"], ["block_0"], ["block_1"], ["heads"]]
    assert "pipeline: 4 stages" in capsys.readouterr().out
    single, single_losses, single_grads, single_summary = trained(
        make_cfg(bert_data, tmp_path / "single", **RUN))
    names = [v.path for v in single.model.trainable_variables]
    assert [v.path for v in staged.model.trainable_variables] == names
    for name, ours, theirs in zip(names, grads, single_grads, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7, err_msg=name)
    assert summary["train"]["grad_norm"] > RUN["grad_clip_norm"]  # clipping is active
    assert len(losses) == RUN["max_steps"]
    np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
    single.recorded.assert_equal(weights(staged))
    assert summary["eval"]["loss"] == pytest.approx(single_summary["eval"]["loss"], rel=1e-5)
