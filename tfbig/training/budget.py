"""A run that fits in a time budget: `--max_steps=0` trains for `--time_budget_minutes` of
wall time, counted from the start of the command, under a warmup-stable-decay schedule.

The learning rate warms up over --warmup_steps, then holds at its peak; the decay (the
--lr_schedule shape, down to --min_lr_ratio of the peak) takes the last DECAY_FRACTION of the
run's steps. When that decay starts is decided from the time left, re-estimated every
ESTIMATE_EVERY steps from the steps measured lately, not the first ones (on a 2-core Xeon the
main job's first timed steps ran at 0.64-0.84 s, the rest at ~0.49 s: a count fixed from them
left 1-2 of the 9 minutes unused):
  1. a process's first COMPILE_STEPS steps compile and are not timed; after that a mark is
     taken every ESTIMATE_EVERY steps, and the seconds a step takes are the median of the last
     RECENT_INTERVALS intervals between marks (fewer: the last one), checkpoint saves and
     validation passes inside them left out;
  2. at the first mark the run saves its first checkpoint and times a validation pass (two
     batches: the first compiles the forward, the second is timed), so the pauses to come are
     measured: a checkpoint every --checkpoint_every steps and a validation pass every
     --eval_every steps count as their share of each step's time;
  3. at every mark every process takes the slowest figures of all (so all agree), and
     total = steps done + (budget - elapsed - finish) / seconds per step, where `finish` is the
     end of the run after its last step (the validation pass, the last checkpoint, and
     FINISH_SECONDS for the sample and the summary): the last step is the last one whose
     predicted end leaves the finish inside the budget;
  4. once the warmup is over and the steps left are at most DECAY_FRACTION of that total, the
     decay starts at this step and ends at that total: both are written to
     MODEL_DIR/config.json (`budget`), with the figures behind them, and the step count is
     fixed from there on.
A resumed run whose record holds a decided decay continues that schedule exactly, even on a
machine of another speed; one resumed before its decay was decided gets the budget again from
its own start and decides it anew (the constant rate does not depend on the total).

Example:
    tfbig-train                               # the main job: 9 minutes from start to sample
    tfbig-train --time_budget_minutes=30      # half an hour
    tfbig-train --max_steps=500               # exactly 500 steps, warmup then decay, no budget
"""
import contextlib
import dataclasses
import json
import math
import os
import statistics
import time
from typing import Optional

COMPILE_STEPS = 2  # a process's first steps compile: not timed
ESTIMATE_EVERY = 10  # steps between marks, where the time left is estimated again
RECENT_INTERVALS = 3  # the seconds per step: the median of the last intervals between marks
DECAY_FRACTION = 0.2  # the decay takes the last fifth of the steps (MiniCPM's WSD: 10-20%)
FINISH_SECONDS = 5.0  # the sample text and the summary


@dataclasses.dataclass
class Budget:
    """A budgeted run's schedule and the figures behind it (kept in config.json)."""

    minutes: float
    max_steps: int  # the decided total; until the decay is decided, the latest estimate
    seconds_per_step: float
    elapsed_seconds: float  # from the command's start to the estimate
    finish_seconds: float
    checkpoint_seconds: float = 0.0  # a checkpoint save, measured
    validation_seconds: float = 0.0  # a whole validation pass, measured
    # the step the decay starts after (None: not decided yet); records of earlier versions,
    # which fixed the count once and decayed from the warmup's end, read as 0: that schedule
    decay_start: Optional[int] = 0
    timed_steps: tuple = ()  # (first, last): the steps the seconds per step were timed over
    predicted_end_seconds: float = 0.0  # the run's end predicted at this estimate
    ended_seconds: Optional[float] = None  # the run's fit() ended (after the finish's save
    # and validation; the sample and summary follow), in this process's accounting

    @property
    def decided(self):
        return self.decay_start is not None

    def describe(self):
        measured = (f"{self.seconds_per_step:.3f} s/step (steps {self.timed_steps[0]}-"
                    f"{self.timed_steps[1]}), a checkpoint {self.checkpoint_seconds:.1f} s, "
                    f"validation {self.validation_seconds:.1f} s") if self.timed_steps else \
            f"{self.seconds_per_step:.3f} s/step"
        head = f"time budget {self.minutes:g} min: "
        if not self.decided:
            return (head + f"about {self.max_steps} steps at {measured} (measured), "
                    f"{self.elapsed_seconds:.0f} s spent, {self.finish_seconds:.0f} s kept for "
                    f"the end of the run; the peak learning rate holds until the time left "
                    f"fits the decay (the last {DECAY_FRACTION:.0%} of the steps), estimated "
                    f"again every {ESTIMATE_EVERY} steps")
        return (head + f"decay from step {self.decay_start} to step {self.max_steps} at "
                f"{measured} (measured at {self.elapsed_seconds:.0f} s); the run's end "
                f"predicted at {self.predicted_end_seconds:.0f} s of {self.minutes * 60:.0f}")


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
                         "could not take part in deciding when the decay starts; give "
                         "--max_steps")


