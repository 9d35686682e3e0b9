"""Cut a layer sequence into pipeline stages: balanced automatically or at given boundaries.

Automatic boundaries minimise the most expensive stage (contiguous stages, at least one layer
each) under a per-layer cost: training FLOPs per token (`balance="flops"`, what sets the pipeline's
pace) or parameters (`balance="params"`, what sets its memory). `--stage_boundaries` overrides them
with the first layer of every stage after the first, by index or name. The plan is data: a list
of `StagePlan`s, printed before training (`format_plan`).

What each stage holds is the planner's estimate (tfbig.plan.estimate.stage_table, printed by
`format_plan`); tfbig-plan lays out its stages with this partition too.

Example:
    plan = partition(layer_specs(gpt_config, 128), num_stages=2)
    plan = partition(costs, 2, boundaries="block_3")   # stage 1 starts at block_3
    print(format_plan(plan, devices, memory))
"""
import dataclasses

BALANCES = ("flops", "params")


@dataclasses.dataclass
class StagePlan:
    """Layers [start, stop) of the layer sequence, and what they cost together."""

    index: int
    start: int
    stop: int
    layer_names: list
    params: int
    flops_per_token: float


def parse_boundaries(text, names):
    """'3,6' or 'block_2,head' -> [3, 6]: the first layer index of stages 1, 2, ..."""
    starts = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        if item.lstrip("-").isdigit():
            starts.append(int(item))
        elif item in names:
            starts.append(names.index(item))
        else:
            raise ValueError(f"--stage_boundaries={text!r}: {item!r} is neither a layer index "
                             f"nor a layer name; layers are {names}")
    return starts


def _check_starts(starts, num_stages, num_layers, text):
    if len(starts) != num_stages - 1:
        raise ValueError(f"--stage_boundaries={text!r} gives {len(starts)} boundaries; "
                         f"--pipeline_stages={num_stages} needs {num_stages - 1}")
    edges = [0] + starts + [num_layers]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--stage_boundaries={text!r} must increase strictly within "
                         f"1..{num_layers - 1} so that every stage gets at least one layer")


def balanced_starts(weights, num_stages):
    """Stage start indices minimising the largest stage sum of `weights` (>= 0; exact, by DP;
    among equal cuts the earliest)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest max-stage cost of the first i layers cut into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            # the last stage is layers [j, i); it only grows as j falls, so once it alone costs
            # more than the best cut found no earlier j can be better (tfbig-plan cuts 96
            # layers in 12 ways per model: this keeps that to milliseconds)
            for j in range(i - 1, k - 2, -1):
                last = prefix[i] - prefix[j]
                if last > best[k][i]:
                    break
                cost = max(best[k - 1][j], last)
                if cost <= best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(num_stages, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return sorted(starts)


def partition(costs, num_stages, boundaries="", balance="flops"):
    """StagePlans for `costs` (a list of LayerSpec) cut into `num_stages` stages."""
    names = [c.name for c in costs]
    if not 1 <= num_stages <= len(costs):
        raise ValueError(f"--pipeline_stages={num_stages}: the model has {len(costs)} layers "
                         f"({names[0]} .. {names[-1]}), so 1..{len(costs)} stages are possible")
    if balance not in BALANCES:
        raise ValueError(f"--pipeline_balance={balance!r}: expected one of {BALANCES}")
    if boundaries:
        starts = parse_boundaries(boundaries, names)
        _check_starts(starts, num_stages, len(costs), boundaries)
    else:
        weights = [c.flops_per_token if balance == "flops" else c.params for c in costs]
        starts = balanced_starts(weights, num_stages)
    edges = [0] + starts + [len(costs)]
    plan = []
    for index, (start, stop) in enumerate(zip(edges, edges[1:])):
        part = costs[start:stop]
        plan.append(StagePlan(index, start, stop, names[start:stop], sum(c.params for c in part),
                              sum(c.flops_per_token for c in part)))
    return plan


def _human(n, unit=""):
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def format_plan(plan, devices, memory):
    """The plan as a table: stage, device, layers, parameters, FLOPs share, est. memory
    (`memory`: per stage {"state", "activations"} bytes, tfbig.plan.estimate.stage_table)."""
    total_flops = sum(s.flops_per_token for s in plan) or 1.0
    rows = [f"{'stage':<6}{'device':<17}{'layers':<26}{'params':>9}{'flops':>7}"
            f"{'est. memory (state+activations)':>36}"]
    for stage, device, mem in zip(plan, devices, memory):
        layers = (stage.layer_names[0] if len(stage.layer_names) == 1 else
                  f"{stage.layer_names[0]}..{stage.layer_names[-1]} ({len(stage.layer_names)})")
        row = (f"{stage.index:<6}{device:<17}{layers:<26}{_human(stage.params):>9}"
               f"{stage.flops_per_token / total_flops:>7.0%}")
        if mem["activations"] is None:  # a user model: state counted, activations unknown
            rows.append(row + f"{_human(mem['state'], 'B'):>14} + activations unknown")
            continue
        total = mem["state"] + mem["activations"]
        rows.append(row + f"{_human(total, 'B'):>14} = {_human(mem['state'], 'B')} + "
                    f"{_human(mem['activations'], 'B')}")
    return "\n".join(rows)
