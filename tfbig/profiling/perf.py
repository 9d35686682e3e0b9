"""Honest throughput figures: model FLOPs per token, device peaks, MFU.

MFU = model FLOPs per token x tokens/s / peak FLOP/s of the devices used. Model FLOPs count the
matmuls of forward and backward (6 x matmul parameters + attention, PaLM appendix B), not
recomputation. On GPUs the peak comes from the vendor table below; on CPUs it is measured by a
large matmul probe, so "MFU on this machine" means "fraction of what TF's own matmul reaches".

Example:
    peak = cpu_peak_flops()                     # FLOP/s measured here
    mfu(config.flops_per_token(1024), tokens_per_sec=12000, peak=peak)
"""
import os
import platform
import time

import tensorflow as tf

# Dense peak FLOP/s per device (vendor datasheets, SXM parts, no sparsity).
GPU_PEAK_FLOPS = {
    "V100": {"fp32": 15.7e12, "fp16": 125e12, "bf16": None, "tf32": None},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "fp16": 312e12, "bf16": 312e12},
    "H100": {"fp32": 67e12, "tf32": 495e12, "fp16": 989e12, "bf16": 989e12},
    "H200": {"fp32": 67e12, "tf32": 495e12, "fp16": 989e12, "bf16": 989e12},
}
PRECISION_KEYS = {"fp32": "fp32", "mixed_float16": "fp16", "mixed_bfloat16": "bf16"}


def cpu_threads():
    """CPU threads a TF op of this process can use: the intra-op setting, else the cores this
    process may run on."""
    configured = (tf.config.threading.get_intra_op_parallelism_threads()
                  or int(os.environ.get("TF_NUM_INTRAOP_THREADS", "0") or 0))
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(configured, available) if configured > 0 else available


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (platform.processor() is often empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_peak_flops(size=2048, dtype=tf.float32, seconds=1.0, clock=None):
    """FLOP/s of a large square matmul on the CPU, best of repeated timed runs (XLA-compiled).

    Each run is read on two clocks: wall time, and this process's CPU time spread over the
    threads it can use (`cpu_threads()`). The faster reading counts. Other processes on the
    same cores stretch wall time but not CPU time, so a busy machine cannot make the probe read
    low (and the run's MFU read above 100%); on an idle machine the two agree to within the
    matmul's threading overhead. `clock=time.process_time` gives FLOP per CPU-second of this
    process instead (the benchmarks' per-CPU figure).
    """
    a = tf.random.normal((size, size), dtype=dtype)
    b = tf.random.normal((size, size), dtype=dtype)
    matmul = tf.function(lambda x, y: tf.reduce_sum(tf.matmul(x, y)), jit_compile=True,
                         autograph=False)
    matmul(a, b).numpy()  # compile
    # (clock, threads its reading is spread over)
    clocks = [(clock, 1)] if clock else [(time.perf_counter, 1), (time.process_time, cpu_threads())]
    best = [float("inf")] * len(clocks)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or best[0] == float("inf"):
        starts = [read() for read, _ in clocks]
        matmul(a, b).numpy()
        best = [min(b_, (read() - s_) / n) for b_, (read, n), s_ in zip(best, clocks, starts)]
    return 2.0 * size ** 3 / max(min(best), 1e-9)


def gpu_peak_flops(device_name, precision):
    """Vendor peak for a GPU whose name contains V100/A100/H100/H200, else None."""
    key = PRECISION_KEYS.get(precision, "fp32")
    for model, peaks in GPU_PEAK_FLOPS.items():
        if model in device_name:
            return peaks.get(key) or peaks["fp32"]
    return None


def device_peak_flops(precision="fp32"):
    """(peak FLOP/s of one device, where the figure came from)."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "")
        peak = gpu_peak_flops(name, precision)
        if peak:
            return peak, f"table:{name}:{PRECISION_KEYS.get(precision, 'fp32')}"
    dtype = tf.bfloat16 if precision == "mixed_bfloat16" else tf.float32
    return cpu_peak_flops(dtype=dtype), f"measured:cpu-matmul:{dtype.name}"


def mfu(flops_per_token, tokens_per_sec, peak):
    """Model FLOPs utilisation: achieved model FLOP/s over peak FLOP/s."""
    return flops_per_token * tokens_per_sec / peak
