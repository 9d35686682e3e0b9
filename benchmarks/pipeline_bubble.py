"""Pipeline bubble: step time as the number of micro-batches M grows, against the ideal.

For K balanced stages both schedules idle (K - 1) / (M + K - 1) of a step (the bubble). K = 2 is
measured for real: two logical CPU devices, one thread per stage (one intra-op thread, K
inter-op threads), on this 2-core machine. Its ideal step time is the schedule's timeline
computed from each stage's forward and backward time measured alone; the excess is how much
slower the real step is. For K = 4 and 8 (more stages than cores) the timeline is computed from
the stages' measured times only, so the schedule itself is checked beyond the cores we have.
Peak activation memory (the CPU allocator's peak during a step, above what was allocated
before it) is measured for GPipe and 1F1B, with and without activation checkpointing.

`cores_used` (process CPU time / wall time of that step) shows whether the two stage threads
really got two cores: on a machine busy with other work it stays near 1 and the excess grows
(--wait_idle waits for a quiet machine). `concurrent_slowdown` is how much slower both stages'
forward+backward run at once, on independent data, than the slower alone: the part of the
excess that is the hardware's (two busy cores share caches, memory bandwidth and clocks).
Times are the minimum over --repeats rounds (the least disturbed by other processes); the rounds
interleave every step and stage timing so that a busy spell of the machine hits all alike.

Example:
    python benchmarks/pipeline_bubble.py --microbatches=1,2,4,8,16
Prints one JSON line last: {"worst_excess_over_ideal": ..., "k2": {...}, "peak_activation_bytes":
{...}, "timelines": {"4": ..., "8": ...}}
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tfbig.config import ExperimentConfig  # noqa: E402
from tfbig.models.gpt import GPTConfig  # noqa: E402
from tfbig.pipeline import schedules  # noqa: E402
from tfbig.pipeline.devices import configure_cpu_devices  # noqa: E402
from tfbig.pipeline.strategy import PipelineStrategy  # noqa: E402
from tfbig.tasks.gpt import GPTTask  # noqa: E402


class SyntheticTask(GPTTask):
    """GPT next-token loss on random ids: the task's model and loss, without a dataset."""

    def __init__(self, model_config, seq_length):  # noqa: D107 - no data to load
        self.model_config = model_config
        self.seq_length = seq_length


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", default="1,2,4,8,16")
    parser.add_argument("--micro_batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq_length", type=int, default=64)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=8)
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10, help="timing rounds (min is kept)")
    parser.add_argument("--memory_microbatches", type=int, default=8)
    parser.add_argument("--memory_micro_batch", type=int, default=16,
                        help="sequences per micro-batch for the memory figures: TF's CPU "
                             "allocator counts only large (>= 256 KiB) allocations")
    parser.add_argument("--xla", action="store_true", help="XLA-compile each stage")
    parser.add_argument("--wait_idle", type=float, default=0.0,
                        help="wait up to this many seconds for the CPUs to be >= 90%% idle "
                             "before the K=2 timings (other processes take the cores the two "
                             "stages need)")
    parser.add_argument("--parts", default="k2,memory,timelines",
                        help="what to run: k2 (real 2-stage steps), memory, timelines (K=4, 8)")
    return parser.parse_args()


def timed(fn):
    """(wall seconds, process CPU seconds over all threads) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def best_of_rounds(functions, repeats):
    """{name: (wall, cpu) of its fastest call}: every function warmed up, then timed once per
    round, rounds interleaved so that a busy spell of the machine hits all of them alike."""
    for fn in functions.values():
        fn()  # trace, compile, warm up
    best = {name: (float("inf"), 0.0) for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            best[name] = min(best[name], timed(fn))
    return best


def idle_fraction(seconds=1.0):
    """Share of all CPUs' time spent idle over the next `seconds` (from /proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return values[3] + values[4], sum(values)  # idle + iowait, total

    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_until_idle(max_seconds, threshold=0.9):
    """Wait until the CPUs are idle for two seconds in a row; returns the last idle share."""
    deadline, calm, idle = time.monotonic() + max_seconds, 0, idle_fraction()
    while time.monotonic() < deadline:
        idle = idle_fraction()
        calm = calm + 1 if idle >= threshold else 0
        if calm >= 2:
            break
    return idle


