"""Runs under `horovodrun -np 2` for tests/distribute/test_integrity_horovod.py.

    horovodrun -np 2 -H localhost:2 --gloo python integrity_worker.py PLAN_JSON

PLAN_JSON: {"config": tfbig.config.to_dict, "out": dir, "damage": [kind, ...]}. Both ranks
train to max_steps with checkpoints in one shared --model_dir; then, for each kind, rank 0
copies the run directory, damages its newest checkpoint that way, and both ranks resume from
the copy and train to the end again. Each rank writes OUT/KIND.rank{R}.json: the step it
restored (before any training), its final weights' checksum and the messages it logged.
"""
import json
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402

from tfbig import config as config_lib  # noqa: E402
from tfbig.training.registry import get_strategy  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_integrity import DAMAGE, Recorder, data_file  # noqa: E402


def checksum(trainer):
    return float(sum(np.abs(v.numpy()).sum() for v in trainer.model.trainable_variables))


def main(plan_path):
    with open(plan_path) as f:
        plan = json.load(f)
    cfg = config_lib.from_dict(plan["config"])
    strategy = get_strategy("horovod", cfg)
    rank = strategy.rank
    source = cfg.train.model_dir
    trainer = Trainer(cfg, strategy=strategy)
    trainer.fit()
    straight = checksum(trainer)
    for kind in plan["damage"]:
        run = f"{source}-{kind}"
        if rank == 0:
            shutil.copytree(source, run)
            DAMAGE[kind](data_file(os.path.join(run, f"ckpt-{cfg.train.max_steps}")))
        hvd.join()  # the copy is damaged before either rank looks at it
        cfg.train.model_dir = run
        logger = Recorder(run, strategy.is_chief, cfg.train.max_steps)
        resumed = Trainer(cfg, strategy=strategy, logger=logger)
        restored = int(resumed.step.numpy())
        resumed.fit()
        with open(os.path.join(plan["out"], f"{kind}.rank{rank}.json"), "w") as f:
            json.dump({"restored_step": restored, "restored_from": resumed.restored_from,
                       "checksum": checksum(resumed), "straight": straight,
                       "messages": logger.messages, "run": run}, f)
    strategy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
