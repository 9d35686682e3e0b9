"""`tfbig-train --plan_only`: the plan of a training config's own layout on this machine.

The layout comes from the training flags (`search.layout_from_config`), the data-parallel degree
from the launcher (horovodrun/mpirun, or TF_CONFIG's workers), the device from what is here: a GPU of the table, else the
CPU with its matmul peak measured by tfbig.profiling.perf's probe, its RAM and its memory bandwidth (a
copy probe). Nothing else of training (data, model) is built.

Example:
    tfbig-train --preset=small --batch_size=16 --plan_only
"""
import time

from tfbig.models import shapes as models
from tfbig.plan import calibration as calibration_lib
from tfbig.plan import hardware, report, search

BANDWIDTH_PROBE_BYTES = 256 * 2 ** 20


def memory_bandwidth(seconds=0.3):
    """Bytes/s of a large array copy (read + write), best of repeated runs."""
    import numpy as np

    src = np.ones(BANDWIDTH_PROBE_BYTES // 8)
    dst = src.copy()  # touched once, so that page faults are not timed
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def local_device(precision, peak_tflops=0.0):
    """This machine's first GPU from the table, else the CPU, measured."""
    import psutil
    import tensorflow as tf

    from tfbig.profiling import perf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "")
        for key in hardware.GPUS:
            if key.split("-")[0] in name:
                return hardware.gpu(key, precision)
    dtype = tf.bfloat16 if precision == "mixed_bfloat16" else tf.float32
    peak = peak_tflops * 1e12 if peak_tflops else perf.cpu_peak_flops(dtype=dtype)
    bandwidth = memory_bandwidth()
    # the probe's rate is already an achieved matmul rate; the CPU allocator holds no reserve
    return hardware.Device("cpu", peak, psutil.virtual_memory().total, bandwidth, bandwidth,
                           matmul_fraction=1.0, reserve_bytes=0.0)


def _tf_config():
    import json
    import os

    return json.loads(os.environ.get("TF_CONFIG") or "{}")


def processes():
    """Processes of this job: Horovod/MPI's world size, else TF_CONFIG's chief and workers,
    else 1."""
    from tfbig.distribute.mesh import launcher_world_size

    if launcher_world_size() > 1:
        return launcher_world_size()
    cluster = _tf_config().get("cluster", {})
    return max(1, len(cluster.get("chief", [])) + len(cluster.get("worker", [])))


def first_process():
    """Whether this process is the one of its job that prints a plan: Horovod/MPI's rank 0,
    TF_CONFIG's chief (its worker 0 where it names no chief), or the only process."""
    from tfbig.distribute.mesh import launcher_rank, launcher_world_size

    if launcher_world_size() > 1:
        return launcher_rank() == 0
    config = _tf_config()
    task = config.get("task") or {}
    if not task:
        return True
    chief = "chief" in config.get("cluster", {})
    return task.get("type") == ("chief" if chief else "worker") and int(task.get("index", 0)) == 0


def training_plan(cfg, device=None, world_size=None):
    """The plan text of an ExperimentConfig's model, batch and layout on this machine; with
    --calibration, on the measured device and collectives, this machine's probe beside."""
    t = cfg.train
    overrides = dict(num_layers=t.num_layers or None, hidden_size=t.hidden_size or None,
                     num_heads=t.num_heads or None, seq_length=t.seq_length or None,
                     embedding_size=cfg.albert.embedding_size or None,
                     num_groups=cfg.albert.num_groups or None,
                     dropout=t.dropout if t.dropout >= 0 else None, attention=t.attention)
    model_cfg = models.model_config(t.model, t.preset, **overrides)
    shape = models.shape_of(model_cfg, t.model, t.seq_length or model_cfg.seq_length)
    fixed = search.layout_from_config(cfg)
    devices = (world_size or processes()) * (
        fixed["pipeline_stages"] if t.strategy == "pipeline" else 1)
    device = device or local_device(t.precision, cfg.profile.peak_tflops)
    cluster = hardware.Cluster(device, devices, 1, device.local_bandwidth)
    spec = None
    if t.calibration:
        spec, cluster = cluster, calibration_lib.cluster(
            calibration_lib.load(t.calibration), t.precision, devices, 1, 0.0)
    estimates = search.search(shape, cluster, t.precision, t.batch_size, fixed=fixed)
    beside = spec and search.evaluate(shape, estimates[0].layout, estimates[0].batch_size,
                                      t.precision, spec, 300e9)
    return report.text(shape, cluster, t.precision, 300e9, estimates, top=1, spec=beside)
