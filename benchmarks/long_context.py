"""Long sequences: peak memory and step time of dense vs blockwise attention (--attention).

The same GPT (the `small` preset: 4 layers, hidden 256, 4 heads, vocabulary 8000) at batch 1,
one training step (forward, backward, AdamW's apply) at each sequence length:
- memory: the CPU allocator's peak during a step above what was held before it, in a
  TensorFlow graph without XLA (what tfbig-plan counts; least of --repeats steps), minus the
  step's float32 gradients = the activations; beside it the plan's activation term;
- time: wall and CPU seconds per step (mean of --steps after a compiling one), XLA-compiled
  as tfbig-train runs by default, at --time_lengths;
- the longest sequence that trains in --memory_gib: each attention's measured peaks fitted
  (dense: a + b T + c T^2; blockwise: a + b T) and solved, beside the plan's answer. Nothing
  is run at that length: the machine is shared.
Each case runs in its own process (a clean allocator). Dense cases whose planned activations
exceed half of the memory available now are skipped and named (the machine is shared).

With --context=C, context parallelism instead (its own JSON line, `long_context_cp`): the same
GPT with blockwise attention at --context_lengths, CP1 (one process) against CPC (C processes
under `horovodrun --gloo` on this machine, the cores shared out between them), both as
TensorFlow graphs (CP runs without XLA): per-rank activation memory (allocator peak minus the
gradients, the largest rank), step wall time, the communication share (the step's collectives
- K/V all-gathers, their gradients' reduce-scatters, the gradient average - run alone, over
the step's time), and the longest sequence whose fitted per-rank peak fits C ranks on
--memory_gib (nothing run at that length).

    python benchmarks/long_context.py            # ~10 minutes on 2 busy cores
    python benchmarks/long_context.py --context=2

Prints one JSON line last: the CPU, the load average before and after, and every figure.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from tfbig.profiling import perf  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("lengths", ["1024", "2048", "4096", "8192"], "Sequence lengths measured.")
flags.DEFINE_list("time_lengths", ["1024", "4096"], "Lengths whose step time is measured.")
flags.DEFINE_integer("block_size", 512, "--attention_block_size of the blockwise runs.")
flags.DEFINE_integer("repeats", 2, "Steps whose least allocator peak is the memory figure.")
flags.DEFINE_integer("steps", 3, "Timed steps per case (after one that compiles).")
flags.DEFINE_bool("time_xla", True, "Time XLA-compiled steps (tfbig-train's default); "
                                    "--notime_xla: TensorFlow graphs.")
flags.DEFINE_float("memory_gib", 24.0, "Memory of the machine the longest sequence is for.")
flags.DEFINE_string("case", "", "Internal: run one case 'attention,length,memory|time' or "
                                "'context,C,length'.")
flags.DEFINE_integer("context", 0, "Measure --context_parallel=C against one process instead.")
flags.DEFINE_list("context_lengths", ["1024", "2048", "4096"], "Lengths of the --context runs.")

MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, vocab_size=8000)  # the small preset


def build(attention, length):
    import keras

    from tfbig.config import TrainConfig
    from tfbig.models.gpt import GPT, GPTConfig
    from tfbig.optim import build_optimizer

    keras.utils.set_random_seed(0)
    model = GPT(GPTConfig(**MODEL, seq_length=length, attention=attention,
                          attention_block_size=FLAGS.block_size))
    model.build()
    optimizer = build_optimizer(TrainConfig(max_steps=10, warmup_steps=1),
                                model.trainable_variables)
    return model, optimizer


def run_case(attention, length, kind):
    """One case in this process: {"step_peak", "gradients"} bytes or {"wall_s", "cpu_s"}."""
    import tensorflow as tf

    from tfbig.training.measure import allocator_peak

    model, optimizer = build(attention, length)
    ids = tf.random.uniform((1, length + 1), 0, MODEL["vocab_size"], tf.int32, seed=0)

    @tf.function(jit_compile=kind == "time" and FLAGS.time_xla)
    def forward_backward(batch):
        with tf.GradientTape() as tape:
            logits = model(batch[:, :-1], training=True)  # (1, T, V)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                batch[:, 1:], logits))
        return loss, tape.gradient(loss, model.trainable_variables)

    @tf.function
    def step(batch):
        loss, grads = forward_backward(batch)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    if kind == "memory":
        peak = allocator_peak(lambda: step(ids).numpy(), repeats=FLAGS.repeats)
        grads = sum(4 * v.shape.num_elements() for v in model.trainable_variables)
        return {"step_peak": peak, "gradients": grads}
    step(ids).numpy()  # compiles
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(FLAGS.steps):
        step(ids).numpy()
    return {"wall_s": (time.perf_counter() - wall) / FLAGS.steps,
            "cpu_s": (time.process_time() - cpu) / FLAGS.steps}


def run_context_case(size, length):
    """One CP case (rank 0 prints it): per-rank step peak, gradients, step and collective
    seconds. size 1: one process, no Horovod; else this process is one rank of `size`."""
    import numpy as np
    import tensorflow as tf

    from tfbig.training.measure import allocator_peak

    model, optimizer = build("blockwise", length)
    cross_entropy, average, gather, rank = tf.nn.sparse_softmax_cross_entropy_with_logits, \
        (lambda grads: grads), (lambda x: x[None]), 0
    collectives = None
    if size > 1:
        from types import SimpleNamespace

        from tfbig.distribute import horovod_keras
        from tfbig.distribute.context_layers import ContextGroup, apply_plan
        from tfbig.distribute.horovod_keras import hvd

        horovod_keras.init(pin_gpu=False)
        rank, world = hvd.rank(), hvd.global_process_set
        group = ContextGroup(world, rank, size, length)
        task = SimpleNamespace(vocab_cross_entropy=cross_entropy)
        apply_plan(model, task, group)
        cross_entropy = task.vocab_cross_entropy
        average = lambda grads: horovod_keras.average_gradients(grads, process_set=world)  # noqa: E731
        gather = lambda x: hvd.allgather(x[None], process_set=world)  # noqa: E731
        collectives = _collectives(model, group, hvd)
    ids = tf.random.uniform((1, length + 1), 0, MODEL["vocab_size"], tf.int32, seed=0)

    @tf.function
    def step(batch):
        with tf.GradientTape() as tape:
            logits = model(batch[:, :-1], training=True)
            loss = tf.reduce_mean(cross_entropy(batch[:, 1:], logits))
        grads = average(tape.gradient(loss, model.trainable_variables))
        optimizer.apply(grads, model.trainable_variables)
        return loss

    peak = allocator_peak(lambda: step(ids).numpy(), repeats=FLAGS.repeats)
    wall = _seconds(lambda: step(ids).numpy())
    comm = _seconds(lambda: collectives().numpy()) if collectives else 0.0
    grads = sum(4 * v.shape.num_elements() for v in model.trainable_variables)
    rows = gather(tf.constant([peak, grads, wall, comm], tf.float64)).numpy()
    if rank == 0:
        print(json.dumps({"step_peak": rows[:, 0].tolist(), "gradients": rows[:, 1].tolist(),
                          "wall_s": float(np.max(rows[:, 2])),
                          "collectives_s": float(np.max(rows[:, 3]))}))


def _collectives(model, group, hvd):
    """A function running the collectives of one CP step alone: per layer the K/V all-gather
    (forward, and again backward) and the reduce-scatter of their gradients, then the
    gradients' average."""
    import tensorflow as tf

    from tfbig.distribute.context_layers import gather_keys_values

    local = group.seq_length // group.size
    heads, width = MODEL["num_heads"], MODEL["hidden_size"]
    # Inputs as arguments: constants would let Grappler fold the collectives away (measured)
    kv = tf.random.uniform((1, local, heads, 2 * width // heads))
    grads = [tf.random.uniform(v.shape) for v in model.trainable_variables]

    @tf.function
    def run(kv, grads):
        total = tf.constant(0.0)
        for _ in range(MODEL["num_layers"]):
            total += tf.reduce_sum(gather_keys_values(kv, group))  # the forward's gather
            with tf.GradientTape() as tape:  # the backward's gather and reduce-scatter
                tape.watch(kv)
                whole = gather_keys_values(kv, group)
            total += tf.reduce_sum(tape.gradient(whole, kv))
        summed = hvd.grouped_allreduce(grads, op=hvd.Average, process_set=group.process_set)
        return total + tf.add_n([tf.reduce_sum(g) for g in summed])

    return lambda: run(kv, grads)


def _seconds(run):
    """Mean wall seconds of `run()` over --steps, after one untimed call."""
    run()
    start = time.perf_counter()
    for _ in range(FLAGS.steps):
        run()
    return (time.perf_counter() - start) / FLAGS.steps


def context_case(size, length):
    """Run one CP case in its own process(es): horovodrun for size > 1, the cores shared out."""
    argv = [sys.executable, os.path.abspath(__file__), f"--case=context,{size},{length}",
            f"--block_size={FLAGS.block_size}", f"--repeats={FLAGS.repeats}",
            f"--steps={FLAGS.steps}"]
    threads = str(max(1, (os.cpu_count() or 1) // size))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TF_NUM_INTRAOP_THREADS": threads,
           "TF_NUM_INTEROP_THREADS": "1"}
    if size > 1:
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        argv = [horovodrun, "-np", str(size), "-H", f"localhost:{size}", "--gloo", *argv]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout
    line = next(line for line in reversed(out.splitlines()) if '{"step_peak"' in line)
    return json.loads(line[line.index("{"):])


def context_main():
    """--context=C: the CP1 / CPC comparison, one JSON line."""
    size, load_before = FLAGS.context, os.getloadavg()
    lengths = [int(n) for n in FLAGS.context_lengths]
    runs = {c: {n: context_case(c, n) for n in lengths} for c in (1, size)}
    activations = {c: {n: max(p - g for p, g in zip(r["step_peak"], r["gradients"]))
                       for n, r in v.items()} for c, v in runs.items()}
    budget = FLAGS.memory_gib * 2 ** 30
    longest_fitted = {  # per-rank peaks; C ranks share the machine's memory
        f"cp{c}": longest(lengths, [max(v[n]["step_peak"]) for n in lengths], 1, budget / c)
        for c, v in runs.items()}
    result = {
        "benchmark": "long_context_cp", "model": "gpt small, batch 1, fp32, blockwise, graph",
        "context": size, "cpu": perf.cpu_model(), "cores": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "activations_mib": {f"cp{c}": {str(n): round(b / 2 ** 20, 1) for n, b in v.items()}
                            for c, v in activations.items()},
        "activation_ratio_per_rank": {str(n): round(activations[size][n] / activations[1][n], 3)
                                      for n in lengths},
        "step_wall_s": {f"cp{c}": {str(n): round(r["wall_s"], 3) for n, r in v.items()}
                        for c, v in runs.items()},
        "speed_cp_over_cp1": {str(n): round(runs[1][n]["wall_s"] / runs[size][n]["wall_s"], 3)
                              for n in lengths},
        "communication_share": {str(n): round(runs[size][n]["collectives_s"]
                                              / runs[size][n]["wall_s"], 3) for n in lengths},
        "longest_in_memory_gib": FLAGS.memory_gib, "longest_fitted": longest_fitted,
        "load_after": [round(x, 2) for x in os.getloadavg()]}
    _record.emit(result)


def planned_activations(attention, length):
    """tfbig-plan's activation bytes of this step (fp32, batch 1, one device)."""
    from tfbig.plan import estimate
    from tfbig.models import shapes as models

    cfg = models.model_config("gpt", "small", seq_length=length, attention=attention)
    return estimate.activation_memory(models.shape_of(cfg, "gpt", length), estimate.Layout(),
                                      1, "fp32")


def available_bytes():
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def in_subprocess(attention, length, kind):
    argv = [sys.executable, os.path.abspath(__file__), f"--case={attention},{length},{kind}",
            f"--block_size={FLAGS.block_size}", f"--repeats={FLAGS.repeats}",
            f"--steps={FLAGS.steps}", f"--time_xla={FLAGS.time_xla}"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def longest(lengths, peaks, degree, budget):
    """The longest T (to 256 tokens) whose fitted step peak (a polynomial of `degree` in T)
    plus the model state (weights and AdamW's two slots; the position table grows with T)
    fits `budget` bytes."""
    import numpy as np

    from tfbig.models.configs import GPTConfig

    fit = np.polyfit(np.array(lengths, float), np.array(peaks, float), degree)

    def fits(t):
        state = 12 * GPTConfig(**MODEL, seq_length=t).num_params()
        return np.polyval(fit, t) + state <= budget

    t = 256
    while fits(t + 256) and t < 2 ** 22:
        t += 256
    return t


def planned_longest(attention, budget):
    """The longest T (to 256 tokens) whose planned state + activations fit `budget` bytes."""
    from tfbig.plan import estimate, hardware
    from tfbig.models import shapes as models

    cpu = hardware.Device("cpu", 1e11, 2 ** 50, 1e10, 1e10, 1.0, 0.0)
    t = 256
    while t < 2 ** 22:
        cfg = models.model_config("gpt", "small", seq_length=t + 256, attention=attention)
        mem = estimate.memory(models.shape_of(cfg, "gpt", t + 256), estimate.Layout(), 1,
                              "fp32", cpu)
        if sum(mem.values()) > budget:
            break
        t += 256
    return t


def main(argv):
    if FLAGS.case.startswith("context,"):
        _, size, length = FLAGS.case.split(",")
        run_context_case(int(size), int(length))
        return
    if FLAGS.case:
        attention, length, kind = FLAGS.case.split(",")
        print(json.dumps(run_case(attention, int(length), kind)))
        return
    if FLAGS.context:
        context_main()
        return
    load_before = os.getloadavg()
    lengths = [int(n) for n in FLAGS.lengths]
    memory, skipped = {"dense": {}, "blockwise": {}}, []
    for length in lengths:
        for attention in ("dense", "blockwise"):
            planned = planned_activations(attention, length)
            if attention == "dense" and 2 * planned > available_bytes():
                skipped.append(f"dense at {length}: planned {planned / 2**30:.1f} GiB, more "
                               f"than half of the {available_bytes() / 2**30:.1f} GiB available")
                continue
            held = in_subprocess(attention, length, "memory")
            memory[attention][length] = {
                "step_peak_mib": held["step_peak"] / 2 ** 20,
                "activations_mib": (held["step_peak"] - held["gradients"]) / 2 ** 20,
                "planned_activations_mib": planned / 2 ** 20}
    times = {}
    for length in (int(n) for n in FLAGS.time_lengths):
        times[length] = {a: in_subprocess(a, length, "time") for a in ("dense", "blockwise")}
    budget = FLAGS.memory_gib * 2 ** 30
    result = {
        "benchmark": "long_context", "model": "gpt small, batch 1, fp32", "block_size":
            FLAGS.block_size, "cpu": perf.cpu_model(),
        "cores": os.cpu_count(), "load_before": [round(x, 2) for x in load_before],
        "memory_no_xla": {a: {str(k): {n: round(x, 1) for n, x in v.items()}
                              for k, v in m.items()} for a, m in memory.items()},
        "activation_ratio_blockwise_over_dense": {
            str(n): round(memory["blockwise"][n]["activations_mib"]
                          / memory["dense"][n]["activations_mib"], 3)
            for n in lengths if n in memory["dense"] and n in memory["blockwise"]},
        "step_time": "xla" if FLAGS.time_xla else "graph",
        "step_time_s": {str(n): {a: {k: round(x, 3) for k, x in t.items()}
                                   for a, t in v.items()} for n, v in times.items()},
        "speed_blockwise_over_dense_wall": {
            str(n): round(v["dense"]["wall_s"] / v["blockwise"]["wall_s"], 3)
            for n, v in times.items()},
        "speed_blockwise_over_dense_cpu": {
            str(n): round(v["dense"]["cpu_s"] / v["blockwise"]["cpu_s"], 3)
            for n, v in times.items()},
        "longest_in_memory_gib": FLAGS.memory_gib,
        "longest_fitted": {
            a: longest(sorted(m), [m[n]["step_peak_mib"] * 2 ** 20 for n in sorted(m)],
                       2 if a == "dense" else 1, budget)
            for a, m in memory.items() if len(m) >= 3},
        "longest_planned": {a: planned_longest(a, budget) for a in ("dense", "blockwise")},
        "skipped": skipped, "load_after": [round(x, 2) for x in os.getloadavg()]}
    _record.emit(result)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    app.run(main)
