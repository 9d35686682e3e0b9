"""What one pipeline stage holds at its peak, op by op: an allocation trace of its schedule column.

    python benchmarks/pipeline_memory_trace.py --schedule=1f1b --num_microbatches=4 --stage=1 \
        [--activation_checkpointing]

Runs stage `--stage` of benchmarks/plan_accuracy.py's 2-stage h128 GPT alone
(tfbig.training.measure.stage_alone, whose ops are named F<m>/... and B<m>/... by micro-batch) under
TensorFlow's profiler, replays the CPU allocator's allocation and deallocation events, and prints
one JSON line: the allocator's least peak of 5 steps, the tensors' least peak of 3
(tfbig.training.measure.tensor_peak) and the plan's bytes (as plan_accuracy); of one traced step, the
peak of the tensors' bytes and of the allocator's chunks holding them, the live bytes at the
tensors' peak by op (F<m>/B<m> and the stage function call), and the largest live tensors with
the op that made them.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import collections
import dataclasses
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tfbig.pipeline.devices import configure_cpu_devices  # noqa: E402
from tfbig.plan import estimate  # noqa: E402
from tfbig.training.measure import (allocation_events, allocator_peak, live_at_peak,  # noqa: E402
    pipeline_step, planned_stage_peak, stage_alone, stage_layers, tensor_peak)

PIPELINE = dict(hidden_size=128, num_layers=4, num_heads=2, seq_length=128, vocab_size=2048)
MICRO_BATCH = 4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--num_microbatches", type=int, default=4)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--activation_checkpointing", action="store_true")
    args = parser.parse_args()
    configure_cpu_devices(2)
    layout = estimate.Layout(pipeline=2, num_microbatches=args.num_microbatches,
                             schedule=args.schedule,
                             activation_checkpointing=args.activation_checkpointing)
    strategy, _ = pipeline_step(PIPELINE, MICRO_BATCH, layout)
    layout = dataclasses.replace(layout, stage_layers=stage_layers(strategy.plan))
    run = stage_alone(strategy, args.stage, MICRO_BATCH)
    measured, tensors = allocator_peak(run), tensor_peak(run)
    logdir = tempfile.mkdtemp()
    tf.profiler.experimental.start(logdir)
    run()
    tf.profiler.experimental.stop()
    events = allocation_events(logdir)
    peak, live = live_at_peak(events)
    by_call = collections.Counter()
    for size, op, _ in live.values():
        by_call["/".join(op.split("/")[:2])] += size
    largest = sorted(live.values(), reverse=True)[:12]
    _record.emit({
        "case": vars(args), "allocator_peak_mb": round(measured / 1e6, 2),
        "tensor_peak_mb": round(tensors / 1e6, 2),
        "planned_mb": round(planned_stage_peak(PIPELINE, MICRO_BATCH, layout, args.stage) / 1e6,
                            2),
        "traced_peak_mb": round(peak / 1e6, 2),
        "traced_allocator_peak_mb": round(live_at_peak(events, "allocation_bytes")[0] / 1e6, 2),
        "live_by_call_mb": {k: round(v / 1e6, 2) for k, v in by_call.most_common()},
        "largest": [[round(size / 1e6, 3), op, str(shape)] for size, op, shape in largest]})


if __name__ == "__main__":
    main()
