"""Runs under `horovodrun` for test_cross_rank.py: train the runs of a plan with
--strategy=horovod --pipeline_stages=K (one stage per rank) and save what each rank ends with.

    horovodrun -np 4 -H localhost:4 --gloo python cross_rank_worker.py PLAN_JSON

PLAN_JSON is a list of runs {"name", "config" (tfbig.config.to_dict), "out"} with optional
    first_gradients  save the averaged gradients of the first batch (no update)
    interrupt_at     fit that many steps, then resume with a new Trainer
Each rank writes OUT/NAME.rank{R}.npz: the paths of the weights it holds (`paths`), whether it
owns each (`owned`), their final values w0.. and first-batch gradients g0.., the per-step train
losses and grad norms, its stage, data and tensor index and the tensor degree, the tensor
splits of the weights it holds (JSON {path: [axis, sections]}, empty without
--tensor_parallel), the bytes of weights it holds and the full model's, the evaluation loss.
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

from horovod_worker import RecordingLogger  # noqa: E402
from tfbig import config as config_lib  # noqa: E402
from tfbig.distribute import get_strategy  # noqa: E402
from tfbig.trainer import Trainer  # noqa: E402


def nbytes(variables):
    return sum(math.prod(v.value.shape) * v.value.dtype.size for v in variables)


def train(run):
    cfg = config_lib.from_dict(run["config"])
    strategy = get_strategy("horovod", cfg)
    rank = hvd.rank()
    logger = RecordingLogger(cfg.train.model_dir, strategy.is_chief, cfg.train.max_steps)
    trainer = Trainer(cfg, strategy=strategy, logger=logger)
    arrays = {}
    if run.get("first_gradients"):
        _, grads, _ = trainer.forward_backward(next(trainer._train_iterator()))
        grads = strategy.all_reduce_gradients(grads)
        arrays.update({f"g{i}": np.asarray(g) for i, g in enumerate(grads)})
    if run.get("interrupt_at"):
        trainer.fit(steps=run["interrupt_at"])
        trainer = Trainer(cfg, strategy=strategy, logger=logger)  # resumes from its stage
        arrays["restored_step"] = int(trainer.step.numpy())
    summary = trainer.fit()
    held = trainer.model.trainable_variables
    arrays.update({f"w{i}": v.numpy() for i, v in enumerate(held)})
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
    arrays["model_bytes"] = sum(math.prod(v.shape) * 4 for v in strategy.built.model.model
                                .variables if "seed_generator" not in v.path)
    arrays["step"] = int(trainer.step.numpy())
    arrays["eval_loss"] = summary["eval"].get("loss", np.nan)
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
