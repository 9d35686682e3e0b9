"""What one rank measures on its own: its build, its device, and one tiny training step.

Every rate is the median of repeated timed runs over a short window: the rate the device
sustains while the rest of the machine does what it does (on a shared host, what training will
get), steadier than one run. On a CPU the rank's device is the CPU with the threads TensorFlow gives it; on a GPU
host, the GPU of its local rank.

Test-only hook: TFBIG_DOCTOR_TEST_DELAY_RANK=R (or R1,R2,...) makes rank R sleep
TFBIG_DOCTOR_TEST_DELAY_SECONDS (default 0.02) inside every timed run of its device probes, so
that the tests can slow one rank on purpose and check it is named as the straggler. It is not a
feature; never set it outside tests.
"""
import os
import platform
import socket
import statistics
import time

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DELAY_RANK_VARIABLE = "TFBIG_DOCTOR_TEST_DELAY_RANK"
DELAY_SECONDS_VARIABLE = "TFBIG_DOCTOR_TEST_DELAY_SECONDS"


def test_delay(rank):
    """Seconds rank `rank` sleeps inside each timed run (0 unless the test-only hook names it,
    alone or in a comma-separated list)."""
    if str(rank) not in os.environ.get(DELAY_RANK_VARIABLE, "").split(","):
        return 0.0
    return float(os.environ.get(DELAY_SECONDS_VARIABLE, "0.02"))


def typical_seconds(run, seconds, delay=0.0):
    """Median wall time of one `run()` over repeated calls for about `seconds` (at least 2
    calls after one untimed warm-up call)."""
    run()
    times, deadline = [], time.perf_counter() + seconds
    while len(times) < 2 or time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        if delay:
            time.sleep(delay)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_name():
    return socket.gethostname()


def build_info():
    """Versions of TensorFlow, Keras and Horovod, and what this Horovod was built with:
    controllers (Gloo, MPI) and GPU operations (NCCL). A Horovod that cannot be imported is
    reported as such, not raised."""
    import keras
    import tensorflow as tf

    info = {"python": platform.python_version(), "tensorflow": tf.__version__,
            "keras": keras.__version__, "cuda_build": bool(tf.test.is_built_with_cuda())}
    try:
        import horovod
        import horovod.tensorflow as hvd
    except ImportError as error:
        return {**info, "horovod": None, "horovod_error": str(error),
                "controllers": {"gloo": False, "mpi": False}, "gpu_operations": {"nccl": False}}
    return {**info, "horovod": horovod.__version__,
            "controllers": {"gloo": bool(hvd.gloo_built()), "mpi": bool(hvd.mpi_built())},
            "gpu_operations": {"nccl": bool(hvd.nccl_built())}}


def rank_device(local_rank):
    """(TensorFlow device string, description) of the device this rank trains on: the GPU of
    its local rank, else the CPU."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        index = local_rank % len(gpus)
        name = tf.config.experimental.get_device_details(gpus[index]).get("device_name", "GPU")
        return f"/GPU:{index}", {"kind": "gpu", "name": name, "gpus_on_host": len(gpus)}
    from tfbig.profiling import perf

    return "/CPU:0", {"kind": "cpu", "name": perf.cpu_model(), "threads": perf.cpu_threads()}


def memory_bytes(kind):
    """Bytes of memory the device has: the GPU's (TensorFlow's view), else the host's RAM."""
    import psutil

    if kind == "gpu":
        import tensorflow as tf

        details = tf.config.experimental.get_device_details(
            tf.config.list_physical_devices("GPU")[0])
        if details.get("memory_limit"):
            return float(details["memory_limit"])
    return float(psutil.virtual_memory().total)


def xla_compiles(device):
    """{"compiles": bool, "seconds": compile + first run, "error": ...} of a small dense
    forward and backward step under jit_compile."""
    import tensorflow as tf

    with tf.device(device):
        weights = tf.Variable(tf.random.normal([64, 64], seed=1))
        inputs = tf.random.normal([32, 64], seed=2)

    @tf.function(jit_compile=True, autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.tanh(tf.matmul(x, weights)) ** 2)
        return loss, tape.gradient(loss, weights)

    start = time.perf_counter()
    try:
        with tf.device(device):
            step(inputs)[1].numpy()
    except Exception as error:  # noqa: BLE001 - a failing compile is the finding
        return {"compiles": False, "error": f"{type(error).__name__}: {error}"[:500]}
    return {"compiles": True, "seconds": time.perf_counter() - start}


