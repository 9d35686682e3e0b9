"""The plan as text (the recommendation, then a table of the best layouts) or as JSON."""
import json

from tfbig.layouts import composition
from tfbig.plan import speed
from tfbig.plan.hardware import GB

PARTS = ("parameters", "gradients", "optimizer", "activations", "communication", "reserve")
TIME_PARTS = ("compute", "elementwise", "tensor", "context", "expert", "pipeline", "data",
              "update")


def _human(n, giga="B"):
    """1.3B parameters, 95.3k tokens/s; giga="G" for 82.1 GFLOP."""
    for scale, suffix in ((1e12, "T"), (1e9, giga), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return f"{n:.0f}"


def _days(days):
    return f"{days:,.0f}" if days >= 100 else f"{days:.3g}"


def header(shape, cluster, precision, token_budget):
    d = cluster.device
    network = (f", inter-node {cluster.internode_bandwidth * 8 / 1e9:g} Gb/s per node"
               if cluster.nodes > 1 else "")
    moe = (f" ({_human(shape.active_params)} active: {shape.experts_per_token} of "
           f"{shape.num_experts} experts per token; FLOPs and MFU count the active ones)"
           if shape.num_experts else "")
    return [f"model: {shape.family.upper()} {shape.num_layers} layers x {shape.hidden_size} "
            f"({shape.num_heads} heads), {_human(shape.params)} parameters{moe}, "
            f"{_human(shape.flops_per_token, 'G')} FLOP per token at seq {shape.seq_length}, "
            f"{precision}, budget {_human(token_budget)} tokens",
            f"cluster: {cluster.nodes} x {cluster.gpus_per_node} {d.name} "
            f"({d.memory_bytes / GB:.0f} GB, {d.peak_flops / 1e12:.4g} TFLOP/s peak, "
            f"links {d.local_bandwidth / GB:.3g} GB/s{network})"]


def _stage_layers(counts):
    """6/6/7/5, or in runs for many stages: 2 x 95, 1."""
    if len(counts) <= 8:
        return "/".join(map(str, counts))
    runs = []
    for n in counts:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ", ".join(f"{n} x {r}" if r > 1 else f"{n}" for n, r in runs)


def _experts(shape, e, precision):
    """The expert all-to-alls of an MoE layout: bytes per exchange and time per layer."""
    if e.layout.expert == 1 or not shape.num_experts:
        return []
    sent = speed.expert_exchange_bytes(shape, e.layout, e.micro_batch, precision)
    per_layer = e.time["expert"] / (e.layout.num_microbatches * shape.num_layers)
    return [f"  experts over {e.layout.expert} ranks: {sent / 1e6:.3g} MB of rows per rank in "
            f"each all-to-all, {speed.expert_exchanges(e.layout)} per MoE layer and micro-batch, "
            f"{per_layer * 1e3:.3g} ms per layer and micro-batch"]


def describe_estimate(e, memory_limit, shape, precision):
    mem = ", ".join(f"{k} {e.memory[k] / GB:.2f}" for k in PARTS)
    time = ", ".join(f"{k} {e.time[k]:.3g}" for k in TIME_PARTS)
    stages = ([f"  stages: {_stage_layers(e.layout.stage_layers)} transformer layers "
               f"(tfbig-train's FLOPs-balanced cut); memory below is stage {e.peak_stage}'s, "
               f"the fullest"] if e.layout.pipeline > 1 else [])
    return [f"  batch {e.batch_size} = {e.layout.data} replicas x {e.layout.num_microbatches} "
            f"micro-batches x {e.micro_batch} sequences"] + stages + [
            f"  memory per GPU {e.memory_bytes / GB:.2f} GB of {memory_limit / GB:.0f} "
            f"({'fits' if e.fits else 'does NOT fit'}): {mem}",
            f"  step {e.step_seconds:.3g} s: {time}"] + _experts(shape, e, precision) + [
            f"  {e.samples_per_sec:.3g} samples/s, {_human(e.tokens_per_sec)} tokens/s, "
            f"{e.tflops_per_gpu:.3g} model TFLOP/s per GPU, MFU {e.mfu:.1%}",
            f"  token budget: {_days(e.days)} days, {_human(e.gpu_hours)} GPU-hours"]


def table(estimates):
    rows = [f"{'layout':<36}{'batch':>6}{'GB/GPU':>8}{'fits':>5}{'samples/s':>11}"
            f"{'tokens/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'days':>9}{'GPU-h':>8}"]
    for e in estimates:
        rows.append(f"{e.layout.describe():<36}{e.batch_size:>6}{e.memory_bytes / GB:>8.1f}"
                    f"{'yes' if e.fits else 'no':>5}{e.samples_per_sec:>11.3g}"
                    f"{_human(e.tokens_per_sec):>10}{e.tflops_per_gpu:>9.3g}{e.mfu:>7.1%}"
                    f"{_days(e.days):>9}{_human(e.gpu_hours):>8}")
    return rows


def side_by_side(measured, spec):
    """The recommended layout's figures on the calibrated cluster and on the spec one."""
    return [f"  calibrated vs spec: step {measured.step_seconds:.3g} s vs "
            f"{spec.step_seconds:.3g} s, {_human(measured.tokens_per_sec)} vs "
            f"{_human(spec.tokens_per_sec)} tokens/s, memory {measured.memory_bytes / GB:.2f} vs "
            f"{spec.memory_bytes / GB:.2f} GB per device (spec / calibrated step time "
            f"{spec.step_seconds / measured.step_seconds:.3g})"]


def text(shape, cluster, precision, token_budget, estimates, top, spec=None):
    """The recommendation (the fastest layout that fits) and the best `top` layouts; `spec`:
    the same layout's Estimate on the spec table, printed beside (with a calibration)."""
    lines = header(shape, cluster, precision, token_budget)
    if cluster.calibration is not None:
        lines.append(f"calibration: {cluster.calibration.path} (measured by tfbig-doctor; the "
                     f"spec table's figures beside)")
    best = estimates[0]
    if best.fits:
        lines.append(f"recommended: {best.layout.describe()}")
    else:
        lines.append(f"no layout fits in {cluster.device.memory_bytes / GB:.0f} GB per GPU; "
                     f"the fastest needs {best.memory_bytes / GB:.1f} GB: more GPUs, "
                     f"a smaller --batch_size or ZeRO would be needed")
    refused = composition.refusal(best.layout.flags())
    if refused:  # only where the fixed flags asked for it (search._allowed)
        lines.append(f"  tfbig-train refuses this layout: {refused}")
    lines += describe_estimate(best, cluster.device.memory_bytes, shape, precision)
    if spec is not None:
        lines += side_by_side(best, spec)
    lines.append(f"best {min(top, len(estimates))} of {len(estimates)} layouts (D data, "
                 f"P pipeline, C context, T tensor, M micro-batches per replica, ckpt activation "
                 f"checkpointing, sp sequence parallel):")
    return "\n".join(lines + table(estimates[:top]))


def as_json(shape, cluster, precision, token_budget, estimates, top, spec=None):
    import dataclasses

    best = estimates[0]
    calibration = cluster.calibration
    cluster = dataclasses.replace(cluster, calibration=None)
    model = {k: v for k, v in dataclasses.asdict(shape).items() if k != "pipe_layers"}
    return json.dumps({"model": model, "precision": precision,
                       "token_budget": token_budget,
                       "cluster": {**dataclasses.asdict(cluster), "size": cluster.size},
                       "recommended": best.to_dict() if best.fits else None,
                       "layouts_considered": len(estimates),
                       "top": [e.to_dict() for e in estimates[:top]],
                       "calibration": calibration.path if calibration else None,
                       "spec": spec.to_dict() if spec else None})
