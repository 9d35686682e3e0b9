"""Goodput: the share of a run's wall time spent in productive training steps, and where the
rest went (badput by cause), accumulated across restarts in MODEL_DIR/goodput.json.

The wall time runs from the first training process's start to the last record, restarts
included. It splits into:

    productive          training steps (input wait, checkpoints and evaluation taken out)
    startup             each process's start: imports, building, restoring's neighbours,
                        compilation (the first step's time beyond a usual step's)
    checkpoint_save     the loop's waits for saves (with --async_checkpoint: the host copy)
    checkpoint_restore  reading the checkpoint at a resume
    evaluation          validation passes
    input_wait          waiting for the next batch
    lost_progress       steps trained after the checkpoint a restart resumed from (redone),
                        and a dead process's time after its last record
    restart             from a death to the next process's start (the supervisor's back-off
                        and relaunch: tfbig-launch --max_restarts records the death time in
                        MODEL_DIR/restarts.jsonl; without it, the whole gap)

The chief records its totals at every progress line and checkpoint, so a process killed at
any moment loses at most the time since its last record to `lost_progress`.

    clock = GoodputClock(model_dir, process_start_epoch, enabled=is_chief)
    clock.loop_started()
    with clock.step():                                   # one iteration of the loop
        with clock.measure("input_wait"): batch = ...
    clock.summary()  # {"goodput": 0.83, "wall_seconds": ..., "seconds": {part: s}, ...}
"""
import json
import os
import time

FILE = "goodput.json"
RESTARTS_FILE = "restarts.jsonl"  # one line per restart, appended by the supervisor
CAUSES = ("startup", "checkpoint_save", "checkpoint_restore", "evaluation", "input_wait",
          "lost_progress", "restart")
PARTS = ("productive",) + CAUSES


def record_restart(model_dir, died, relaunched, cause):
    """Append one restart (epoch seconds of the death and of the relaunch) for the next
    process's goodput; the supervisor calls it (no TensorFlow)."""
    if not model_dir or not os.path.isdir(model_dir):
        return
    with open(os.path.join(model_dir, RESTARTS_FILE), "a") as f:
        f.write(json.dumps({"died": died, "relaunched": relaunched, "cause": cause}) + "\n")


