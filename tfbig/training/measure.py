"""What one training step of a GPT holds and how fast it runs on this machine, beside the plan.

The step is the trainer's single-replica step: forward and backward of the next-token loss
(XLA-compiled or not) and the optimizer's apply (tfbig.optim: AdamW with its two slots). Held
bytes are read, not modelled: the model state is the bytes of the variables (weights and
optimizer slots), the step peak is the CPU allocator's peak during a step above what was
allocated before it (the least of 5 steps: the executor's thread interleaving moves it). Pipeline
stages: `pipeline_step` (in this process, or this rank's stage under horovodrun), `stage_alone`
(one in-process stage's schedule column: its own peak), `planned_stage_peak` (the plan's), and
`tensor_peak`: the bytes of the tensors alive at a step's peak, replayed from the allocator's
records of each allocation (what the plan's terms count; the allocator's own peak also counts
the slack of its chunks, which depends on what it freed before: `allocator_peak`). This module
imports TensorFlow; the rest of tfbig.plan does not.

Example:
    measure_step(dict(hidden_size=128, num_layers=2, num_heads=4, seq_length=128,
                      vocab_size=2048), batch_size=8)   # {"model_state": ..., "step_peak": ...}
"""
import time


def measure_step(model, batch_size, xla=True, steps=0):
    """Bytes held (model_state, step_peak) and, with `steps` > 0, tokens/s of a tiny-preset GPT
    with the `model` fields overridden."""
    import tensorflow as tf

    from tfbig.config import TrainConfig
    from tfbig.models.gpt import GPT, GPTConfig
    from tfbig.optim import build_optimizer

    config = GPTConfig.from_preset("tiny", **model)
    net = GPT(config)
    net.build()
    optimizer = build_optimizer(TrainConfig(max_steps=10, warmup_steps=1),
                                net.trainable_variables)
    ids = tf.random.uniform((batch_size, config.seq_length + 1), 0, config.vocab_size, tf.int32)

    @tf.function(jit_compile=xla, autograph=False)
    def forward_backward(batch):
        with tf.GradientTape() as tape:
            logits = net(batch[:, :-1], training=True)  # (B, T, V)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                batch[:, 1:], logits))
        return tape.gradient(loss, net.trainable_variables)

    @tf.function(autograph=False)
    def step(batch):
        optimizer.apply(forward_backward(batch), net.trainable_variables)

    step(ids)  # compiles and creates the optimizer slots
    held = {"model_state": sum(v.numpy().nbytes for v in net.variables + optimizer.variables)}
    peaks = []
    for _ in range(5):  # the order independent ops run in moves the peak by up to ~15% here
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        step(ids)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    held["step_peak"] = min(peaks)  # what the step needs in its tightest observed order
    if steps:
        start = time.perf_counter()
        for _ in range(steps):
            step(ids)
        optimizer.iterations.numpy()  # waits for the last step
        held["tokens_per_sec"] = steps * batch_size * config.seq_length / (
            time.perf_counter() - start)
    return held


def allocator_peak(run, repeats=5):
    """Least over `repeats` calls of `run()` of the CPU allocator's peak above the bytes held
    before the call (the order independent ops run in moves the peak; the least is what the
    step needs in its tightest observed order)."""
    import tensorflow as tf

    run()  # traces, and creates whatever persists across steps
    peaks = []
    for _ in range(repeats):
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        run()
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    return min(peaks)


def tensor_peak(run, repeats=3, reduce=min):
    """Least (`reduce`=min) or most (max) over `repeats` calls of `run()` of the bytes of the
    tensors it allocated that are alive together at its peak (the sizes asked of the
    allocator, from the profiler's record of every allocation and deallocation:
    `allocation_events`).

    The CPU allocator (oneDNN's BFC allocator) hands out a free chunk up to twice the size
    asked for without splitting it, and counts the whole chunk in its peak: a 4.2 MB tensor
    was held in chunks of 4.2-7.6 MB from one step to the next. That slack is fragmentation
    (the plan's framework reserve on a GPU), not bytes the step's tensors need."""
    import tempfile

    import tensorflow as tf

    run()  # traces, and creates whatever persists across steps
    peaks = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as logdir:
            tf.profiler.experimental.start(logdir)
            run()
            tf.profiler.experimental.stop()
            peaks.append(live_at_peak(allocation_events(logdir))[0])
    return reduce(peaks)


