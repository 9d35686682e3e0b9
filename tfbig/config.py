"""Experiment configuration: dataclasses whose fields are the command-line flags, one to one.

Every field carries its help text in `metadata["help"]`; `define_flags` turns each field of each
section into an absl flag of the same name, and `from_flags` reads them back. A backend that needs
options adds its own section dataclass to SECTIONS.

Example:
    cfg = ExperimentConfig()
    cfg.train.max_steps = 10
    save_json(cfg, "/tmp/run/config.json")
"""
import dataclasses
import json
import os


def field(default, help):  # noqa: A002 - mirrors absl's argument name
    """A dataclass field with its flag help text."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class TrainConfig:
    """What to train, on what data, for how long, and how."""

    model: str = field("gpt", "Model family to train: gpt | albert | bert | llama.")
    preset: str = field("small", "Model size preset (see tfbig.models.gpt.GPT_PRESETS; "
                                 "--model=llama: tfbig.models.llama_config.LLAMA_PRESETS).")
    num_layers: int = field(0, "Override the preset's number of layers (0 keeps the preset).")
    hidden_size: int = field(0, "Override the preset's hidden size (0 keeps the preset).")
    num_heads: int = field(0, "Override the preset's number of attention heads (0 keeps it).")
    dropout: float = field(-1.0, "Override the preset's dropout rate (negative keeps it).")
    data_dir: str = field("", "Directory with manifest.json and TFRecord shards from tfbig-prep, "
                              "or a weighted mixture of them (a:0.6,b:0.4 or a mixture file). "
                              "Empty: prepare the embedded Shakespeare corpus once (cached).")
    model_dir: str = field("runs/gpt-small", "Run directory: checkpoints, config.json, "
                                             "TensorBoard events. An existing checkpoint resumes.")
    init_checkpoint: str = field("", "Start from the weights of this tfbig-convert output, "
                                     "tfbig-train run or Hugging Face Llama-family directory "
                                     "(fresh optimizer, step 0; its config.json fixes the model)."
                                     " A --model_dir checkpoint of a run from it resumes instead.")
    max_steps: int = field(0, "Optimizer steps to train for, in total across resumes (0: as "
                              "many as fit in --time_budget_minutes).")
    time_budget_minutes: float = field(9.0, "With --max_steps=0: wall minutes for the whole "
                                            "command, from its start to its last line "
                                            "(preparation, compilation, the final evaluation "
                                            "and sample included). The learning rate warms "
                                            "up, holds at its peak, and decays over the last "
                                            "fifth of the steps; when the decay starts is "
                                            "decided from the time left, estimated every 10 "
                                            "steps from the recent step times, and kept in "
                                            "MODEL_DIR/config.json for a resume.")
    batch_size: int = field(32, "Global batch size in sequences per optimizer step, over all "
                                "data-parallel replicas and accumulation steps.")
    seq_length: int = field(0, "Tokens per training sequence (0: the data's seq_length).")
    learning_rate: float = field(1e-3, "Peak learning rate, reached after warmup.")
    min_lr_ratio: float = field(0.1, "Final learning rate as a fraction of the peak.")
    warmup_steps: int = field(50, "Linear warmup steps from 0 to the peak learning rate.")
    lr_schedule: str = field("cosine", "Decay after warmup: linear | cosine | polynomial.")
    optimizer: str = field("adamw", "adamw | lamb.")
    weight_decay: float = field(0.1, "Decoupled weight decay (not on LayerNorm, biases, "
                                     "embeddings).")
    beta_1: float = field(0.9, "Adam/LAMB beta_1.")
    beta_2: float = field(0.95, "Adam/LAMB beta_2.")
    epsilon: float = field(1e-8, "Adam/LAMB epsilon.")
    grad_clip_norm: float = field(1.0, "Clip gradients to this global norm (0 disables).")
    grad_accum_steps: int = field(1, "Micro-steps accumulated into one optimizer update.")
    precision: str = field("fp32", "fp32 | mixed_float16 (dynamic loss scaling) | "
                                   "mixed_bfloat16.")
    attention: str = field("auto", "How attention computes its scores: dense (the whole "
                                   "T x T softmax, kept for the backward) | blockwise (tiles "
                                   "of --attention_block_size with an online softmax and a "
                                   "recomputing backward: memory linear in T) | auto "
                                   "(blockwise from 1024 tokens on, where it measured no "
                                   "slower than dense on a CPU; dense below: "
                                   "docs/guides/long-sequences.md).")
    attention_block_size: int = field(512, "Rows of the query and key tiles of blockwise "
                                           "attention.")
    xla: bool = field(True, "Compile the forward/backward pass with XLA (jit_compile).")
    compile_update: bool = field(True, "With --xla: compile the optimizer update (clipping, "
                                       "loss-scale update, apply) too, into one XLA program "
                                       "with the forward/backward where the backend's "
                                       "collectives allow it (single), else into one after "
                                       "the gradient all-reduce (Horovod); false: it runs "
                                       "op by op, as it does under ZeRO, tensor parallelism, "
                                       "pipelines, multiworker and mirrored.")
    seed: int = field(0, "Random seed for initialisation, dropout and data order.")
    deterministic: bool = field(False, "Deterministic ops and data order: exact resume, "
                                       "bit-for-bit repeatable runs (slower).")
    strategy: str = field("single", "Training backend: single | horovod | multiworker | "
                                     "mirrored | pipeline.")
    log_every: int = field(10, "Log loss, learning rate and throughput every N steps.")
    eval_every: int = field(0, "Evaluate on the validation split every N steps (0: at the "
                                "end only).")
    eval_steps: int = field(50, "Validation batches per evaluation (0: the whole split).")
    checkpoint_every: int = field(200, "Save a checkpoint every N steps (and at the end).")
    keep_checkpoints: int = field(3, "Keep the last N checkpoints.")
    async_checkpoint: str = field("auto", "on | off | auto: write checkpoints beside training, "
                                          "the loop waiting only for a host copy of the state "
                                          "(auto: on unless the checkpoint is ZeRO, tensor or "
                                          "pipeline pieces). The final save waits for its write.")
    straggler_every: int = field(100, "Every N steps, name a process 20% or more below the "
                                      "median step rate, with its host (tfbig-doctor's rule; "
                                      "0: never).")
    skip_corrupt: bool = field(False, "Skip corrupt TFRecord shards (counted in the logs) "
                                      "instead of failing.")
    data_trace: str = field("", "Directory where each input pipeline appends the global position "
                                "and CRC-32 of every example it reads (pipeline-<id>-<pid>.tsv; "
                                "read-ahead included) (empty: none).")
    sample_tokens: int = field(200, "Tokens of text generated at the end of training (0: none).")
    plan_only: bool = field(False, "Print the plan of these flags on this machine (memory, step "
                                   "time, tokens/s) and exit before building anything.")
    calibration: str = field("", "With --plan_only: a tfbig-doctor --calibration_out file; the "
                                 "plan uses its measured device and collectives.")


@dataclasses.dataclass
class MultiWorkerConfig:
    """tf.distribute options of --strategy=multiworker (MultiWorkerMirroredStrategy) and
    --strategy=mirrored (MirroredStrategy, one host)."""

    collective: str = field("auto", "All-reduce implementation: auto | ring (CPU or GPU) | "
                                    "nccl (GPUs only).")
    collective_timeout: float = field(600.0, "Seconds a collective may wait for the other "
                                             "workers before the run fails (0: forever).")
    cluster_resolver: str = field("auto", "Where --strategy=multiworker finds its cluster: "
                                          "auto (TF_CONFIG, else Slurm under srun, else this "
                                          "process alone) | tf_config | slurm.")


@dataclasses.dataclass
class AlbertTrainConfig:
    """ALBERT pretraining options (--model=albert); the masking of the shards is set by tfbig-prep."""

    embedding_size: int = field(0, "ALBERT: override the preset's embedding size E (0 keeps it).")
    num_groups: int = field(0, "ALBERT: override the preset's shared layer groups (0 keeps it).")
    dynamic_masking: bool = field(False, "ALBERT and BERT: draw fresh token-level masks (80/10/10) for "
                                         "every batch in the input pipeline instead of using "
                                         "the masks stored in the shards.")
    dynamic_masked_lm_prob: float = field(0.15, "ALBERT and BERT, with --dynamic_masking: share of "
                                                "tokens to predict (at most the shards' "
                                                "max_predictions_per_seq).")


@dataclasses.dataclass
class MoEConfig:
    """Mixture-of-experts options of --model=llama (tfbig.models.moe); each overrides the
    preset's field of the same name (tfbig.models.llama_config.LlamaConfig) when set."""

    num_experts: int = field(0, "MoE: experts in each block's MLP (0 keeps the preset's; "
                                "presets tiny-moe and mixtral-8x7b have them).")
    experts_per_token: int = field(0, "MoE: experts each token is routed to, 1 or 2 (0 "
                                      "keeps the preset's).")
    moe_intermediate_size: int = field(0, "MoE: SwiGLU width of one expert (0 keeps the "
                                          "preset's).")
    shared_intermediate_size: int = field(-1, "MoE: width of the shared experts every "
                                              "token goes through (0: none; -1 keeps the "
                                              "preset's).")
    shared_expert_gate: bool = field(False, "MoE: shared experts' output x sigmoid(x . w), "
                                            "per token (Qwen2-MoE; needs shared experts).")
    router_softmax: str = field("", "MoE: after_topk (Mixtral: softmax of the k chosen "
                                    "logits) | before_topk (Qwen-MoE: the chosen experts' "
                                    "probabilities over all E); empty keeps the preset's.")
    capacity_factor: float = field(0.0, "MoE: each expert takes at most ceil(factor * tokens "
                                        "* k / E) of a micro-batch's assignments (a factor > 0)"
                                        ", the rest dropped and counted. Unset (0 in a config):"
                                        " the preset's, dropless in every preset.")
    router_aux_loss_coef: float = field(-1.0, "MoE: weight of the load-balancing loss "
                                              "(negative keeps the preset's).")
    router_z_loss_coef: float = field(-1.0, "MoE: weight of the router z-loss (< 0: the preset's).")


