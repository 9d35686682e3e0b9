"""What a training run records about its own speed, in one object the trainer drives.

Why it is built this way: docs/design/notes/profiling.md (tfbig.profiling.profiler).
"""
import contextlib
import functools
import json
import os
import time

from tfbig.profiling.monitor import SystemMonitor
from tfbig.profiling.timing import PHASES, StepTimer

PROFILE_DIR = "profile"


def parse_profile_steps(text):
    """'N,M' -> (N, M), the inclusive range of steps to trace; '' -> None."""
    if not text:
        return None
    try:
        first, last = (int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--profile_steps={text!r}: expected two step numbers 'N,M' "
                         f"(e.g. 20,25), or empty for no trace") from None
    if not 1 <= first <= last:
        raise ValueError(f"--profile_steps={text!r}: need 1 <= N <= M")
    return first, last


@functools.lru_cache(maxsize=None)
def peak_flops(precision, override_tflops=0.0):
    """(peak FLOP/s of one device, its source); measured once per process on CPU."""
    if override_tflops > 0:
        return override_tflops * 1e12, "flag:peak_tflops"
    from tfbig.profiling.perf import device_peak_flops

    return device_peak_flops(precision)


class RunProfiler:
    """Step timing, throughput/MFU per interval, the system monitor and profiler traces.

    Args:
      cfg: the ProfileConfig section.
      model_dir: the run directory.
      enabled: False on non-chief processes (timing only: no files, monitor or trace).
      tokens_per_step, sequences_per_step: global, per optimizer step.
      flops_per_token: model training FLOPs per token (None: no TFLOP/s or MFU).
      precision: --precision, picks the peak.
      num_devices: devices the step runs on (MFU is over all of them). A CPU peak measured
        by the probe is the whole host's, which its replicas share: MFU then counts one
        device (one host; multi-host CPU runs are not normalised).
    """

    def __init__(self, cfg, model_dir, *, enabled=True, tokens_per_step, sequences_per_step,
                 flops_per_token=None, precision="fp32", num_devices=1):
        self.cfg = cfg
        self.model_dir = model_dir
        self.enabled = enabled
        self.trace_steps = parse_profile_steps(cfg.profile_steps)
        if cfg.monitor_interval_ms < 0:
            raise ValueError(f"--monitor_interval_ms={cfg.monitor_interval_ms}: expected a "
                             f"positive period in milliseconds, or 0 to switch the monitor off")
        self.tokens_per_step = tokens_per_step
        self.sequences_per_step = sequences_per_step
        self.flops_per_token = flops_per_token
        self.precision = precision
        self.num_devices = num_devices
        self.timer = StepTimer()
        self.monitor = None
        self._steps_file = None
        self._warmup = True
        self._tracing = False  # a tf.profiler session is capturing
        self._trace = None  # the current step's marker while capturing

    # ---- session -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self, step):
        """Monitor, step log and trace run inside this context; all stop when it exits."""
        self._start(step)
        try:
            yield self
        finally:
            self._stop()

    def _path(self, name):
        return os.path.join(self.model_dir, PROFILE_DIR, name)

    def _start(self, step):
        self.timer.reset()
        self._warmup = True
        if not self.enabled:
            return
        os.makedirs(self._path(""), exist_ok=True)
        peak, source = self.peak()
        with open(self._path("run.json"), "w") as f:
            json.dump({"peak_flops_per_device": peak, "peak_source": source,
                       "num_devices": self._mfu_devices(), "precision": self.precision,
                       "flops_per_token": self.flops_per_token,
                       "tokens_per_step": self.tokens_per_step,
                       "sequences_per_step": self.sequences_per_step,
                       "monitor_interval_ms": self.cfg.monitor_interval_ms,
                       "profile_steps": self.trace_steps, "start_step": step,
                       "start_time": time.time()}, f, indent=2)
        self._steps_file = open(self._path("steps.jsonl"), "a")
        if self.cfg.monitor_interval_ms:
            self.monitor = SystemMonitor(self._path("system.jsonl"), self.cfg.monitor_interval_ms,
                                         summary_dir=os.path.join(self.model_dir, "system"))
            self.monitor.start()
        self._maybe_start_trace(step + 1)

    def _stop(self):
        self._stop_trace()
        if self.monitor is not None:
            self.monitor.stop()
        if self._steps_file is not None:
            self._write_steps(self.timer.window()["step_records"])
            self._steps_file.close()
            self._steps_file = None

    def _mfu_devices(self):
        _, source = self.peak()
        return 1 if source and source.startswith("measured:cpu") else self.num_devices

    def peak(self):
        """(peak FLOP/s of one device, source), or (None, None) without FLOPs to compare."""
        if self.flops_per_token is None or not self.enabled:
            return None, None
        return peak_flops(self.precision, self.cfg.peak_tflops)

    # ---- per step ----------------------------------------------------------------------------
    def phase(self, name):
        """Context timing one phase of the current step (input, compute, checkpoint)."""
        return self.timer.phase(name)

    def step_done(self, step, communication=None):
        """Close step `step`; `communication` is its gradient all-reduce seconds (tensor ok)."""
        self.timer.step_done(step, communication)
        if self._warmup:  # the first step of a session compiles: keep it out of every figure
            self._warmup = False
            records = self.timer.window()["step_records"]
            self._write_steps([{**r, "warmup": True} for r in records])
            self.timer.reset()
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None
            if step >= self.trace_steps[1]:
                self._stop_trace()
        self._maybe_start_trace(step + 1)

    def interval(self):
        """Throughput, MFU and time breakdown of the steps since the last call."""
        window = self.timer.window()
        self.timer.reset()
        self._write_steps(window["step_records"])
        steps, seconds = window["steps"], window["step_seconds"]
        if not steps or seconds <= 0:
            return {}
        tokens_per_sec = steps * self.tokens_per_step / seconds
        values = {"tokens_per_sec": tokens_per_sec,
                  "sequences_per_sec": steps * self.sequences_per_step / seconds,
                  "step_time_ms": 1000.0 * seconds / steps}
        peak, _ = self.peak()
        if self.flops_per_token:
            values["tflops"] = self.flops_per_token * tokens_per_sec / 1e12
        if peak:
            values["mfu"] = self.flops_per_token * tokens_per_sec / (peak * self._mfu_devices())
        for phase in PHASES:
            values[f"time_fraction/{phase}"] = window["seconds"][phase] / seconds
        return values

    def _write_steps(self, records):
        if self._steps_file is not None and records:
            if self.trace_steps:  # the profiler's own overhead distorts these steps
                first, last = self.trace_steps
                records = [{**r, "traced": True} if first <= r["step"] <= last else r
                           for r in records]
            self._steps_file.write("".join(json.dumps(r) + "\n" for r in records))
            self._steps_file.flush()

    # ---- profiler trace ----------------------------------------------------------------------
    def _maybe_start_trace(self, next_step):
        if not self.enabled or self.trace_steps is None:
            return
        first, last = self.trace_steps
        if not first <= next_step <= last:
            return
        import tensorflow as tf

        if not self._tracing:
            tf.profiler.experimental.start(self.model_dir)
            self._tracing = True
        # Step markers let the Profile tab's overview split time per training step.
        self._trace = tf.profiler.experimental.Trace("train", step_num=next_step, _r=1)
        self._trace.__enter__()

    def _stop_trace(self):
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None
        if self._tracing:
            import tensorflow as tf

            tf.profiler.experimental.stop()
            self._tracing = False
