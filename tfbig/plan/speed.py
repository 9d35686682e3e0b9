"""Step time of a layout (closed forms): each matmul at its size's compute fraction plus its
operands streamed, a pipeline tick per stage, the bubble of the schedule, the all-to-alls of
expert parallelism, and the gradient all-reduce across data-parallel replicas. The memory side
is tfbig.plan.estimate."""
import dataclasses

from tfbig.plan import hardware
from tfbig.plan.estimate import (ELEMENTWISE_PRECISION, LOSS_SOFTMAX_BYTES, activation_byte_size,
                                 layer_activation_bytes, layers_on, logits_traffic, memory,
                                 normalisation_bytes, stage_params, with_partition)


def flops_share(shape, layout, stage):
    """The share of the model's FLOPs pipeline stage `stage` runs: its layers, and the embedding
    on the first stage and the head on the last, as tfbig-train's partition counts them."""
    if layout.pipeline == 1:
        return 1.0
    layers = layers_on(shape, layout, stage)
    if not shape.pipe_layers:
        return layers / shape.num_layers
    first, block, head = (shape.pipe_layers[i].flops_per_token for i in (0, 1, -1))
    total = sum(spec.flops_per_token for spec in shape.pipe_layers)
    return (layers * block + (first if stage == 0 else 0)
            + (head if stage == layout.pipeline - 1 else 0)) / total


def matmul_products(shape, layout, micro_batch):
    """((m, k, n), count) of each matrix product of a micro-batch's forward on one rank: QKV,
    attention output, MLP up and down (per layer), attention's two (per sequence and head),
    the logits (the backward runs each again twice, at the same sizes)."""
    tokens, s, t = micro_batch * shape.seq_length, shape.seq_length, layout.tensor
    h, f, a = shape.hidden_size, shape.intermediate_size, shape.num_heads
    d = h // a
    layers, heads = shape.num_layers, shape.num_layers * micro_batch * a / t
    qkv = (1 + 2 * shape.kv_fraction) * h  # grouped-query attention: narrower K and V
    up = 2 if shape.gated_mlp else 1  # SwiGLU's gate and up
    return [((tokens, h, qkv / t), layers), ((tokens, h / t, h), layers),
            ((tokens, h, f / t), up * layers), ((tokens, f / t, h), layers),
            ((s, d, s), heads), ((s, s, d), heads),  # per sequence and head
            ((tokens, h, shape.vocab_size / t), 1)]


def matmul_fraction(shape, layout, micro_batch, device, precision="fp32"):
    """Achieved / peak FLOP/s of a layer's matmuls, each product's time weighted by its FLOPs
    (a harmonic mean: the time). A roofline sum where the device has one: each product takes
    its FLOPs at a fraction of peak plus its operands and result (m k + k n + m n values)
    streamed once at the achieved memory bandwidth, not overlapped. Large products are
    compute-bound and run near the compute fraction; products whose arithmetic intensity
    (FLOPs per byte) is near or below the ridge point (peak / bandwidth: ~140 on a V100 in
    fp16, ~17 in fp32; ~13 on one core of this project's CPU) lose to memory traffic: a
    768-wide layer, attention's head-sized products and a narrow model's vocabulary-wide
    logits run further from peak than a 12,288-wide layer. One sum of two physical terms, not
    a fitted curve:
    - a calibration (`device.matmul_efficiency`): the compute fraction of each product is the
      one measured for its size (the cube root of m k n; tfbig.plan.calibration takes each
      measured square product's own traffic out of it, so the sum gives back its time);
    - a spec-table GPU (`device.roofline`): `device.matmul_fraction`, the big-GEMM fraction;
      published BERT figures check it (tests/plan/test_published.py);
    - otherwise (a measured CPU peak without a calibration): `device.matmul_fraction`, no
      traffic term."""
    if not (device.roofline or device.matmul_efficiency):
        return device.matmul_fraction
    products = matmul_products(shape, layout, micro_batch)
    work = [2 * m * k * n * count for (m, k, n), count in products]
    bandwidth = device.memory_bandwidth * device.bandwidth_fraction

    def compute_fraction(m, k, n):
        if device.matmul_efficiency:
            return hardware.log_interpolate(device.matmul_efficiency, (m * k * n) ** (1 / 3))
        return device.matmul_fraction

    seconds = [w / (device.peak_flops * compute_fraction(m, k, n))
               + count * activation_byte_size(precision) * (m * k + k * n + m * n) / bandwidth
               for w, ((m, k, n), count) in zip(work, products)]
    return sum(work) / sum(seconds) / device.peak_flops


