"""Runs under `horovodrun` for test_pipeline_horovod.py: one data-parallel replica of a
--strategy=pipeline run per rank, each with its stages on its own logical CPU devices.

    horovodrun -np 2 -H localhost:2 --gloo python pipeline_horovod_worker.py CONFIG_JSON OUT

Each rank writes OUT/rank{R}.npz: trainable weights w0.., the final train loss, the number of
replicas, its data-parallel rank and the devices of its variables.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from tfbig import config as config_lib  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402


def main(config_path, out):
    with open(config_path) as f:
        cfg = config_lib.from_dict(json.load(f))
    trainer = Trainer(cfg)
    summary = trainer.fit()
    strategy = trainer.strategy
    arrays = {f"w{i}": v.numpy() for i, v in enumerate(trainer.model.trainable_variables)}
    arrays.update(loss=summary["train"]["loss"], grad_norm=summary["train"]["grad_norm"],
                  num_replicas=strategy.num_replicas, rank=strategy.rank,
                  devices=np.array(sorted({v.value.device for v in trainer.model.variables
                                           if "seed_generator" not in v.path})))
    np.savez(os.path.join(out, f"rank{strategy.rank}.npz"), **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
