"""Runs under `horovodrun` (or as one plain process) for test_zero.py's delayed-initialisation
test: build the trainer of CONFIG_JSON (no step) and write this rank's peak resident memory and
the model-state bytes it holds to OUT.rank{R}.json, with the peak before building it.

    horovodrun -np 4 -H localhost:4 --gloo python zero_memory_worker.py CONFIG_JSON OUT
"""
import json
import math
import os
import resource
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfbig import config as config_lib  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(config_path, out):
    with open(config_path) as f:
        cfg = config_lib.from_dict(json.load(f))
    before = peak_rss()  # TensorFlow, Horovod and tfbig imported
    trainer = Trainer(cfg)
    peak = peak_rss()
    strategy = trainer.strategy
    mesh = getattr(strategy, "mesh", None)
    record = {"peak_rss": peak, "peak_rss_before": before, "params": sum(math.prod(v.shape) for v in
                                              trainer.model.trainable_variables),
              "state": strategy.state_bytes() if hasattr(strategy, "state_bytes") else {}}
    with open(f"{out}.rank{mesh.rank if mesh else 0}.json", "w") as f:
        json.dump(record, f)
    strategy.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
