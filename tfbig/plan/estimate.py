"""Memory per GPU and step time of one layout: closed forms, each term named.

Why it is built this way: docs/design/notes/plan.md (tfbig.plan.estimate).
"""
import dataclasses

from tfbig.layouts import partition as partition_lib
from tfbig.plan import hardware

SCHEDULES = ("1f1b", "gpipe")
# Bytes per token (16-bit) a layer's two keras LayerNorms keep beyond their inputs: each saves
# its normalised output (h values) for the backward; Megatron's fused kernel keeps statistics.
LAYERNORM_OUTPUTS = 4
# Bytes per head and token blockwise attention keeps for its backward: the float32 log-sum-exp.
LSE_BYTES = 4
LOSS_SOFTMAX_BYTES = 8  # the loss's softmax reads and writes each float32 logit once
# The width the element-wise passes of a layer move their values at, whatever --precision.
ELEMENTWISE_PRECISION = "fp32"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a batch and a model are spread over data x pipeline x context x tensor ranks."""

    data: int = 1
    pipeline: int = 1  # --pipeline_stages
    tensor: int = 1  # --tensor_parallel
    zero_stage: int = 0
    shard_degree: int = 0  # data ranks per ZeRO partition group; 0: all of them
    num_microbatches: int = 1  # per replica and step (pipeline micro-batches or accumulation)
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    # transformer layers on each pipeline stage; () = tfbig-train's FLOPs-balanced partition
    # (`partition_layers`; a run with its own --stage_boundaries passes its own)
    stage_layers: tuple = ()
    context: int = 1  # --context_parallel: ranks sharing every sequence

    @property
    def gpus(self):
        return self.data * self.pipeline * self.context * self.tensor

    @property
    def partition(self):
        """Ranks one copy of the model state is sharded over (1 without ZeRO)."""
        return (self.shard_degree or self.data) if self.zero_stage else 1

    def describe(self):
        zero = f" zero{self.zero_stage}/{self.partition}" if self.zero_stage else ""
        context = f" C{self.context}" if self.context > 1 else ""
        return (f"D{self.data} P{self.pipeline}{context} T{self.tensor}{zero} "
                f"M{self.num_microbatches}"
                f"{' ckpt' if self.activation_checkpointing else ''}"
                f"{' sp' if self.sequence_parallel else ''}"
                f"{' ' + self.schedule if self.pipeline > 1 else ''}")


def _act_bytes(precision):
    return 4 if precision == "fp32" else 2


def stage_layer_counts(plan):
    """Transformer layers on each stage of a partition (tfbig.layouts.partition's StagePlans
    of a layer sequence `embedding, layers..., head`): what `Layout.stage_layers` holds."""
    last = plan[-1].stop
    return tuple(s.stop - s.start - (s.start == 0) - (s.stop == last) for s in plan)


def partition_layers(shape, stages):
    """Transformer layers per stage when tfbig-train cuts `shape`'s model into `stages`
    (--pipeline_balance=flops, no --stage_boundaries: tfbig.layouts.partition)."""
    if stages == 1:
        return (shape.num_layers,)
    if not shape.pipe_layers:  # a Shape built by hand: the layers split evenly
        return (shape.num_layers // stages,) * stages
    return stage_layer_counts(partition_lib.partition(list(shape.pipe_layers), stages))


def with_partition(shape, layout):
    """`layout` with its `stage_layers` filled in from tfbig-train's partition (if unset)."""
    if layout.stage_layers or layout.pipeline == 1:
        return layout
    return dataclasses.replace(layout, stage_layers=partition_layers(shape, layout.pipeline))


def layers_on(shape, layout, stage):
    """Transformer layers pipeline stage `stage` runs (all of them without stages)."""
    if layout.pipeline == 1:
        return shape.num_layers
    return (layout.stage_layers or partition_layers(shape, layout.pipeline))[stage]


def stage_params(shape, layout, last=False, stage=None):
    """Weights one GPU holds before ZeRO: its layers (ALBERT: every shared block), plus, with
    stages, the embedding on the first stage and the final norm and output matrix on the last
    (a tied token table is held by both), over T. `stage`: its index (default: the first or,
    with `last`, the last)."""
    stage = (layout.pipeline - 1 if last else 0) if stage is None else stage
    layers = shape.block_params if shape.shared_layers else (
        shape.block_params * layers_on(shape, layout, stage) / shape.num_layers)
    ends = shape.params - shape.block_params
    if layout.pipeline > 1:
        ends = (shape.first_params if stage == 0 else 0) + (
            shape.last_params if stage == layout.pipeline - 1 else 0)
    return (layers + ends) / layout.tensor


