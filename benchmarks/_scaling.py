"""What the two scaling benchmarks share (horovod_scaling.py, multiworker_scaling.py).

Weak scaling: every process has one intra-op and one inter-op thread and the same per-process
batch, so two processes train a batch twice as large per step;
    efficiency = tokens/s with 2 processes / (2 x tokens/s with 1 process).
Throughput is the trainer's own figure (the chief's last logging window: steps --steps+1 ..
2 x --steps, after compilation), so it includes input, the gradient all-reduce and the loop's
per-step checks. Runs alternate (1, 2, 1, 2, ...) --repeats times and the fastest of each size
counts, since other load on the machine only ever slows a run down; the JSON line also carries
each repeat's own efficiency (its 2-process run against the 1-process run just before it) and
their spread, and the 1-minute load average (it should stay below the core count).
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
              "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}


def worker(config_path, out_path):
    """One process: train the config; the chief writes its last logged train values."""
    from tfbig import config as config_lib
    from tfbig.training.trainer import Trainer

    with open(config_path) as f:
        trainer = Trainer(config_lib.from_dict(json.load(f)))
    summary = trainer.fit()
    if trainer.strategy.is_chief:
        with open(out_path, "w") as f:
            json.dump(summary["train"], f)
    trainer.strategy.shutdown()


def parse_args(description, unit, extra_flags=()):
    """The shared flags; --per_{unit}_batch is stored as args.per_process_batch.
    extra_flags: (args, kwargs) pairs for parser.add_argument."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--hidden_size", type=int, default=0, help="0 keeps the preset's")
    parser.add_argument("--num_layers", type=int, default=0, help="0 keeps the preset's")
    parser.add_argument("--seq_length", type=int, default=128)
    parser.add_argument(f"--per_{unit}_batch", dest="per_process_batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30,
                        help="steps per timed window (each run trains 2 x steps)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each size, interleaved; the fastest of each counts")
    parser.add_argument("--xla", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--data_dir", default="", help="empty: the embedded corpus (cached)")
    for flag_args, flag_kwargs in extra_flags:
        parser.add_argument(*flag_args, **flag_kwargs)
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args()


def write_experiment(args, strategy, processes, run_dir, **sections):
    """Write the run's experiment.json; returns its path. sections: {"horovod": {...}, ...}."""
    from tfbig import config as config_lib

    cfg = config_lib.ExperimentConfig()
    values = dict(strategy=strategy, data_dir=args.data_dir, model_dir=os.path.join(run_dir, "run"),
                  preset=args.preset, seq_length=args.seq_length,
                  batch_size=args.per_process_batch * processes, max_steps=2 * args.steps,
                  log_every=args.steps, checkpoint_every=10 * args.steps, eval_steps=1,
                  sample_tokens=0, xla=args.xla, warmup_steps=1)
    if args.hidden_size:
        values.update(hidden_size=args.hidden_size, num_heads=max(1, args.hidden_size // 64))
    if args.num_layers:
        values["num_layers"] = args.num_layers
    for key, value in values.items():
        setattr(cfg.train, key, value)
    for section, fields in sections.items():
        for key, value in fields.items():
            setattr(getattr(cfg, section), key, value)
    config_path = os.path.join(run_dir, "experiment.json")
    with open(config_path, "w") as f:
        json.dump(config_lib.to_dict(cfg), f)
    return config_path


def prepare_data(args):
    """The embedded Shakespeare corpus, prepared once for --seq_length (cached)."""
    if args.data_dir:
        return args.data_dir
    from tfbig import data

    return data.prepare_locked(data.default_data_dir(seq_length=args.seq_length),
                               seq_length=args.seq_length)


def run(args, name, unit, measure):
    """Interleave measure(args, n, directory) for n = 1, 2 and print the JSON line.
    measure returns the chief's train summary (tokens_per_sec, time fractions)."""
    args.data_dir = prepare_data(args)
    runs = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix=f"tfbig-{name}-") as directory:
        for repeat in range(args.repeats):
            for n in runs:
                run_dir = os.path.join(directory, str(repeat), f"{unit}s{n}")
                os.makedirs(run_dir)
                runs[n].append(measure(args, n, run_dir))
    best = {n: max(r, key=lambda t: t["tokens_per_sec"]) for n, r in runs.items()}
    speed = {n: t["tokens_per_sec"] for n, t in best.items()}
    efficiency = speed[2] / (2 * speed[1])
    each = [two["tokens_per_sec"] / (2 * one["tokens_per_sec"])
            for one, two in zip(runs[1], runs[2])]
    print(f"tokens/s: 1 {unit} {speed[1]:,.0f}, 2 {unit}s {speed[2]:,.0f}; "
          f"scaling efficiency {efficiency:.3f} (repeats {', '.join(f'{e:.3f}' for e in each)})",
          file=sys.stderr)
    flags = {k: v for k, v in vars(args).items() if k not in ("worker", "data_dir")}
    _record.emit({"benchmark": name, "efficiency": round(efficiency, 4),
                      "tokens_per_sec": {"1": round(speed[1], 1), "2": round(speed[2], 1)},
                      "all_tokens_per_sec": {str(n): [round(t["tokens_per_sec"], 1) for t in r]
                                             for n, r in runs.items()},
                      "efficiency_per_repeat": [round(e, 4) for e in each],
                      "efficiency_spread": round(max(each) - min(each), 4),
                      "communication_fraction_2": round(
                          best[2].get("time_fraction/communication", float("nan")), 4),
                      **flags, f"threads_per_{unit}": 1,
                      "load_average": round(os.getloadavg()[0], 2)})
