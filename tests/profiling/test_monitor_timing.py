"""System monitor samples and stops; step timer and the in-graph timing of a collective."""
import json
import os
import threading
import time

import numpy as np
import psutil
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tfbig.distribute.base import Strategy
from tfbig.profiling.monitor import SystemMonitor
from tfbig.profiling.profiler import parse_profile_steps
from tfbig.profiling.timing import StepTimer, timed


def _busy(seconds):
    end, x = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        x += 1


def test_monitor_writes_sane_jsonl_and_tensorboard_and_stops(tmp_path):
    path = str(tmp_path / "profile" / "system.jsonl")
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(4 << 20))
    with SystemMonitor(path, interval_ms=50, summary_dir=str(tmp_path / "system")) as monitor:
        _busy(0.3)
        with open(blob, "rb") as f:  # 4 MiB the process reads (page cache included)
            while f.read(1 << 16):
                pass
        deadline = time.perf_counter() + 10  # a busy machine may delay samples: wait for them
        while monitor.samples < 6 and time.perf_counter() < deadline:
            _busy(0.05)
    assert not any(t.name == "tfbig-system-monitor" for t in threading.enumerate())
    size = os.path.getsize(path)
    time.sleep(0.2)
    assert os.path.getsize(path) == size  # nothing written after stop
    with open(path) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == monitor.samples >= 6
    assert all(len(r["cpu_percent"]) == psutil.cpu_count() for r in records)
    assert all(0.0 <= c <= 100.0 for r in records for c in r["cpu_percent"])
    assert all(0.0 <= r["iowait_percent"] <= 100.0 and r["process_rss_mb"] > 10 for r in records)
    assert max(r["cpu_mean"] for r in records) > 20  # the busy loop shows
    read_mb = sum(r["process_read_mb_per_sec"] * r["interval_seconds"] for r in records)
    assert 3.9 < read_mb < 40  # the 4 MiB file (plus a little else the process read)
    elapsed = [r["elapsed"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[-1] < 5.0
    assert records[-1]["monitor_cpu_seconds"] <= monitor.cpu_seconds
    assert records[0]["gpus"] == [] or "utilization_percent" in records[0]["gpus"][0]
    events = EventAccumulator(str(tmp_path / "system"))
    events.Reload()
    assert len(events.Scalars("cpu_mean")) == len(records)
    assert f"cpu_core/{psutil.cpu_count() - 1}" in events.Tags()["scalars"]


def test_monitor_cost_per_sample_is_under_one_percent_of_its_period():
    """Own CPU time per sample (psutil + JSON + TensorBoard) vs the default 500 ms period."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        with SystemMonitor(os.path.join(directory, "s.jsonl"), interval_ms=20,
                           summary_dir=directory) as monitor:
            time.sleep(1.0)
    assert monitor.samples >= 10
    assert monitor.cpu_seconds / monitor.samples < 0.01 * 0.5


def test_timed_measures_exactly_the_wrapped_collective():
    def slow_identity(grads):  # stands in for an all-reduce that takes 80 ms
        return [tf.py_function(lambda g: (time.sleep(0.08), g)[1], [g], g.dtype) for g in grads]

    @tf.function
    def step(x):
        grads = [x * 2.0, x + 1.0]
        reduced, seconds = timed(slow_identity, grads)
        return reduced, seconds

    reduced, seconds = step(tf.constant([1.0, 2.0]))
    np.testing.assert_allclose(reduced[0], [2.0, 4.0])
    np.testing.assert_allclose(reduced[1], [2.0, 3.0])
    assert 0.07 < float(seconds) < 5.0  # the sleep, and no other step (a busy machine may add)


class _TwoReplicas(Strategy):
    """A backend surface whose all-reduce takes 60 ms (the default timing is inherited)."""

    num_replicas = 2

    def all_reduce_gradients(self, grads):
        return [tf.py_function(lambda g: (time.sleep(0.06), g / 1.0)[1], [g], g.dtype)
                for g in grads]


def test_strategy_reports_communication_time_through_the_surface():
    grads = [tf.ones([3]), tf.ones([2, 2])]
    reduced, seconds = tf.function(Strategy().all_reduce_gradients_timed)(grads)
    assert float(seconds) == 0.0 and reduced[1].shape == (2, 2)  # one replica: nothing sent
    reduced, seconds = tf.function(_TwoReplicas().all_reduce_gradients_timed)(grads)
    assert 0.05 < float(seconds) < 5.0
    np.testing.assert_allclose(reduced[1], np.ones([2, 2]))


def test_step_timer_splits_compute_and_communication():
    timer = StepTimer()
    for step in (1, 2):
        with timer.phase("input"):
            time.sleep(0.02)
        with timer.phase("compute"):
            time.sleep(0.05)
        timer.step_done(step, communication=tf.constant(0.03, tf.float64))
    with timer.phase("checkpoint"):  # between steps: charged to the next one
        time.sleep(0.01)
    with timer.phase("compute"):
        time.sleep(0.01)
    timer.step_done(3, communication=1.0)  # more than the step: clamped to it
    window = timer.window()
    assert window["steps"] == 3
    first, _, third = window["step_records"]  # sleeps last at least as long as asked
    assert 0.02 <= first["input"] < first["total"]
    assert first["communication"] == pytest.approx(0.03)
    assert first["compute"] >= 0.05 - 0.03 - 1e-6  # the step less its communication
    assert third["checkpoint"] >= 0.01 and third["compute"] == 0.0  # clamped to the step
    assert third["communication"] >= 0.01
    assert window["step_seconds"] == pytest.approx(sum(r["total"] for r in window["step_records"]))
    with pytest.raises(ValueError, match="unknown step phase 'io'"):
        with timer.phase("io"):
            pass


def test_profile_steps_flag_is_checked():
    assert parse_profile_steps("") is None
    assert parse_profile_steps("20,25") == (20, 25)
    for bad in ("5", "a,b", "4,2", "0,3"):
        with pytest.raises(ValueError, match="--profile_steps="):
            parse_profile_steps(bad)
