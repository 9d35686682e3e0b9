"""Stragglers during training: every --straggler_every steps each process's own step time is
gathered (Strategy.gather_over_processes) and tfbig-doctor's rule applied
(tfbig.doctor.findings.below_median on steps/s): a process 20% or more below the median rate is
named with its host, in the log and in the run's summary.

A process's own step time is its step's wall time less the gradient all-reduce's (where a fast
process waits for a slow one): input wait, forward, backward and the update; its first step
(compilation) is left out. Under
--deterministic TensorFlow refuses the timestamps that time the all-reduce, every process's step
then takes the same time and none is named.

Test hook (tfbig-doctor's): TFBIG_DOCTOR_TEST_DELAY_RANK=r (or r1,r2,...) and
TFBIG_DOCTOR_TEST_DELAY_SECONDS=s make process r sleep s seconds in each step.
"""
import time

from tfbig.doctor import findings, probes

MEASUREMENT = "training_step"  # steps/s of a process's own work, as tfbig-doctor names it


class StragglerWatch:
    """Per-process step times since the last check; `check(step)` on every process at the
    same steps (a collective) returns the stragglers found then.

        watch = StragglerWatch(strategy, every=100, say=logger.info)
        watch.step_started(); ...; watch.step_done(seconds, communication_seconds)
        watch.check(step)   # every process, at step % every == 0
    """

    def __init__(self, strategy, every, say):
        self.strategy, self.every, self.say = strategy, every, say
        self.delay = probes.test_delay(strategy.rank)
        self.hosts = None
        self.seconds, self.steps = 0.0, 0
        self.communication = 0.0  # a tensor sum once steps report one (read at a check)
        self.found = []  # every straggler named, with the step of its check
        self.started = False

    def step_started(self):
        if self.delay:
            time.sleep(self.delay)  # tfbig-doctor's test hook: this process is slow

    def step_done(self, seconds, communication):
        """One step of `seconds` wall time, `communication` of them in the all-reduce. A
        process's first step (compiling, at its own pace) is not counted."""
        if not self.started:
            self.started = True
            return
        self.seconds += seconds
        self.steps += 1
        self.communication = self.communication + communication

    def due(self, step):
        return self.every > 0 and step % self.every == 0

    def check(self, step):
        """Gather every process's own seconds per step since the last check and name the
        stragglers (a collective: every process calls it at the same step)."""
        own = (self.seconds - float(self.communication)) / max(self.steps, 1)
        self.seconds, self.steps, self.communication = 0.0, 0, 0.0
        rows = self.strategy.gather_over_processes([max(own, 1e-9)])
        if len(rows) < 2:
            return []
        if self.hosts is None:
            self.hosts = self.strategy.process_hosts()
        rates = {rank: 1.0 / row[0] for rank, row in enumerate(rows)}
        found = findings.below_median(rates, findings.STRAGGLER_THRESHOLD, MEASUREMENT, "rank",
                                      dict(enumerate(self.hosts)))
        for straggler in found:
            straggler["step"] = step
            straggler["seconds_per_step"] = 1.0 / straggler["value"]
            straggler["median_seconds_per_step"] = 1.0 / straggler["median"]
            self.say(f"straggler at step {step}: rank {straggler['rank']} on host "
                     f"{straggler['host']} takes {straggler['seconds_per_step']:.3f} s per step "
                     f"of its own work, {straggler['below']:.0%} below the median rate "
                     f"({straggler['median_seconds_per_step']:.3f} s per step)")
        self.found += found
        return found

    def describe(self):
        """One line for the run's end: each process named, with the steps of its checks."""
        steps = {}
        for s in self.found:
            steps.setdefault((s["rank"], s["host"]), []).append(str(s["step"]))
        return "stragglers: " + "; ".join(
            f"rank {rank} on host {host} (at step {', '.join(at)})"
            for (rank, host), at in sorted(steps.items()))