def _load(model_dir):
    try:
        with open(os.path.join(model_dir, FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _restarts(model_dir):
    try:
        with open(os.path.join(model_dir, RESTARTS_FILE)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


class GoodputClock:
    """This process's time by cause, added to what earlier processes of the run recorded.

    Args:
      model_dir: the run directory (goodput.json, restarts.jsonl).
      process_start: epoch seconds of this process's start.
      enabled: whether this process writes goodput.json (the chief).
    """

    def __init__(self, model_dir, process_start, enabled=True):
        self.model_dir, self.enabled = model_dir, enabled
        self.process_start = process_start
        self.seconds = dict.fromkeys(PARTS, 0.0)  # this process's
        self.step_seconds = []  # this process's steps, the first one (compiling) included
        previous = _load(model_dir)
        self.base = dict(previous["seconds"]) if previous else dict.fromkeys(PARTS, 0.0)
        self.run_start = previous["run_start"] if previous else process_start
        self.saved = dict(previous.get("saved", {})) if previous else {}
        self.restarts = previous.get("restarts", 0) if previous else 0
        if previous and previous.get("finished"):  # a finished run trained further: the time
            self.run_start += max(0.0, process_start - previous["updated"])  # between is not its
        elif previous:
            self._account_gap(previous)
        self.in_loop = False

    def _account_gap(self, previous):
        """The time between the previous process's last record and this one's start."""
        gap = max(0.0, self.process_start - previous["updated"])
        died = [r["died"] for r in _restarts(self.model_dir)
                if previous["updated"] - 1.0 <= r["died"] <= self.process_start]
        tail = min(gap, max(0.0, died[-1] - previous["updated"])) if died else 0.0
        self.base["lost_progress"] += tail  # the dead process worked on after its record
        self.base["restart"] += gap - tail
        self.restarts += 1

    def resumed(self, step):
        """A resume at checkpoint `step`: earlier processes' productive time after it is lost
        (its steps are trained again)."""
        productive_then = self.saved.get(str(step), 0.0 if step == 0 else None)
        if productive_then is None:  # a checkpoint this run's records do not know
            return
        lost = max(0.0, self.base["productive"] - productive_then)
        self.base["productive"] -= lost
        self.base["lost_progress"] += lost

    def measure(self, part):
        """Context adding its duration to `part`."""
        return _Measure(self, part)

    def loop_started(self):
        """The step loop begins: what this process did before it is start-up."""
        if not self.in_loop:
            measured = sum(self.seconds.values())
            self.seconds["startup"] += max(0.0, time.time() - self.process_start - measured)
            self.in_loop = True

    def step(self):
        """Context around one iteration of the loop: its time, less what `measure` gave
        other parts meanwhile (input wait, saves, evaluation), is a productive step's."""
        return _Step(self)

    def checkpoint_saved(self, step):
        """Remember the productive time at checkpoint `step` (what a resume there keeps)."""
        self.saved[str(step)] = self.totals()["productive"]
        self.write()

    def _usual_step(self):
        """The median of this process's steps after its first (0 before there is one)."""
        rest = sorted(self.step_seconds[1:])
        return min(rest[len(rest) // 2], self.step_seconds[0]) if rest else 0.0

    def totals(self):
        """{part: seconds} over the whole run so far. This process's first step counts as
        start-up (it compiles) but for a usual step's time, once one is known."""
        usual = self._usual_step()
        out = {p: self.base[p] + self.seconds[p] for p in PARTS}
        out["productive"] += usual
        out["startup"] -= usual
        return out

    def summary(self):
        """{"goodput": share, "wall_seconds", "seconds": {part: s}, "restarts": n}."""
        seconds = self.totals()
        wall = time.time() - self.run_start
        return {"goodput": seconds["productive"] / wall if wall > 0 else 0.0,
                "wall_seconds": wall, "seconds": seconds, "restarts": self.restarts}

    def scalars(self):
        """TensorBoard figures: goodput and each cause's share of the wall time."""
        summary = self.summary()
        wall = summary["wall_seconds"] or 1.0
        return {"goodput": summary["goodput"],
                **{f"badput/{c}": summary["seconds"][c] / wall for c in CAUSES}}

    def describe(self):
        """One line: goodput and the largest causes of badput."""
        summary = self.summary()
        causes = sorted(((s, c) for c, s in summary["seconds"].items()
                         if c in CAUSES and s >= 0.05), reverse=True)
        return (f"goodput {summary['goodput']:.1%} of {summary['wall_seconds']:.1f} s wall"
                + (f" ({summary['restarts']} restart(s))" if summary["restarts"] else "")
                + ("; badput: " + ", ".join(f"{c.replace('_', ' ')} {s:.1f} s" for s, c in causes)
                   if causes else ""))

    def write(self, finished=False):
        """Record the run's totals in MODEL_DIR/goodput.json (atomically; the chief only)."""
        if not self.enabled or not os.path.isdir(self.model_dir):
            return
        record = {"run_start": self.run_start, "updated": time.time(), "seconds": self.totals(),
                  "saved": self.saved, "restarts": self.restarts, "finished": finished}
        path = os.path.join(self.model_dir, FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)


class _Measure:
    def __init__(self, clock, part):
        self.clock, self.part = clock, part

    def __enter__(self):
        self.begin = time.time()
        return self

    def __exit__(self, *exc):
        self.clock.seconds[self.part] += time.time() - self.begin


class _Step:
    def __init__(self, clock):
        self.clock = clock

    def __enter__(self):
        self.begin, self.elsewhere = time.time(), sum(self.clock.seconds.values())
        return self

    def __exit__(self, *exc):
        seconds = (time.time() - self.begin) - (sum(self.clock.seconds.values()) - self.elsewhere)
        first = not self.clock.step_seconds
        self.clock.step_seconds.append(seconds)
        self.clock.seconds["startup" if first else "productive"] += seconds
