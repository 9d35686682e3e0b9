"""One process of tests/distribute/test_user_moe.py: examples/own_moe.py's MoETask (a user's
Keras model with tfbig's SparseMoE layers) trained through the public API's Trainer, the first
update's gradients recorded (tests/equality.py).

    horovodrun -np 2 -H localhost:2 --gloo python user_moe_worker.py RUN_JSON

RUN_JSON: {"flags": {tfbig-train flag: value}, "model_dir": ...}. The chief writes
MODEL_DIR/result.npz: the logged losses, the number of data-parallel replicas, and each
trainable weight's first-step gradient and final value gathered whole from the expert group
(the strategy's gather_full), in the order of MODEL_DIR/paths.json.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))

import numpy as np  # noqa: E402

import own_moe  # noqa: E402
from equality import RecordedGradients  # noqa: E402


def train(model_dir, flags, task=None):
    """(trainer, RecordedGradients) of `task` (MoETask) trained with `flags` into `model_dir`."""
    from tfbig.api import _trainer, check_user_flags, configure

    config = configure(model_dir=model_dir, **flags)
    task = task or own_moe.MoETask()
    check_user_flags(config, task)
    trainer = _trainer(task, config, recorder=True)
    recorded = RecordedGradients(trainer)
    trainer.fit()
    return trainer, recorded


def main(path):
    with open(path) as f:
        run = json.load(f)
    trainer, recorded = train(run["model_dir"], run["flags"])
    variables = trainer.model.trainable_variables
    gradients = trainer.strategy.gather_full(variables, recorded.gradients()[0])
    weights = trainer.strategy.gather_full(variables)
    if trainer.strategy.is_chief:
        with open(os.path.join(run["model_dir"], "paths.json"), "w") as f:
            json.dump([v.path for v in variables], f)
        np.savez(os.path.join(run["model_dir"], "result.npz"),
                 losses=np.array(trainer.logger.losses), replicas=trainer.strategy.num_replicas,
                 **{f"gradient{i}": g for i, g in enumerate(gradients)},
                 **{f"weight{i}": w for i, w in enumerate(weights)})
    trainer.strategy.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
