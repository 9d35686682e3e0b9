"""Horovod scaling: training tokens/s of 1 vs 2 processes under `horovodrun --gloo`.

Both sizes go through horovodrun and the same --strategy=horovod trainer (one rank still
allreduces, with itself). How it is measured: benchmarks/_scaling.py.

Example:
    python benchmarks/horovod_scaling.py --preset=tiny --seq_length=128 \
        --per_rank_batch=16 --steps=30 --repeats=3
Prints one JSON line last: {"efficiency": ..., "tokens_per_sec": {"1": ..., "2": ...}, ...}
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scaling  # noqa: E402

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# The Horovod flags this benchmark passes on (scaling_pair.py takes the same).
FLAGS = [(("--hvd_fp16_allreduce",), dict(action="store_true", help="send gradients as float16")),
         (("--hvd_thread_policy",), dict(default="auto", choices=("auto", "batch", "normal"),
                                         help="scheduling of Horovod's background threads"))]


def measure(args, ranks, run_dir):
    """Rank 0's last logged train values with `ranks` Horovod processes."""
    config_path = _scaling.write_experiment(
        args, "horovod", ranks, run_dir, horovod={"hvd_fp16_allreduce": args.hvd_fp16_allreduce,
                                                  "hvd_thread_policy": args.hvd_thread_policy})
    out_path = os.path.join(run_dir, "train.json")
    command = [HOROVODRUN, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
               sys.executable, os.path.abspath(__file__), "--worker", config_path, out_path]
    proc = subprocess.run(command, env={**os.environ, **_scaling.ONE_THREAD},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
        raise SystemExit(f"horovodrun -np {ranks} failed with exit code {proc.returncode}")
    with open(out_path) as f:
        return json.load(f)


def main():
    args = _scaling.parse_args(__doc__.split("\n\n")[0], "rank", extra_flags=FLAGS)
    if args.worker:
        return _scaling.worker(*args.worker)
    _scaling.run(args, "horovod_scaling", "rank", measure)


if __name__ == "__main__":
    main()
