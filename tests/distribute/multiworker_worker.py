"""One worker of the multi-worker tests: train a config, then save its weights and summary.

    python multiworker_worker.py CONFIG_JSON OUT_DIR [--cpu_devices=N]

CONFIG_JSON is an ExperimentConfig as tfbig.config.to_dict writes it; TF_CONFIG (set by the
test or by tfbig-launch) makes it a worker of a cluster. Writes OUT_DIR/worker{rank}.npz (the
trainable weights) and OUT_DIR/worker{rank}.json (summary, restored step). `--cpu_devices`
splits the CPU into that many logical devices first (for --strategy=mirrored). Exit code 143
after a SIGTERM, like tfbig-train.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main(config_path, out_dir, cpu_devices=0):
    if cpu_devices:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_devices)
    from tfbig import config as config_lib
    from tfbig.trainer import Trainer

    with open(config_path) as f:
        cfg = config_lib.from_dict(json.load(f))
    trainer = Trainer(cfg)
    restored_step = int(trainer.step.numpy())
    summary = trainer.fit()
    rank = trainer.strategy.rank
    np.savez(os.path.join(out_dir, f"worker{rank}.npz"),
             *[v.numpy() for v in trainer.model.trainable_variables])
    with open(os.path.join(out_dir, f"worker{rank}.json"), "w") as f:
        json.dump({"restored_step": restored_step, "step": summary["step"],
                   "preempted": bool(summary.get("preempted")),
                   "num_replicas": trainer.strategy.num_replicas,
                   "checkpoint": summary["checkpoint"], "train": summary["train"]}, f)
    trainer.strategy.shutdown()
    return 143 if summary.get("preempted") else 0


if __name__ == "__main__":
    devices = [int(a.split("=")[1]) for a in sys.argv[3:] if a.startswith("--cpu_devices=")]
    sys.exit(main(sys.argv[1], sys.argv[2], devices[0] if devices else 0))