def allocation_events(logdir):
    """[(time ns, "MemoryAllocation"|"MemoryDeallocation", {stat: value})] in time order,
    from the profile TensorFlow's profiler wrote in `logdir` (the host's XPlane)."""
    import glob
    import os

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    path = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0]
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if name in ("MemoryAllocation", "MemoryDeallocation"):
                    stats = {stat_names[s.metadata_id]: _stat_value(s, stat_names)
                             for s in event.stats if s.WhichOneof("value")}
                    events.append((line.timestamp_ns + event.offset_ps // 1000, name, stats))
    return sorted(events, key=lambda e: e[0])


def _stat_value(stat, names):
    """An XStat's value (strings stored once in the plane's metadata are referenced by id)."""
    kind = stat.WhichOneof("value")
    return names[stat.ref_value] if kind == "ref_value" else getattr(stat, kind)


def live_at_peak(events, size="requested_bytes"):
    """(peak bytes, {address: (bytes, op, shape)} alive at that moment) of the tensors
    allocated during `events` (`allocation_events`); `size`: "requested_bytes" (the tensor's)
    or "allocation_bytes" (the allocator's chunk)."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for _, name, stats in events:
        address = stats.get("addr")
        if name == "MemoryAllocation":
            live[address] = (int(stats.get(size, 0)), stats.get("tf_op", "?"),
                             stats.get("shape", ""))
            total += live[address][0]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif address in live:
            total -= live.pop(address)[0]
    return peak, at_peak


def pipeline_step(model, micro_batch, layout, boundaries="", cross_rank=False):
    """(strategy, step) of one forward/backward (no optimizer apply) of a GPT over random
    tokens, cut into `layout.pipeline` stages running `layout.schedule` over
    `layout.num_microbatches` micro-batches: every stage in this process on logical CPU devices
    (--strategy=pipeline), or only this rank's stage (`cross_rank`: under horovodrun,
    --strategy=horovod --pipeline_stages=K). `boundaries`: --stage_boundaries."""
    import tensorflow as tf

    from tfbig.config import ExperimentConfig
    from tfbig.models.gpt import GPTConfig
    from tfbig.tasks.gpt import GPTTask

    class RandomTokens(GPTTask):
        def __init__(self, model_config):  # noqa: D107 - the task's model and loss, no data
            self.model_config, self.seq_length = model_config, model_config.seq_length

    cfg = ExperimentConfig()
    cfg.train.batch_size = micro_batch * layout.num_microbatches
    cfg.train.strategy = "horovod" if cross_rank else "pipeline"
    p = cfg.pipeline
    p.pipeline_stages, p.num_microbatches, p.schedule = (layout.pipeline,
                                                         layout.num_microbatches,
                                                         layout.schedule)
    p.activation_checkpointing, p.stage_boundaries = layout.activation_checkpointing, boundaries
    if cross_rank:
        from tfbig.pipeline.cross_rank import CrossRankPipeline as Backend
    else:
        from tfbig.pipeline.strategy import PipelineStrategy as Backend
    strategy = Backend(cfg)
    if not cross_rank:
        strategy.cfg = None  # no plan table printed
    config = GPTConfig.from_preset("tiny", **model)
    net = strategy.build_model(RandomTokens(config))
    step = strategy.make_forward_backward(None, net.trainable_variables, lambda loss: loss,
                                          False)
    ids = tf.random.uniform([1, cfg.train.batch_size, config.seq_length + 1], 0,
                            config.vocab_size, tf.int32, seed=1)
    return strategy, lambda: step({"input_ids": ids})[0].numpy()


def stage_layers(plan):
    """Transformer blocks on each stage of a pipeline partition (tfbig.layouts.partition's
    StagePlans): the plan's `Layout.stage_layers` for that partition."""
    from tfbig.plan import estimate

    return estimate.stage_layer_counts(plan)


def stage_alone(strategy, index, micro_batch):
    """A step running only stage `index` of an in-process `pipeline_step` strategy: its
    column of the schedule, on its device, the activation it receives (forward) and the
    gradient of its output (backward) created just before the op that reads them, as a
    receive from a neighbour on another device would. What it allocates is that stage's own
    peak, which the one shared CPU allocator of the whole in-process pipeline cannot show."""
    import tensorflow as tf

    from tfbig.pipeline.strategy import split_microbatches

    stage = strategy.make_stages(False)[index]
    ops, num_micro = strategy.ops[index], strategy.options.num_microbatches
    config = strategy.task.model_config
    shape = [micro_batch, config.seq_length, config.hidden_size]  # a GPT stage boundary

    def arriving(micro):
        # Drawn from the micro-batch's tokens once the stage's previous op is done. Not a
        # constant: Grappler would fold the stage's first ops on it and run the rest (reading
        # only weights and constants) at the step's start, ahead of the schedule.
        with tf.device(stage.device):
            seed = stage._after_previous(micro["input_ids"][0, :2])
            return tf.random.stateless_normal(shape, seed)

    def column(batch):
        micro_batches = split_microbatches(batch, num_micro, batch_axes=2)
        stage.begin_step(lambda loss: loss, num_micro)
        for op in ops:
            m = op.microbatch
            with tf.name_scope(f"{op.kind}{m}"):  # allocation traces name the op: F0/..., B0/...
                if op.kind == "F":
                    stage.forward(m, micro_batches[m] if stage.is_first else arriving(
                        micro_batches[m]), micro_batches[m])
                else:
                    stage.backward(m, None if stage.is_last else [arriving(micro_batches[m])])
        return list(stage.gradient_sums.values())  # the step's outputs, as the pipeline's

    run = tf.function(column, autograph=False)
    ids = tf.random.uniform([1, micro_batch * num_micro, config.seq_length + 1], 0,
                            config.vocab_size, tf.int32, seed=1)
    return lambda: len(run({"input_ids": ids}))


def planned_stage_peak(model, micro_batch, layout, stage=0):
    """The plan's bytes a forward/backward step allocates above the model state on pipeline
    stage `stage` of a tiny-preset GPT with the `model` fields overridden (fp32): the stage's
    gradients, activations and pipeline send/receive buffers."""
    from tfbig.models import shapes as models
    from tfbig.plan import estimate, hardware

    cfg = models.model_config("gpt", "tiny", **model)
    shape = models.shape_of(cfg, "gpt", cfg.seq_length)
    device = hardware.Device("cpu", 1e11, 2 ** 40, 1e10, 1e10, 1.0, 0.0)  # memory terms only
    mem = estimate.memory(shape, layout, micro_batch, "fp32", device, stage=stage)
    return mem["gradients"] + mem["activations"] + mem["communication"]
