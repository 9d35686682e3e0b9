"""The compiled training step (tfbig.training.step): with --xla the whole single-device step,
update included, is one XLA program; it trains exactly as the step whose update runs op by
op (--compile_update=false), fp16's skip of a non-finite step included."""
import numpy as np
import pytest
import tensorflow as tf

from equality import RecordedGradients
from test_trainer import make_cfg, weights
from tfbig.tasks.gpt import GPTTask
from tfbig.training.trainer import Trainer

# Clipping at 0.5 is active at every step (the gradient norm is above it).
STEPS = dict(max_steps=4, grad_clip_norm=0.5, xla=True)


class PoisonedTask(GPTTask):
    """GPT whose loss is multiplied by `poison` (inf: a non-finite step)."""

    def __init__(self, train):
        super().__init__(train)
        self.poison = tf.Variable(1.0, trainable=False)

    def loss(self, model, batch, training=False):
        loss, metrics = super().loss(model, batch, training)
        return loss * self.poison, {k: v * self.poison for k, v in metrics.items()}


class StepLosses:
    """The loss, grad norm and loss scale of every step the trainer logs (log_every=1)."""

    def __init__(self, trainer):
        self.rows = []
        scalars = trainer.logger.scalars

        def keep(split, step, values):
            if split == "train":
                self.rows.append((values["loss"], values["grad_norm"],
                                  values.get("loss_scale", 1.0)))
            scalars(split, step, values)
        trainer.logger.scalars = keep


def run(data, directory, compile_update, poison_first=False, **train):
    cfg = make_cfg(data, directory, compile_update=compile_update, **{**STEPS, **train})
    task = PoisonedTask(cfg.train)
    trainer = Trainer(cfg, task=task)
    losses = StepLosses(trainer)
    recorded = RecordedGradients(trainer)
    initial = weights(trainer)
    if poison_first:  # step 1's loss is inf: the update is skipped, the scale halved
        task.poison.assign(float("inf"))
        trainer.fit(steps=1)
        task.poison.assign(1.0)
        after_poison = weights(trainer)
        assert int(trainer.nonfinite_steps.numpy()) == 1
        for a, b in zip(initial, after_poison):
            np.testing.assert_array_equal(a, b)
    trainer.fit()
    trainer.recorded, trainer.losses = recorded, np.array(losses.rows)
    return trainer


def assignments_outside_xla(trainer):
    """Variable assignments of the traced training step (nested functions included) that run
    outside every XLA-compiled function."""
    graph = trainer._train_step.get_concrete_function(next(trainer._train_iterator())).graph
    count, pending, seen = 0, [graph], set()
    while pending:
        g = pending.pop()
        count += sum(op.type in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")
                     for op in g.get_operations())
        for name, function in g._functions.items():
            compiled = function.definition.attr.get("_XlaMustCompile")
            if not (compiled and compiled.b) and name not in seen:
                seen.add(name)
                pending.append(function.graph)
    return count


def test_compiled_step_equals_the_op_by_op_update(gpt_data, tmp_path):
    ops_by_op = run(gpt_data, tmp_path / "ops", compile_update=False)
    compiled = run(gpt_data, tmp_path / "xla", compile_update=True)
    assert np.all(ops_by_op.losses[:, 1] > STEPS["grad_clip_norm"])  # clipping is active
    np.testing.assert_allclose(compiled.losses, ops_by_op.losses, rtol=1e-6)  # the bound
    ours = weights(compiled)
    for path, weight in zip(ops_by_op.recorded.paths, ours):
        ops_by_op.recorded.assert_equal_piece(path, weight)
    assert int(compiled.optimizer.iterations.numpy()) == STEPS["max_steps"]
    # The step counter, the input position and the non-finite count; op by op, the update's
    # assignments (three per variable) run one by one.
    assert assignments_outside_xla(compiled) == 3
    assert assignments_outside_xla(ops_by_op) > 3 * len(ours)


@pytest.mark.slow
def test_compiled_fp16_step_skips_a_non_finite_step_as_the_op_by_op_one(gpt_data, tmp_path):
    fp16 = dict(precision="mixed_float16")
    ops_by_op = run(gpt_data, tmp_path / "ops", False, poison_first=True, **fp16)
    compiled = run(gpt_data, tmp_path / "xla", True, poison_first=True, **fp16)
    for trainer in (ops_by_op, compiled):
        assert int(trainer.optimizer.iterations.numpy()) == STEPS["max_steps"] - 1
        # the skipped step's scale 2**15, halved for the 3 good steps after it
        np.testing.assert_array_equal(trainer.losses[:, 2], [2.0 ** 15] + [2.0 ** 14] * 3)
    np.testing.assert_allclose(compiled.losses, ops_by_op.losses, rtol=1e-5)
    for a, b in zip(weights(compiled), weights(ops_by_op)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-3)  # float16's own noise
