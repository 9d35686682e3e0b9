"""Checks a run makes before step 1, so nothing fails at its end that could fail at its start.

    batches = validation_batches(task, micro_batch=8, num_replicas=2, eval_steps=50, say=print)
    check_tokenizer(task)   # the file the end-of-run sample needs
"""
from tfbig.errors import UsageError


def validation_batches(task, micro_batch, num_replicas, eval_steps, say):
    """Validation batches every replica evaluates (at most `eval_steps`; 0: the whole split).

    0 when the data has no validation split: the run trains without evaluating and `say`s so.
    A split smaller than one batch per replica is an error now, not after training.
    """
    split = task.manifest.splits.get("validation")
    records = split.records if split is not None else 0
    if records == 0:
        say(f"no validation split in {task.data_dir}: training without evaluation "
            f"(prepare the data with tfbig-prep --validation_fraction > 0 to evaluate)")
        return 0
    available = records // (micro_batch * num_replicas)
    if available == 0:
        raise UsageError(
            f"the validation split of {task.data_dir} has {records} records, fewer than one "
            f"batch of {micro_batch} per replica x {num_replicas} replicas; lower --batch_size "
            f"(or raise --grad_accum_steps), or prepare more validation data")
    return min(available, eval_steps or available)


def check_tokenizer(task):
    """Load the data's tokenizer once (a missing or corrupt file is a UsageError now)."""
    try:
        return task.tokenizer()
    except (ValueError, OSError) as error:
        raise UsageError(f"{error}; the end-of-run sample (--sample_tokens) needs it: "
                         f"prepare the data again or pass --sample_tokens=0") from error
