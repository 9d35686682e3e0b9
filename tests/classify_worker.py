"""Runs under `horovodrun` or `tfbig-launch` for tests/test_classify.py: fine-tune a BERT
classifier as tfbig-classify does (its own pieces), the loss of one step made non-finite on
one process, and save what each process ends with.

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
    Returns (strategy, {losses, scales, initial*, after*, final*})."""
    import keras

    from tfbig.classify import _examples, build_classifier, encode, read_data
    from tfbig.distribute.finetune import (current_loss_scale, fine_tune_strategy,
                                           precision_policy, replica_batches)
    from tfbig.squad.finetune import pretrained_config

    strategy = fine_tune_strategy(options.strategy, "classify_worker", options.init_checkpoint)
    with precision_policy(options.precision):
        config, tokenizer = pretrained_config(options.init_checkpoint)
        train, _, names = read_data(options)
        data = encode(train, tokenizer, options.max_seq_length,
                      {name: i for i, name in enumerate(names)})
        keras.utils.set_random_seed(options.seed)
        model, optimizer, step = build_classifier(config, len(names), options,
                                                  options.max_steps, strategy)
        batches = replica_batches(strategy, lambda: _examples(data, options.seed),
                                  options.train_batch_size)
        bias = model.classifier_head.bias
        result = {"losses": [], "scales": [current_loss_scale(optimizer)]}
        for index in range(options.max_steps):
            if index == poison_step:
                result.update({f"initial{i}": v.numpy()
                               for i, v in enumerate(model.trainable_variables)})
                kept = bias.numpy()
                if poisoned:
                    bias.assign(np.full_like(kept, np.inf))
            result["losses"].append(float(step(next(batches))))
            result["scales"].append(current_loss_scale(optimizer))
            if index == poison_step:
                bias.assign(kept)
                result.update({f"after{i}": v.numpy()
                               for i, v in enumerate(model.trainable_variables)})
        result.update({f"final{i}": v.numpy() for i, v in enumerate(model.trainable_variables)})
    return strategy, result


def main(path):
    from tfbig.classify import ClassifyOptions

    with open(path) as file:
        run = json.load(file)
    options = ClassifyOptions(**run["options"])
    rank = int(os.environ.get("HOROVOD_RANK", json.loads(
        os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]))
    strategy, result = poisoned_run(options, run["poison_step"],
                                    poisoned=rank == run["poisoned_rank"])
    assert strategy.rank == rank and strategy.num_replicas == 2
    np.savez(os.path.join(run["out"], f"rank{rank}.npz"), **result)
    strategy.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
