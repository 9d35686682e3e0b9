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
    expert: int = 1  # --expert_parallel: data ranks splitting each MoE layer's experts

    @property
    def gpus(self):
        return self.data * self.pipeline * self.context * self.tensor

    def flags(self):
        """{tfbig-train flag: value} of this layout (tfbig.layouts.composition's keys)."""
        return {"tensor_parallel": self.tensor, "pipeline_stages": self.pipeline,
                "context_parallel": self.context, "expert_parallel": self.expert,
                "sequence_parallel": self.sequence_parallel, "zero_stage": self.zero_stage,
                "shard_degree": self.shard_degree}

    @property
    def partition(self):
        """Ranks one copy of the model state is sharded over (1 without ZeRO)."""
        return (self.shard_degree or self.data) if self.zero_stage else 1

    def describe(self):
        zero = f" zero{self.zero_stage}/{self.partition}" if self.zero_stage else ""
        context = f" C{self.context}" if self.context > 1 else ""
        context += f" E{self.expert}" if self.expert > 1 else ""
        return (f"D{self.data} P{self.pipeline}{context} T{self.tensor}{zero} "
                f"M{self.num_microbatches}"
                f"{' ckpt' if self.activation_checkpointing else ''}"
                f"{' sp' if self.sequence_parallel else ''}"
                f"{' ' + self.schedule if self.pipeline > 1 else ''}")


def activation_byte_size(precision):
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
    (a tied token table is held by both), over T; an MoE model's routed experts over
    --expert_parallel, whole on each tensor rank (tfbig splits an MoE model's attention, not
    its experts). `stage`: its index (default: the first or, with `last`, the last)."""
    stage = (layout.pipeline - 1 if last else 0) if stage is None else stage
    blocks = shape.block_params - shape.expert_params
    share = 1 if shape.shared_layers else layers_on(shape, layout, stage) / shape.num_layers
    ends = shape.params - shape.block_params
    if layout.pipeline > 1:
        ends = (shape.first_params if stage == 0 else 0) + (
            shape.last_params if stage == layout.pipeline - 1 else 0)
    # more tensor ranks than key/value heads: each holds the whole key/value projections
    kv = 2 * shape.hidden_size ** 2 * shape.kv_fraction * shape.num_layers * share
    replicated = kv * (1 - 1 / layout.tensor) if layout.tensor > shape.kv_heads else 0
    return ((blocks * share + ends) / layout.tensor + replicated
            + expert_params_held(shape, layout, stage))


def expert_params_held(shape, layout, stage=0):
    """The routed experts' weights one GPU holds (in `stage_params`): its layers' E/N (the
    same on every tensor rank)."""
    layers = 1 if shape.shared_layers else layers_on(shape, layout, stage) / shape.num_layers
    return shape.expert_params * layers / layout.expert


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
    return (replicated + split) * activation_byte_size(precision) / 2 + statistics


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
    return (norms + scores) * activation_byte_size(precision) / 2


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
    return wide * activation_byte_size(precision) + 3 * wide * 4 + (0 if precision == "fp32" else wide * 4)


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
    return activation_byte_size(precision) * shape.hidden_size / (
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
    kept = activation_byte_size(precision) * shape.hidden_size / (
        layout.tensor if layout.sequence_parallel else 1)
    return (layers * kept + per_layer) * tokens + backward


def memory(shape, layout, micro_batch, precision, device, stage=0):
    """Bytes per GPU by kind on pipeline stage `stage` (0 without stages).

    ZeRO over a partition group of g: stage 1 slices the optimizer state (moments and a
    float32 master copy: 12 bytes per parameter / g), stage 2 also the gradients, stage 3 the
    parameters too."""
    params = stage_params(shape, layout, stage=stage)
    experts = expert_params_held(shape, layout, stage) if layout.expert > 1 else 0
    z = layout.zero_stage
    boundary = (micro_batch * shape.seq_length * shape.hidden_size
                * activation_byte_size(precision) / layout.context)  # a rank's chunks
    # ZeRO-3 gathers a layer's weights (and the next one's, prefetched); a rank's own experts
    # are not gathered (tfbig/distribute/expert_zero.py)
    gathered = shape.layer_params - (shape.expert_params / shape.num_layers if experts else 0)
    comm = ((hardware.FUSION_BUFFER_BYTES if layout.data > 1 else 0)
            + (2 * boundary if layout.pipeline > 1 else 0)
            + (2 * 4 * gathered / layout.tensor if z == 3 else 0))
    state = state_memory(params - experts, layout)
    if experts:  # a rank's own experts: whole under every ZeRO stage (expert_zero.py)
        whole = state_memory(experts, dataclasses.replace(layout, zero_stage=0))
        state = {kind: state[kind] + whole[kind] for kind in state}
    return {**state,
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


