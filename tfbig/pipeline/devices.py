"""Which device each pipeline stage runs on: /GPU:i when there are enough GPUs, else logical CPUs.

Logical CPU devices let the whole pipeline path run (and be tested) on a CPU-only machine. TF fixes
its device list the first time it runs an op, so `stage_devices` must be called before that; the
pipeline strategy calls it when it is constructed, which the trainer does before building anything.

Example:
    devices = stage_devices(2)   # ["/GPU:0", "/GPU:1"] or ["/device:CPU:0", "/device:CPU:1"]
"""
import tensorflow as tf


def configure_cpu_devices(count):
    """Split the host CPU into at least `count` logical devices; returns how many there are.

    Raises RuntimeError if TensorFlow already initialised fewer devices than `count`.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu) or []
    if len(configured) >= count:
        return len(configured)
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
        return count
    except RuntimeError:  # devices already initialised: their number is frozen
        existing = len(tf.config.list_logical_devices("CPU"))
    if existing >= count:
        return existing
    raise RuntimeError(
        f"--pipeline_stages={count} needs {count} logical CPU devices, but TensorFlow has "
        f"already initialised {existing}. Create the pipeline strategy (or call "
        f"tfbig.pipeline.devices.configure_cpu_devices({count})) before running any "
        f"TensorFlow op, or run on {count} GPUs.")


def stage_devices(num_stages, first=0):
    """Device names of stages 0..num_stages-1, starting at device index `first`.

    `first` lets several processes on one host (data-parallel ranks) take disjoint GPUs.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if len(gpus) < first + num_stages:
            raise ValueError(f"--pipeline_stages={num_stages} from GPU {first} needs "
                             f"{first + num_stages} GPUs on this host; found {len(gpus)}")
        return [f"/GPU:{first + i}" for i in range(num_stages)]
    configure_cpu_devices(num_stages)  # logical CPUs belong to this process: no offset
    return [f"/device:CPU:{i}" for i in range(num_stages)]


def same_device(a, b):
    """Whether device names `a` and `b` ('/job:localhost/.../device:CPU:1', '/CPU:1') match."""
    a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (a.device_type, a.device_index) == (b.device_type, b.device_index)
