"""Multi-worker scaling: training tokens/s of 1 vs 2 MultiWorkerMirroredStrategy workers.

Weak scaling: every worker is one local process with one intra-op and one inter-op thread and
the same per-worker batch, so two workers train a batch twice as large per step;
    efficiency = tokens/s with 2 workers / (2 x tokens/s with 1 worker).
Throughput is the trainer's own figure (the chief's last logging window: steps --steps+1 ..
2 x --steps, after compilation), so it includes input, all-reduce and the loop's per-step
preemption check. Runs alternate (1, 2, 1, 2, ...) --repeats times and the best of each is
kept, since other load on the machine only ever slows a run down. Workers are started by
tfbig-launch's `Workers` with TF_CONFIG on free localhost ports.

Example:
    python benchmarks/multiworker_scaling.py --preset=tiny --seq_length=128 \
        --per_worker_batch=16 --steps=30
Prints one JSON line last: {"efficiency": ..., "tokens_per_sec": {"1": ..., "2": ...}, ...}
"""
import argparse
import io
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ONE_THREAD = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
              "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


def worker(config_path, out_path):
    """One worker: train the config; the chief writes its last logged train values."""
    from tfbig import config as config_lib
    from tfbig.trainer import Trainer

    with open(config_path) as f:
        trainer = Trainer(config_lib.from_dict(json.load(f)))
    summary = trainer.fit()
    if trainer.strategy.is_chief:
        with open(out_path, "w") as f:
            json.dump(summary["train"], f)
    trainer.strategy.shutdown()


def experiment(args, workers, model_dir):
    from tfbig.config import ExperimentConfig

    cfg = ExperimentConfig()
    values = dict(strategy="multiworker", data_dir=args.data_dir, model_dir=model_dir,
                  preset=args.preset, seq_length=args.seq_length,
                  batch_size=args.per_worker_batch * workers, max_steps=2 * args.steps,
                  log_every=args.steps, checkpoint_every=10 * args.steps, eval_steps=1,
                  sample_tokens=0, xla=args.xla, warmup_steps=1)
    if args.hidden_size:
        values.update(hidden_size=args.hidden_size, num_heads=max(1, args.hidden_size // 64))
    if args.num_layers:
        values["num_layers"] = args.num_layers
    for key, value in values.items():
        setattr(cfg.train, key, value)
    return cfg


def measure(args, workers, directory):
    """The chief's last logged train values (tokens_per_sec, time fractions) with `workers`."""
    from launch.local import Workers
    from tfbig import config as config_lib

    run_dir = os.path.join(directory, f"workers{workers}")
    os.makedirs(run_dir)
    config_path = os.path.join(run_dir, "experiment.json")
    with open(config_path, "w") as f:
        json.dump(config_lib.to_dict(experiment(args, workers, os.path.join(run_dir, "run"))), f)
    out_path = os.path.join(run_dir, "train.json")
    log = io.StringIO()
    command = [sys.executable, os.path.abspath(__file__), "--worker", config_path, out_path]
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": ROOT}
    code = Workers(command, workers, env=env, stream=log).wait()
    if code != 0:
        sys.stderr.write(log.getvalue())
        raise SystemExit(f"{workers} worker(s) failed with exit code {code}")
    with open(out_path) as f:
        return json.load(f)


def prepare_data(args):
    """The embedded Shakespeare corpus, prepared once for --seq_length (cached)."""
    if args.data_dir:
        return args.data_dir
    from tfbig import prepare

    out = prepare.default_data_dir(seq_length=args.seq_length)
    prepare.prepare(None, out, seq_length=args.seq_length)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--hidden_size", type=int, default=0, help="0 keeps the preset's")
    parser.add_argument("--num_layers", type=int, default=0, help="0 keeps the preset's")
    parser.add_argument("--seq_length", type=int, default=128)
    parser.add_argument("--per_worker_batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30,
                        help="steps per timed window (each run trains 2 x steps)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per worker count")
    parser.add_argument("--xla", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--data_dir", default="", help="empty: the embedded corpus (cached)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    args.data_dir = prepare_data(args)
    runs = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="tfbig-scaling-") as directory:
        for repeat in range(args.repeats):
            for n in runs:
                runs[n].append(measure(args, n, os.path.join(directory, str(repeat))))
    best = {n: max(r, key=lambda t: t["tokens_per_sec"]) for n, r in runs.items()}
    speed = {n: t["tokens_per_sec"] for n, t in best.items()}
    efficiency = speed[2] / (2 * speed[1])
    print(f"tokens/s: 1 worker {speed[1]:,.0f}, 2 workers {speed[2]:,.0f}; "
          f"scaling efficiency {efficiency:.3f}", file=sys.stderr)
    print(json.dumps({"benchmark": "multiworker_scaling", "efficiency": round(efficiency, 4),
                      "tokens_per_sec": {"1": round(speed[1], 1), "2": round(speed[2], 1)},
                      "all_tokens_per_sec": {str(n): [round(t["tokens_per_sec"], 1) for t in r]
                                             for n, r in runs.items()},
                      "communication_fraction_2": round(
                          best[2].get("time_fraction/communication", float("nan")), 4),
                      "preset": args.preset, "hidden_size": args.hidden_size,
                      "num_layers": args.num_layers, "seq_length": args.seq_length,
                      "per_worker_batch": args.per_worker_batch, "steps": args.steps,
                      "repeats": args.repeats,
                      "xla": args.xla, "threads_per_worker": 1}))


if __name__ == "__main__":
    main()
