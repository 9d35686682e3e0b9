"""Expert parallelism's step time, all-to-all share and per-rank bytes (`--expert_parallel=2`)
against one process holding every expert, at one fixed global batch.

    python benchmarks/moe.py          # MoE Llama: 4 experts, top-2, hidden 128, 2 layers, seq 64

Three runs: one process (`--strategy=single`, every expert), EP2 (`horovodrun -np 2 --gloo`,
--expert_parallel=2: each rank half the experts and half the batch) and EP2 with the
all-to-alls replaced by local identities (wrong routing, the same expert compute: the "dry" run).
all-to-all share = 1 - dry / EP2 (wall seconds). Each also reports its CPU seconds per step
(rank 0's for EP2), less sensitive to other load than wall time. Bytes: the expert and
replicated parameter bytes rank 0 holds, against the planner's per-rank figure
(tfbig.plan.estimate, parameters of Layout(data=2, expert=2)). A fourth run, EP2 with
--zero_stage=1, reports its step time against EP2's and the parameter and optimizer-state bytes
rank 0 holds (parameters, the replicated weights' master slices, every Adam slot) against the
planner's (tfbig.plan.estimate.memory: parameters + optimizer); a fifth, EP2 with
--zero_stage=3, the same (its replicated weights held only as their slices). One-thread
processes, no XLA (MoE layers run without it). One JSON line with the load average; on a 2-core
machine the two ranks share the cores with anything else running.
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


def _local_alltoall(tensor, splits=None, process_set=None):
    """The dry run's all-to-all: every row stays (same shapes and compute, no messages)."""
    import tensorflow as tf

    return tensor if splits is None else (tensor, tf.cast(splits, tf.int32))


def worker(config_path, out_path, warmup, steps, dry):
    """One rank (or the single process): time `steps` steps after `warmup`, write figures."""
    import time

    from tfbig import config as config_lib
    from _timing import time_steps
    from tfbig.training.trainer import Trainer

    if dry:
        from tfbig.distribute import expert_parallel

        class DryHorovod:
            def __getattr__(self, name):
                return getattr(expert_parallel.hvd, name)

            alltoall = staticmethod(_local_alltoall)

        expert_parallel.hvd = DryHorovod()
    with open(config_path) as f:
        trainer = Trainer(config_lib.from_dict(json.load(f)))
    time_steps(trainer, warmup, 1)  # tracing and the first steps, outside both clocks
    cpu = time.process_time()
    step_seconds = time_steps(trainer, 0, steps)
    cpu_seconds = (time.process_time() - cpu) / steps  # this process's CPU per timed step
    strategy = trainer.strategy
    if hasattr(strategy, "state_bytes"):
        held = strategy.state_bytes()
    else:
        total = sum(v.numpy().nbytes for v in trainer.model.trainable_variables)
        held = {"parameters": total}
    rank = getattr(getattr(strategy, "mesh", None), "rank", 0)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"parameter_bytes": held, "step_seconds": step_seconds,
                   "cpu_seconds": cpu_seconds}, f)
    if hasattr(strategy, "mesh"):
        strategy.shutdown()


