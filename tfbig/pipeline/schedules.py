"""Pipeline schedules: in which order each stage runs the forwards and backwards of M micro-batches.

Every schedule has the same signature, `schedule(num_stages, num_microbatches) -> ops`, where
`ops[stage]` is that stage's list of `Op("F"|"B", microbatch)`; `run` executes any of them on
the stages, and `timeline` computes when each op would start and end given per-stage op times.

GPipe (Huang et al. 2019) runs all forwards, then all backwards: every stage holds the
activations of all M micro-batches. 1F1B (PipeDream-Flush, Narayanan et al. 2021) starts the
backwards as soon as the last stage can, so stage s holds at most K - s micro-batches. Both have
the same bubble, (K - 1) / (M + K - 1) of the step for K balanced stages.

Example:
    ops = get_schedule("1f1b")(num_stages=2, num_microbatches=4)
    loss, metrics = run(ops, stages, micro_batches)
"""
import collections

import tensorflow as tf

Op = collections.namedtuple("Op", "kind microbatch")  # kind: "F" forward, "B" backward


def gpipe(num_stages, num_microbatches):
    """All forwards, then all backwards, on every stage."""
    forwards = [Op("F", m) for m in range(num_microbatches)]
    backwards = [Op("B", m) for m in range(num_microbatches)]
    return [forwards + backwards for _ in range(num_stages)]


