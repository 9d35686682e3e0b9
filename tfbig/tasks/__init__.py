"""Tasks: the single-replica view of training one model family (see gpt.GPTTask)."""
import importlib

# --model flag -> "module:Class"
TASKS = {
    "gpt": "tfbig.tasks.gpt:GPTTask",
    "albert": "tfbig.tasks.albert:AlbertTask",
    "bert": "tfbig.tasks.bert:BertTask",
    "llama": "tfbig.tasks.llama:LlamaTask",
}


def get_task(train, experiment=None):
    """The task for TrainConfig `train` (its `model` field picks the family).

    A family with its own ExperimentConfig section (the task's `config_section`, else the
    field named like --model, e.g. `albert`; BERT reads ALBERT's masking section) gets that
    section as a second argument when `experiment` is given.
    """
    if train.model not in TASKS:
        raise ValueError(f"--model={train.model!r}: expected one of {sorted(TASKS)}")
    module, cls = TASKS[train.model].split(":")
    task_class = getattr(importlib.import_module(module), cls)
    section = getattr(experiment, getattr(task_class, "config_section", train.model), None)
    return task_class(train) if section is None else task_class(train, section)
