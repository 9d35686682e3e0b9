"""Runs under `horovodrun` for tests/plan/test_memory.py: each rank trains one step of every
case with the real trainer and writes the bytes of the variables it holds (weights and
optimizer slots) beside its model config and layout.

    horovodrun -np 2 -H localhost:2 --gloo python horovod_memory_worker.py CASES_JSON OUT_DIR

CASES_JSON: a list of {"name", "config" (tfbig.config.to_dict)}; OUT_DIR/NAME.rank{R}.json.
A sharded or tensor-parallel case is one more entry with its --parallel fields set.
"""
import dataclasses
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402

from tfbig import config as config_lib  # noqa: E402
from tfbig.plan.search import layout_from_config  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402


def main(cases_path, out_dir):
    with open(cases_path) as f:
        cases = json.load(f)
    for case in cases:
        cfg = config_lib.from_dict(case["config"])
        trainer = Trainer(cfg)
        trainer.fit()
        held = sum(v.numpy().nbytes for v in trainer.model.variables + trainer.optimizer.variables
                   + getattr(trainer.strategy, "shards", [])  # ZeRO: the master slices
                   if getattr(v, "_value", True) is not None)  # ZeRO 3: model holds no value
        with open(os.path.join(out_dir, f"{case['name']}.rank{hvd.rank()}.json"), "w") as f:
            json.dump({"model_state": held, "world_size": hvd.size(),
                       "model_config": dataclasses.asdict(trainer.task.model_config),
                       "layout": layout_from_config(cfg),
                       "stage": getattr(trainer.strategy, "stage_index", 0)}, f)
    trainer.strategy.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