def tick_time(shape, layout, micro_batch, precision, cluster, stage):
    """Seconds of one micro-batch's forward and backward on pipeline stage `stage`, by part:
    compute, elementwise, tensor."""
    device, t = cluster.device, layout.tensor
    tokens = micro_batch * shape.seq_length / layout.context  # this rank's
    recompute = layout.activation_checkpointing
    experts = expert_flops_per_token(shape)  # an MoE model's experts: whole on each tensor rank
    flops = (((shape.flops_per_token - experts) / t + experts)
             * flops_share(shape, layout, stage) * tokens * (4 / 3 if recompute else 1))
    pairs = 1 if shape.num_experts else 2  # a block's split pairs: attention (and the MLP)
    layers = layers_on(shape, layout, stage)
    last = stage == layout.pipeline - 1
    # blockwise attention's tiles are written and read as dense attention's scores are (Keras
    # ops, no fused kernel keeps them on chip) and recomputed in the backward: dense's traffic
    dense = dataclasses.replace(shape, blockwise=False)
    whole_kv = (2 * micro_batch * shape.seq_length * shape.hidden_size * shape.kv_fraction / t
                * activation_byte_size(precision))
    context = (layers * (3 if recompute else 2) * cluster.collective_time(
        whole_kv, layout.context, t, 1) if layout.context > 1 else 0.0)
    # counted at float32 width in every precision: tfbig's softmax and LayerNorms run in
    # float32 under mixed precision (tfbig.models), and each cast around them is a pass too
    wide = layer_activation_bytes(dense, layout, ELEMENTWISE_PRECISION)
    rows = normalisation_bytes(dense, layout, ELEMENTWISE_PRECISION)
    passes = 5 if recompute else 4
    # of a step's passes over the softmaxes' and LayerNorms' bytes, the forward normalisation
    # (again when recomputed) and the backward's are reductions along the row, the rest maps;
    # the loss normalises the float32 logits once (its gradient is formed in that forward)
    row_passes = 3 if recompute else 2
    loss_rows = LOSS_SOFTMAX_BYTES * shape.vocab_size / t if last else 0.0
    loss_maps = 2 * logits_traffic(shape, layout, precision) - loss_rows if last else 0.0
    maps = ((passes * wide - row_passes * rows) * layers + loss_maps) * tokens
    normalised = (row_passes * rows * layers + loss_rows) * tokens
    bandwidth = device.memory_bandwidth * device.bandwidth_fraction
    row_bandwidth = (device.normalisation_bandwidth or device.memory_bandwidth) * (
        device.bandwidth_fraction)
    boundary = tokens * shape.hidden_size * activation_byte_size(precision)
    fraction = matmul_fraction(shape, layout, micro_batch, device, precision)
    return {"compute": flops / (device.peak_flops * fraction),
            "elementwise": maps / bandwidth + normalised / row_bandwidth,
            "tensor": layers * pairs * (3 if recompute else 2) * cluster.collective_time(
                boundary, t, 1, 2),
            "context": context,
            "expert": layers * expert_exchange_time(shape, layout, boundary, cluster)}


def expert_flops_per_token(shape):
    """Training FLOPs per token of an MoE model's routed experts (the k each token uses)."""
    if not shape.num_experts:
        return 0.0
    return 6 * shape.expert_params * shape.experts_per_token / shape.num_experts


def expert_exchange_bytes(shape, layout, micro_batch, precision):
    """Bytes of the rows one rank sends to the experts in one all-to-all of an MoE layer (a
    micro-batch's tokens, k rows each, of the hidden width); as many come back."""
    tokens = micro_batch * shape.seq_length / layout.context
    return shape.experts_per_token * tokens * shape.hidden_size * activation_byte_size(precision)


def expert_exchanges(layout):
    """All-to-alls of one MoE layer per micro-batch: dispatch and combine forward, their
    gradients backward, and the forward's again when it is recomputed."""
    return 6 if layout.activation_checkpointing else 4


