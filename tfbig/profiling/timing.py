"""Where a training step's wall-clock time goes: input wait, compute, communication, checkpoint.

The loop brackets its phases with `StepTimer.phase`; gradient communication happens inside the
compiled step, so it is measured there with in-graph timestamps (`timed`) and handed to the
timer as a tensor, read only when a window is summarised (no per-step device sync).

Example:
    timer = StepTimer()
    with timer.phase("input"):
        batch = next(iterator)
    with timer.phase("compute"):
        out = train_step(batch)
    timer.step_done(step, communication=out.pop("communication_seconds"))
    window = timer.window()   # {"steps": 1, "seconds": {...}, "step_records": [...]}
"""
import contextlib
import time

PHASES = ("input", "compute", "communication", "checkpoint")


def timed(fn, tensors):
    """`(fn(tensors), seconds)` measured in the graph with tf.timestamp around fn.

    The inputs are made to wait for the start stamp and the outputs for the end stamp, so
    the interval covers exactly fn (e.g. a gradient all-reduce) and nothing scheduled around it.
    """
    import tensorflow as tf  # here, so `tfbig-profile report` starts without TensorFlow
    flat = [t for t in tf.nest.flatten(tensors, expand_composites=True) if t is not None]
    with tf.control_dependencies(flat):
        start = tf.timestamp()
    with tf.control_dependencies([start]):
        tensors = tf.nest.map_structure(lambda t: t if t is None else tf.identity(t), tensors,
                                        expand_composites=True)
    result = fn(tensors)
    done = [t for t in tf.nest.flatten(result, expand_composites=True) if t is not None]
    with tf.control_dependencies(done):
        end = tf.timestamp()
    with tf.control_dependencies([end]):
        result = tf.nest.map_structure(lambda t: t if t is None else tf.identity(t), result,
                                       expand_composites=True)
    return result, end - start


class StepTimer:
    """Accumulates per-step phase times over a logging window.

    "compute" as measured by the loop is the whole compiled step, which includes the
    gradient communication the step reports; `window()` splits it into compute proper and
    communication. Time outside any phase (logging, evaluation) is not counted; a phase
    timed between steps (a checkpoint save) is charged to the next step.
    """

    def __init__(self):
        self._steps = []
        self._current = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def phase(self, name):
        """Add the wall-clock time of the `with` body to phase `name` of the current step."""
        if name not in PHASES:
            raise ValueError(f"unknown step phase {name!r}; expected one of {PHASES}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self._current[name] += time.perf_counter() - start

    def step_done(self, step, communication=None):
        """Close the current step; `communication` is seconds (a tensor is read lazily)."""
        self._steps.append((step, time.time(), self._current, communication))
        self._current = dict.fromkeys(PHASES, 0.0)

    def reset(self):
        """Forget the window so far (e.g. the first step, which includes compilation)."""
        self._steps = []
        self._current = dict.fromkeys(PHASES, 0.0)

    def __len__(self):
        return len(self._steps)

    def window(self):
        """Summary of the steps since the last reset: totals per phase and one record a step.

        Returns {"steps": n, "seconds": {phase: total}, "step_seconds": total,
        "step_records": [{"step", "time", "input", "compute", "communication", "checkpoint",
        "total"}]}, where compute excludes communication and total is their sum.
        """
        records = []
        for step, wall_time, phases, communication in self._steps:
            comm = 0.0 if communication is None else float(communication)
            # Clocks differ (graph vs host); communication cannot exceed the step it is in.
            comm = min(max(comm, 0.0), phases["compute"])
            record = {**phases, "compute": phases["compute"] - comm, "communication": comm}
            record = {"step": step, "time": wall_time,
                      **{k: round(v, 6) for k, v in record.items()}}
            record["total"] = round(sum(record[p] for p in PHASES), 6)
            records.append(record)
        seconds = {p: sum(r[p] for r in records) for p in PHASES}
        return {"steps": len(records), "seconds": seconds,
                "step_seconds": sum(seconds.values()), "step_records": records}
