"""Per-rank model state, peak RSS and step time of plain Horovod data parallelism vs ZeRO stages
1-3 at shard degrees 2 and 4, and of the compositions TP2 x ZeRO-3 and CP2 x ZeRO-3 against
their parts alone (TP2, CP2: each x DP2), PP2 x ZeRO-1 against PP2 (x DP2) and CP2 x PP2, on
4 ranks, for a GPT of over 100M parameters.

    python benchmarks/sharded_memory.py            # 125m-wide GPT (14 layers), seq 64
    python benchmarks/sharded_memory.py --layouts=tp2,tp2_zero3_d2,cp2,cp2_zero3_d2
    python benchmarks/sharded_memory.py --layouts=pp2,pp2_zero1_d2,cp2_pp2 --num_layers=4

Each layout is its own `horovodrun -np 4 --gloo` launch (so each process's peak RSS is its
own layout's). Every rank reports the bytes of the model state it holds: parameters, master
slices and optimizer slots (the values its variables hold: a stage-3 model variable holds
none), peak RSS right after building the trainer (stage 3: delayed initialisation, no full
model is ever made), at the end (getrusage) and during the timed steps only (Linux's VmHWM
reset after the warm-up: tracing excluded), the mean and the longest step time over --steps
steps after --warmup (the longest over all ranks: a stalled step shows there instead of only
inflating the mean), and the highest peak RSS over the ranks. With --tensor_bytes the ranks
allocate through TensorFlow's BFC allocator and also report the peak bytes of live tensors
during the timed steps (a figure malloc's pooling does not blur). One JSON line: per layout,
rank 0's figures, the closed form beside the measured bytes (stages 1-2: 4P + 12S, stage 3:
12S, plain DP: 12P; S = sum of ceil(n / N) per variable; gradients are transient tensors, not
counted; P and S of the rank's own variables: a tensor rank's slices), tfbig-plan's figure
for the same layout (plan_state: parameters + optimizer state of tfbig.plan.estimate, from the
model's shape) and the measured state over it (state_vs_plan), the full single-process state
16P for the RSS comparison, step time relative to
plain DP measured in the same run, the load average and the CPU model. One-thread processes,
no XLA (the ZeRO collectives sit between TF ops; see tfbig/distribute/zero.py). The launches
get a Gloo timeout of --gloo_timeout_seconds (300 s; horovodrun's 30 s default kills runs
whose large messages stall on loopback TCP, see docs/guides/scale-out.md, ZeRO). A layout whose launch fails
stops the run with the last lines of its ranks' output (Horovod/Gloo errors included);
without `dp` in --layouts there is no step_time_vs_dp.

    python benchmarks/sharded_memory.py --hidden_size=512 --num_layers=8 --layouts=dp,zero3_d2
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import argparse
import dataclasses
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# name: (zero stage, shard degree, tensor parallel, context parallel, pipeline stages)
LAYOUTS = {"dp": (0, 0, 1, 1, 1), "zero1_d2": (1, 2, 1, 1, 1), "zero1_d4": (1, 4, 1, 1, 1),
           "zero2_d2": (2, 2, 1, 1, 1), "zero2_d4": (2, 4, 1, 1, 1), "zero3_d2": (3, 2, 1, 1, 1),
           "zero3_d4": (3, 4, 1, 1, 1),
           # the compositions against their parts alone: TP2 x DP2, CP2 x DP2 and PP2 x DP2
           # (stages on ranks, 1F1B), without ZeRO and with ZeRO-3 (ZeRO-1 with the stages)
           # over the 2 data ranks; CP2 x PP2 (no data parallelism)
           "tp2": (0, 0, 2, 1, 1), "tp2_zero3_d2": (3, 2, 2, 1, 1), "cp2": (0, 0, 1, 2, 1),
           "cp2_zero3_d2": (3, 2, 1, 2, 1), "pp2": (0, 0, 1, 1, 2),
           "pp2_zero1_d2": (1, 2, 1, 1, 2), "cp2_pp2": (0, 0, 1, 2, 2)}
ENV = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "OMP_NUM_THREADS": "1",
       "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}
LOG_TAIL = 60  # lines of a failed launch's output printed


def worker(config_path, out_path, warmup, steps):
    """One rank: build the trainer, time `steps` steps after `warmup`, write its figures."""
    import tensorflow as tf

    from tfbig import config as config_lib
    from tfbig.training.trainer import Trainer

    with open(config_path) as f:
        trainer = Trainer(config_lib.from_dict(json.load(f)))
    rss_after_init = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step_times, rss_steps = timed_steps(trainer, warmup, steps)
    strategy = trainer.strategy
    variables = trainer.model.trainable_variables  # a tensor rank's: its slices
    nbytes = lambda vs: sum(math.prod(v.shape) * 4 for v in vs)  # noqa: E731 - all float32
    stage = getattr(strategy, "stage", 0)
    if stage:  # ZeRO (under TP or CP too): the values its variables hold
        state = strategy.state_bytes()
        slices = sum(math.ceil(math.prod(v.shape) / strategy.num_shards) for v in variables)
    else:
        state = {"parameters": nbytes(variables), "optimizer_slots": 2 * nbytes(variables)}
        slices = 0
    params = sum(math.prod(v.shape) for v in variables)
    closed = {0: 12 * params, 3: 12 * slices}.get(stage, 4 * params + 12 * slices)
    figures = {"rank": strategy.mesh.rank, "params": params, "state_bytes": state,
               "model_config": dataclasses.asdict(trainer.task.model_config),
               "state_total": sum(state.values()), "closed_form": closed,
               "full_state_16p": 16 * params, "peak_rss_after_init_bytes": rss_after_init,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "peak_rss_steps_bytes": rss_steps, "step_seconds": sum(step_times) / steps,
               "max_step_seconds": max(step_times)}
    if tensor_bytes():
        figures["tensor_peak_steps_bytes"] = tf.config.experimental.get_memory_info(
            "CPU:0")["peak"]
    with open(f"{out_path}.rank{strategy.mesh.rank}", "w") as f:
        json.dump(figures, f)
    strategy.shutdown()


def timed_steps(trainer, warmup, steps):
    """Wall seconds of each of `steps` steps after `warmup` (input included, each step's loss
    read back), and the peak RSS while they ran: Linux's high-water mark is reset after the
    warm-up (/proc/self/clear_refs), so the tracing of the first step is not counted."""
    import tensorflow as tf

    batches = trainer._train_iterator()
    for _ in range(warmup):
        trainer._train_step(next(batches))["loss"].numpy()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if tensor_bytes():
        tf.config.experimental.reset_memory_stats("CPU:0")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer._train_step(next(batches))["loss"].numpy()
        times.append(time.perf_counter() - start)
    return times, vm_hwm()


def tensor_bytes():
    """Whether TensorFlow's CPU tensors come from its BFC allocator (--tensor_bytes), which
    counts the bytes they hold (get_memory_info)."""
    return os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "true"


def vm_hwm():
    """This process's peak resident bytes since the last reset (/proc/self/status VmHWM)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def launch(args, name, stage, degree, tensor, context, stages, root):
    from tfbig import config as config_lib

    cfg = config_lib.ExperimentConfig()
    t = cfg.train
    t.preset, t.num_layers, t.seq_length = args.preset, args.num_layers, args.seq_length
    if args.hidden_size:  # heads of width 64, as the GPT-3 presets
        t.hidden_size, t.num_heads = args.hidden_size, max(1, args.hidden_size // 64)
    t.strategy, t.batch_size, t.xla, t.model_dir = "horovod", 4 * args.per_rank_batch, False, \
        os.path.join(root, name)
    t.max_steps, t.log_every, t.sample_tokens = 1000, 1000, 0
    cfg.parallel.zero_stage, cfg.parallel.shard_degree = stage, degree
    cfg.parallel.tensor_parallel, cfg.parallel.context_parallel = tensor, context
    if stages > 1:  # stages on ranks: rank 0 holds stage 0 (the embedding and first blocks)
        cfg.pipeline.pipeline_stages, cfg.pipeline.schedule = stages, "1f1b"
    cfg.profile.monitor_interval_ms = 0
    config_path = os.path.join(root, f"{name}.json")
    with open(config_path, "w") as f:
        json.dump(config_lib.to_dict(cfg), f)
    out = os.path.join(root, f"{name}.out")
    command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "4", "-H",
               "localhost:4", "--gloo", "--gloo-timeout-seconds", str(args.gloo_timeout_seconds),
               sys.executable, os.path.abspath(__file__), "--worker", config_path, out,
               str(args.warmup), str(args.steps)]
    log = os.path.join(root, f"{name}.log")
    env = {**os.environ, **ENV}
    if args.tensor_bytes:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    with open(log, "w") as f:
        code = subprocess.run(command, env=env, cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT).returncode
    if code:  # the ranks' own errors (e.g. a Gloo timeout), before the directory goes away
        with open(log) as f:
            tail = f.read().splitlines()[-LOG_TAIL:]
        raise SystemExit(f"layout {name} failed (horovodrun exit {code}); last {len(tail)} "
                         f"lines of its output:\n" + "\n".join(tail))
    ranks = []
    for rank in range(4):
        with open(f"{out}.rank{rank}") as f:
            ranks.append(json.load(f))
    figures = ranks[0]  # rank 0's, with the worst step and peak over the ranks
    figures["max_step_seconds"] = max(r["max_step_seconds"] for r in ranks)
    figures["peak_rss_bytes_max_rank"] = max(r["peak_rss_bytes"] for r in ranks)
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--num_layers", type=int, default=14, help="14: over 100M parameters "
                        "with the embedded corpus' 8000-token vocabulary")
    parser.add_argument("--hidden_size", type=int, default=0,
                        help="override the preset's width (0 keeps it; heads of 64)")
    parser.add_argument("--seq_length", type=int, default=64)
    parser.add_argument("--per_rank_batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="comma-separated subset of " + ",".join(LAYOUTS) + " (step_time_vs_dp "
                        "needs dp among them)")
    parser.add_argument("--gloo_timeout_seconds", "--gloo-timeout-seconds", type=int,
                        default=300, help="horovodrun's Gloo timeout (its default, 30 s, ends "
                        "a run when a large message stalls on loopback TCP; see docs/guides/scale-out.md, ZeRO)")
    parser.add_argument("--tensor_bytes", action="store_true",
                        help="ranks allocate tensors with TensorFlow's BFC allocator and report "
                        "the peak bytes of live tensors during the timed steps "
                        "(tensor_peak_steps_bytes); their RSS then includes its pooling")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        config_path, out, warmup, steps = args.worker
        return worker(config_path, out, int(warmup), int(steps))
    with tempfile.TemporaryDirectory() as root:
        results = {name: launch(args, name, *LAYOUTS[name], root)
                   for name in args.layouts.split(",")}
    dp = results["dp"]["step_seconds"] if "dp" in results else None
    for figures in results.values():
        if dp:  # a subset without dp (e.g. --layouts=zero3_d2) reports no ratio
            figures["step_time_vs_dp"] = round(figures["step_seconds"] / dp, 3)
        figures["state_vs_closed_form"] = round(figures["state_total"] /
                                                figures["closed_form"], 4)
    for name, figures in results.items():
        figures["plan_state"] = plan_state(figures.pop("model_config"), args.seq_length,
                                           *LAYOUTS[name])
        figures["state_vs_plan"] = round(figures["state_total"] / figures["plan_state"], 4)
    _record.emit({"benchmark": "sharded_memory", "ranks": 4, "preset": args.preset,
                      "num_layers": args.num_layers, "hidden_size": args.hidden_size or None,
                      "seq_length": args.seq_length,
                      "layouts": results, "load_average": [round(x, 2) for x in
                                                           os.getloadavg()],
                      "cpu": cpu_model()})


def plan_state(model_config, seq_length, stage, degree, tensor, context, stages):
    """tfbig-plan's bytes of parameters and optimizer state per rank for this layout on 4
    ranks (tfbig.plan.estimate.state_memory; gradients are transient, not counted; with
    stages, the first stage's, as rank 0 holds it)."""
    from tfbig.models import shapes
    from tfbig.plan import estimate

    config_class, _ = shapes.load_configs("gpt")
    shape = shapes.shape_of(config_class(**model_config), "gpt", seq_length)
    data = 4 // (tensor * context * stages)
    layout = estimate.Layout(data=data, tensor=tensor, context=context, pipeline=stages,
                             zero_stage=stage, shard_degree=degree if stage else 0)
    state = estimate.state_memory(estimate.stage_params(shape, layout), layout)
    return round(state["parameters"] + state["optimizer"])


def cpu_model():
    """`lscpu`'s model name (the figures differ between machines of the same size)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown")


if __name__ == "__main__":
    main()
