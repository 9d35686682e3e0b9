"""Candidate layouts for a model on a cluster, checked, estimated and ranked.

Every layout flag the user gives fixes that part; the rest is searched: tensor parallel within a
node (dividing the heads and the node's GPUs), pipeline stages dividing the layers (cut as
tfbig-train cuts them: FLOPs-balanced, tfbig.layouts.partition), data = GPUs / (T x K), ZeRO 0-3
over all data ranks or a node-sized partition group (MiCS), micro-batches dividing the per-replica
batch, with and without activation checkpointing, sequence parallel wherever T > 1, context
parallel C (2, 4, 8, where 2C divides the sequence) in the data ranks' place, and for an MoE
model expert parallel N (data ranks dividing its experts). A layout holding a pair tfbig-train
refuses (tfbig.layouts.composition) is never searched; where the fixed flags hold one (a
published layout to compare against), it is estimated and the report names the refusal.

Example:
    best = search(shape, cluster, precision="mixed_bfloat16", batch_size=512)[0]
"""
import dataclasses
import math

from tfbig.config import pipeline_stages
from tfbig.layouts import composition
from tfbig.plan import estimate, speed

DEFAULT_BATCH_TOKENS = 2 ** 20  # --batch_size=0: about a million tokens per step (GPT-3's 0.5-3.2M)
LAYOUT_FLAGS = ("tensor_parallel", "pipeline_stages", "num_microbatches", "zero_stage",
                "shard_degree", "activation_checkpointing", "sequence_parallel", "schedule",
                "context_parallel", "expert_parallel")


@dataclasses.dataclass
class Estimate:
    """One layout's figures (bytes, seconds, per-second rates)."""

    layout: estimate.Layout
    batch_size: int
    micro_batch: int
    memory: dict  # bytes per GPU by kind, on the busier pipeline stage
    memory_bytes: float
    fits: bool
    time: dict  # seconds per step by part
    step_seconds: float
    samples_per_sec: float
    tokens_per_sec: float
    tflops_per_gpu: float  # model FLOPs (no recomputation) per second per GPU / 1e12
    mfu: float
    days: float  # for the token budget
    gpu_hours: float
    peak_stage: int = 0  # the pipeline stage `memory` is of (the one holding the most)

    def to_dict(self):
        return {**dataclasses.asdict(self), "layout": {**dataclasses.asdict(self.layout),
                                                       "describe": self.layout.describe()},
                "refused": composition.refusal(self.layout.flags())}  # None: tfbig-train runs it


def layout_from_config(cfg):
    """The layout flags an ExperimentConfig (tfbig-train's flags) sets: the one place that knows
    which config section holds which field."""
    pipelined = cfg.train.strategy == "pipeline" or pipeline_stages(cfg) > 1
    return {"tensor_parallel": cfg.parallel.tensor_parallel,
            "context_parallel": cfg.parallel.context_parallel,
            "expert_parallel": cfg.parallel.expert_parallel,
            "sequence_parallel": cfg.parallel.sequence_parallel,
            "zero_stage": cfg.parallel.zero_stage, "shard_degree": cfg.parallel.shard_degree,
            "pipeline_stages": pipeline_stages(cfg),
            "num_microbatches": (cfg.pipeline.num_microbatches if pipelined
                                 else cfg.train.grad_accum_steps),
            "schedule": cfg.pipeline.schedule if pipelined else "1f1b",
            "activation_checkpointing": (cfg.pipeline.activation_checkpointing
                                         or cfg.parallel.zero_stage == 3)}  # implied by ZeRO 3


def evaluate(shape, layout, batch_size, precision, cluster, token_budget):
    """The Estimate of one valid layout."""
    micro_batch = batch_size // (layout.data * layout.num_microbatches)
    stage, worst = estimate.peak_stage_memory(shape, layout, micro_batch, precision,
                                              cluster.device)
    total = sum(worst.values())
    time = speed.step_time(shape, layout, micro_batch, precision, cluster)
    step = sum(time.values())
    tokens = batch_size * shape.seq_length / step
    tflops = shape.flops_per_token * tokens / layout.gpus / 1e12
    days = token_budget / tokens / 86400
    return Estimate(layout, batch_size, micro_batch, worst, total,
                    total <= cluster.device.memory_bytes, time, step, batch_size / step, tokens,
                    tflops, tflops * 1e12 / cluster.device.peak_flops, days,
                    days * 24 * layout.gpus, stage)