def layer_activation_bytes(shape, layout, precision):
    """Bytes per token one transformer layer keeps for its backward pass. Dense attention
    keeps its (T, T) softmax (and dropout mask and output) per head: the `a s` term, quadratic
    in T per sequence. Blockwise attention keeps none of it, only a float32 log-sum-exp per
    head (tfbig.models.attention); its dropout masks are drawn again, not kept."""
    h, a, s, t, c = (shape.hidden_size, shape.num_heads, shape.seq_length, layout.tensor,
                     layout.context)
    blockwise = shape.blockwise or c > 1  # context parallelism runs blockwise attention
    replicated = ((10 if shape.dropout else 8) + LAYERNORM_OUTPUTS) * h / (
        t if layout.sequence_parallel else 1)
    scores = 0 if blockwise else (5 if shape.dropout else 2) * a * s
    gathered = 4 * c * h * shape.kv_fraction if c > 1 else 0  # the whole sequence's K and V
    split = (split_layer_bytes(shape) + scores + gathered) / t
    statistics = LSE_BYTES * a / t if blockwise else 0
    return (replicated + split) * _act_bytes(precision) / 2 + statistics


def split_layer_bytes(shape):
    """16-bit bytes per token a layer keeps of what tensor parallelism splits. GPT: Q, K, V
    and the attention output (8h), the MLP's 4h-wide input and GELU output (16h). Llama: Q and
    the attention output (4h), K and V at the key/value heads' width (4h x kv_fraction), and
    SwiGLU's gate, its SiLU, up and their product (8f)."""
    h = shape.hidden_size
    if not shape.gated_mlp:
        return 24 * h
    return (4 + 4 * shape.kv_fraction) * h + 8 * shape.intermediate_size


def normalisation_bytes(shape, layout, precision):
    """The part of `layer_activation_bytes` row normalisations pass over: the attention
    softmax's (T, T) scores per head (and with dropout its mask and output) and the LayerNorms'
    outputs. Their max or mean and sum or variance are reductions along a row, which a CPU
    runs several times slower per byte than a map (tfbig-doctor measures both)."""
    h, a, s, t = shape.hidden_size, shape.num_heads, shape.seq_length, layout.tensor
    blockwise = shape.blockwise or layout.context > 1
    norms = LAYERNORM_OUTPUTS * h / (t if layout.sequence_parallel else 1)
    scores = 0 if blockwise else (5 if shape.dropout else 2) * a * s / t
    return (norms + scores) * _act_bytes(precision) / 2


def head_bytes(shape, layout, precision):
    """Bytes per token the loss keeps for its backward: the float32 softmax gradient
    TensorFlow's fused cross-entropy computes in the forward (in the logits' buffer), + the
    16-bit logits under mixed precision."""
    return (4 + (0 if precision == "fp32" else 2)) * shape.vocab_size / layout.tensor


def logits_traffic(shape, layout, precision):
    """Bytes per token of one pass over the logits, the softmax and the logits' gradient."""
    return (12 + (0 if precision == "fp32" else 2)) * shape.vocab_size / layout.tensor


def backward_working_bytes(shape, layout, precision):
    """Bytes per token of one micro-batch a layer's backward holds beside the activations at
    its peak, the GELU's: the gradient of the GELU's output (4h/t) and the float32 temporaries
    of its derivative and of their product with that gradient, up to three 4h/t-wide alive
    together (allocation traces on this machine: benchmarks/pipeline_memory_trace.py; the
    last becomes the gradient of the GELU's input), + the float32 copy of a 16-bit input."""
    wide = (shape.intermediate_size if shape.gated_mlp else 4 * shape.hidden_size) / layout.tensor
    return wide * _act_bytes(precision) + 3 * wide * 4 + (0 if precision == "fp32" else wide * 4)


def head_gradient_bytes(shape, layout):
    """Bytes the backward of the model's head forms while the logits' gradient is alive:
    this micro-batch's float32 gradient of the head's weights (the output matrix, over T) and a
    second copy, the gradient transposed (GPT's tied table: the logits multiply by its
    transpose) or the new running sum it is added into (tfbig.pipeline.stages sums each
    micro-batch's gradients). The layers' backward starts once the logits' gradient is
    consumed (a pipeline's last stage waits for the head's weight gradients:
    tfbig.pipeline.stages; a single device's least peak of several steps is that order), so
    this and the layers' working set are not alive together."""
    return 2 * 4 * shape.last_params / layout.tensor