def precisions_run(device):
    """{precision: True/False}: whether a small matmul runs in it on `device`, with and
    without XLA (a precision the hardware lacks may still be emulated: its matmul rate says)."""
    import tensorflow as tf

    runs = {}
    for name, dtype in PRECISIONS.items():
        try:
            with tf.device(device):
                x = tf.ones([16, 16], dtype)
                tf.function(tf.matmul, jit_compile=True, autograph=False)(x, x).numpy()
                tf.matmul(x, x).numpy()
            runs[name] = True
        except Exception:  # noqa: BLE001 - the precision does not run here: reported False
            runs[name] = False
    return runs


CALL_SECONDS = 0.01  # a timed matmul call lasts at least this long: dispatch then costs ~1%
BATCH_BYTES = 2 ** 26  # ... unless its batch of operands would hold more than this


def matmul_flops(device, sizes, precisions, seconds, delay=0.0, longest_call=1.0):
    """{precision: {size: FLOP/s}} of square XLA-compiled matmuls on `device`, as a training
    step runs them: a call multiplies a batch of independent size x size pairs (one pair once
    a pair alone lasts CALL_SECONDS), so that the few hundred microseconds of launching a call
    are not charged to a small product; inside a compiled step, attention's head-sized
    products are one batched matmul too. A size whose call would take over `longest_call`
    seconds at the rate of the size before is left out (a precision the device only
    emulates: fp16 on most CPUs)."""
    import tensorflow as tf

    rates = {}
    for name in precisions:
        dtype = getattr(tf, PRECISIONS[name])
        rates[name], previous = {}, None  # previous: FLOP/s of the size before, delay left out
        for size in sizes:
            if previous and 2.0 * size ** 3 / previous > longest_call:
                break
            batch = _matmul_batch(device, size, dtype)
            multiply, pairs = _multiply_pairs(), _pairs(device, batch, size, dtype)
            with tf.device(device):
                typical = typical_seconds(lambda: multiply(pairs).numpy(), seconds, delay)
            work = 2.0 * batch * size ** 3
            rates[name][str(size)] = work / typical
            previous = work / max(typical - delay, 1e-9)
    return rates


