"""Checks a run makes before step 1, so nothing fails at its end that could fail at its start.

    batches = validation_batches(task, micro_batch=8, num_replicas=2, eval_steps=50, say=print)
    check_tokenizer(task)   # the file the end-of-run sample needs
"""
from tfbig.errors import UsageError
from tfbig.training import evaluation


def validation_batches(task, micro_batch, num_replicas, eval_steps, say):
    """Global validation batches of micro_batch x num_replicas records (at most `eval_steps`;
    0: the whole split, its last batch padded: tfbig.training.trainer evaluates every record once).

    0 when the data has no validation split: the run trains without evaluating and `say`s so.
    """
    split = task.manifest.splits.get("validation")
    records = split.records if split is not None else 0
    if records == 0:
        say(f"no validation split in {task.data_dir}: training without evaluation "
            f"(prepare the data with tfbig-prep --validation_fraction > 0 to evaluate)")
        return 0
    return evaluation.num_batches(records, micro_batch * num_replicas, eval_steps)


def check_tokenizer(task):
    """Load the data's tokenizer once (a missing or corrupt file is a UsageError now)."""
    try:
        return task.tokenizer()
    except (ValueError, OSError) as error:
        raise UsageError(f"{error}; the end-of-run sample (--sample_tokens) needs it: "
                         f"prepare the data again or pass --sample_tokens=0") from error


def check_same_step(strategy, step, model_dir):
    """Raise unless every process resumed at the same step `step` (a collective). The ranks of
    a layout with pieces (tensor, pipeline, context, expert, ZeRO) each restore their own
    piece's newest intact checkpoint; a save cut short on one of them leaves it older, and the
    run would go on with its pieces from another step than the others'."""
    steps = [int(row[0]) for row in strategy.gather_over_processes([step])]
    if len(set(steps)) > 1:
        ranks = ", ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
        raise UsageError(
            f"--model_dir={model_dir}: the processes resumed from checkpoints of different "
            f"steps ({ranks}): a save was cut short on some rank, whose newest intact "
            f"checkpoint is older. Remove every piece's checkpoints newer than step "
            f"{min(steps)} (the ckpt-N files and their line in each piece's `checkpoint` "
            f"file), then start again")
