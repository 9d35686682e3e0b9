"""Tasks: the single-replica view of training one model family (see gpt.GPTTask)."""
import importlib

# --model flag -> "module:Class"
TASKS = {
    "gpt": "tfbig.tasks.gpt:GPTTask",
}


def get_task(train):
    """The task for TrainConfig `train` (its `model` field picks the family)."""
    if train.model not in TASKS:
        raise ValueError(f"--model={train.model!r}: expected one of {sorted(TASKS)}")
    module, cls = TASKS[train.model].split(":")
    return getattr(importlib.import_module(module), cls)(train)
