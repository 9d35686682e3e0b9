"""tfbig.plan against this machine: bytes held and tokens/s measured beside the plan's figures.

    python benchmarks/plan_accuracy.py [--cross_rank] [--parts=memory,pipeline,speed,horovod]
                                       [--calibration]

Rows (each a ratio measured / planned, 1.0 = exact):
    memory    peak bytes of one fp32 training step of a single-device GPT (model state + the CPU
              allocator's peak during the step), without and with XLA
    pipeline  the transient peak (gradients, activations, send/receive buffers) of one
              forward/backward of a 2-stage pipeline, per stage and whole, GPipe and 1F1B at 4
              and 8 micro-batches, with and without activation checkpointing: in one process
              (stages on logical CPU devices sharing one allocator, so each stage's column of
              the schedule is also run alone) and, with --cross_rank, one stage per Horovod
              rank (each its own allocator). "stage<k>": the bytes of the tensors alive at the
              peak (tfbig.training.measure.tensor_peak, what the plan counts); "allocator": the
              allocator's peak of the same steps per stage, which also counts the slack of the
              chunks it handed out (up to 2x a tensor's size)
    speed     tokens/s of two GPTs (h128 x 2 layers, seq 128; h256 x 4 layers, seq 256; batch 16,
              fp32, XLA) trained by benchmarks/train_throughput.py's run (the Trainer on the
              prepared corpus, input included; the best of 2 runs of 8 timed steps) against
              the plan on this CPU (its matmul peak and memory bandwidth probed first)
    horovod   step time of benchmarks/horovod_scaling.py's run (the tiny preset, seq 128, 16
              sequences per rank, one thread per rank) with 2 and 4 Gloo ranks against the plan
              of that layout (not in the default --parts: a few minutes)
--calibration adds, to speed and horovod, the plan with a calibration tfbig-doctor measured
just before under the same launch (alone for speed; horovodrun with one thread per rank for
horovod): measured / planned with and without it.
Prints one JSON line last, with the load average and the CPU model.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfbig.pipeline.devices import configure_cpu_devices  # noqa: E402
from tfbig.plan import calibration as calibration_lib  # noqa: E402
from tfbig.plan import estimate, hardware, search  # noqa: E402
from tfbig.models import shapes as models
from tfbig.training.local_plan import local_device  # noqa: E402
from tfbig.training.measure import (allocator_peak, measure_step, pipeline_step,  # noqa: E402
    planned_stage_peak, stage_alone, stage_layers, tensor_peak)

CPU = hardware.Device("cpu", 1e11, 2 ** 40, 1e10, 1e10, 1.0, 0.0)  # memory terms only
SINGLE = {"h128": dict(hidden_size=128, num_layers=2, num_heads=4, seq_length=128,
                       vocab_size=2048),
          "h256": dict(hidden_size=256, num_layers=4, num_heads=4, seq_length=256,
                       vocab_size=8000)}
# tests/plan/test_memory.py's pipeline model: megabytes per stage and micro-batch
PIPELINE = dict(hidden_size=128, num_layers=4, num_heads=2, seq_length=128, vocab_size=2048)
PIPELINE_MICRO_BATCH = 4


def shape(fields):
    cfg = models.model_config("gpt", "tiny", **fields)
    return models.shape_of(cfg, "gpt", cfg.seq_length)


def planned(fields, layout, micro_batch, kinds):
    """Planned bytes of `kinds` (a single device)."""
    return sum(estimate.memory(shape(fields), layout, micro_batch, "fp32", CPU)[k]
               for k in kinds)


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
    """measured / planned transient bytes of each stage of a 2-stage in-process pipeline (each
    stage's column of the schedule run alone: all stages share one CPU allocator) and of the
    whole pipeline (against the sum of the stages), GPipe and 1F1B at 4 and 8 micro-batches,
    with and without activation checkpointing."""
    rows = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            for ckpt in (False, True):
                layout = estimate.Layout(pipeline=2, num_microbatches=m, schedule=schedule,
                                         activation_checkpointing=ckpt)
                strategy, step = pipeline_step(PIPELINE, PIPELINE_MICRO_BATCH, layout)
                layout = dataclasses.replace(layout, stage_layers=stage_layers(strategy.plan))
                planned = [planned_stage_peak(PIPELINE, PIPELINE_MICRO_BATCH, layout, k)
                           for k in range(2)]
                runs = [stage_alone(strategy, k, PIPELINE_MICRO_BATCH) for k in range(2)]
                row = {f"stage{k}": round(tensor_peak(run) / p, 3)
                       for k, (run, p) in enumerate(zip(runs, planned))}
                row["allocator"] = [round(allocator_peak(run) / p, 3)
                                    for run, p in zip(runs, planned)]
                row["whole"] = round(tensor_peak(step) / sum(planned), 3)
                rows[f"{schedule}_m{m}{'_ckpt' if ckpt else ''}"] = row
    return rows


def cross_rank_rows():
    """measured / planned transient bytes per stage rank of the cross-rank pipeline
    (--strategy=horovod --pipeline_stages=2, one horovodrun launch of 2 ranks)."""
    worker = os.path.join(ROOT, "tests", "plan", "pipeline_peak_worker.py")
    layouts = {f"{s}_m{m}{'_ckpt' if ckpt else ''}": estimate.Layout(
        pipeline=2, num_microbatches=m, schedule=s, activation_checkpointing=ckpt)
        for s in ("gpipe", "1f1b") for m in (4, 8) for ckpt in (False, True)}
    with tempfile.TemporaryDirectory() as out:
        cases = [{"name": name, "model": PIPELINE, "micro_batch": PIPELINE_MICRO_BATCH,
                  "layout": dataclasses.asdict(layout)} for name, layout in layouts.items()]
        with open(os.path.join(out, "cases.json"), "w") as f:
            json.dump(cases, f)
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        subprocess.run([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                        worker, os.path.join(out, "cases.json"), out], check=True,
                       env={**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2",
                            "HOROVOD_DYNAMIC_PROCESS_SETS": "1"},  # a strategy per layout
                       stdout=subprocess.DEVNULL)
        rows = {}
        for name, layout in layouts.items():
            for rank in (0, 1):
                with open(os.path.join(out, f"{name}.rank{rank}.json")) as f:
                    record = json.load(f)
                planned = planned_stage_peak(PIPELINE, PIPELINE_MICRO_BATCH, dataclasses.replace(
                    layout, stage_layers=tuple(record["stage_layers"])), record["stage"])
                row = rows.setdefault(name, {"allocator": [None, None]})
                row[f"stage{record['stage']}"] = round(record["tensor_peak"] / planned, 3)
                row["allocator"][record["stage"]] = round(record["peak"] / planned, 3)
    return rows


SPEED = {"h128": (dict(hidden_size=128, num_layers=2, num_heads=4, seq_length=128), 16),
         "h256": (dict(hidden_size=256, num_layers=4, num_heads=4, seq_length=256), 16)}
SPEED_STEPS, SPEED_REPEATS = 8, 2  # timed steps per run; runs per model (the best counts)
HOROVOD_RUN = dict(preset="tiny", seq_length=128, per_process_batch=16, steps=10)
DOCTOR = ["-m", "tfbig.doctor", "--precisions=fp32", f"--max_bytes={2 ** 24}"]


def calibrate(directory, ranks):
    """A calibration tfbig-doctor measures under the launch the measured runs use: alone (all
    threads) for 1, else horovodrun with one thread per rank (benchmarks/_scaling.py)."""
    import _scaling

    path = os.path.join(directory, f"calibration{ranks}.json")
    command = [sys.executable, *DOCTOR, f"--calibration_out={path}"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    if ranks > 1:
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        command = [horovodrun, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", *command]
        env.update(_scaling.ONE_THREAD)
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return calibration_lib.load(path)


def ratios(measured, planned, calibrated, name):
    """measured / planned figures, without and (when given) with the calibration."""
    row = {f"measured_{name}": round(measured, 4), f"planned_{name}": round(planned, 4),
           "ratio": round(measured / planned, 3)}
    if calibrated is not None:
        row.update({f"calibrated_{name}": round(calibrated, 4),
                    "calibrated_ratio": round(measured / calibrated, 3)})
    return row


def speed_rows(calibration_dir=None):
    """tokens/s of the SPEED models trained by benchmarks/train_throughput.py's run (the
    Trainer on the prepared corpus, one process with all its threads; the best of
    SPEED_REPEATS runs) / planned for the model that run built (its vocabulary is the
    corpus')."""
    import train_throughput

    device = local_device("fp32")
    cluster = hardware.Cluster(device, 1, 1, device.local_bandwidth)
    measured_cluster = None
    if calibration_dir:
        measured_cluster = calibration_lib.cluster(calibrate(calibration_dir, 1), "fp32", 1, 1,
                                                   0.0)
    rows = {"peak_flops": round(device.peak_flops),
            "memory_bandwidth": round(device.memory_bandwidth)}
    for name, (fields, batch) in SPEED.items():
        model = {k: fields[k] for k in ("hidden_size", "num_layers", "num_heads")}
        with tempfile.TemporaryDirectory() as run_dir:
            runs = [train_throughput.train_once(
                "fp32", True, os.path.join(run_dir, str(k)), preset="tiny", batch_size=batch,
                seq_length=fields["seq_length"], steps=SPEED_STEPS, data_dir="", **model)
                for k in range(SPEED_REPEATS)]
        config = runs[0]["model_config"]
        built = models.shape_of(config, "gpt", fields["seq_length"])
        plans = [search.evaluate(built, estimate.Layout(), batch, "fp32", c, 1e9)
                 for c in (cluster, measured_cluster) if c is not None]
        measured = max(run["tokens_per_sec"] for run in runs)
        rows[name] = ratios(measured, plans[0].tokens_per_sec,
                            plans[1].tokens_per_sec if measured_cluster else None,
                            "tokens_per_sec")
        rows[name]["vocab_size"] = config.vocab_size
    return rows


def horovod_rows(calibration_dir=None):
    """Step seconds measured / planned of horovod_scaling.py's run with 2 and 4 ranks."""
    import _scaling
    import horovod_scaling

    args = types.SimpleNamespace(hidden_size=0, num_layers=0, xla=True, data_dir="",
                                 hvd_fp16_allreduce=False, hvd_thread_policy="auto",
                                 **HOROVOD_RUN)
    args.data_dir = _scaling.prepare_data(args)
    device = local_device("fp32")
    fields = models.model_config("gpt", "tiny", seq_length=args.seq_length)
    model = models.shape_of(fields, "gpt", args.seq_length)
    rows = {}
    for ranks in (2, 4):
        batch = ranks * args.per_process_batch
        clusters = [hardware.Cluster(device, ranks, 1, device.local_bandwidth)]
        if calibration_dir:
            clusters.append(calibration_lib.cluster(calibrate(calibration_dir, ranks), "fp32",
                                                    ranks, 1, 0.0))
        plans = [search.evaluate(model, estimate.Layout(data=ranks), batch, "fp32", c, 1e9)
                 for c in clusters]
        with tempfile.TemporaryDirectory() as run_dir:
            summary = horovod_scaling.measure(args, ranks, run_dir)
        measured = batch * args.seq_length / summary["tokens_per_sec"]
        rows[str(ranks)] = ratios(measured, plans[0].step_seconds,
                                  plans[1].step_seconds if calibration_dir else None,
                                  "step_seconds")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cross_rank", action="store_true",
                        help="also the cross-rank pipeline's stage ranks (one horovodrun launch)")
    parser.add_argument("--parts", default="memory,pipeline,speed",
                        help="from memory, pipeline, speed, horovod")
    parser.add_argument("--calibration", action="store_true",
                        help="also plan speed and horovod with a calibration tfbig-doctor "
                             "measures first under the same launch")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - {"memory", "pipeline", "speed", "horovod"}
    if unknown:
        parser.error(f"--parts={args.parts}: {sorted(unknown)} not one of memory, pipeline, "
                     f"speed, horovod")
    configure_cpu_devices(2)
    result = {"benchmark": "plan_accuracy"}
    with tempfile.TemporaryDirectory() as calibrations:
        directory = calibrations if args.calibration else None
        for name, rows in (("memory", memory_rows), ("pipeline", pipeline_rows),
                           ("speed", lambda: speed_rows(directory)),
                           ("horovod", lambda: horovod_rows(directory))):
            if name in parts:
                result[name] = rows()
    if args.cross_rank:
        result["cross_rank"] = cross_rank_rows()
    result["load_average"] = os.getloadavg()
    result["cpu"] = subprocess.run("lscpu | grep 'Model name'", shell=True, text=True,
                                   capture_output=True).stdout.split(":")[-1].strip() or (
        platform.processor())
    _record.emit(result)


if __name__ == "__main__":
    main()
