"""Training throughput and MFU of the real tfbig loop: fp32 without and with XLA, and bf16.

Each mode trains a fresh model with `Trainer` on the prepared data (the embedded Shakespeare
corpus unless --data_dir) for 1 + --steps steps; the first step (compilation) is not timed:
tokens/s runs from the end of step 1 to the end of the last step (input wait included).
MFU = model FLOPs per token (6 x matmul params + attention) x tokens/s / peak, where on CPU
the peak is measured in this run by a large XLA matmul probe, taken before every mode; the
best probe is used (so MFU is never flattered by a probe that ran while the machine was busy).
Both are also measured in CPU time of the process (`*_mfu_cpu_time`: tokens per CPU-second
over the probe's FLOP per CPU-second), which stays meaningful when other processes share the
cores. Modes are run in turns for --repeats rounds and the best round of each is reported.

    python benchmarks/train_throughput.py --preset=small --batch_size=16 --seq_length=256

Prints one JSON line last; `mfu` is the XLA fp32 figure.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

import _timing  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "small", "GPT preset.")
flags.DEFINE_integer("batch_size", 16, "Sequences per step.")
flags.DEFINE_integer("seq_length", 256, "Tokens per sequence.")
flags.DEFINE_integer("steps", 6, "Timed steps per mode and round.")
flags.DEFINE_integer("repeats", 2, "Rounds over all modes; the best round of each is reported.")
flags.DEFINE_string("data_dir", "", "Prepared data (default: the embedded corpus, cached).")
flags.DEFINE_list("modes", ["fp32", "fp32_xla", "fp32_xla_op_update", "bf16_xla"],
                  "Modes to measure.")

# mode -> (--precision, --xla, --compile_update): fp32_xla is the whole step in one XLA program
# (tfbig.training.step), fp32_xla_op_update the forward/backward alone, the update op by op.
MODES = {"fp32": ("fp32", False, True), "fp32_xla": ("fp32", True, True),
         "fp32_xla_op_update": ("fp32", True, False),
         "bf16_xla": ("mixed_bfloat16", True, True)}


def train_once(precision, xla, model_dir, preset=None, batch_size=None, seq_length=None,
               steps=None, data_dir=None, compile_update=True, **model):
    """Train one fresh model; tokens/s and tokens per CPU-second over the timed steps, and the
    model's config. Arguments left None take this script's flags (--preset, ...); `model`
    overrides the preset's fields (hidden_size, num_layers, num_heads: tfbig-train's flags)."""
    from tfbig.config import ExperimentConfig
    from tfbig.training.trainer import Trainer

    settings = dict(preset=preset or FLAGS.preset, batch_size=batch_size or FLAGS.batch_size,
                    seq_length=seq_length or FLAGS.seq_length,
                    data_dir=FLAGS.data_dir if data_dir is None else data_dir)
    cfg = ExperimentConfig()
    steps = 1 + (steps or FLAGS.steps)  # the first one compiles and is left out
    for key, value in dict(
            **settings, **model, model_dir=model_dir, max_steps=steps, log_every=steps,
            warmup_steps=1, eval_steps=1, checkpoint_every=10 ** 9, sample_tokens=0,
            precision=precision, xla=xla, compile_update=compile_update).items():
        setattr(cfg.train, key, value)
    trainer = Trainer(cfg)
    marks = _timing.clock_steps(trainer)
    summary = trainer.fit()["train"]
    return {**_timing.rates(marks, settings["batch_size"] * trainer.task.seq_length),
            "input_wait": summary["time_fraction/input"],
            "flops_per_token": trainer.task.flops_per_token(),
            "model_config": trainer.model.config}


def main(argv):
    del argv
    best, peaks = {}, {}
    with tempfile.TemporaryDirectory() as root:
        for round_index in range(FLAGS.repeats):
            for mode in FLAGS.modes:
                precision, xla, compile_update = MODES[mode]
                wall, cpu = _timing.peak_flops(precision)
                old = peaks.get(precision, (0.0, 0.0))
                peaks[precision] = (max(old[0], wall), max(old[1], cpu or 0.0))
                run = train_once(precision, xla, os.path.join(root, f"{mode}-{round_index}"),
                                 compile_update=compile_update)
                print(f"round {round_index} {mode}: {run['tokens_per_sec']:,.0f} tok/s, "
                      f"{run['tokens_per_cpu_sec']:,.0f} tok/CPU-s, "
                      f"input wait {run['input_wait']:.1%}", flush=True)
                old = best.get(mode, {"tokens_per_sec": 0.0, "tokens_per_cpu_sec": 0.0})
                best[mode] = {**run, **{k: max(old[k], run[k])
                                        for k in ("tokens_per_sec", "tokens_per_cpu_sec")}}
    flops = next(iter(best.values()))["flops_per_token"]
    result = {"preset": FLAGS.preset, "batch_size": FLAGS.batch_size,
              "seq_length": FLAGS.seq_length, "timed_steps": FLAGS.steps,
              "repeats": FLAGS.repeats, "flops_per_token": flops,
              "peak_flops": {p: round(v[0]) for p, v in peaks.items()},
              "peak_flops_per_cpu_sec": {p: round(v[1]) for p, v in peaks.items()}}
    for mode, run in best.items():
        peak, peak_cpu = peaks[MODES[mode][0]]
        result[f"{mode}_tokens_per_sec"] = round(run["tokens_per_sec"], 1)
        result[f"{mode}_mfu"] = round(flops * run["tokens_per_sec"] / peak, 4)
        result[f"{mode}_tokens_per_cpu_sec"] = round(run["tokens_per_cpu_sec"], 1)
        if peak_cpu:
            result[f"{mode}_mfu_cpu_time"] = round(flops * run["tokens_per_cpu_sec"] / peak_cpu, 4)
        result[f"{mode}_input_wait"] = round(run["input_wait"], 4)
    if "fp32_xla_mfu" in result:
        result["mfu"] = result["fp32_xla_mfu"]
    if "fp32_xla_tokens_per_sec" in result and "fp32_xla_op_update_tokens_per_sec" in result:
        result["compiled_update_speedup"] = round(result["fp32_xla_tokens_per_sec"]
                                                  / result["fp32_xla_op_update_tokens_per_sec"], 3)
    result["load"] = [round(x, 2) for x in os.getloadavg()]
    _record.emit(result)


if __name__ == "__main__":
    app.run(main)