def live_microbatches(layout, stage):
    """Micro-batches whose saved activations pipeline stage `stage` holds at its peak. GPipe
    runs every forward before the first backward: all M. 1F1B (PipeDream-Flush) starts stage
    k's first backward after K - k forwards and then alternates one forward, one backward: at
    most K - k (tfbig.pipeline.schedules). Without stages the micro-batches of gradient
    accumulation run one after the other: one."""
    k, m = layout.pipeline, layout.num_microbatches
    if k == 1:
        return 1
    return m if layout.schedule == "gpipe" else min(k - stage, m)


def stage_input_bytes(shape, layout, precision, stage):
    """Bytes per token of a stage's input: the previous stage's output activation (stage 0
    reads token ids from the batch the step was given, already held)."""
    if stage == 0:
        return 0.0
    return _act_bytes(precision) * shape.hidden_size / (
        layout.tensor if layout.sequence_parallel else 1)


def activation_memory(shape, layout, micro_batch, precision, stage=0):
    """Bytes of activations pipeline stage `stage` (0 without stages) holds at its peak: what
    the micro-batches in flight keep, and the backward of one of them. On the last stage (or
    without stages) that backward differentiates the head first: the logits' gradient beside
    the head's weight gradients, then, that freed, the layers' working set."""
    tokens = micro_batch * shape.seq_length / layout.context  # this rank's
    last = stage == layout.pipeline - 1
    layers = layers_on(shape, layout, stage)
    per_layer = layer_activation_bytes(shape, layout, precision)
    live = live_microbatches(layout, stage)
    working = backward_working_bytes(shape, layout, precision) * tokens
    head = head_bytes(shape, layout, precision) * tokens if last else 0.0
    # the micro-batch being differentiated: its head's backward, then its layers'
    backward = max(head + head_gradient_bytes(shape, layout), working) if last else working
    if not layout.activation_checkpointing:
        return live * layers * per_layer * tokens + (live - 1) * head + backward
    if layout.pipeline > 1:
        # tfbig's pipeline stage keeps only its input per micro-batch in flight and recomputes
        # the whole stage's forward in the backward of one (tfbig.pipeline.stages); that one's
        # input is its first layer's, counted in the recomputed layers' bytes
        kept = stage_input_bytes(shape, layout, precision, stage)
        return (live - 1) * kept * tokens + layers * per_layer * tokens + backward
    # without stages each block is recomputed (tfbig.distribute.recompute): block inputs, and
    # one block's full set while it is recomputed
    kept = _act_bytes(precision) * shape.hidden_size / (
        layout.tensor if layout.sequence_parallel else 1)
    return (layers * kept + per_layer) * tokens + backward


def memory(shape, layout, micro_batch, precision, device, stage=0):
    """Bytes per GPU by kind on pipeline stage `stage` (0 without stages).

    ZeRO over a partition group of g: stage 1 slices the optimizer state (moments and a
    float32 master copy: 12 bytes per parameter / g), stage 2 also the gradients, stage 3 the
    parameters too."""
    params = stage_params(shape, layout, stage=stage)
    z = layout.zero_stage
    boundary = micro_batch * shape.seq_length * shape.hidden_size * _act_bytes(precision)
    comm = ((hardware.FUSION_BUFFER_BYTES if layout.data > 1 else 0)
            + (2 * boundary if layout.pipeline > 1 else 0)
            + (2 * 4 * shape.layer_params / layout.tensor if z == 3 else 0))
    return {**state_memory(params, layout),
            "activations": activation_memory(shape, layout, micro_batch, precision, stage),
            "communication": comm, "reserve": device.reserve_bytes}


def state_memory(params, layout):
    """Bytes per GPU of `params` float32 weights' state: {"parameters", "gradients",
    "optimizer"} (Adam/LAMB's two slots), each sharded over ZeRO's partition group from its
    stage (3: parameters, 2: gradients, 1: optimizer)."""
    g, z = layout.partition, layout.zero_stage
    return {"parameters": 4 * params / (g if z >= 3 else 1),
            "gradients": 4 * params / (g if z >= 2 else 1),
            # moments; with ZeRO 1-2 also the float32 master copy of the slice the optimizer
            # updates (tfbig/distribute/zero.py), the full weights being kept beside it; with
            # ZeRO 3 that slice is the parameters themselves
            "optimizer": (8 * params / g) if z >= 3 else (12 * params / g) if z else 8 * params}


