"""Multi-worker scaling: training tokens/s of 1 vs 2 MultiWorkerMirroredStrategy workers.

Workers are started by tfbig-launch's `Workers` with TF_CONFIG on free localhost ports.
How it is measured: benchmarks/_scaling.py.

Example:
    python benchmarks/multiworker_scaling.py --preset=tiny --seq_length=128 \
        --per_worker_batch=16 --steps=30 --repeats=3 [--collective=ring]
Prints one JSON line last: {"efficiency": ..., "tokens_per_sec": {"1": ..., "2": ...}, ...}
"""
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scaling  # noqa: E402

sys.path.insert(0, _scaling.ROOT)


def measure(args, workers, run_dir):
    """The chief's last logged train values with `workers` processes."""
    from tfbig.training.workers import Workers

    config_path = _scaling.write_experiment(args, "multiworker", workers, run_dir,
                                            multiworker={"collective": args.collective})
    out_path = os.path.join(run_dir, "train.json")
    log = io.StringIO()
    command = [sys.executable, os.path.abspath(__file__), "--worker", config_path, out_path]
    code = Workers(command, workers, env={**os.environ, **_scaling.ONE_THREAD}, stream=log).wait()
    if code != 0:
        sys.stderr.write(log.getvalue())
        raise SystemExit(f"{workers} worker(s) failed with exit code {code}")
    with open(out_path) as f:
        return json.load(f)


def main():
    args = _scaling.parse_args(__doc__.split("\n\n")[0], "worker", extra_flags=[
        (("--collective",), dict(default="auto", choices=("auto", "ring"),
                                 help="the all-reduce implementation (--collective)"))])
    if args.worker:
        return _scaling.worker(*args.worker)
    _scaling.run(args, "multiworker_scaling", "worker", measure)


if __name__ == "__main__":
    main()