def expert_exchange_time(shape, layout, boundary, cluster):
    """Seconds of one MoE layer's all-to-alls for a micro-batch under --expert_parallel=N
    (tfbig.distribute.expert_parallel): each token's k rows of `boundary` / tokens bytes go to
    the ranks holding their experts and come back (2 all-to-alls forward), and their gradients
    the same way (2 backward), again in a recomputed forward. An all-to-all over N ranks
    moves (N - 1) / N of each rank's rows, as a ring reduce-scatter of the same bytes does:
    it is timed as one (a calibration's reduce-scatter where there is one). The expert group
    is N consecutive data ranks (tfbig.distribute.mesh)."""
    if layout.expert == 1 or not shape.num_experts:
        return 0.0
    span = layout.tensor * layout.pipeline * layout.context  # data neighbours' distance
    return expert_exchanges(layout) * cluster.collective_time(
        shape.experts_per_token * boundary, layout.expert, span, passes=1)


def step_time(shape, layout, micro_batch, precision, cluster):
    """Seconds per optimizer step by part: compute, elementwise, tensor, context, expert,
    pipeline, data, update.
    The slowest stage (tfbig-train's partition balances FLOPs, not the logits' traffic) sets
    the pace of every tick."""
    layout = with_partition(shape, layout)
    device, t, k, m = cluster.device, layout.tensor, layout.pipeline, layout.num_microbatches
    counts = layout.stage_layers or (shape.num_layers,)
    # a middle stage ticks as long as the first one with as many layers
    ticks_by_stage = [tick_time(shape, layout, micro_batch, precision, cluster, s)
                      for s in sorted({0, k - 1} | {counts.index(n) for n in set(counts)})]
    tick = max(ticks_by_stage, key=lambda parts: sum(parts.values()))
    # with context parallelism a rank sends its chunks of the sequence only
    boundary = (micro_batch * shape.seq_length * shape.hidden_size
                * activation_byte_size(precision) / layout.context)
    # each stage sends its output forward and receives a gradient back; the slowest boundary
    # (across nodes once a model copy spans several) sets the pace
    across_nodes = t * k * layout.context > cluster.gpus_per_node
    link = cluster.link_bandwidth(cluster.gpus_per_node if across_nodes else 1)
    pipe = 0.0 if k == 1 else 2 * boundary / (link * hardware.BANDWIDTH_FRACTION)
    ticks = m + k - 1
    data = data_sync_time(shape, layout, cluster)
    state = sum(v for key, v in memory(shape, layout, micro_batch, precision, device).items()
                if key in ("parameters", "gradients", "optimizer"))
    # the optimizer's ops run per variable (clipping's norm, AdamW's slots): a calibration
    # measures their time per variable; a stage updates about its share of the variables
    update = (2 * state / (device.memory_bandwidth * device.bandwidth_fraction)
              + shape.num_variables / k * device.update_seconds_per_variable)
    return {"compute": ticks * tick["compute"], "elementwise": ticks * tick["elementwise"],
            "tensor": ticks * tick["tensor"], "context": ticks * tick["context"],
            "expert": ticks * tick["expert"],
            "pipeline": ticks * pipe, "data": data,
            "update": update}


def data_sync_time(shape, layout, cluster):
    """Gradient averaging (and ZeRO's gathers) over the data axis, per optimizer step, after
    the average over the context group."""
    d = layout.data
    size = 4 * stage_params(shape, layout, last=False)  # float32 gradients / weights
    context = (cluster.collective_time(size, layout.context, layout.tensor, passes=2)
               if layout.context > 1 else 0.0)
    if d == 1:
        return context
    span = layout.tensor * layout.pipeline * layout.context  # data neighbours' distance
    if layout.zero_stage == 0:
        return context + cluster.collective_time(size, d, span, passes=2)
    g = layout.partition
    inner = cluster.collective_time(size, g, span, passes=1)  # in the partition group
    outer = cluster.collective_time(size / g, d // g, span * g, passes=2)  # across replicas
    if layout.zero_stage < 2:  # one reduce-scatter, the slice's all-reduce, one all-gather
        return context + 2 * inner + outer
    # ZeRO 2-3 keep no full gradient: reduce-scatter each micro-batch; ZeRO 3 gathers the
    # weights before every forward and backward (and recompute) of every micro-batch
    passes = 2 if layout.zero_stage == 3 else 0  # tfbig's ZeRO 3 gathers once for the
    # forward and once for the backward, which recomputes the layer with those weights
    gathers = layout.num_microbatches * passes if passes else 1
    return context + (layout.num_microbatches + gathers) * inner + outer