def peak_stage_memory(shape, layout, micro_batch, precision, device):
    """(stage, memory by kind) of the pipeline stage holding the most. Besides the first (the
    embedding, the most micro-batches in flight under 1F1B) and the last (the output matrix and
    the loss's vocabulary-sized tensors), a middle stage holds most where it first has its
    number of layers (later ones with as many have no more micro-batches in flight)."""
    layout = with_partition(shape, layout)
    counts = layout.stage_layers or (shape.num_layers,)
    stages = {0, layout.pipeline - 1} | {counts.index(n) for n in set(counts)}
    return max(((k, memory(shape, layout, micro_batch, precision, device, k))
                for k in sorted(stages)), key=lambda item: sum(item[1].values()))


def stage_table(shape, layout, micro_batch, precision):
    """Per pipeline stage, the bytes it holds as tfbig-train prints them beside its partition
    (tfbig.layouts.partition.format_plan): {"state": weights, gradients and optimizer slots,
    "activations": activations and send/receive buffers} (no framework reserve)."""
    device = hardware.Device("memory", 1.0, 0.0, 1.0, 1.0, 1.0, 0.0)
    table = []
    for k in range(layout.pipeline):
        mem = memory(shape, layout, micro_batch, precision, device, k)
        table.append({"state": mem["parameters"] + mem["gradients"] + mem["optimizer"],
                      "activations": mem["activations"] + mem["communication"]})
    return table


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
               + count * _act_bytes(precision) * (m * k + k * n + m * n) / bandwidth
               for w, ((m, k, n), count) in zip(work, products)]
    return sum(work) / sum(seconds) / device.peak_flops


def tick_time(shape, layout, micro_batch, precision, cluster, stage):
    """Seconds of one micro-batch's forward and backward on pipeline stage `stage`, by part:
    compute, elementwise, tensor."""
    device, t = cluster.device, layout.tensor
    tokens = micro_batch * shape.seq_length / layout.context  # this rank's
    recompute = layout.activation_checkpointing
    flops = (shape.flops_per_token * flops_share(shape, layout, stage) * tokens / t
             * (4 / 3 if recompute else 1))
    layers = layers_on(shape, layout, stage)
    last = stage == layout.pipeline - 1
    # blockwise attention's tiles are written and read as dense attention's scores are (Keras
    # ops, no fused kernel keeps them on chip) and recomputed in the backward: dense's traffic
    dense = dataclasses.replace(shape, blockwise=False)
    whole_kv = (2 * micro_batch * shape.seq_length * shape.hidden_size * shape.kv_fraction / t
                * _act_bytes(precision))
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
    boundary = tokens * shape.hidden_size * _act_bytes(precision)
    fraction = matmul_fraction(shape, layout, micro_batch, device, precision)
    return {"compute": flops / (device.peak_flops * fraction),
            "elementwise": maps / bandwidth + normalised / row_bandwidth,
            "tensor": layers * (6 if recompute else 4) * cluster.collective_time(boundary, t, 1,
                                                                                 2),
            "context": context}


def step_time(shape, layout, micro_batch, precision, cluster):
    """Seconds per optimizer step by part: compute, elementwise, tensor, pipeline, data, update.
    The slowest stage (tfbig-train's partition balances FLOPs, not the logits' traffic) sets
    the pace of every tick."""
    layout = with_partition(shape, layout)
    device, t, k, m = cluster.device, layout.tensor, layout.pipeline, layout.num_microbatches
    counts = layout.stage_layers or (shape.num_layers,)
    # a middle stage ticks as long as the first one with as many layers
    ticks_by_stage = [tick_time(shape, layout, micro_batch, precision, cluster, s)
                      for s in sorted({0, k - 1} | {counts.index(n) for n in set(counts)})]
    tick = max(ticks_by_stage, key=lambda parts: sum(parts.values()))
    boundary = micro_batch * shape.seq_length * shape.hidden_size * _act_bytes(precision)
    # each stage sends its output forward and receives a gradient back; the slowest boundary
    # (across nodes once a model copy spans several) sets the pace
    across_nodes = t * k > cluster.gpus_per_node
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