def launch(args, root, ranks, dry=False, zero_stage=0):
    from tfbig import config as config_lib

    cfg = config_lib.ExperimentConfig()
    t = cfg.train
    name = f"ep{ranks}" + ("_dry" if dry else "") + (f"_zero{zero_stage}" if zero_stage else "")
    t.model, t.preset, t.hidden_size, t.num_layers = "llama", "tiny-moe", args.hidden_size, 2
    t.num_heads, t.seq_length, t.batch_size, t.xla = 4, args.seq_length, args.batch_size, False
    t.model_dir, t.max_steps, t.log_every, t.sample_tokens = os.path.join(root, name), 1000, \
        1000, 0
    t.strategy = "horovod" if ranks > 1 else "single"
    cfg.parallel.expert_parallel, cfg.parallel.zero_stage = ranks, zero_stage
    cfg.profile.monitor_interval_ms = 0
    config_path = os.path.join(root, f"{name}.json")
    with open(config_path, "w") as f:
        json.dump(config_lib.to_dict(cfg), f)
    out = os.path.join(root, f"{name}.out")
    command = [sys.executable, os.path.abspath(__file__), "--worker", config_path, out,
               str(args.warmup), str(args.steps), str(int(dry))]
    if ranks > 1:
        command = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np",
                   str(ranks), "-H", f"localhost:{ranks}", "--gloo", *command]
    subprocess.run(command, check=True, env={**os.environ, **ENV}, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(f"{out}.rank0") as f:
        return json.load(f), cfg


def planned_parameter_bytes(cfg, seq_length):
    """The planner's parameter bytes per rank of an EP2 x DP2... here: data 2, expert 2."""
    from tfbig.models import shapes
    from tfbig.models.llama_config import LlamaConfig
    from tfbig.plan import estimate
    from tfbig.tasks.gpt import DEFAULT_VOCAB_SIZE

    t = cfg.train
    config = LlamaConfig.from_preset(t.preset, hidden_size=t.hidden_size, num_layers=2,
                                     num_heads=4, intermediate_size=0, moe_intermediate_size=0,
                                     vocab_size=DEFAULT_VOCAB_SIZE)
    shape = shapes.shape_of(config, "llama", seq_length)
    return 4 * estimate.stage_params(shape, estimate.Layout(data=2, expert=2))


def planned_zero_state_bytes(cfg, seq_length, stage):
    """The planner's parameter and optimizer-state bytes per rank of EP2 x ZeRO-`stage` on 2
    ranks (stage 1: the replicated weights' master slices and moments over 2; stage 3: their
    weights and moments over 2, no master copy; the experts' weights and moments whole)."""
    from tfbig.models import shapes
    from tfbig.models.llama_config import LlamaConfig
    from tfbig.plan import estimate, hardware
    from tfbig.tasks.gpt import DEFAULT_VOCAB_SIZE

    t = cfg.train
    config = LlamaConfig.from_preset(t.preset, hidden_size=t.hidden_size, num_layers=2,
                                     num_heads=4, intermediate_size=0, moe_intermediate_size=0,
                                     vocab_size=DEFAULT_VOCAB_SIZE)
    shape = shapes.shape_of(config, "llama", seq_length)
    device = hardware.Device("memory", 1.0, 0.0, 1.0, 1.0, 1.0, 0.0)
    held = estimate.memory(shape, estimate.Layout(data=2, expert=2, zero_stage=stage),
                           t.batch_size // 2, "fp32", device)
    return held["parameters"] + held["optimizer"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--seq_length", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=8, help="global batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        config_path, out, warmup, steps, dry = args.worker
        return worker(config_path, out, int(warmup), int(steps), dry == "1")
    with tempfile.TemporaryDirectory() as root:
        single, _ = launch(args, root, 1)
        ep2, cfg = launch(args, root, 2)
        dry, _ = launch(args, root, 2, dry=True)
        zero1, _ = launch(args, root, 2, zero_stage=1)
        zero3, _ = launch(args, root, 2, zero_stage=3)
    held = ep2["parameter_bytes"]
    planned = planned_parameter_bytes(cfg, args.seq_length)
    # EP2 x ZeRO-1: the replicated weights' optimizer state sliced over the 2 ranks; ZeRO-3:
    # the replicated weights themselves sliced (their only copy), gathered block by block
    zero = {}
    for stage, run in ((1, zero1), (3, zero3)):
        state = run["parameter_bytes"]
        held_state = state["parameters"] + state["master_slices"] + state["optimizer_slots"]
        plan = planned_zero_state_bytes(cfg, args.seq_length, stage)
        zero.update({
            f"ep2_zero{stage}_step_seconds": round(run["step_seconds"], 4),
            f"ep2_zero{stage}_step_time_vs_ep2": round(run["step_seconds"]
                                                       / ep2["step_seconds"], 3),
            f"ep2_zero{stage}_rank0_cpu_seconds": round(run["cpu_seconds"], 4),
            f"ep2_zero{stage}_state_bytes": state,
            f"ep2_zero{stage}_planned_state_bytes": int(plan),
            f"ep2_zero{stage}_state_vs_plan": round(held_state / plan, 4)})
    _record.emit({
        "benchmark": "moe", "hidden_size": args.hidden_size, "num_layers": 2, "num_experts": 4,
        "experts_per_token": 2, "seq_length": args.seq_length, "batch_size": args.batch_size,
        "single_step_seconds": round(single["step_seconds"], 4),
        "ep2_step_seconds": round(ep2["step_seconds"], 4),
        "ep2_step_time_vs_single": round(ep2["step_seconds"] / single["step_seconds"], 3),
        "ep2_step_seconds_without_all_to_all": round(dry["step_seconds"], 4),
        "all_to_all_share": round(1 - dry["step_seconds"] / ep2["step_seconds"], 3),
        # CPU seconds per step of the single process and of EP2's rank 0 (robust to other
        # processes taking the cores; the all-to-all's waits are not CPU time)
        "single_cpu_seconds": round(single["cpu_seconds"], 4),
        "ep2_rank0_cpu_seconds": round(ep2["cpu_seconds"], 4),
        "ep2_rank0_cpu_seconds_without_all_to_all": round(dry["cpu_seconds"], 4),
        "single_parameter_bytes": single["parameter_bytes"]["parameters"],
        "ep2_parameter_bytes": held, "ep2_planned_parameter_bytes": int(planned),
        "ep2_bytes_vs_plan": round(held["parameters"] / planned, 4),
        **zero,
        "load_average": [round(x, 2) for x in os.getloadavg()]})


if __name__ == "__main__":
    main()