def one_f_one_b(num_stages, num_microbatches):
    """One forward, one backward in the steady state; stage s keeps <= num_stages - s alive."""
    ops = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        steady = num_microbatches - warmup
        # Warmup: forwards only, until the first backward can reach this stage.
        stage_ops = [Op("F", m) for m in range(warmup)]
        # Steady: each forward is followed by the backward of the oldest micro-batch in flight.
        for i in range(steady):
            stage_ops += [Op("F", warmup + i), Op("B", i)]
        # Cooldown: drain the backwards of the micro-batches still in flight.
        stage_ops += [Op("B", m) for m in range(steady, num_microbatches)]
        ops.append(stage_ops)
    return ops


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def get_schedule(name):
    if name not in SCHEDULES:
        raise ValueError(f"--schedule={name!r}: expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]


def _dependency(op, stage, num_stages):
    """The op of another stage whose output `op` needs (None for the pipeline's ends)."""
    if op.kind == "F":
        return (stage - 1, Op("F", op.microbatch)) if stage > 0 else None
    return (stage + 1, Op("B", op.microbatch)) if stage < num_stages - 1 else None


def timeline(ops, forward_time=1.0, backward_time=2.0):
    """{(stage, op): (start, end)} when each stage runs its ops in order as soon as their
    inputs exist. Times are numbers or per-stage lists."""
    num_stages = len(ops)
    per_stage = lambda t: list(t) if isinstance(t, (list, tuple)) else [t] * num_stages  # noqa
    fwd, bwd = per_stage(forward_time), per_stage(backward_time)
    times, position, free = {}, [0] * num_stages, [0.0] * num_stages
    while any(position[s] < len(ops[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            while position[s] < len(ops[s]):
                op = ops[s][position[s]]
                dep = _dependency(op, s, num_stages)
                if dep is not None and dep not in times:
                    break
                start = max(free[s], times[dep][1] if dep else 0.0)
                free[s] = start + (fwd[s] if op.kind == "F" else bwd[s])
                times[(s, op)] = (start, free[s])
                position[s] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule deadlocks: stage ops {ops} wait on each other")
    return times


def makespan(ops, forward_time=1.0, backward_time=2.0):
    """Time from the first op's start to the last op's end."""
    return max(end for _, end in timeline(ops, forward_time, backward_time).values())


def issue_order(ops):
    """All (stage, op) in an order that respects dependencies: by start time, then stage."""
    times = timeline(ops)
    return sorted(times, key=lambda key: (times[key][0], key[0]))


def run(ops, stages, micro_batches):
    """Run schedule `ops` on `stages`; returns (mean loss, mean metrics) over micro-batches.

    Activations flow forward stage to stage and their gradients back; weight gradients stay
    summed in each stage (`Stage.gradient_sums`).
    """
    last = len(stages) - 1
    outputs, input_grads, losses = {}, {}, {}
    for s, op in issue_order(ops):
        m, stage = op.microbatch, stages[s]
        if op.kind == "F":
            x = micro_batches[m] if s == 0 else outputs.pop((s - 1, m))
            out = stage.forward(m, x, micro_batches[m])
            (losses if s == last else outputs)[(s, m) if s < last else m] = out
        else:
            dx = stage.backward(m, input_grads.pop((s, m), None))
            if s > 0:
                input_grads[(s - 1, m)] = dx
    return _mean([losses[m] for m in sorted(losses)])


def run_forward(stages, micro_batches):
    """Inference: micro-batches flow forward only; returns (the last stage's outputs
    concatenated over micro-batches, (mean loss, mean metrics))."""
    for stage in stages:
        stage.begin_step(None, len(micro_batches))
    forwards = [[Op("F", m) for m in range(len(micro_batches))] for _ in stages]
    outputs, results = {}, {}
    for s, op in issue_order(forwards):
        m = op.microbatch
        x = micro_batches[m] if s == 0 else outputs.pop((s - 1, m))
        out = stages[s].infer(x, micro_batches[m])
        if s == len(stages) - 1:
            results[m] = out
        else:
            outputs[(s, m)] = out
    ordered = [results[m] for m in sorted(results)]
    mean = _mean([(loss, metrics) for _, loss, metrics in ordered])
    merged = tf.nest.map_structure(lambda *parts: tf.concat(parts, 0),
                                   *[outputs for outputs, _, _ in ordered])
    return merged, mean


def _mean(values):
    """Mean of a list of (loss, metrics) pairs."""
    scale = 1.0 / len(values)
    loss = tf.add_n([loss for loss, _ in values]) * scale
    metrics = {k: tf.add_n([m[k] for _, m in values]) * scale for k in values[0][1]}
    return loss, metrics


# ---- one rank's column of the schedule (tfbig.pipeline.cross_rank) ------------------------
def _stamped(run, inputs, stamps, stage):
    """run(inputs), with [start, end] wall-clock stamps around it appended to `stamps` (the
    start waits for the inputs and the previous op's end, the end for everything the op
    produced, weight-gradient sums included; the benchmark's bubble)."""
    if stamps is None:
        return run(inputs)
    deps = [t for t in tf.nest.flatten(inputs) if t is not None] + stamps[-1:]
    with tf.control_dependencies(deps):
        start = tf.timestamp()
    with tf.control_dependencies([start]):
        inputs = tf.nest.map_structure(lambda t: t if t is None else tf.identity(t), inputs)
    out = run(inputs)
    # A control dependency on a function call's output waits, once Grappler inlines the call,
    # only for the function's stateful ops, not its math (the forwards then measured ~0 ms):
    # the end waits for a value read from every output instead.
    produced = [t for t in tf.nest.flatten(out) if t is not None] + list(
        stage.gradient_sums.values())
    ready = tf.add_n([tf.constant(0.0)] + [
        tf.reduce_sum(tf.cast(tf.reshape(t, [-1])[:1], tf.float32)) for t in produced])
    with tf.control_dependencies([ready]):
        stamps.append(tf.stack([start, tf.timestamp()]))
    return out


def run_stage(ops, stage, link, micro_batches, specs, stamps=None):
    """This rank's column of the schedule: {microbatch: (loss, metrics)} on the last stage.
    `stamps` (a list) collects each op's [start, end] wall-clock times."""
    results = {}
    for op in ops:
        m = op.microbatch
        if op.kind == "F":
            x = micro_batches[m] if stage.is_first else link.receive_forward(
                m, specs[stage.index - 1])
            out = _stamped(lambda i, m=m: stage.forward(m, *i), (x, micro_batches[m]), stamps,
                           stage)
            if stage.is_last:
                results[m] = out
            else:
                link.send_forward(m, out)
        else:
            dy = None if stage.is_last else link.receive_backward(m, specs[stage.index])
            dx = _stamped(lambda d, m=m: stage.backward(m, d), dy, stamps, stage)
            if not stage.is_first:
                link.send_backward(m, dx)
    return results