def steps_fitting(budget_seconds, elapsed_seconds, seconds_per_step, finish_seconds,
                  pauses=()):
    """How many more steps end before the budget, leaving `finish_seconds` after the last.

    `pauses`: (seconds, every) of what the loop does every `every` steps after a step (a
    checkpoint save, a validation pass); each adds seconds / every to a step's share.
    """
    left = budget_seconds - elapsed_seconds - finish_seconds
    return max(0, math.floor(left / step_share(seconds_per_step, pauses)))


def step_share(seconds_per_step, pauses=()):
    """Seconds a step costs with its share of the pauses."""
    return seconds_per_step + sum(seconds / every for seconds, every in pauses if every)


def steps_within(budget_seconds, elapsed_seconds, seconds_per_step, finish_seconds, done,
                 pauses=()):
    """The run's step count: the `done` steps plus those that fit in what is left (an error
    naming the flag when none does)."""
    total = done + steps_fitting(budget_seconds, elapsed_seconds, seconds_per_step,
                                 finish_seconds, pauses)
    if total <= done:
        raise ValueError(
            f"--time_budget_minutes={budget_seconds / 60:g} is used up: {elapsed_seconds:.0f} s "
            f"went to preparation, compilation and {done} steps, and the end of the run needs "
            f"{finish_seconds:.0f} s more; raise --time_budget_minutes or give --max_steps")
    return total


def decay_due(done, total, warmup_steps):
    """Whether the decay starts after step `done` of an estimated `total`: the warmup is over
    and the steps left are at most DECAY_FRACTION of the total."""
    return done >= warmup_steps and total - done <= DECAY_FRACTION * total


def check_warmup_fits(total, warmup_steps, budget_minutes, seconds_per_step):
    """Refuse a budget too short for the warmup and a decay after it."""
    if total * (1 - DECAY_FRACTION) < warmup_steps:
        raise ValueError(
            f"--time_budget_minutes={budget_minutes:g} fits about {total} steps at "
            f"{seconds_per_step:.3f} s/step, too few for --warmup_steps={warmup_steps} and a "
            f"decay over the last {DECAY_FRACTION:.0%} of the steps after it; raise "
            f"--time_budget_minutes, lower --warmup_steps or give --max_steps")