@dataclasses.dataclass
class HorovodConfig:
    """Options of --strategy=horovod (one process per device, started by horovodrun/mpirun)."""

    scale_lr: bool = field(False, "Horovod: multiply --learning_rate by the number of processes "
                                  "(the linear scaling rule, for a --batch_size that grows "
                                  "with them).")
    hvd_fp16_allreduce: bool = field(False, "Horovod: send gradients as float16 in the "
                                            "allreduce (half the bytes; averaged in float32 "
                                            "otherwise).")
    hvd_thread_policy: str = field("auto", "Horovod: Linux scheduling of Horovod's background "
                                           "threads: batch (SCHED_BATCH: their 1 ms negotiation "
                                           "cycles never preempt the step's compute), normal, or "
                                           "auto (batch when the process sees no GPU).")
    elastic: bool = field(False, "Horovod: train on as ranks die or join (horovodrun --min-np "
                                 "--max-np --host-discovery-script); a layout with groups stops "
                                 "for tfbig-launch --max_restarts to restart it in a new world.")
    elastic_commit_every: int = field(10, "Horovod, with --elastic: steps between in-memory "
                                          "commits a lost rank rolls back to (also before "
                                          "every checkpoint).")


@dataclasses.dataclass
class ParallelConfig:
    """Model-parallel and sharded layouts on the Horovod backend: the rank grid
    (tfbig.distribute.mesh) is data x pipeline x context x tensor, with ZeRO/MiCS groups inside
    data."""

    tensor_parallel: int = field(1, "Horovod: ranks that split each layer (Megatron tensor "
                                    "parallelism; normally the GPUs of one host).")
    context_parallel: int = field(1, "Horovod: ranks that split every sequence (context "
                                     "parallelism: 2 of 2C chunks each, keys/values gathered "
                                     "per attention layer).")
    sequence_parallel: bool = field(False, "Horovod, with --tensor_parallel: split the "
                                           "LayerNorm/dropout regions along the sequence.")
    placement: str = field("cluster", "Horovod: rank order of the mesh: cluster (tensor ranks "
                                      "adjacent, then pipeline, then data), spread, or an "
                                      "order of D, P, T such as DPT (last varies fastest).")
    zero_stage: int = field(0, "Horovod: ZeRO sharding of the model state over a partition "
                               "group: 0 none, 1 optimizer slots, 2 + gradients, "
                               "3 + parameters.")
    shard_degree: int = field(0, "Horovod, with --zero_stage: data-parallel ranks per "
                                 "partition group (MiCS); 0: all of them (ZeRO/FSDP).")
    expert_parallel: int = field(1, "Horovod, with an MoE model: data-parallel ranks that "
                                    "split each MoE layer's experts (E/N each), tokens sent "
                                    "to their experts and back by all-to-all.")


