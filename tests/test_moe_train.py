"""An MoE Llama (--preset=tiny-moe) through the trainer on one process: its loss is the
cross-entropy plus the router losses times their coefficients, the per-expert token counts and
dropped tokens reach the progress line, and MoE settings that cannot run are refused by name
before anything is written. (Expert parallelism against one process:
tests/distribute/test_expert_parallel.py.)"""
import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_trainer import make_cfg  # noqa: E402

from tfbig.training.trainer import Trainer  # noqa: E402

MOE = dict(model="llama", preset="tiny-moe", num_layers=2, hidden_size=32, num_heads=4)


def moe_cfg(data, model_dir, moe=None, parallel=None, **train):
    cfg = make_cfg(data, model_dir, **{**MOE, **train})
    for section, values in (("moe", moe), ("parallel", parallel)):
        for key, value in (values or {}).items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def test_the_moe_loss_adds_the_router_losses_and_logs_expert_counts(gpt_data, tmp_path, capsys):
    # capacity ceil(0.5 x 128 tokens x 2 / 4 experts) = 32: at most 128 of the 256 kept
    cfg = moe_cfg(gpt_data, tmp_path / "run", {"router_z_loss_coef": 0.1, "capacity_factor": 0.5},
                  max_steps=2)
    trainer = Trainer(cfg)
    assert trainer.model.config.num_experts == 4
    batch = next(trainer._train_iterator())
    _, _, metrics = trainer.forward_backward(batch)
    metrics = {k: float(v) for k, v in metrics.items()}
    assert metrics["router_aux_loss"] > 0.5 and metrics["router_z_loss"] > 0
    np.testing.assert_allclose(metrics["loss"], metrics["lm_loss"] + 0.01 * metrics[
        "router_aux_loss"] + 0.1 * metrics["router_z_loss"], rtol=1e-6)
    assert metrics["expert_tokens_mean"] == 8 * 16 * 2 / 4  # batch 8 x 16 tokens, k=2
    assert metrics["expert_tokens_min"] <= 64 <= metrics["expert_tokens_max"]
    assert metrics["dropped_tokens"] >= 128
    summary = trainer.fit()
    assert np.isfinite(summary["train"]["loss"])
    out = capsys.readouterr().out
    assert "expert tokens" in out and "(min/mean/max)" in out
    dropped = [int(n) for n in re.findall(r"\| dropped (\d+)", out)]
    assert len(dropped) == 2 and min(dropped) >= 128, out  # each step's, on its progress line


HOROVOD = dict(strategy="horovod")
EP2 = {"expert_parallel": 2}


@pytest.mark.parametrize("train,moe,parallel,message", [
    (dict(xla=True), {}, {}, "--xla"),
    (dict(preset="tiny"), {"experts_per_token": 1}, {}, "--experts_per_token=1 has no effect"),
    (dict(model="gpt", preset="tiny"), {"num_experts": 4}, {}, "--num_experts=4 has no effect"),
    ({}, {"experts_per_token": 3}, {}, "--experts_per_token=3"),  # k > 2
    ({}, {"num_experts": 1}, {}, "--experts_per_token=2: expected 1 or 2, at most "
                                 "--num_experts=1"),  # k > E
    ({}, {"capacity_factor": -0.5}, {}, "--capacity_factor=-0.5"),
    ({}, {}, EP2, "--expert_parallel=2 has no effect with --strategy=single"),
    (HOROVOD, {}, EP2, "--expert_parallel=2 does not divide the 1 data-parallel ranks"),
    (HOROVOD, {}, {**EP2, "tensor_parallel": 2, "zero_stage": 3},
     "--expert_parallel=2 with --tensor_parallel=2 and --zero_stage=3"),
    (dict(HOROVOD, pipeline_stages=2), {}, {**EP2, "tensor_parallel": 2},
     "--expert_parallel=2 with --pipeline_stages=2 and --tensor_parallel=2"),
])
def test_moe_settings_that_cannot_run_are_refused_before_anything_is_written(
        gpt_data, tmp_path, train, moe, parallel, message):
    train = dict(train)
    stages = train.pop("pipeline_stages", 0)
    cfg = moe_cfg(gpt_data, tmp_path / "run", moe, parallel, **train)
    cfg.pipeline.pipeline_stages = stages
    with pytest.raises(ValueError, match=message):
        Trainer(cfg)
    assert not os.path.exists(tmp_path / "run")
    tf.keras.backend.clear_session()


@pytest.mark.parametrize("value", ["0", "-0.5"])
def test_a_given_capacity_factor_at_or_below_zero_is_refused_by_the_command(tmp_path, value):
    """0 is a config's "unset" (dropless), so only the command, which knows a flag was given,
    can refuse `--capacity_factor=0`: one line, exit code 2, nothing written."""
    from test_cli import command

    code, out, err = command("tfbig-train", "--model=llama", "--preset=tiny-moe",
                             f"--capacity_factor={value}", f"--model_dir={tmp_path / 'run'}")
    assert code == 2, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(
        f"tfbig-train: error: --capacity_factor={value}: expected a factor > 0 such as 1.25")
    assert not os.path.exists(tmp_path / "run")
