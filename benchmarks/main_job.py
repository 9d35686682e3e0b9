"""The main job as a new user runs it: `tfbig-train` with no flags, timed from outside.

Runs the command --repeats times, one after the other, each with a fresh run directory
(--model_dir in a temporary directory: every other flag keeps its default, so the recipe and
the 9-minute time budget are the user's) and, with --empty_cache (the default), a fresh
$TFBIG_CACHE, so the embedded corpus is prepared inside the budget as on a first run.
For each run it reports the wall time measured from outside (process start to exit), the
steps trained and the validation bits per byte (the run's last line), and the goodput the run
recorded (MODEL_DIR/goodput.json: time in productive training steps over wall time, with the
badput by cause), the median tokens/s and MFU of its progress lines' second half, and the
budget's decision (config.json: when the decay started, the speed it
was measured at, the end it predicted, when the loop really ended, and the speed of the steps
after the decision). Goals (issue 43): within 20 s of the budget and <= 2.20 bits per byte.

    python benchmarks/main_job.py --repeats=3 --record
    python benchmarks/main_job.py --models=gpt,llama --repeats=1 --record   # issue 41

With --models=gpt,llama each repeat runs `tfbig-train` then `tfbig-train --model=llama` (the
Llama family's main job: its recipe `llama/small`, the same budget and corpus), and a last
line gives each model's mean bits per byte and steps (goal: the Llama's <= the GPT's).

Prints one JSON line per run (and records each with --record).
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 3, "Runs of the main job, one after the other.")
flags.DEFINE_list("models", ["gpt"], "--model of each run, in turn within every repeat "
                  "(gpt: the main job as it is, no flags).")
flags.DEFINE_bool("empty_cache", True, "Each run prepares the embedded corpus in a fresh "
                  "$TFBIG_CACHE (as a first run does); false: the user's cache.")

TRAIN = os.path.join(os.path.dirname(sys.executable), "tfbig-train")
BUDGET_SECONDS = 9 * 60
DONE = re.compile(r"^done: step (\d+), .*validation bits per byte ([0-9.]+)$", re.M)
# a progress line's throughput and MFU (tfbig.training.logs): "... | 6,120 tok/s | MFU 41.3% |"
SPEED = re.compile(r"\| ([0-9,]+) tok/s \| MFU ([0-9.]+)%")


def logged_speed(stdout):
    """Median tokens/s and MFU of the progress lines of the run's second half (its windows
    after compilation and warmup), as the run printed them."""
    found = [(float(t.replace(",", "")), float(m) / 100) for t, m in SPEED.findall(stdout)]
    later = found[len(found) // 2:] or [(float("nan"), float("nan"))]
    speeds, mfus = sorted(t for t, _ in later), sorted(m for _, m in later)
    return speeds[len(speeds) // 2], mfus[len(mfus) // 2]


def run_once(root, model):
    model_dir = os.path.join(root, "run")
    env = dict(os.environ)
    if FLAGS.empty_cache:
        env["TFBIG_CACHE"] = os.path.join(root, "cache")
    started = time.monotonic()
    command = [TRAIN, f"--model_dir={model_dir}"] + ([] if model == "gpt" else [f"--model={model}"])
    proc = subprocess.run(command, env=env, capture_output=True,
                          text=True)
    wall = time.monotonic() - started
    done = DONE.search(proc.stdout)
    if proc.returncode != 0 or not done:
        sys.exit(f"tfbig-train failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                 f"\n{proc.stderr[-3000:]}")
    with open(os.path.join(model_dir, "goodput.json")) as f:
        recorded = json.load(f)
    with open(os.path.join(model_dir, "config.json")) as f:
        budget = json.load(f)["budget"]  # the decay the run decided, and the figures behind it
    seconds = recorded["seconds"]
    tokens_per_sec, mfu = logged_speed(proc.stdout)
    recorded_wall = recorded["updated"] - recorded["run_start"]
    return {
        "benchmark": "main_job",
        "model": model,
        "cache": "empty" if FLAGS.empty_cache else "the user's",
        "wall_seconds": round(wall, 1),
        "over_budget_seconds": round(wall - BUDGET_SECONDS, 1),
        "steps": int(done.group(1)),
        "validation_bits_per_byte": float(done.group(2)),
        "goodput": round(seconds["productive"] / recorded_wall, 3),
        # what the run's own progress lines said (compare benchmarks/train_throughput.py)
        "logged_tokens_per_sec_median": round(tokens_per_sec, 1),
        "logged_mfu_median": round(mfu, 4),
        "badput_seconds": {k: round(v, 1) for k, v in seconds.items() if k != "productive"},
        # the budget's decision: when, at which measured speed, the end it predicted, and when
        # the training loop really ended (the sample and the summary follow); steps after the
        # decision that run slower than measured push the end past the budget
        "budget": {"decay_from_step": budget["decay_start"],
                   "decided_at_seconds": round(budget["elapsed_seconds"], 1),
                   "seconds_per_step_then": round(budget["seconds_per_step"], 3),
                   "predicted_end_seconds": round(budget["predicted_end_seconds"], 1),
                   "loop_ended_seconds": round(budget["ended_seconds"], 1)},
        "seconds_per_step_after_decision": round(
            # the loop's end comes after the last checkpoint and validation (not the sample)
            (budget["ended_seconds"] - budget["elapsed_seconds"] - budget["checkpoint_seconds"]
             - budget["validation_seconds"]) / max(1, budget["max_steps"] - budget["decay_start"]),
            3),
    }


def main(_):
    runs = []
    for _ in range(FLAGS.repeats):
        for model in FLAGS.models:
            with tempfile.TemporaryDirectory() as root:
                runs.append(run_once(root, model))
                _record.emit(runs[-1])
    if len(FLAGS.models) > 1:
        mean = {}
        for model in FLAGS.models:
            mine = [run for run in runs if run["model"] == model]
            mean[model] = {key: round(sum(run[key] for run in mine) / len(mine), 4)
                           for key in ("validation_bits_per_byte", "steps", "wall_seconds")}
        first, *others = FLAGS.models
        _record.emit({"benchmark": "main_job_models", "repeats": FLAGS.repeats, "mean": mean,
                      "bits_per_byte_minus_" + first: {
                          model: round(mean[model]["validation_bits_per_byte"]
                                       - mean[first]["validation_bits_per_byte"], 4)
                          for model in others}})


if __name__ == "__main__":
    app.run(main)