@dataclasses.dataclass
class ProfileConfig:
    """What a run records about its own speed (tfbig.profiling; `tfbig-profile report`)."""

    monitor_interval_ms: int = field(500, "System monitor period in ms: CPU per core, memory, "
                                          "disk reads, I/O wait, GPUs (0: no monitor).")
    profile_steps: str = field("", "Capture a TensorFlow profiler trace of steps N,M "
                                   "(inclusive, e.g. 20,25) for TensorBoard's Profile tab; "
                                   "empty: none.")
    peak_tflops: float = field(0.0, "Peak TFLOP/s of one device for MFU (0: the table for "
                                    "V100/A100/H100/H200, else a CPU matmul probe at start).")


@dataclasses.dataclass
class PipelineConfig:
    """Options of --strategy=pipeline (stages on devices, micro-batches; tfbig.pipeline)."""

    pipeline_stages: int = field(0, "Pipeline: stages the model is cut into: with "
                                     "--strategy=pipeline one device each (GPUs, else logical "
                                     "CPU devices; 0: 2), with --strategy=horovod one rank "
                                     "each (0: no pipeline).")
    num_microbatches: int = field(4, "Pipeline: micro-batches each replica's batch is split "
                                     "into; must divide it.")
    schedule: str = field("1f1b", "Pipeline: gpipe (all forwards, then all backwards) | 1f1b "
                                  "(one forward one backward: at most K micro-batches alive "
                                  "per stage).")
    stage_boundaries: str = field("", "Pipeline: first layer of each stage after the first, "
                                      "by index or name (e.g. 'block_2' or '3,6'); empty: "
                                      "balance automatically.")
    pipeline_balance: str = field("flops", "Pipeline: balance automatic stage boundaries by "
                                           "flops | params.")
    activation_checkpointing: bool = field(False, "Every backend: keep only each transformer "
                                                  "block's input (the pipeline: each stage's) "
                                                  "and recompute its forward in the backward.")
    offload_activations: bool = field(False, "With --activation_checkpointing (not the "
                                             "pipeline): keep the saved block inputs in host "
                                             "memory between forward and backward.")