def make_pipeline(args, num_stages, num_microbatches, schedule="1f1b", checkpointing=False,
                  micro_batch=None):
    micro_batch = micro_batch or args.micro_batch
    cfg = ExperimentConfig()
    cfg.train.batch_size = micro_batch * num_microbatches
    p = cfg.pipeline
    p.pipeline_stages, p.num_microbatches, p.schedule = num_stages, num_microbatches, schedule
    p.activation_checkpointing = checkpointing
    model_config = GPTConfig(vocab_size=args.vocab_size, seq_length=args.seq_length,
                             num_layers=args.num_layers, hidden_size=args.hidden_size,
                             num_heads=max(1, args.hidden_size // 64), dropout=0.0)
    strategy = PipelineStrategy(cfg)
    strategy.cfg = None  # no plan printed per configuration (printed once in main)
    model = strategy.build_model(SyntheticTask(model_config, args.seq_length))
    step = strategy.make_forward_backward(None, model.trainable_variables, lambda l: l,
                                          args.xla)
    ids = tf.random.uniform([1, micro_batch * num_microbatches, args.seq_length + 1], 0,
                            args.vocab_size, tf.int32, seed=1)
    return strategy, model, lambda: step({"input_ids": ids})[0].numpy()


def stage_functions(args, strategy):
    """{("F"|"FB", stage): function} running one stage alone on one micro-batch: its forward,
    and its forward then backward."""
    ids = tf.random.uniform([args.micro_batch, args.seq_length + 1], 0, args.vocab_size,
                            tf.int32, seed=2)
    micro_batch = {"input_ids": ids}
    hidden = tf.random.normal([args.micro_batch, args.seq_length, args.hidden_size])
    functions = {}
    for stage in strategy.make_stages(args.xla):
        x = micro_batch if stage.is_first else hidden
        dy = None if stage.is_last else [tf.ones_like(hidden)]

        def forward(stage=stage, x=x):
            stage.begin_step(lambda loss: loss, 1)
            return tf.nest.flatten(stage.forward(0, x, micro_batch))

        def forward_backward(stage=stage, x=x, dy=dy):
            forward(stage, x)
            stage.backward(0, dy)
            return list(stage.gradient_sums.values())

        for kind, fn in (("F", forward), ("FB", forward_backward)):
            compiled = tf.function(fn, autograph=False)
            functions[(kind, stage.index)] = lambda f=compiled: [t.numpy() for t in f()]
        functions[("raw", stage.index)] = forward_backward
    return functions


def concurrent_pair(functions):
    """Both stages' forward+backward of one micro-batch at once, on independent data: how much
    each core slows down when the other is busy too (shared caches, memory, clocks)."""
    raw = [functions.pop(("raw", s)) for s in (0, 1)]
    both = tf.function(lambda: raw[0]() + raw[1](), autograph=False)
    return lambda: [t.numpy() for t in both()]


def split_times(best, num_stages):
    """(forward, backward) seconds per stage from the F and FB timings."""
    forward = [best[("F", s)][0] for s in range(num_stages)]
    backward = [max(best[("FB", s)][0] - best[("F", s)][0], 0.0) for s in range(num_stages)]
    return forward, backward


def measure_k2(args, microbatches):
    """Real 2-stage steps for each M and schedule, against the timeline of measured stages."""
    functions = {}
    for m in microbatches:
        for schedule in ("gpipe", "1f1b"):
            strategy, _, step = make_pipeline(args, 2, m, schedule)
            functions[(m, schedule)] = step
    functions.update(stage_functions(args, strategy))
    functions["pair"] = concurrent_pair(functions)
    for fn in functions.values():
        fn()  # trace and compile before waiting for a quiet machine
    idle = wait_until_idle(args.wait_idle) if args.wait_idle else None
    best = best_of_rounds(functions, args.repeats)
    fwd, bwd = split_times(best, 2)
    slowdown = best["pair"][0] / max(best[("FB", 0)][0], best[("FB", 1)][0])
    print(f"K=2 both stages at once on independent data: {slowdown:.2f}x the slower one alone",
          flush=True)
    rows = []
    for m in microbatches:
        for schedule in ("gpipe", "1f1b"):
            measured, cpu = best[(m, schedule)]
            ideal = schedules.makespan(schedules.get_schedule(schedule)(2, m), fwd, bwd)
            busy = m * max(f + b for f, b in zip(fwd, bwd))
            rows.append({"M": m, "schedule": schedule, "step_seconds": measured,
                         "ideal_seconds": ideal, "excess_over_ideal": measured / ideal - 1,
                         "ideal_bubble": 1 / (m + 1), "measured_bubble": 1 - busy / measured,
                         "cores_used": cpu / measured})
            print(f"K=2 M={m:<3} {schedule:<6} step {measured * 1e3:8.1f} ms  ideal "
                  f"{ideal * 1e3:8.1f} ms  excess {measured / ideal - 1:+6.1%}  bubble "
                  f"measured {1 - busy / measured:5.1%} ideal {1 / (m + 1):5.1%}  cores used "
                  f"{cpu / measured:4.2f}", flush=True)
    return {"stage_forward_seconds": fwd, "stage_backward_seconds": bwd, "rows": rows,
            "idle_before_timing": idle, "concurrent_slowdown": slowdown}


def timelines(args, num_stages, microbatches):
    """Computed steps for K stages from their measured times (more stages than cores)."""
    strategy, _, _ = make_pipeline(args, num_stages, 1)
    functions = {k: v for k, v in stage_functions(args, strategy).items() if k[0] != "raw"}
    fwd, bwd = split_times(best_of_rounds(functions, args.repeats), num_stages)
    out = {"stage_forward_seconds": fwd, "stage_backward_seconds": bwd, "rows": []}
    for m in microbatches:
        for name in ("gpipe", "1f1b"):
            ops = schedules.get_schedule(name)(num_stages, m)
            span = schedules.makespan(ops, fwd, bwd)
            busy = m * max(f + b for f, b in zip(fwd, bwd))
            ideal = (num_stages - 1) / (m + num_stages - 1)
            out["rows"].append({"M": m, "schedule": name, "step_seconds": span,
                                "bubble": 1 - busy / span, "ideal_bubble": ideal})
            print(f"K={num_stages} M={m:<3} {name:<6} timeline {span * 1e3:8.1f} ms  bubble "
                  f"{1 - busy / span:5.1%}  ideal {ideal:5.1%}", flush=True)
    return out


def peak_activation_bytes(args, num_stages):
    """Allocator peak during one step above the bytes held before it, per schedule."""
    out = {}
    for schedule in ("gpipe", "1f1b"):
        for checkpointing in (False, True):
            _, _, step = make_pipeline(args, num_stages, args.memory_microbatches, schedule,
                                       checkpointing, args.memory_micro_batch)
            step()
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            tf.config.experimental.reset_memory_stats("CPU:0")
            step()
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
            key = schedule + ("+recompute" if checkpointing else "")
            out[key] = int(peak)
            print(f"K={num_stages} M={args.memory_microbatches} (x{args.memory_micro_batch} "
                  f"sequences) {key:<16} peak activation "
                  f"bytes {peak / 2**20:8.2f} MiB", flush=True)
    return out


def main():
    args = parse_args()
    if args.num_layers + 2 < 8:
        sys.exit(f"--num_layers={args.num_layers}: the K=8 timeline needs at least 8 pipeline "
                 f"layers (embedding, {args.num_layers} blocks, head); use --num_layers>=6")
    # Before TensorFlow starts: one thread per op, two ops (stages) at once, 8 logical CPUs.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    configure_cpu_devices(8)
    microbatches = [int(m) for m in args.microbatches.split(",")]
    parts = set(args.parts.split(","))
    strategy, _, _ = make_pipeline(args, 2, max(microbatches))
    print(strategy.describe(args.micro_batch * args.seq_length), flush=True)
    result = {"benchmark": "pipeline_bubble"}
    if "k2" in parts:
        k2 = measure_k2(args, microbatches)
        result.update(worst_excess_over_ideal=max(r["excess_over_ideal"] for r in k2["rows"]),
                      goal=0.10, k2=k2)
    if "memory" in parts:
        result["peak_activation_bytes"] = {str(k): peak_activation_bytes(args, k) for k in (2, 4)}
    if "timelines" in parts:
        result["timelines"] = {str(k): timelines(args, k, microbatches) for k in (4, 8)}
    result["config"] = vars(args)
    _record.emit(result)


if __name__ == "__main__":
    main()
