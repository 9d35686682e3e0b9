"""A background system monitor: CPU per core, memory, disk reads, I/O wait, and GPUs via NVML.

Every `interval_ms` a daemon thread appends one JSON line to a file in the run directory (and,
optionally, TensorBoard scalars under the run's `system` directory). It measures its own CPU
time (`cpu_seconds`) so its cost can be checked against the step time it steals from.

Example:
    with SystemMonitor("/tmp/run/profile/system.jsonl", interval_ms=500) as monitor:
        train()
    print(monitor.samples, monitor.cpu_seconds)
"""
import json
import os
import socket
import threading
import time

import psutil
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

MB = 1024.0 * 1024.0


class GpuSampler:
    """Utilisation and memory of each NVIDIA GPU through NVML; empty when there is none."""

    def __init__(self):
        self.handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                            for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception:  # no driver, no library, no device: a CPU-only machine
            self.handles = []

    def sample(self):
        out = []
        for index, handle in enumerate(self.handles):
            util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            out.append({"index": index, "utilization_percent": float(util.gpu),
                        "memory_used_mb": memory.used / MB, "memory_total_mb": memory.total / MB})
        return out

    def close(self):
        if self.handles:
            self._nvml.nvmlShutdown()
            self.handles = []


class SystemSampler:
    """One call of `sample()` = the machine's state since the previous call."""

    def __init__(self, pid=None):
        self.process = psutil.Process(pid)
        self.gpus = GpuSampler()
        self.process.cpu_percent()  # the first call only sets the reference point
        self._last = (time.perf_counter(), self._disk_read_bytes(), self._process_read_bytes())
        self._last_cpu = psutil.cpu_times(percpu=True)

    def _cpu(self):
        """(busy % per core, I/O wait % of all cores) since the last call.

        Computed from our own counters rather than psutil.cpu_percent, whose reference point
        is global and shared with any other caller in the process.
        """
        now = psutil.cpu_times(percpu=True)
        busy, iowait, total = [], 0.0, 0.0
        for before, after in zip(self._last_cpu, now):
            delta = {f: getattr(after, f) - getattr(before, f) for f in after._fields}
            # guest time is already counted in user time on Linux
            spent = sum(v for f, v in delta.items() if f not in ("guest", "guest_nice"))
            idle = delta.get("idle", 0.0) + delta.get("iowait", 0.0)
            busy.append(100.0 * (spent - idle) / spent if spent > 0 else 0.0)
            iowait += delta.get("iowait", 0.0)
            total += spent
        self._last_cpu = now
        return busy, (100.0 * iowait / total if total > 0 else 0.0)

    def _disk_read_bytes(self):
        counters = psutil.disk_io_counters()
        return counters.read_bytes if counters else 0

    def _process_read_bytes(self):
        try:  # read_chars counts page-cache hits too: everything the input pipeline read
            counters = self.process.io_counters()
            return getattr(counters, "read_chars", counters.read_bytes)
        except (AttributeError, psutil.Error):  # not available on this platform
            return 0

    def sample(self):
        wall, now = time.time(), time.perf_counter()
        disk, proc = self._disk_read_bytes(), self._process_read_bytes()
        seconds = max(now - self._last[0], 1e-6)
        cores, iowait = self._cpu()
        record = {
            "time": wall,
            "interval_seconds": seconds,  # what the rates below are averaged over
            "cpu_percent": cores,
            "cpu_mean": sum(cores) / max(len(cores), 1),
            "iowait_percent": iowait,
            "process_cpu_percent": self.process.cpu_percent(),
            "process_rss_mb": self.process.memory_info().rss / MB,
            "memory_used_percent": psutil.virtual_memory().percent,
            "swap_used_percent": psutil.swap_memory().percent,
            "disk_read_mb_per_sec": max(disk - self._last[1], 0) / MB / seconds,
            "process_read_mb_per_sec": max(proc - self._last[2], 0) / MB / seconds,
            "gpus": self.gpus.sample(),
        }
        self._last = (now, disk, proc)
        return record


def tensorboard_scalars(record):
    """The scalars of one sample worth a TensorBoard chart."""
    values = {key: record[key] for key in (
        "cpu_mean", "iowait_percent", "process_cpu_percent", "process_rss_mb",
        "memory_used_percent", "disk_read_mb_per_sec", "process_read_mb_per_sec")}
    for core, percent in enumerate(record["cpu_percent"]):
        values[f"cpu_core/{core}"] = percent
    for gpu in record["gpus"]:
        values[f"gpu{gpu['index']}/utilization_percent"] = gpu["utilization_percent"]
        values[f"gpu{gpu['index']}/memory_used_mb"] = gpu["memory_used_mb"]
    return values


class EventWriter:
    """TensorBoard scalars written synchronously in pure Python (protobuf, no TF ops).

    tf.summary from this thread costs ~4 ms a sample; this ~0.04 ms, and its cost is
    counted in the monitor's own CPU time instead of hiding in a writer thread.
    """

    def __init__(self, directory):
        os.makedirs(directory, exist_ok=True)
        name = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}.system"
        self._file = open(os.path.join(directory, name), "wb")
        self._records = RecordWriter(self._file)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event):
        self._records.write(event.SerializeToString())
        self._file.flush()

    def scalars(self, step, values, wall_time=None):
        summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v))
                                 for k, v in values.items()])
        self._write(Event(wall_time=wall_time or time.time(), step=step, summary=summary))

    def close(self):
        self._file.close()


class SystemMonitor:
    """Samples the machine in a daemon thread until `stop()` (or the `with` block ends).

    Args:
      path: JSONL file to append one record per sample to (its directory is created).
      interval_ms: sampling period in milliseconds.
      summary_dir: if set, also write each sample as TensorBoard scalars there.
    """

    def __init__(self, path, interval_ms=500, summary_dir=None):
        if interval_ms <= 0:
            raise ValueError(f"--monitor_interval_ms={interval_ms} must be positive")
        self.path = path
        self.interval = interval_ms / 1000.0
        self.summary_dir = summary_dir
        self.samples = 0
        self.cpu_seconds = 0.0  # CPU time the monitor thread itself used
        self.started = self.stopped = None
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._file = open(self.path, "a")
        self._events = EventWriter(self.summary_dir) if self.summary_dir else None
        self._sampler = SystemSampler()
        self.started = time.time()
        self._thread = threading.Thread(target=self._loop, name="tfbig-system-monitor",
                                        daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        while not self._stop.wait(self.interval):
            self._record()
        self._record()  # the final state, so short runs still have a sample
        self._sampler.gpus.close()

    def _record(self):
        start = time.thread_time()
        record = self._sampler.sample()
        record["elapsed"] = record["time"] - self.started
        record["monitor_cpu_seconds"] = self.cpu_seconds + time.thread_time() - start
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.samples += 1
        if self._events is not None:
            self._events.scalars(self.samples, tensorboard_scalars(record), record["time"])
        self.cpu_seconds += time.thread_time() - start

    def stop(self, timeout=10.0):
        """Stop sampling, write a last sample, close the file; safe to call twice."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"system monitor writing {self.path} did not stop in {timeout}s")
        self._thread = None
        self.stopped = time.time()
        self._file.close()
        if self._events is not None:
            self._events.close()

    @property
    def overhead(self):
        """Monitor CPU time as a fraction of the wall time it ran for."""
        end = self.stopped or time.time()
        return self.cpu_seconds / max(end - (self.started or end), 1e-9)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
