"""Runs under `horovodrun` or `tfbig-launch` for tests/test_classify.py: fine-tune a BERT
classifier as tfbig-classify does (its task on the Trainer), one step at a time, the loss of
one step made non-finite on one process, and save what each process ends with.

    horovodrun -np 2 -H localhost:2 --gloo python classify_worker.py RUN_JSON

RUN_JSON: {"options": ClassifyOptions fields, "poison_step": step index, "poisoned_rank": rank,
"out": directory}. Each process writes OUT/rank{R}.npz: per-step losses, the loss scale before
each step and after the last, the trainable weights before (initial0..) and after (after0..)
the poisoned step and at the end (final0..). `poisoned_run` is also the tests' single-process
reference (the whole batch poisoned).
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def poisoned_run(options, poison_step, poisoned):
    """Fine-tune for options.max_steps steps; during step `poison_step` the classifier's bias
    is +inf where `poisoned` (this process's loss and gradients are NaN), then restored.
    Returns (trainer, {losses, scales, initial*, after*, final*})."""
    import tensorflow as tf

    from tfbig.training import finetune
    from tfbig.optim import loss_scale
    from tfbig.tasks.classify import ClassifyTask
    from tfbig.training.trainer import Trainer
    from tfbig.training.precision import precision_policy

    cfg = finetune.experiment(options, "classify")
    with precision_policy(options.precision):
        strategy = finetune.strategy(cfg)
        task = ClassifyTask(cfg.train, options)
        finetune.set_steps(cfg, options, len(task.examples["train"]))
        logger = finetune.LossRecorder(options.output_dir, False, cfg.train.max_steps)
        trainer = Trainer(cfg, strategy=strategy, task=task, logger=logger)
        model = trainer.model
        bias = model.classifier_head.bias
        scale = lambda: float(tf.convert_to_tensor(loss_scale(trainer.optimizer)))  # noqa: E731
        result = {"scales": [scale()]}
        for index in range(options.max_steps):
            if index == poison_step:
                result.update({f"initial{i}": v.numpy()
                               for i, v in enumerate(model.trainable_variables)})
                kept = bias.numpy()
                if poisoned:
                    bias.assign(np.full_like(kept, np.inf))
            trainer.fit(steps=1)
            result["scales"].append(scale())
            if index == poison_step:
                bias.assign(kept)
                result.update({f"after{i}": v.numpy()
                               for i, v in enumerate(model.trainable_variables)})
        result.update({f"final{i}": v.numpy() for i, v in enumerate(model.trainable_variables)})
    result["losses"] = logger.losses
    return trainer, result


def main(path):
    from tfbig.commands.classify import ClassifyOptions

    with open(path) as file:
        run = json.load(file)
    options = ClassifyOptions(**run["options"])
    rank = int(os.environ.get("HOROVOD_RANK", json.loads(
        os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]))
    trainer, result = poisoned_run(options, run["poison_step"],
                                   poisoned=rank == run["poisoned_rank"])
    assert trainer.strategy.rank == rank and trainer.strategy.num_replicas == 2
    np.savez(os.path.join(run["out"], f"rank{rank}.npz"), **result)
    trainer.strategy.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