@dataclasses.dataclass
class ExperimentConfig:
    """All sections of one run; serialised to MODEL_DIR/config.json."""

    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    albert: AlbertTrainConfig = dataclasses.field(default_factory=AlbertTrainConfig)
    multiworker: MultiWorkerConfig = dataclasses.field(default_factory=MultiWorkerConfig)
    horovod: HorovodConfig = dataclasses.field(default_factory=HorovodConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)


SECTIONS = {f.name: f.type for f in dataclasses.fields(ExperimentConfig)}


def _applicability():
    """flag -> (the TrainConfig field that decides, values under which the flag is read)."""
    rules = {"scale_lr": ("strategy", ("horovod",)), "elastic": ("strategy", ("horovod",)),
             "elastic_commit_every": ("strategy", ("horovod",)),
             "hvd_fp16_allreduce": ("strategy", ("horovod", "pipeline")),
             "hvd_thread_policy": ("strategy", ("horovod", "pipeline"))}
    for section, key, allowed in ((PipelineConfig, "strategy", ("pipeline", "horovod")),
                                  (MultiWorkerConfig, "strategy", ("multiworker", "mirrored")),
                                  (ParallelConfig, "strategy", ("horovod",)),
                                  (AlbertTrainConfig, "model", ("albert",)),
                                  (MoEConfig, "model", ("llama",))):
        rules.update({f.name: (key, allowed) for f in dataclasses.fields(section)})
    for flag in ("dynamic_masking", "dynamic_masked_lm_prob"):  # BERT reads them too
        rules[flag] = ("model", ("albert", "bert"))
    # Read by every backend (tfbig.distribute.recompute), though they live in PipelineConfig.
    rules.pop("activation_checkpointing")
    rules["offload_activations"] = ("strategy", ("single", "horovod", "multiworker", "mirrored"))
    return rules


ASYNC_CHECKPOINT = ("auto", "on", "off")


