"""Per-rank parameter bytes, step time and communication share of tensor parallelism at TP 1, 2
and 4 (`--tensor_parallel`, one data-parallel replica), at one fixed global batch.

    python benchmarks/tensor_parallel.py          # 125m-wide GPT (4 layers), seq 64, batch 8

Each degree T is its own `horovodrun -np T --gloo` launch. Every rank reports the parameter
bytes it holds (split and replicated, from the variables themselves) and the mean step time over
--steps steps after --warmup. The communication share of a TP step is measured by running the
same layout a second time with the tensor group's collectives replaced by identities (wrong
math, same compute): share = 1 - (step without collectives) / (step with them). One JSON line:
per degree, rank 0's figures, bytes against P/T + replicated and P/T, step time relative to
TP 1 measured in the same run, and the load average. One-thread processes, no XLA (Horovod's
collectives sit inside the TP forward/backward; see tfbig/distribute/tensor_parallel.py). On a
2-core machine, 4 ranks share 2 cores: step times there measure oversubscription as much as TP.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ENV = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}


class _NoCollectives:
    """Horovod with the tensor group's all-gather as an identity (the dry run)."""

    def __init__(self, hvd):
        self._hvd = hvd

    def __getattr__(self, name):
        return getattr(self._hvd, name)

    @staticmethod
    def allgather(x, process_set=None):
        return x


def worker(config_path, out_path, warmup, steps, dry):
    """One rank: build the trainer, time `steps` steps after `warmup`, write its figures."""
    import tensorflow as tf

    from tfbig import config as config_lib
    from tfbig.distribute import tensor_collectives, tensor_parallel
    from _timing import time_steps
    from tfbig.training.trainer import Trainer

    if dry:  # the same compute without the tensor group's communication
        tensor_collectives.all_reduce_sum = lambda x, process_set: tf.identity(x)
        tensor_collectives.hvd = _NoCollectives(tensor_collectives.hvd)
        tensor_parallel.hvd = tensor_collectives.hvd
    with open(config_path) as f:
        trainer = Trainer(config_lib.from_dict(json.load(f)))
    step_seconds = time_steps(trainer, warmup, steps)
    strategy = trainer.strategy
    variables = trainer.model.trainable_variables
    if hasattr(strategy, "state_bytes"):
        held = strategy.state_bytes()
    else:
        total = sum(v.numpy().nbytes for v in variables)
        held = {"parameters": total, "split_parameters": total, "replicated_parameters": 0}
    figures = {"rank": strategy.mesh.rank, "parameter_bytes": held, "step_seconds": step_seconds}
    with open(f"{out_path}.rank{strategy.mesh.rank}", "w") as f:
        json.dump(figures, f)
    strategy.shutdown()


def launch(args, tensor, root, dry=False):
    from tfbig import config as config_lib

    cfg = config_lib.ExperimentConfig()
    t = cfg.train
    name = f"tp{tensor}" + ("_dry" if dry else "")
    t.preset, t.num_layers, t.seq_length = args.preset, args.num_layers, args.seq_length
    t.strategy, t.batch_size, t.xla, t.model_dir = "horovod", args.batch_size, False, \
        os.path.join(root, name)
    t.max_steps, t.log_every, t.sample_tokens = 1000, 1000, 0
    cfg.parallel.tensor_parallel = tensor
    cfg.profile.monitor_interval_ms = 0
    config_path = os.path.join(root, f"{name}.json")
    with open(config_path, "w") as f:
        json.dump(config_lib.to_dict(cfg), f)
    out = os.path.join(root, f"{name}.out")
    command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", str(tensor),
               "-H", f"localhost:{tensor}", "--gloo", sys.executable, os.path.abspath(__file__),
               "--worker", config_path, out, str(args.warmup), str(args.steps), str(int(dry))]
    subprocess.run(command, check=True, env={**os.environ, **ENV}, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(f"{out}.rank0") as f:
        return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--seq_length", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=8, help="global batch (all degrees)")
    parser.add_argument("--degrees", default="1,2,4")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        config_path, out, warmup, steps, dry = args.worker
        return worker(config_path, out, int(warmup), int(steps), dry == "1")
    degrees = [int(d) for d in args.degrees.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for tensor in degrees:
            figures = launch(args, tensor, root)
            if tensor > 1:
                dry = launch(args, tensor, root, dry=True)["step_seconds"]
                figures["step_seconds_without_collectives"] = dry
                figures["communication_share"] = round(1 - dry / figures["step_seconds"], 3)
            results[f"tp{tensor}"] = figures
    base = results[f"tp{degrees[0]}"]
    full = base["parameter_bytes"]["parameters"]  # P: degree 1 holds the whole model
    for tensor in degrees:
        figures = results[f"tp{tensor}"]
        held = figures["parameter_bytes"]
        figures["step_time_vs_tp1"] = round(figures["step_seconds"] / base["step_seconds"], 3)
        figures["bytes_vs_p_over_t_plus_replicated"] = round(
            held["parameters"] / (full / tensor + held["replicated_parameters"]), 4)
        figures["bytes_vs_p_over_t"] = round(held["parameters"] / (full / tensor), 4)
    _record.emit({"benchmark": "tensor_parallel", "preset": args.preset,
                      "num_layers": args.num_layers, "seq_length": args.seq_length,
                      "batch_size": args.batch_size, "degrees": results,
                      "load_average": [round(x, 2) for x in os.getloadavg()]})


if __name__ == "__main__":
    main()
