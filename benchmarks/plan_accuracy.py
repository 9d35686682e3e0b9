"""tfbig.plan against this machine: bytes held and tokens/s measured beside the plan's figures.

    python benchmarks/plan_accuracy.py

Rows (each a ratio measured / planned, 1.0 = exact):
    memory    peak bytes of one fp32 training step of a single-device GPT (model state + the CPU
              allocator's peak during the step), without and with XLA
    pipeline  the transient peak of one forward/backward of a 2-stage pipeline on two logical
              CPU devices (gradients + activations; one shared allocator: measured is both
              stages together, planned is the sum of the two stages' peaks), GPipe and 1F1B at 4
              and 8 micro-batches
    speed     tokens/s of the `small` preset (batch 16, seq 256, fp32, XLA) against the plan on
              this CPU (its matmul peak and memory bandwidth probed first)
Prints one JSON line last, with the load average and the CPU model.
"""
import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tfbig.pipeline.devices import configure_cpu_devices  # noqa: E402
from tfbig.plan import estimate, hardware, models, search  # noqa: E402
from tfbig.plan.local import local_device  # noqa: E402
from tfbig.plan.measure import measure_step  # noqa: E402

CPU = hardware.Device("cpu", 1e11, 2 ** 40, 1e10, 1e10, 1.0, 0.0)  # memory terms only
SINGLE = {"h128": dict(hidden_size=128, num_layers=2, num_heads=4, seq_length=128,
                       vocab_size=2048),
          "h256": dict(hidden_size=256, num_layers=4, num_heads=4, seq_length=256,
                       vocab_size=8000)}


def shape(fields):
    cfg = models.model_config("gpt", "tiny", **fields)
    return models.shape_of(cfg, "gpt", cfg.seq_length)


def planned(fields, layout, micro_batch, kinds, stages=(True,)):
    """Planned bytes of `kinds`, summed over the stages (first: False, last: True)."""
    return sum(sum(estimate.memory(shape(fields), layout, micro_batch, "fp32", CPU,
                                   last=last)[k] for k in kinds) for last in stages)


def memory_rows():
    rows = {}
    for name, fields in SINGLE.items():
        for xla in (False, True):
            held = measure_step(fields, 8, xla)
            measured = held["model_state"] + held["step_peak"]
            kinds = ("parameters", "gradients", "optimizer", "activations")
            rows[f"{name}{'_xla' if xla else ''}"] = round(
                measured / planned(fields, estimate.Layout(), 8, kinds), 3)
    return rows


def pipeline_rows():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import pipeline_bubble

    args = argparse.Namespace(micro_batch=4, seq_length=128, hidden_size=128, num_layers=4,
                              vocab_size=2048, xla=False)
    fields = dict(hidden_size=128, num_layers=4, num_heads=2, seq_length=128, vocab_size=2048)
    rows = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            _, _, step = pipeline_bubble.make_pipeline(args, 2, m, schedule)
            step()
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            tf.config.experimental.reset_memory_stats("CPU:0")
            step()
            transient = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
            layout = estimate.Layout(pipeline=2, num_microbatches=m, schedule=schedule)
            both = planned(fields, layout, args.micro_batch, ("gradients", "activations"),
                           stages=(False, True))
            rows[f"{schedule}_m{m}"] = round(transient / both, 3)
    return rows


def speed_row():
    fields = dict(hidden_size=256, num_layers=4, num_heads=4, seq_length=256, vocab_size=8000)
    device = local_device("fp32")
    cluster = hardware.Cluster(device, 1, 1, device.local_bandwidth)
    planned = search.evaluate(shape(fields), estimate.Layout(), 16, "fp32", cluster, 1e9)
    measured = measure_step(fields, 16, xla=True, steps=6)["tokens_per_sec"]
    return {"planned_tokens_per_sec": round(planned.tokens_per_sec),
            "measured_tokens_per_sec": round(measured),
            "ratio": round(measured / planned.tokens_per_sec, 3),
            "peak_flops": round(device.peak_flops), "memory_bandwidth": round(
                device.memory_bandwidth)}


def main():
    configure_cpu_devices(2)
    result = {"benchmark": "plan_accuracy", "memory": memory_rows(),
              "pipeline": pipeline_rows(), "speed": speed_row(),
              "load_average": os.getloadavg(),
              "cpu": subprocess.run("lscpu | grep 'Model name'", shell=True, text=True,
                                    capture_output=True).stdout.split(":")[-1].strip()
              or platform.processor()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