def _divisors(n):
    return [i for i in range(1, n + 1) if n % i == 0]


def tensor_degrees(shape):
    """The --tensor_parallel degrees a model splits by: divisors of its key/value heads, and
    multiples of them dividing the query heads (the key/value heads replicated)."""
    return [t for t in _divisors(shape.num_heads)
            if shape.kv_heads % t == 0 or t % shape.kv_heads == 0]


def check_layout(shape, fixed, cluster, batch_size):
    """Named errors for fixed flags that cannot divide the model, the cluster or the batch."""
    t, k = fixed.get("tensor_parallel"), fixed.get("pipeline_stages")
    if t is not None and t not in tensor_degrees(shape):
        kv = f", num_kv_heads={shape.kv_heads}" if shape.kv_heads != shape.num_heads else ""
        raise ValueError(f"--tensor_parallel={t} does not divide the model's "
                         f"num_heads={shape.num_heads}{kv}; choose one of "
                         f"{tensor_degrees(shape)}")
    if t and t > shape.kv_heads and fixed.get("sequence_parallel"):
        raise ValueError(f"--sequence_parallel with --tensor_parallel={t} above the model's "
                         f"num_kv_heads={shape.kv_heads} (replicated key/value heads): tfbig-train "
                         f"refuses the pair; drop one")
    if k is not None and (k < 1 or shape.num_layers % k):
        raise ValueError(f"--pipeline_stages={k} does not divide the model's "
                         f"num_layers={shape.num_layers}; choose one of "
                         f"{_divisors(shape.num_layers)}")
    if t and k and cluster.size % (t * k):
        raise ValueError(f"--tensor_parallel={t} x --pipeline_stages={k} = {t * k} GPUs per "
                         f"model copy does not divide the cluster's {cluster.size} GPUs")
    g = fixed.get("shard_degree")
    if t and k and g and (cluster.size // (t * k)) % g:
        d = cluster.size // (t * k)
        raise ValueError(f"--shard_degree={g} does not divide the {d} data-parallel replicas "
                         f"({cluster.size} GPUs / (--tensor_parallel={t} x "
                         f"--pipeline_stages={k})); choose one of {_divisors(d)}")
    if t and k and batch_size and fixed.get("num_microbatches"):
        d, m = cluster.size // (t * k), fixed["num_microbatches"]
        if batch_size % (d * m):
            raise ValueError(f"--batch_size={batch_size} is not divisible into {d} data-parallel "
                             f"replicas x --num_microbatches={m} = {d * m} equal micro-batches; "
                             f"use a multiple of {d * m}")
    c = fixed.get("context_parallel", 1)
    if c < 1 or shape.seq_length % (2 * c):
        raise ValueError(f"--context_parallel={c}: the sequence length {shape.seq_length} is "
                         f"not a multiple of 2 x {c} (each rank holds 2 of {2 * c} chunks)")
    _check_expert(shape, fixed)
    if fixed.get("zero_stage", 0) not in (0, 1, 2, 3):
        raise ValueError(f"--zero_stage={fixed['zero_stage']}: expected 0, 1, 2 or 3")
    if fixed.get("schedule", "1f1b") not in estimate.SCHEDULES:
        raise ValueError(f"--schedule={fixed['schedule']!r}: expected one of "
                         f"{list(estimate.SCHEDULES)}")


def _check_expert(shape, fixed):
    """Named errors for a fixed --expert_parallel the model or tfbig-train cannot run."""
    n = fixed.get("expert_parallel", 1)
    if n == 1:
        return
    if n < 1 or not shape.num_experts:
        raise ValueError(f"--expert_parallel={n}: " + (
            "expected a positive degree" if n < 1 else
            "the model has no MoE layers; choose an MoE preset (tiny-moe, mixtral-8x7b)"))
    if shape.num_experts % n:
        raise ValueError(f"--expert_parallel={n} does not divide the model's num_experts="
                         f"{shape.num_experts}; choose one of {_divisors(shape.num_experts)}")


def _expert_options(shape, fixed, d):
    """Expert-parallel degrees to try over d data ranks: N dividing both the data ranks and
    the experts (the pairs tfbig-train refuses are left out by `_allowed`)."""
    if "expert_parallel" in fixed:
        n = fixed["expert_parallel"]
        return [n] if n == 1 or d % n == 0 else []
    return [1] + ([n for n in _divisors(d) if n > 1 and shape.num_experts % n == 0]
                  if shape.num_experts else [])


def _options(fixed, name, searched):
    return [fixed[name]] if name in fixed else searched


def candidates(shape, cluster, fixed, batch_size):
    """(Layout, global batch) pairs allowed by the fixed flags."""
    node = cluster.gpus_per_node  # a tensor group is never split between nodes
    cuts = {}  # pipeline stages -> transformer layers per stage
    for t in _options(fixed, "tensor_parallel", [t for t in tensor_degrees(shape)
                                                 if node % t == 0]):
        for k in _options(fixed, "pipeline_stages", _divisors(shape.num_layers)):
            for c in _context_options(shape, fixed):
                if cluster.size % (t * k * c):
                    continue
                d = cluster.size // (t * k * c)
                batch = batch_size or d * math.ceil(DEFAULT_BATCH_TOKENS / shape.seq_length / d)
                if batch % d:
                    continue
                if k not in cuts:  # tfbig-train's FLOPs-balanced partition of the layers
                    cuts[k] = estimate.partition_layers(shape, k) if k > 1 else ()
                for layout, batch in _data_layouts(fixed, t, k, d, batch, cuts[k],
                                                   t <= shape.kv_heads):
                    layout = dataclasses.replace(layout, context=c)
                    for n in _expert_options(shape, fixed, d):
                        layout = dataclasses.replace(layout, expert=n)
                        if _allowed(layout, fixed):
                            yield layout, batch


def _allowed(layout, fixed):
    """Whether the search may plan `layout`: no pair tfbig-train refuses, unless the fixed
    flags hold that pair (then it is estimated as asked, and the report says it is refused)."""
    return all(name in fixed for first, second, _ in composition.pairs_in_use(layout.flags())
               for name in composition.flag_names(first) + composition.flag_names(second))


def _context_options(shape, fixed):
    """Context-parallel degrees to try: what tfbig-train runs (2C chunks dividing the
    sequence)."""
    if "context_parallel" in fixed:
        return [fixed["context_parallel"]]
    return [1] + [c for c in (2, 4, 8) if shape.seq_length % (2 * c) == 0]


def _data_layouts(fixed, t, k, d, batch, stage_layers, sequence=True):
    """`sequence`: sequence parallelism may run (not with replicated key/value heads)."""
    node_group = [g for g in _divisors(d) if 1 < g < d and g * t * k in (8, 16)]
    for z in _options(fixed, "zero_stage", [0, 1, 2, 3] if d > 1 else [0]):
        shard = _options(fixed, "shard_degree", [0] + node_group if z else [0])
        for g in shard:
            if g and d % g:
                continue
            for m in _options(fixed, "num_microbatches", _divisors(batch // d)):
                if (batch // d) % m:
                    continue
                for ckpt in _options(fixed, "activation_checkpointing", [False, True]):
                    if z == 3 and not ckpt:  # tfbig's ZeRO 3 recomputes every layer (zero3.py)
                        continue
                    yield estimate.Layout(
                        d, k, t, z, g if z else 0, m, ckpt,
                        fixed.get("sequence_parallel", t > 1 and sequence),
                        fixed.get("schedule", "1f1b"), stage_layers), batch


def search(shape, cluster, precision, batch_size=0, token_budget=300e9, fixed=None):
    """Estimates of every allowed layout, best first: those that fit, fastest first (to 3
    digits), then fewer micro-batches (larger matmuls run closer to peak), then less memory."""
    fixed = fixed or {}
    check_layout(shape, fixed, cluster, batch_size)
    found = [evaluate(shape, layout, batch, precision, cluster, token_budget)
             for layout, batch in candidates(shape, cluster, fixed, batch_size)]
    if not found:
        raise ValueError(f"no layout of {cluster.size} GPUs matches the given flags "
                         f"{fixed or ''} with --batch_size={batch_size}: every data-parallel "
                         f"degree must divide the batch into equal micro-batches")
    return sorted(found, key=lambda e: (not e.fits, -float(f"{e.samples_per_sec:.3g}"),
                                        e.layout.num_microbatches, e.memory_bytes))
