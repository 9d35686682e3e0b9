"""Runs under `horovodrun` for test_finetune_parallel.py: tfbig-squad's fine_tune on any layout
of the Trainer (--strategy=horovod with --tensor_parallel, --pipeline_stages...), saving what
each rank holds besides the command's own outputs.

    horovodrun -np 4 -H localhost:4 --gloo python squad_worker.py RUN_JSON

RUN_JSON: {"options": SquadOptions fields, "overrides": Trainer flags, "out": directory}. Each
rank writes OUT/rank{R}.npz: the paths of the weights it holds (`paths`), their first-batch
gradients averaged over the data-parallel group (g0.., before any update) and final values
(w0..), its pipeline stage and tensor index, and the tensor splits of the weights it holds
(JSON {path: [axis, sections]}).
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def main(path):
    from tfbig.commands.squad import SquadOptions, fine_tune

    with open(path) as file:
        run = json.load(file)
    arrays = {}

    def first_gradients(trainer):
        strategy = trainer.strategy
        _, grads, _ = trainer.forward_backward(next(trainer._train_iterator()))
        grads = strategy.all_reduce_gradients(grads)
        arrays.update({f"g{i}": np.asarray(g) for i, g in enumerate(grads)})
        arrays["rank"] = strategy.mesh.rank
        arrays["stage"] = getattr(strategy, "stage_index", 0)
        arrays["tensor"] = strategy.mesh.coords["tensor"]
        arrays["splits"] = json.dumps({p: list(piece) for p, piece in
                                       getattr(strategy, "splits", {}).items()})
        arrays["model"] = trainer.model

    fine_tune(SquadOptions(**run["options"]), before_fit=first_gradients, **run["overrides"])
    held = arrays.pop("model").trainable_variables
    arrays.update({f"w{i}": v.numpy() for i, v in enumerate(held)})
    arrays["paths"] = np.array([v.path for v in held])
    np.savez(os.path.join(run["out"], f"rank{arrays['rank']}.npz"), **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
