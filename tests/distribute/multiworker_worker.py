"""One worker of the multi-worker tests: train a config, then save its weights and summary.

    python multiworker_worker.py CONFIG_JSON OUT_DIR [--steps=N] [--cpu_devices=N]
                                 [--hang_rank=R]

CONFIG_JSON is an ExperimentConfig as tfbig.config.to_dict writes it; TF_CONFIG (set by the
test or by tfbig-launch) makes it a worker of a cluster. Writes OUT_DIR/worker{rank}.npz (the
trainable weights) and OUT_DIR/worker{rank}.json (summary, restored step). `--steps` stops
after that many steps (Trainer.fit(steps=)); `--cpu_devices` splits the CPU into that many
logical devices first (for --strategy=mirrored); with `--hang_rank`, all workers train 2
steps, then that worker prints "hanging" and sleeps (alive, but never reaching the next
collective) while the others go on.
Exit code 143 after a SIGTERM, like tfbig-train.
"""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main(config_path, out_dir, steps=None, cpu_devices=0, hang_rank=-1):
    if cpu_devices:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_devices)
    from tfbig import config as config_lib
    from tfbig.training.trainer import Trainer

    with open(config_path) as f:
        cfg = config_lib.from_dict(json.load(f))
    trainer = Trainer(cfg)
    restored_step = int(trainer.step.numpy())
    if hang_rank >= 0:
        trainer.fit(2)  # compiled and running before the hang
        if trainer.strategy.rank == hang_rank:
            print("hanging", flush=True)
            time.sleep(3600)
    summary = trainer.fit(steps)
    rank = trainer.strategy.rank
    np.savez(os.path.join(out_dir, f"worker{rank}.npz"),
             *[v.numpy() for v in trainer.model.trainable_variables])
    with open(os.path.join(out_dir, f"worker{rank}.json"), "w") as f:
        json.dump({"restored_step": restored_step, "step": summary["step"],
                   "preempted": bool(summary.get("preempted")),
                   "num_replicas": trainer.strategy.num_replicas,
                   "checkpoint": summary["checkpoint"], "train": summary["train"],
                   "eval": summary["eval"]}, f)
    trainer.strategy.shutdown()
    return 143 if summary.get("preempted") else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--cpu_devices", type=int, default=0)
    parser.add_argument("--hang_rank", type=int, default=-1)
    args = parser.parse_args()
    raise SystemExit(main(args.config, args.out_dir, args.steps, args.cpu_devices,
                          args.hang_rank))
