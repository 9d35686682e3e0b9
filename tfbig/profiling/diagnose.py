"""Read a run's profile files and say what limits its speed, with evidence and advice.

Findings, most costly first:
  input-bound          input wait > 5% of step time (without the longest 2% of waits), or
                       utilisation swinging with high I/O wait
  communication-bound  gradient all-reduce > 15% of step time
  checkpoint-bound     saving checkpoints > 10% of step time
  memory-bound         host memory >= 90% used, swapping, or a GPU's memory >= 95% full
  compute-bound        none of the above: the device does the work (with its MFU)

Example:
    run = load_run("runs/gpt-small")
    for finding in diagnose(run):
        print(finding.kind, finding.evidence, finding.advice)
"""
import dataclasses
import json
import os
import statistics

from tfbig.profiling.profiler import PROFILE_DIR
from tfbig.profiling.timing import PHASES

INPUT_WAIT_LIMIT = 0.05
COMMUNICATION_LIMIT = 0.15
CHECKPOINT_LIMIT = 0.10
SWING_POINTS = 20.0  # std of utilisation (percentage points) that counts as swinging
HIGH_IOWAIT = 10.0  # mean I/O wait (%) that counts as high
MEMORY_LIMIT = 90.0
GPU_MEMORY_LIMIT = 0.95


@dataclasses.dataclass
class Run:
    """A run directory's profile: run.json, config.json, steps (warmup apart) and samples."""

    directory: str
    info: dict
    config: dict
    steps: list
    warmup: list
    samples: list


@dataclasses.dataclass
class Finding:
    kind: str
    share: float  # fraction of step time it accounts for (ordering)
    evidence: list
    advice: list


def _jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_run(directory):
    """The profile of run directory `directory` (written by tfbig.profiling.RunProfiler)."""
    profile = os.path.join(directory, PROFILE_DIR)
    if not os.path.exists(os.path.join(profile, "run.json")):
        raise FileNotFoundError(f"{profile}/run.json not found: {directory} is not a run "
                                f"directory of tfbig-train (or ran with an older tfbig)")
    with open(os.path.join(profile, "run.json")) as f:
        info = json.load(f)
    config = {}
    if os.path.exists(os.path.join(directory, "config.json")):
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
    records = _jsonl(os.path.join(profile, "steps.jsonl"))
    steps = [s for s in records if not s.get("warmup")]
    untraced = [s for s in steps if not s.get("traced")]
    return Run(directory, info, config, untraced or steps, [s for s in records if s.get("warmup")],
               _jsonl(os.path.join(profile, "system.jsonl")))


def _stats(values):
    values = list(values)
    if not values:
        return 0.0, 0.0
    return statistics.fmean(values), (statistics.pstdev(values) if len(values) > 1 else 0.0)


