"""The measured bubble of the cross-rank pipeline (`--strategy=horovod --pipeline_stages=K`)
against the schedule's (K - 1) / (M + K - 1), for several numbers of micro-batches M.

    python benchmarks/pipeline_cross_rank.py          # K=2 ranks, M=4 and 8, 1F1B
    python benchmarks/pipeline_cross_rank.py --tensor_parallel=2   # each stage on 2 ranks

One `horovodrun -np K --gloo` launch (one data-parallel replica, one thread per rank, no XLA)
times every micro-batch count in turn (with --tensor_parallel=T, K x T ranks: each stage split
over T, its tensor collectives inside its ops' busy time). Each rank records the wall-clock
[start, end] of each of its forward and backward ops inside the step (tf.timestamp around
them; the ranks share this host's clock). Per step, the window is first start to last end over
all ranks; a rank's idle share is 1 - (its busy time) / window, the measured bubble the mean
over ranks (median step).
`timeline_bubble` is what the schedule's timeline gives with each stage's measured forward and
backward times and free communication: the gap between it and the measured bubble is the
exchange's cost (and, on a busy 2-core machine, the ranks' waits for a core). One JSON line,
with the load average and the CPU model.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Dynamic process sets: each micro-batch count builds its own strategy (with --tensor_parallel
# its tensor and pipeline groups are sets below the world) in the one launch.
ENV = {"TF_NUM_INTRAOP_THREADS": "1", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
       "PYTHONPATH": ROOT, "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}


def worker(plan_path, warmup, steps):
    """One rank: for each config of the plan, time `steps` steps after `warmup`."""
    import horovod.tensorflow as hvd

    from tfbig import config as config_lib
    from tfbig.training.trainer import Trainer

    with open(plan_path) as f:
        plan = json.load(f)
    for entry in plan:
        trainer = Trainer(config_lib.from_dict(entry["config"]))
        strategy = trainer.strategy
        step = strategy.make_timed_forward_backward(trainer.model.trainable_variables,
                                                    trainer._scale_loss)
        batches = trainer._train_iterator()
        stamps = []
        for i in range(warmup + steps):
            loss, _, _, times = step(next(batches))
            if i >= warmup:
                stamps.append(times.numpy().tolist())
        kinds = [op.kind for op in strategy.ops]
        with open(f"{entry['out']}.rank{hvd.rank()}", "w") as f:
            json.dump({"stage": strategy.stage_index, "kinds": kinds, "stamps": stamps}, f)
    hvd.join()
    hvd.shutdown()


def bubble(ranks, schedule, num_stages, num_micro):
    """(measured bubble, timeline bubble from the measured op times) of the median step."""
    from tfbig.pipeline import schedules

    measured = []
    forward, backward = [[] for _ in range(num_stages)], [[] for _ in range(num_stages)]
    for step in range(len(ranks[0]["stamps"])):
        ops = [r["stamps"][step] for r in ranks]
        window = max(e for rank in ops for _, e in rank) - min(s for rank in ops for s, _ in rank)
        busy = [sum(e - s for s, e in rank) for rank in ops]
        measured.append(statistics.mean(1 - b / window for b in busy))
        for r, rank in enumerate(ranks):
            for kind, (s, e) in zip(rank["kinds"], ops[r]):
                (forward if kind == "F" else backward)[rank["stage"]].append(e - s)
    fwd = [statistics.median(t) for t in forward]
    bwd = [statistics.median(t) for t in backward]
    ops = schedules.get_schedule(schedule)(num_stages, num_micro)
    span = schedules.makespan(ops, fwd, bwd)
    busy = [num_micro * (f + b) for f, b in zip(fwd, bwd)]
    return statistics.median(measured), statistics.mean(1 - b / span for b in busy), fwd, bwd


def config_for(args, num_micro, root):
    from tfbig import config as config_lib

    cfg = config_lib.ExperimentConfig()
    t = cfg.train
    t.preset, t.num_layers, t.hidden_size, t.num_heads = "tiny", args.num_layers, \
        args.hidden_size, 4
    t.seq_length, t.strategy, t.xla, t.dropout = args.seq_length, "horovod", False, 0.0
    t.batch_size = args.micro_batch * num_micro
    t.max_steps, t.log_every, t.sample_tokens, t.eval_steps = 1000, 1000, 0, 1
    t.model_dir = os.path.join(root, f"m{num_micro}")
    cfg.pipeline.pipeline_stages, cfg.pipeline.num_microbatches = args.stages, num_micro
    cfg.pipeline.schedule = args.schedule
    cfg.parallel.tensor_parallel = args.tensor_parallel
    cfg.profile.monitor_interval_ms = 0
    return config_lib.to_dict(cfg)


def cpu_model():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", default="4,8")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--tensor_parallel", type=int, default=1, help="ranks per stage")
    parser.add_argument("--micro_batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq_length", type=int, default=64)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
    counts = [int(m) for m in args.microbatches.split(",")]
    results = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as root:
        plan = [{"config": config_for(args, m, root), "out": os.path.join(root, f"m{m}")}
                for m in counts]
        with open(os.path.join(root, "plan.json"), "w") as f:
            json.dump(plan, f)
        k, world = args.stages, args.stages * args.tensor_parallel
        command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np",
                   str(world), "-H", f"localhost:{world}", "--gloo", sys.executable,
                   os.path.abspath(__file__), "--worker", os.path.join(root, "plan.json"),
                   str(args.warmup), str(args.steps)]
        done = subprocess.run(command, env={**os.environ, **ENV}, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if done.returncode:
            sys.exit(f"the horovodrun launch failed:\n{done.stdout[-12000:]}")
        for m, entry in zip(counts, plan):
            ranks = []
            for r in range(world):
                with open(f"{entry['out']}.rank{r}") as f:
                    ranks.append(json.load(f))
            if os.environ.get("BENCH_RAW"):
                print(json.dumps(ranks), file=sys.stderr)
            measured, timeline, fwd, bwd = bubble(ranks, args.schedule, k, m)
            theory = (k - 1) / (m + k - 1)
            results[f"m{m}"] = {
                "measured_bubble": round(measured, 3), "theory_bubble": round(theory, 3),
                "timeline_bubble": round(timeline, 3),
                "measured_vs_theory": round(measured / theory, 3),
                "forward_ms_per_stage": [round(1e3 * t, 2) for t in fwd],
                "backward_ms_per_stage": [round(1e3 * t, 2) for t in bwd]}
    _record.emit({"benchmark": "pipeline_cross_rank", "stages": args.stages,
                      "tensor_parallel": args.tensor_parallel,
                      "schedule": args.schedule, "micro_batch": args.micro_batch,
                      "seq_length": args.seq_length, "hidden_size": args.hidden_size,
                      "num_layers": args.num_layers, "results": results,
                      "load_average": [round(x, 2) for x in os.getloadavg()],
                      "cpu_model": cpu_model()})


if __name__ == "__main__":
    main()