def estimate(train, step, seconds_per_step, timed_steps, elapsed_seconds, checkpoint_seconds,
             validation_seconds, first=False):
    """The Budget after step `step` of TrainConfig `train`, from the figures measured: its
    total, and the decay's start once it is due (decay_start None before). `first`: the
    process's first estimate, which refuses a budget already used up; the later ones, inside
    the warmup, refuse one too short for it (the first, timed over the steps just after
    compiling, can be much slower than the rest).

    Example: estimate(train, 900, 0.49, (870, 900), 430.0, 1.0, 6.0) with a 9-minute budget
    and the main job's flags: 98 s left after the finish's 12 fit 197 more steps of 0.495 s
    (a 1 s checkpoint every 200 steps included), the last 18% of 1097: the decay starts after
    step 900 and ends at step 1097.
    """
    budget_seconds = train.time_budget_minutes * 60
    finish = finish_seconds(checkpoint_seconds, validation_seconds)
    pauses = [(checkpoint_seconds, train.checkpoint_every), (validation_seconds, train.eval_every)]
    if first:
        total = steps_within(budget_seconds, elapsed_seconds, seconds_per_step, finish, step,
                             pauses)
    else:
        total = step + steps_fitting(budget_seconds, elapsed_seconds, seconds_per_step, finish,
                                     pauses)
        if step < train.warmup_steps:
            check_warmup_fits(total, train.warmup_steps, train.time_budget_minutes,
                              seconds_per_step)
    decided = decay_due(step, total, train.warmup_steps)
    if decided:
        total = max(total, step + 1)  # a decay of one step at least
    return Budget(train.time_budget_minutes, total, seconds_per_step, elapsed_seconds, finish,
                  checkpoint_seconds, validation_seconds,
                  decay_start=step if decided else None, timed_steps=tuple(timed_steps),
                  predicted_end_seconds=elapsed_seconds + finish + (total - step) * step_share(
                      seconds_per_step, pauses))


def finish_seconds(checkpoint_seconds, validation_seconds):
    """Time after the last step: the validation pass, the last checkpoint and FINISH_SECONDS
    for the sample and the summary."""
    return validation_seconds + checkpoint_seconds + FINISH_SECONDS


class StepTimer:
    """A budgeted run's clock: a mark every ESTIMATE_EVERY steps and the pauses between marks
    (checkpoint saves, validation passes), for the seconds a step takes lately.

    Example:
        timer.start(step)                      # at each fit()'s start
        if timer.due(step): timer.mark(step)   # after the step's results were read
        with timer.pause("checkpoint"): save()
    """

    def __init__(self):
        self.marks = []  # (step, clock, pause seconds until then)
        self.paused = 0.0
        self.seconds = {"checkpoint": 0.0, "validation": 0.0}  # the latest pause of each kind
        self.first = None
        self._compiled = False

    def start(self, step):
        """A fit() begins after `step`: the process's first one times from COMPILE_STEPS steps
        on (they compile), a later one at once."""
        self.marks = []
        self.first = step if self._compiled else step + COMPILE_STEPS
        self._compiled = True
        if self.first == step:
            self.mark(step)

    def due(self, step):
        """Whether the end of `step` is a mark (the caller waits for the step's results)."""
        return step == self.first or (step > self.first and step % ESTIMATE_EVERY == 0)

    def mark(self, step):
        self.marks.append((step, time.monotonic(), self.paused))

    @contextlib.contextmanager
    def pause(self, kind):
        """Time what the loop does between steps (`kind`: checkpoint or validation): left out
        of the steps' time, kept as that kind's latest figure."""
        begin = time.monotonic()
        try:
            yield
        finally:
            self.seconds[kind] = time.monotonic() - begin
            self.paused += self.seconds[kind]

    def seconds_per_step(self):
        """(seconds, (first, last)): the median seconds per step of the last RECENT_INTERVALS
        intervals between marks (with fewer, the last one's) and the steps they span; None
        before two marks."""
        rates = [((c1 - c0 - (p1 - p0)) / (s1 - s0), s0, s1)
                 for (s0, c0, p0), (s1, c1, p1) in zip(self.marks, self.marks[1:])]
        if not rates:
            return None
        recent = rates[-RECENT_INTERVALS:] if len(rates) >= RECENT_INTERVALS else rates[-1:]
        return statistics.median(rate for rate, _, _ in recent), (recent[0][1], recent[-1][2])


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
    """The decided Budget recorded in MODEL_DIR/config.json for this budget, or None (none
    recorded, another budget, or a decay not decided yet)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        record = json.load(f).get("budget")
    if not record or record.get("minutes") != minutes:
        return None
    budget = Budget(**record)
    return budget if budget.decided else None