def _trimmed_input_share(steps):
    """Input wait share without the slowest 2% of waits: one scheduling hiccup on a shared
    machine is not a pipeline that cannot keep up; stalls every few steps still count."""
    drop = -(-len(steps) * 2 // 100)  # ceil(2%)
    kept = sorted(steps, key=lambda s: s["input"])[:max(len(steps) - drop, 1)]
    total = sum(s["total"] for s in kept)
    return (sum(s["input"] for s in kept) / total if total else 0.0), len(steps) - len(kept)


def summarize(run):
    """The numbers the diagnosis rests on."""
    total = sum(s["total"] for s in run.steps)
    shares = {p: (sum(s[p] for s in run.steps) / total if total else 0.0) for p in PHASES}
    steps = len(run.steps)
    input_trimmed, input_dropped = _trimmed_input_share(run.steps) if steps else (0.0, 0)
    tokens_per_sec = run.info["tokens_per_step"] * steps / total if total else 0.0
    peak = run.info.get("peak_flops_per_device")
    flops = run.info.get("flops_per_token")
    gpus = [g for s in run.samples for g in s.get("gpus", [])]
    utilisation = ([g["utilization_percent"] for g in gpus] if gpus
                   else [s["cpu_mean"] for s in run.samples])
    util_mean, util_std = _stats(utilisation)
    swap = [s.get("swap_used_percent", 0.0) for s in run.samples]
    return {
        "steps": steps, "step_ms": 1000.0 * total / steps if steps else 0.0,
        "shares": shares, "tokens_per_sec": tokens_per_sec,
        "input_share_trimmed": input_trimmed, "input_steps_dropped": input_dropped,
        "mfu": (flops * tokens_per_sec / (peak * run.info.get("num_devices", 1))
                if peak and flops else None),
        "device": "GPU" if gpus else "CPU", "util_mean": util_mean, "util_std": util_std,
        "iowait_mean": _stats(s["iowait_percent"] for s in run.samples)[0],
        "disk_read_mb_per_sec": _stats(s["disk_read_mb_per_sec"] for s in run.samples)[0],
        "memory_max": max((s["memory_used_percent"] for s in run.samples), default=0.0),
        "swap_growth": (max(swap) - min(swap)) if swap else 0.0,
        "gpu_memory_max": max((g["memory_used_mb"] / g["memory_total_mb"] for g in gpus),
                              default=0.0),
        "compile_seconds": sum(w["total"] for w in run.warmup),
        "samples": len(run.samples),
        "monitor_overhead": _monitor_overhead(run.samples),
    }


def _monitor_overhead(samples):
    if len(samples) < 2:
        return None
    elapsed = samples[-1]["time"] - samples[0]["time"]
    return samples[-1]["monitor_cpu_seconds"] / elapsed if elapsed > 0 else None


def _train(run, key, default=None):
    return run.config.get("train", {}).get(key, default)


def _input_finding(run, s):
    share = s["input_share_trimmed"]
    swinging = s["util_std"] > SWING_POINTS and s["iowait_mean"] > HIGH_IOWAIT
    if share <= INPUT_WAIT_LIMIT and not swinging:
        return None
    every = s["shares"]["input"]
    evidence = [f"waiting for input: {share:.1%} of step time without the "
                f"{s['input_steps_dropped']} longest wait(s), limit {INPUT_WAIT_LIMIT:.0%} "
                f"(all steps: {every:.1%}, {s['step_ms'] * every:.1f} of {s['step_ms']:.1f} ms "
                f"per step)",
                f"{s['device']} utilisation {s['util_mean']:.0f}% ± {s['util_std']:.0f} points, "
                f"I/O wait {s['iowait_mean']:.1f}%, disk reads "
                f"{s['disk_read_mb_per_sec']:.1f} MB/s"]
    advice = []
    if s["iowait_mean"] > HIGH_IOWAIT:
        advice.append("storage is slow: copy the shards to local SSD (or RAM disk) and read "
                      "more files in parallel — write more, smaller shards "
                      "(tfbig-prep --shard_size_mb) so tfbig.data interleaves more of them")
    if s["device"] == "GPU" and _stats(x["cpu_mean"] for x in run.samples)[0] > 85:
        advice.append("the CPU is saturated: move preprocessing offline into tfbig-prep "
                      "(--num_workers for more prep workers), run fewer processes per host, "
                      "or offload the pipeline with tf.data service")
    advice += ["prefetch more batches so the pipeline runs ahead of the step "
               "(tf.data prefetch on the training dataset)",
               "read more files in parallel (tfbig.data.MAX_PARALLEL_FILES) and prepare more "
               "shards than input pipelines",
               "a larger --batch_size per device makes each step longer relative to the cost "
               "of fetching its batch"]
    return Finding("input-bound", max(share, 0.05 if swinging else 0.0), evidence, advice)


def _communication_finding(run, s):
    share = s["shares"]["communication"]
    if share <= COMMUNICATION_LIMIT:
        return None
    strategy = _train(run, "strategy", "?")
    advice = [f"communicate less often: raise --grad_accum_steps (now "
              f"{_train(run, 'grad_accum_steps', 1)}) or the per-device batch "
              f"(--batch_size, now {_train(run, 'batch_size', '?')})"]
    if strategy == "horovod" and not run.config.get("horovod", {}).get("hvd_fp16_allreduce"):
        advice.append("halve the bytes on the wire: --hvd_fp16_allreduce (fp16 compression)")
    if strategy in ("multiworker", "mirrored"):
        advice.append("on GPUs use NCCL: --collective=nccl")
    advice.append("check the interconnect: same rack/switch, InfiniBand/NVLink over TCP")
    return Finding("communication-bound", share,
                   [f"gradient all-reduce: {share:.1%} of step time "
                    f"({s['step_ms'] * share:.1f} ms per step, --strategy={strategy})"], advice)


def _checkpoint_finding(run, s):
    share = s["shares"]["checkpoint"]
    if share <= CHECKPOINT_LIMIT:
        return None
    return Finding("checkpoint-bound", share,
                   [f"saving checkpoints: {share:.1%} of step time "
                    f"(--checkpoint_every={_train(run, 'checkpoint_every', '?')})"],
                   ["save less often: raise --checkpoint_every",
                    "write checkpoints to faster storage (local disk, then copy)"])


def _memory_finding(run, s):
    evidence = []
    if s["memory_max"] >= MEMORY_LIMIT:
        evidence.append(f"host memory up to {s['memory_max']:.0f}% used")
    if s["swap_growth"] > 1.0:
        evidence.append(f"swap use grew by {s['swap_growth']:.1f} points: the host is swapping")
    if s["gpu_memory_max"] >= GPU_MEMORY_LIMIT:
        evidence.append(f"GPU memory up to {s['gpu_memory_max']:.0%} full")
    if not evidence:
        return None
    advice = ["a smaller micro-batch with the same global batch: raise --grad_accum_steps",
              "mixed precision halves activation memory: --precision=mixed_bfloat16 "
              "(or mixed_float16 on V100)"]
    return Finding("memory-bound", 0.0, evidence, advice)


def _compute_finding(run, s):
    mfu = s["mfu"]
    evidence = [f"compute: {s['shares']['compute']:.1%} of step time; input wait "
                f"{s['shares']['input']:.1%}, communication {s['shares']['communication']:.1%}",
                f"{s['device']} utilisation {s['util_mean']:.0f}%"
                + (f", MFU {mfu:.1%} of {run.info.get('peak_source')}" if mfu is not None else "")]
    advice = []
    if not _train(run, "xla", True):
        advice.append("compile the step with XLA: --xla")
    if _train(run, "precision", "fp32") == "fp32" and s["device"] == "GPU":
        advice.append("mixed precision: --precision=mixed_bfloat16 (A100/H100) or "
                      "mixed_float16 (V100) for the tensor cores")
    if mfu is not None and mfu < 0.3:
        advice.append(f"MFU {mfu:.0%} is low: small matmuls waste the device — a larger "
                      f"per-device batch or sequence length gives it bigger blocks of work")
    advice.append("the device is the limit: add devices (data parallelism) to go faster")
    return Finding("compute-bound", s["shares"]["compute"], evidence, advice)


def diagnose(run, summary=None):
    """Findings for `run`, the one that costs most step time first; never empty with steps."""
    s = summary or summarize(run)
    if not s["steps"]:
        return []
    found = [f for f in (_input_finding(run, s), _communication_finding(run, s),
                         _checkpoint_finding(run, s)) if f]
    found.sort(key=lambda f: -f.share)
    memory = _memory_finding(run, s)
    found += [memory] if memory else []
    return found or [_compute_finding(run, s)]
