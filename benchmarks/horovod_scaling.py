"""Horovod scaling: training tokens/s of 1 vs 2 processes under `horovodrun --gloo`.

Weak scaling: every rank has one intra-op and one inter-op thread and the same per-rank batch,
so two ranks train a batch twice as large per step;
    efficiency = tokens/s with 2 ranks / (2 x tokens/s with 1 rank).
On a shared machine other processes take cores from the 2-rank run first: the JSON line
carries the 1-minute load average (it should be below the core count), and --repeats keeps
the fastest of interleaved runs. Both runs go through horovodrun and the same --strategy=horovod trainer (one rank still
allreduces, with itself). Throughput is the trainer's own figure (rank 0's last logging window:
steps --steps+1 .. 2 x --steps, after compilation), so it includes input, the gradient
allreduce and the loop's per-step checks.

Example:
    python benchmarks/horovod_scaling.py --preset=tiny --seq_length=128 \
        --per_rank_batch=16 --steps=30
Prints one JSON line last: {"efficiency": ..., "tokens_per_sec": {"1": ..., "2": ...}, ...}
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ONE_THREAD = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
              "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def worker(config_path, out_path):
    """One rank: train the config; rank 0 writes its last logged train values."""
    from tfbig import config as config_lib
    from tfbig.trainer import Trainer

    with open(config_path) as f:
        trainer = Trainer(config_lib.from_dict(json.load(f)))
    summary = trainer.fit()
    if trainer.strategy.is_chief:
        with open(out_path, "w") as f:
            json.dump(summary["train"], f)
    trainer.strategy.shutdown()


def experiment(args, ranks, model_dir):
    from tfbig.config import ExperimentConfig

    cfg = ExperimentConfig()
    values = dict(strategy="horovod", data_dir=args.data_dir, model_dir=model_dir,
                  preset=args.preset, seq_length=args.seq_length,
                  batch_size=args.per_rank_batch * ranks, max_steps=2 * args.steps,
                  log_every=args.steps, checkpoint_every=10 * args.steps, eval_steps=1,
                  sample_tokens=0, xla=args.xla, warmup_steps=1)
    if args.hidden_size:
        values.update(hidden_size=args.hidden_size, num_heads=max(1, args.hidden_size // 64))
    if args.num_layers:
        values["num_layers"] = args.num_layers
    for key, value in values.items():
        setattr(cfg.train, key, value)
    cfg.horovod.hvd_fp16_allreduce = args.hvd_fp16_allreduce
    return cfg


def measure(args, ranks, directory):
    """Tokens/s of `ranks` Horovod processes (rank 0's last logging window)."""
    from tfbig import config as config_lib

    run_dir = os.path.join(directory, f"ranks{ranks}")
    os.makedirs(run_dir)
    config_path = os.path.join(run_dir, "experiment.json")
    with open(config_path, "w") as f:
        json.dump(config_lib.to_dict(experiment(args, ranks, os.path.join(run_dir, "run"))), f)
    out_path = os.path.join(run_dir, "train.json")
    command = [HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
               sys.executable, os.path.abspath(__file__), "--worker", config_path, out_path]
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": ROOT}
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
        raise SystemExit(f"horovodrun -np {ranks} failed with exit code {proc.returncode}")
    with open(out_path) as f:
        return json.load(f)["tokens_per_sec"]


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
    parser.add_argument("--per_rank_batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30,
                        help="steps per timed window (each run trains 2 x steps)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each size, interleaved; the fastest of each counts")
    parser.add_argument("--xla", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hvd_fp16_allreduce", action="store_true",
                        help="send gradients as float16")
    parser.add_argument("--data_dir", default="", help="empty: the embedded corpus (cached)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    args.data_dir = prepare_data(args)
    runs = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="tfbig-hvd-scaling-") as directory:
        for repeat in range(args.repeats):
            for n in runs:
                runs[n].append(measure(args, n, os.path.join(directory, str(repeat))))
    speed = {n: max(values) for n, values in runs.items()}
    efficiency = speed[2] / (2 * speed[1])
    print(f"tokens/s: 1 rank {speed[1]:,.0f}, 2 ranks {speed[2]:,.0f}; "
          f"scaling efficiency {efficiency:.3f}", file=sys.stderr)
    print(json.dumps({"benchmark": "horovod_scaling", "efficiency": round(efficiency, 4),
                      "tokens_per_sec": {"1": round(speed[1], 1), "2": round(speed[2], 1)},
                      "preset": args.preset, "hidden_size": args.hidden_size,
                      "num_layers": args.num_layers, "seq_length": args.seq_length,
                      "per_rank_batch": args.per_rank_batch, "steps": args.steps,
                      "xla": args.xla, "hvd_fp16_allreduce": args.hvd_fp16_allreduce,
                      "threads_per_rank": 1, "repeats": args.repeats,
                      "runs": {str(n): [round(v, 1) for v in values] for n, values in runs.items()},
                      "load_average": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
