"""A run's TensorBoard scalars as plain Python data, for notebooks and run comparisons.

tfbig-train writes one event directory per split under its --model_dir (`train`, `validation`,
`system`); each scalar is a tag (`loss`, `tokens_per_sec`, `mfu`, `time_fraction/input` ...)
with one value per logged step. The system monitor's samples and the per-step timings are read
by tfbig.profiling.diagnose.load_run.

Example:
    scalars = read_scalars("runs/gpt-small")      # {"train": {"loss": [(10, 5.1), ...]}, ...}
    curves = compare_runs(["runs/a", "runs/b"], "train", "loss")   # {"runs/a": [(step, v)...]}
"""
import glob
import os

SPLITS = ("train", "validation", "system")


def read_scalars(run_dir, splits=SPLITS):
    """{split: {tag: [(step, value), ...] sorted by step}} of every scalar in `run_dir`'s event
    files (a step written twice, by a resumed run, keeps its last value)."""
    import tensorflow as tf

    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir}: no such run directory (a tfbig-train --model_dir)")
    found, text = {}, tf.string.as_datatype_enum
    for split in splits:
        values = {}
        # A step written twice (by a run and its resume, each with its own file) keeps the value
        # written last, by the event's own wall time: file names and the files' first (version)
        # events carry whole seconds only, and the name's counter is not zero-padded.
        for path in glob.glob(os.path.join(run_dir, split, "events.out.tfevents.*")):
            for record in tf.data.TFRecordDataset(path):  # event files are TFRecords
                event = tf.compat.v1.Event.FromString(record.numpy())
                for value in event.summary.value:
                    if value.HasField("simple_value"):
                        number = float(value.simple_value)
                    elif value.HasField("tensor") and value.tensor.dtype != text:
                        number = float(tf.make_ndarray(value.tensor))
                    else:  # text summaries (the generated samples)
                        continue
                    points = values.setdefault(value.tag, {})
                    if event.step not in points or points[event.step][0] <= event.wall_time:
                        points[event.step] = (event.wall_time, number)
        if values:
            found[split] = {tag: [(step, number) for step, (_, number) in sorted(points.items())]
                            for tag, points in values.items()}
    if not found:
        raise FileNotFoundError(f"{run_dir} holds no TensorBoard scalars under {list(splits)}: "
                                f"is it the --model_dir of a run that logged at least once?")
    return found


def compare_runs(run_dirs, split, tag):
    """{run_dir: [(step, value), ...]} of one scalar in several runs (missing: [])."""
    return {d: read_scalars(d, (split,)).get(split, {}).get(tag, []) for d in run_dirs}
