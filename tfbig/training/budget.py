"""A run that fits in a time budget: `--max_steps=0` trains as many steps as fit in
`--time_budget_minutes` of wall time, counted from the start of the command.

The step count is fixed once, early, from the measured speed of the run itself:
  1. steps 1-2 compile and warm up; then up to TIMED_STEPS steps are timed, ending at step
     CALIBRATION_STEPS or, with a longer warmup, at the warmup's end or step CALIBRATION_MAX
     (the first steps after compiling run slower: in an idle main job steps 3-8 took 1.20 s,
     the rest 1.08 s, which left 40 s of the budget unused; and a short window catches the
     machine's own swings: another idle main job timed 0.475 s a step over steps 9-24, then
     ran at 0.40 s and left 51 s unused, so the window is up to 32 steps long);
  2. every process takes the slowest figures of all (so all agree on one number);
  3. at the window's end the run saves its first checkpoint and runs two validation batches
     (the first compiles the forward, the second is timed), so the pauses to come are
     measured too: a checkpoint every --checkpoint_every steps and a validation pass every
     --eval_every steps count as their share of each step's time (in the idle main job the
     six saves and the final validation's compilation, left out, ran 23 s over 9 minutes);
  4. max_steps = steps done + (budget - elapsed - finish) / seconds per step, where `finish`
     is the end of the run after the last step: the validation pass, the last checkpoint,
     and FINISH_SECONDS for the sample and the summary.
The calibration steps run inside the learning-rate warmup, whose rates do not depend on the
total, so the first steps are the ones an explicit `--max_steps` of the same count would take.
The count is written to MODEL_DIR/config.json (`budget`); a resumed run reads it back and
continues the same schedule exactly, even on a machine of another speed.

Example:
    tfbig-train                               # the main job: 9 minutes from start to sample
    tfbig-train --time_budget_minutes=30      # half an hour
    tfbig-train --max_steps=500               # exactly 500 steps, no budget
"""
import dataclasses
import json
import math
import os
import time

CALIBRATION_STEPS = 8  # steps 1-2 compile; the timing ends at step 8 at the earliest
CALIBRATION_MAX = 48  # ... and at step 48 at the latest (inside a warmup of 48+ steps)
TIMED_STEPS = 32  # the most steps timed: the last ones of the window
FINISH_SECONDS = 5.0  # the sample text and the summary


@dataclasses.dataclass
class Budget:
    """What fixed a budgeted run's step count (kept in config.json)."""

    minutes: float
    max_steps: int
    seconds_per_step: float
    elapsed_seconds: float  # from the command's start to the end of calibration
    finish_seconds: float
    # measured at the calibration's end (0 in records of runs before they were): a checkpoint
    # save and a whole validation pass; seconds_per_step is the training step's alone
    checkpoint_seconds: float = 0.0
    validation_seconds: float = 0.0

    def describe(self):
        return (f"time budget {self.minutes:g} min: {self.max_steps} steps at "
                f"{self.seconds_per_step:.3f} s/step, a checkpoint {self.checkpoint_seconds:.1f} "
                f"s, validation {self.validation_seconds:.1f} s (measured), "
                f"{self.elapsed_seconds:.0f} s spent before, {self.finish_seconds:.0f} s kept "
                f"for the end of the run")


def check(cfg):
    """Refuse budget settings that cannot work, before anything is built (errors name flags)."""
    train = cfg.train
    if train.max_steps < 0:
        raise ValueError(f"--max_steps={train.max_steps}: expected a step count, or 0 for as "
                         f"many steps as fit in --time_budget_minutes")
    if train.max_steps:
        return
    if train.time_budget_minutes <= 0:
        raise ValueError(f"--max_steps=0 trains for --time_budget_minutes, which is "
                         f"{train.time_budget_minutes}; give a positive budget or --max_steps")
    if cfg.horovod.elastic:
        raise ValueError("--max_steps=0 (time budget) with --elastic: ranks that join later "
                         "could not take part in fixing the step count; give --max_steps")
    if train.warmup_steps < CALIBRATION_STEPS:
        raise ValueError(f"--max_steps=0 (time budget) measures the speed during the learning-"
                         f"rate warmup, which needs --warmup_steps >= {CALIBRATION_STEPS} (got "
                         f"{train.warmup_steps}); raise it or give --max_steps")


def calibration_window(step, warmup_steps):
    """(first, last): the budget divides the time from the end of step `first` to the end of
    step `last` by `last - first`, for a run that starts at step `step`."""
    last = step + max(CALIBRATION_STEPS, min(warmup_steps, CALIBRATION_MAX))
    return max(step + 2, last - TIMED_STEPS), last


def steps_within(budget_seconds, elapsed_seconds, seconds_per_step, finish_seconds, done,
                 pauses=()):
    """The run's step count: the `done` steps plus those that fit in what is left.

    `pauses`: (seconds, every) of what the loop does every `every` steps after a step (a
    checkpoint save, a validation pass); each adds seconds / every to a step's share.
    """
    left = budget_seconds - elapsed_seconds - finish_seconds
    share = seconds_per_step + sum(seconds / every for seconds, every in pauses if every)
    total = done + max(0, math.floor(left / share))
    if total <= done:
        raise ValueError(
            f"--time_budget_minutes={budget_seconds / 60:g} is used up: {elapsed_seconds:.0f} s "
            f"went to preparation, compilation and {done} steps, and the end of the run needs "
            f"{finish_seconds:.0f} s more; raise --time_budget_minutes or give --max_steps")
    return total


def finish_seconds(checkpoint_seconds, validation_seconds):
    """Time after the last step: the validation pass, the last checkpoint and FINISH_SECONDS
    for the sample and the summary."""
    return validation_seconds + checkpoint_seconds + FINISH_SECONDS


def command_start():
    """time.monotonic() of the process's start, so a budget and the wall time of the last line
    include the interpreter's start and the imports (5 s in the main job); where /proc is
    missing (not Linux), now."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic()
    age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - max(0.0, age)


def saved(model_dir, minutes):
    """The Budget recorded in MODEL_DIR/config.json for this budget, or None."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        record = json.load(f).get("budget")
    if not record or record.get("minutes") != minutes:
        return None
    return Budget(**record)