def check_applicable(cfg):
    """Refuse a flag set away from its default where nothing reads it (it would do nothing)."""
    values = {f.name: (getattr(getattr(cfg, name), f.name), f.default)
              for name, section in SECTIONS.items() for f in dataclasses.fields(section)}
    for flag, (key, allowed) in _applicability().items():
        value, default = values[flag]
        chosen = getattr(cfg.train, key)
        if value != default and chosen not in allowed:
            raise ValueError(f"--{flag}={value} has no effect with --{key}={chosen}; it applies "
                             f"to --{key}={' or '.join(allowed)}")
    _check_pipeline_flags(cfg)
    budget_default = TrainConfig.__dataclass_fields__["time_budget_minutes"].default
    if cfg.train.max_steps and cfg.train.time_budget_minutes != budget_default:
        raise ValueError(f"--time_budget_minutes={cfg.train.time_budget_minutes:g} has no effect "
                         f"with --max_steps={cfg.train.max_steps}; it applies to --max_steps=0 "
                         f"(as many steps as fit in the budget). Give one of the two")
    if cfg.train.straggler_every < 0:
        raise ValueError(f"--straggler_every={cfg.train.straggler_every}: expected steps, 0 "
                         f"(never) or more")
    if cfg.train.async_checkpoint not in ASYNC_CHECKPOINT:
        raise ValueError(f"--async_checkpoint={cfg.train.async_checkpoint}: expected one of "
                         f"{' | '.join(ASYNC_CHECKPOINT)}")
    if cfg.train.calibration and not cfg.train.plan_only:
        raise ValueError(f"--calibration={cfg.train.calibration} is read by --plan_only only; "
                         f"add --plan_only or drop it")
    if not cfg.train.compile_update and not cfg.train.xla:
        raise ValueError("--compile_update=false has no effect with --xla=false (nothing is "
                         "compiled); it applies to --xla=true")
    if cfg.pipeline.offload_activations and not cfg.pipeline.activation_checkpointing:
        raise ValueError("--offload_activations needs --activation_checkpointing: only the "
                         "block inputs it keeps for the recompute are offloaded")


def pipeline_stages(cfg):
    """Stages the model is cut into: --pipeline_stages, or the strategy's default for 0
    (2 devices with --strategy=pipeline, no pipeline (1) with --strategy=horovod)."""
    stages = cfg.pipeline.pipeline_stages
    return stages if stages else (2 if cfg.train.strategy == "pipeline" else 1)


def _check_pipeline_flags(cfg):
    """Under --strategy=horovod the schedule flags act only with --pipeline_stages > 1."""
    if cfg.train.strategy != "horovod" or pipeline_stages(cfg) > 1:
        return
    for f in dataclasses.fields(PipelineConfig):
        value = getattr(cfg.pipeline, f.name)
        if f.name in ("num_microbatches", "schedule", "stage_boundaries",
                      "pipeline_balance") and value != f.default:
            raise ValueError(f"--{f.name}={value} has no effect with --strategy=horovod and "
                             f"--pipeline_stages={cfg.pipeline.pipeline_stages}; add "
                             f"--pipeline_stages=K (K > 1 stages, one rank each) or drop it")


def define_flags(flag_values=None):
    """Define one absl flag per config field (name = field name, help = field doc)."""
    from absl import flags

    flag_values = flags.FLAGS if flag_values is None else flag_values  # an empty one is falsy
    definers = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
                float: flags.DEFINE_float, str: flags.DEFINE_string}
    for section in SECTIONS.values():
        for f in dataclasses.fields(section):
            if f.name not in flag_values:
                definers[f.type](
                    f.name, f.default, f.metadata["help"], flag_values=flag_values)


def from_flags(flag_values=None):
    """Build an ExperimentConfig from parsed absl flags."""
    from absl import flags

    flag_values = flags.FLAGS if flag_values is None else flag_values  # an empty one is falsy
    return ExperimentConfig(**{
        name: section(**{f.name: flag_values[f.name].value for f in dataclasses.fields(section)})
        for name, section in SECTIONS.items()})


def to_dict(cfg):
    return dataclasses.asdict(cfg)


def from_dict(data):
    """Inverse of to_dict; unknown keys are an error naming them."""
    sections = {}
    for name, section in SECTIONS.items():
        values = data.get(name, {})
        known = {f.name for f in dataclasses.fields(section)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"config section {name!r} has unknown fields {unknown}")
        sections[name] = section(**values)
    return ExperimentConfig(**sections)


def save_json(cfg, path, extra=None):
    """Write the config (plus `extra` keys, e.g. the resolved model config) atomically."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({**to_dict(cfg), **(extra or {})}, f, indent=2, sort_keys=True)
    os.replace(tmp, path)
