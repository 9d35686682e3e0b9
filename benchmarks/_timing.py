"""What the throughput benchmarks share (train_throughput.py, vs_keras_hub.py, the per-rank
workers of sharded_memory.py and tensor_parallel.py): step-end clocks, rates between them, the
mean step time, and the peak the MFU figures divide by."""
import time


def clock():
    """(wall seconds, CPU seconds of this process): CPU time is robust to other processes
    taking cores on a shared machine, wall time is what a user waits."""
    return time.perf_counter(), time.process_time()


def rates(marks, tokens_per_step):
    """tokens/s and tokens per CPU-second between the first and the last step end."""
    (wall0, cpu0), (wall1, cpu1) = marks[0], marks[-1]
    tokens = (len(marks) - 1) * tokens_per_step
    return {"tokens_per_sec": tokens / (wall1 - wall0),
            "tokens_per_cpu_sec": tokens / (cpu1 - cpu0)}


def clock_steps(trainer):
    """Read `clock()` whenever the trainer's own step returns; returns the list it fills."""
    marks, train_step = [], trainer._train_step

    def clocked_step(batch):
        out = train_step(batch)
        marks.append(clock())
        return out

    trainer._train_step = clocked_step
    return marks


def time_steps(trainer, warmup, steps):
    """Mean wall seconds of the trainer's step over `steps` steps after `warmup` (its input
    included, each step's loss read back so the step has finished)."""
    batches = trainer._train_iterator()
    for _ in range(warmup):
        trainer._train_step(next(batches))["loss"].numpy()
    start = time.perf_counter()
    for _ in range(steps):
        trainer._train_step(next(batches))["loss"].numpy()
    return (time.perf_counter() - start) / steps


def peak_flops(precision):
    """(peak FLOP/s, peak FLOP per CPU-second or None): the vendor table on GPUs; on CPU a
    2048^3 XLA matmul probe, ~2 s for each figure."""
    import tensorflow as tf

    from tfbig.profiling.perf import cpu_peak_flops, device_peak_flops

    if tf.config.list_physical_devices("GPU"):
        return device_peak_flops(precision)[0], None
    dtype = tf.bfloat16 if precision == "mixed_bfloat16" else tf.float32
    return (cpu_peak_flops(dtype=dtype, seconds=2.0),
            cpu_peak_flops(dtype=dtype, seconds=2.0, clock=time.process_time))
