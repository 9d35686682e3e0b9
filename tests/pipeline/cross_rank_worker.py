"""Runs under `horovodrun` for test_cross_rank.py: train the runs of a plan with
--strategy=horovod --pipeline_stages=K (one stage per rank) and save what each rank ends with.

    horovodrun -np 4 -H localhost:4 --gloo python cross_rank_worker.py PLAN_JSON

PLAN_JSON is a list of runs {"name", "config" (tfbig.config.to_dict), "out"} with optional
    first_gradients  save the averaged gradients of the first batch (no update)
    interrupt_at     fit that many steps, then resume with a new Trainer
    poison           GPT whose loss is inf on one rank in the first step (the last stage's
                     rank of the last data and tensor index): saves the held weights before
                     (initial0..) and after it (after_poison0..), the loss scale after it
Each rank writes OUT/NAME.rank{R}.npz: the paths of the weights it holds (`paths`), whether it
owns each (`owned`), their final values w0.. and first-batch gradients g0.. (experts gathered
from the expert group under --expert_parallel), the per-step train
losses and grad norms, its stage, data and tensor index and the tensor degree, the tensor
splits of the weights it holds (JSON {path: [axis, sections]}, empty without
--tensor_parallel), the bytes of weights it holds and the full model's, of its optimizer
slots (`slot_bytes`: 1/N of its stage's with --zero_stage=1 over N data ranks), the evaluation
loss,
the skipped (non-finite) steps, the fp16 loss scale of every step and at the end, and with
the shape of the activation stage 0 sends (`sent_shape`: a chunk of the positions with
--sequence_parallel or --context_parallel).
"""
import json
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "distribute"))

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from horovod_worker import RecordingLogger  # noqa: E402
from tfbig import config as config_lib  # noqa: E402
from tfbig.distribute.zero import ZeroStrategy  # noqa: E402
from tfbig.training.registry import get_strategy  # noqa: E402
from tfbig.optim import loss_scale  # noqa: E402
from tfbig.tasks.gpt import GPTTask  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402


class PoisonedStageTask(GPTTask):
    """GPT whose loss is multiplied by `poison` where a pipeline's last stage computes it
    (loss_from_outputs; inf on one rank forces a non-finite step)."""

    def __init__(self, train):
        super().__init__(train)
        self.poison = tf.Variable(1.0, trainable=False)

    def loss_from_outputs(self, logits, batch):
        loss, metrics = super().loss_from_outputs(logits, batch)
        return loss * self.poison, {k: v * self.poison for k, v in metrics.items()}


def poisoned_here(strategy):
    """Whether this rank is the one whose first step is poisoned: the last of everything."""
    grid, coords = strategy.mesh.mesh, strategy.mesh.coords
    return (coords["pipeline"], coords["tensor"], coords["data"]) == (
        grid.pipeline - 1, grid.tensor - 1, grid.data - 1)


def nbytes(variables):
    return sum(math.prod(v.value.shape) * v.value.dtype.size for v in variables)


def train(run):
    cfg = config_lib.from_dict(run["config"])
    strategy = get_strategy("horovod", cfg)
    rank = hvd.rank()
    logger = RecordingLogger(cfg.train.model_dir, strategy.is_chief, cfg.train.max_steps)
    task = PoisonedStageTask(cfg.train) if run.get("poison") else None
    trainer = Trainer(cfg, strategy=strategy, task=task, logger=logger)
    arrays = {}
    if run.get("first_gradients"):
        _, grads, _ = trainer.forward_backward(next(trainer._train_iterator()))
        grads = strategy.all_reduce_gradients(grads)
        if getattr(strategy, "expert_paths", None):  # the stage's experts (and ZeRO-1's
            # slices of the other weights), gathered whole
            grads = strategy.gather_full(trainer.model.trainable_variables, grads)
        elif isinstance(strategy, ZeroStrategy):  # ZeRO-1 stages: the slices, gathered whole
            grads = strategy.partition.gather(grads, [v.shape for v in strategy.model_variables])
        arrays.update({f"g{i}": np.asarray(g) for i, g in enumerate(grads)})
    if run.get("poison"):
        arrays.update({f"initial{i}": v.numpy()
                       for i, v in enumerate(trainer.model.trainable_variables)})
        if poisoned_here(strategy):
            task.poison.assign(float("inf"))
        trainer.fit(steps=1)
        task.poison.assign(1.0)
        arrays.update({f"after_poison{i}": v.numpy()
                       for i, v in enumerate(trainer.model.trainable_variables)})
        arrays["scale_after_poison"] = float(loss_scale(trainer.optimizer))
    if run.get("interrupt_at"):
        trainer.fit(steps=run["interrupt_at"])
        trainer = Trainer(cfg, strategy=strategy, logger=logger)  # resumes from its stage
        arrays["restored_step"] = int(trainer.step.numpy())
    summary = trainer.fit()
    held = trainer.model.trainable_variables
    values = (strategy.gather_full(held) if getattr(strategy, "expert_paths", None)
              else [v.numpy() for v in held])  # expert parallelism: the experts whole
    arrays.update({f"w{i}": value for i, value in enumerate(values)})
    arrays["paths"] = np.array([v.path for v in held])
    arrays["owned"] = np.array([id(v) in strategy.built.owned for v in held])
    steps = sorted(logger.losses)
    arrays["losses"] = np.array([logger.losses[s][0] for s in steps])
    arrays["grad_norms"] = np.array([logger.losses[s][1] for s in steps])
    arrays["stage"], arrays["data"] = strategy.stage_index, strategy.rank
    arrays["tensor"] = strategy.mesh.coords["tensor"]  # with --tensor_parallel: its slices
    arrays["tensor_parallel"] = strategy.mesh.mesh.tensor
    splits = getattr(strategy, "splits", {})
    arrays["splits"] = json.dumps({path: list(piece) for path, piece in splits.items()})
    arrays["held_bytes"] = nbytes(trainer.model.variables)
    inner = getattr(trainer.optimizer, "inner_optimizer", trainer.optimizer)
    arrays["slot_bytes"] = nbytes(list(inner._momentums) + list(inner._velocities))
    arrays["model_bytes"] = sum(math.prod(v.shape) * 4 for v in strategy.built.model.model
                                .variables if "seed_generator" not in v.path)
    arrays["step"] = int(trainer.step.numpy())
    arrays["eval_loss"] = summary["eval"].get("loss", np.nan)
    sent = getattr(strategy, "sent", None)  # the activation's spec stage 0 sends
    if sent:
        arrays["sent_shape"] = np.array(tf.nest.flatten(sent[0])[0].shape.as_list())
    arrays["nonfinite_steps"] = int(trainer.nonfinite_steps.numpy())
    arrays["loss_scales"] = np.array([logger.loss_scales.get(s, np.nan) for s in steps])
    arrays["loss_scale"] = float(loss_scale(trainer.optimizer))
    os.makedirs(run["out"], exist_ok=True)
    np.savez(os.path.join(run["out"], f"{run['name']}.rank{rank}.npz"), **arrays)


def main(plan_path):
    with open(plan_path) as f:
        plan = json.load(f)
    for run in plan:
        train(run)
    hvd.join()  # Horovod: no rank shuts down while others still communicate
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
