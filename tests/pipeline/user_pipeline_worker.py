"""One rank of the user-model cross-rank pipeline tests: examples/own_model.py's MyModel cut
between the layers of own_model.PIPELINE, trained through the public API's Trainer for each
scenario of a plan (one horovodrun launch).

    python user_pipeline_worker.py PLAN_JSON

PLAN_JSON: [{"name", "flags": {tfbig-train flag: value}, "model_dir", "out",
"interrupt_at": steps (optional: stop there, then resume from the stage checkpoints)}].
Each rank writes OUT/NAME.rankR.npz: its stage, data and tensor index, the tensor splits of
the weights it holds (JSON {path: [axis, sections]}), their paths and trained values, their
first update's gradients (averaged over the data group), each logged step's loss, the
validation loss, the step it resumed from.
"""
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import own_model  # noqa: E402
from equality import RecordedGradients  # noqa: E402

from tfbig.api import _trainer, check_user_flags, configure  # noqa: E402
from tfbig.distribute.horovod_keras import hvd  # noqa: E402
from tfbig.tasks.user import FunctionTask  # noqa: E402


def task(tensor_parallel=1, context_parallel=1):
    """own_model's task cut by PIPELINE (with --tensor_parallel: split by LAYOUT too; with
    --context_parallel: its sequences cut by CONTEXT)."""
    layout = {"tensor_layout": own_model.LAYOUT} if tensor_parallel > 1 else {}
    if context_parallel > 1:  # the sequence length the context ranks cut
        layout.update(context_layout=own_model.CONTEXT, tokens_per_example=own_model.SIZE[
            "maxlen"])
    return FunctionTask(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                        name="own_model", pipeline_layers=own_model.PIPELINE, **layout)


def train(scenario):
    config = configure(model_dir=scenario["model_dir"], **scenario["flags"])
    degrees = scenario["flags"].get("tensor_parallel", 1), scenario["flags"].get(
        "context_parallel", 1)
    check_user_flags(config, task(*degrees))
    trainer = _trainer(task(*degrees), config, recorder=True)
    recorded = RecordedGradients(trainer)
    arrays = {"restored_step": -1}
    if scenario.get("interrupt_at"):
        trainer.fit(steps=scenario["interrupt_at"])
        first = recorded.gradients()[0]
        losses = list(trainer.logger.losses)
        trainer = _trainer(task(*degrees), config, recorder=True)  # resumes from its stages
        arrays["restored_step"] = int(trainer.step.numpy())
        summary = trainer.fit()
        losses += trainer.logger.losses
    else:
        summary = trainer.fit()
        first, losses = recorded.gradients()[0], trainer.logger.losses
    arrays["eval_loss"] = summary["eval"]["loss"]
    strategy = trainer.strategy
    held = trainer.model.trainable_variables
    arrays.update({f"w{i}": v.numpy() for i, v in enumerate(held)})
    arrays.update({f"g{i}": np.asarray(g) for i, g in enumerate(first)})
    arrays["paths"] = np.array([v.path for v in held])
    arrays["losses"] = np.array(losses)
    arrays["stage"], arrays["rank"] = strategy.stage_index, hvd.rank()
    arrays["num_replicas"] = strategy.num_replicas
    arrays["tensor"] = strategy.mesh.coords["tensor"]  # with --tensor_parallel: its slices
    arrays["splits"] = json.dumps({p: list(s) for p, s in getattr(strategy, "splits", {}).items()})
    arrays["step"] = int(trainer.step.numpy())
    os.makedirs(scenario["out"], exist_ok=True)
    np.savez(os.path.join(scenario["out"], f"{scenario['name']}.rank{hvd.rank()}.npz"), **arrays)


def main(plan_path):
    with open(plan_path) as f:
        plan = json.load(f)
    for scenario in plan:
        train(scenario)
    hvd.join()  # Horovod: no rank shuts down while others still communicate
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