def _matmul_batch(device, size, dtype, call_seconds=None):
    """Pairs per call so that a call lasts at least CALL_SECONDS, within BATCH_BYTES of
    operands: grown from one pair by the ratio of the time left (a call of few pairs is mostly
    its launch, so the first guesses fall short). `call_seconds(batch)`: how long a call of
    `batch` pairs takes (default: one timed call, after compiling it)."""
    largest = max(1, BATCH_BYTES // (size * size * dtype.size))
    call_seconds = call_seconds or _matmul_call_timer(device, size, dtype)
    batch = 1
    while True:
        took = call_seconds(batch)
        if took >= CALL_SECONDS or batch >= largest:
            return batch
        batch = min(largest, batch * max(2, round(CALL_SECONDS / max(took, 1e-6))))


def _multiply_pairs():
    """An XLA-compiled call multiplying each (size, size) matrix of a batch by itself."""
    import tensorflow as tf

    return tf.function(lambda x: tf.reduce_sum(tf.matmul(x, x)), jit_compile=True, autograph=False)


def _pairs(device, batch, size, dtype):
    """`batch` random (size, size) matrices of `dtype` on `device`."""
    import tensorflow as tf

    with tf.device(device):
        return tf.cast(tf.random.normal([batch, size, size], dtype=tf.float32, seed=1), dtype)


def _matmul_call_timer(device, size, dtype):
    """batch -> seconds of one XLA-compiled call multiplying `batch` size x size pairs."""
    import tensorflow as tf

    multiply = _multiply_pairs()

    def call_seconds(batch):
        pairs = _pairs(device, batch, size, dtype)
        with tf.device(device):
            multiply(pairs).numpy()  # compile
            start = time.perf_counter()
            multiply(pairs).numpy()
        return time.perf_counter() - start

    return call_seconds


def memory_bandwidth(device, size_bytes, seconds, delay=0.0):
    """Bytes/s an XLA-compiled element-wise op streams through memory (reads one float32
    array, writes another): what the plan's element-wise passes do."""
    import tensorflow as tf

    with tf.device(device):
        x = tf.ones([size_bytes // 4], tf.float32)
        add = tf.function(lambda v: v * 1.5 + 1.0, jit_compile=True, autograph=False)
        typical = typical_seconds(lambda: add(x)[:1].numpy(), seconds, delay)
    return 2.0 * size_bytes / typical


NORMALISED_ROW = 1024  # values per row of the softmax probe


def normalisation_bandwidth(device, size_bytes, seconds, delay=0.0):
    """Bytes/s (read + write) an XLA-compiled softmax over rows of NORMALISED_ROW float32
    values streams: a reduction along each row (max, then the sum of exponentials) and a map,
    as attention's softmax and the LayerNorms run. A CPU runs it several times slower per byte
    than a map (`memory_bandwidth`), so the plan counts those passes at this rate."""
    import tensorflow as tf

    with tf.device(device):
        x = tf.ones([max(1, size_bytes // (4 * NORMALISED_ROW)), NORMALISED_ROW], tf.float32)
        softmax = tf.function(lambda v: tf.nn.softmax(v, axis=-1), jit_compile=True,
                              autograph=False)
        typical = typical_seconds(lambda: softmax(x)[:1, :1].numpy(), seconds, delay)
    return 2.0 * 4 * int(x.shape[0]) * NORMALISED_ROW / typical


UPDATE_VARIABLES = 64  # small variables the optimizer probe updates per step


def update_probe_state():
    """The probe's UPDATE_VARIABLES weights of 16 values and the AdamW (clipping) built for
    them, in the current device scope."""
    import tensorflow as tf

    from tfbig.config import TrainConfig
    from tfbig.optim import build_optimizer

    variables = [tf.Variable(tf.ones([16])) for _ in range(UPDATE_VARIABLES)]
    return variables, build_optimizer(TrainConfig(max_steps=10 ** 6, warmup_steps=1,
                                                  grad_clip_norm=1.0), variables)


def update_seconds_per_variable(device, seconds, delay=0.0, compiled=True):
    """Seconds tfbig's optimizer step spends per variable when the bytes are nothing: the
    global norm for clipping and AdamW's update of UPDATE_VARIABLES variables of 16 values,
    over the variable count. `compiled`: in one XLA program, as the Trainer's compiled step
    runs it (tfbig.training.step); False: op by op in a tf.function (--compile_update=false).
    The gradients are made inside the function, as the step's backward makes them. A small
    model's step pays the figure for each of its variables."""
    import tensorflow as tf

    with tf.device(device):
        variables, optimizer = update_probe_state()

        def step():
            grads = [v * 1e-3 for v in variables]
            clipped, norm = tf.clip_by_global_norm(grads, 1.0)
            optimizer.apply(clipped, variables)
            return norm

        step = tf.function(step, jit_compile=compiled, autograph=False)
        typical = typical_seconds(lambda: step().numpy(), seconds, delay)
    return typical / UPDATE_VARIABLES


# ---- a tiny training step, on one device and across the ranks ---------------------------------
TINY_MODEL = dict(hidden_size=16, num_layers=2, num_heads=2, seq_length=16, vocab_size=64)
TINY_SEQUENCES_PER_RANK = 2


def tiny_model():
    """A 2-layer GPT of width 16 and the loss of a batch of token ids, built identically on
    every rank (the same seeds)."""
    import keras
    import tensorflow as tf

    from tfbig.models.gpt import GPT, GPTConfig

    keras.utils.set_random_seed(1234)
    config = GPTConfig.from_preset("tiny", **TINY_MODEL)
    net = GPT(config)
    net.build()

    def loss_of(batch):
        logits = tf.cast(net(batch[:, :-1], training=True), tf.float32)  # (B, T, V)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(batch[:, 1:],
                                                                             logits))
    return net, loss_of


def tiny_batch(sequences):
    import tensorflow as tf

    return tf.random.stateless_uniform([sequences, TINY_MODEL["seq_length"] + 1], [7, 11], 0,
                                       TINY_MODEL["vocab_size"], tf.int32)


def gradients(net, loss_of, batch):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = loss_of(batch)
    return loss, tape.gradient(loss, net.trainable_variables)


def step_rate(device, seconds, delay=0.0):
    """Forward and backward steps per second of the tiny model on this rank's slice."""
    import tensorflow as tf

    with tf.device(device):
        net, loss_of = tiny_model()
        batch = tiny_batch(TINY_SEQUENCES_PER_RANK)
        step = tf.function(lambda b: gradients(net, loss_of, b)[0], autograph=False)
        return 1.0 / typical_seconds(lambda: step(batch).numpy(), seconds, delay)


def interconnect():
    """{"rdma_devices": InfiniBand/EFA devices the kernel lists (/sys/class/infiniband),
    "network_variables": the NCCL/libfabric settings that choose the transport}. No RDMA
    device: collectives across hosts go over TCP sockets."""
    root = "/sys/class/infiniband"
    devices = sorted(os.listdir(root)) if os.path.isdir(root) else []
    names = ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_NET", "FI_PROVIDER",
             "GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE")
    return {"rdma_devices": devices,
            "network_variables": {n: os.environ[n] for n in names if n in os.environ}}
