"""Tensor-parallel and ZeRO fine-tuning (tfbig-classify, tfbig-squad) on Horovod.

    horovodrun -np 4 -H localhost:4 --gloo tfbig-classify --strategy=horovod --tensor_parallel=2 ...
    horovodrun -np 4 -H localhost:4 --gloo tfbig-squad --strategy=horovod --zero_stage=2 \\
        --shard_degree=2 ...

The pretraining backends (tfbig.distribute.tensor_parallel, tfbig.distribute.zero) with what
fine-tuning changes; the commands' training step stays tfbig.distribute.finetune.train_step:
- `--tensor_parallel=T [--sequence_parallel]`: the backbone is split by the model's plan
  (tensor_layout.PLANS: BERT's and ALBERT's blocks, heads and MLP width over the tensor group,
  the word table over the vocabulary), applied from outside to the single-device model built
  (and restored from --init_checkpoint) by the command. The task heads (classifier on the
  pooled [CLS], span head) are a few thousand weights: they stay replicated, as the plan's
  replicated region after the backbone. The forward/backward is not XLA-compiled (Horovod ops
  have no XLA kernels); prediction runs on the assembled model, compiled.
- `--zero_stage=1|2|3 [--shard_degree=N]`: optimizer slots and fp32 master slices sharded over
  partition groups of N (MiCS). Fine-tuning takes one micro-batch per step, so stage 2
  reduce-scatters the gradients right after the backward as stage 1 does: the two hold the same
  bytes here (stage 2 saves memory only when several micro-batches accumulate). Stage 3 shards
  the parameters too: each rank cuts its slices from the command's single-device model (so its
  parameters are whole once per rank, at the start), then trains that model's values-free twin
  gathered layer by layer (zero3.PLANS: the backbone's embedding, blocks and pooler, and the
  task head, each gathered around its call; finetune_horovod.ZeroFineTune).
- `--tensor_parallel=T --zero_stage=1`: each tensor rank's optimizer state sharded over its
  partition group (tfbig.distribute.tensor_zero; fp32); stages 2-3 with T > 1 are not built.
- `--precision=mixed_float16|mixed_bfloat16` with --tensor_parallel or --zero_stage=1|2, as
  with plain data parallelism (the command's forward/backward scales the fp16 loss): a
  non-finite gradient in any rank's slice makes every rank's non-finite (ZeRO: in its
  all_reduce_gradients; tensor parallelism: tensor_parallel.skip_everywhere over the tensor
  group), so the step is skipped and the loss scale halved on all ranks alike.
- Output: the chief writes one single-device checkpoint (`assembled_model`: a tensor-parallel
  run joins the slices of its tensor group first) and predicts with that model, so
  tfbig-squad's predict-only runs and `restore_model` read it as any fine-tuned model; no
  zero.json/tensor.json (ZeRO-3: the chief gathers the slices of its partition group first).
  The backends are in finetune_horovod (it imports Horovod).
Refused before training: these flags without --strategy=horovod, --tensor_parallel with
--zero_stage=2|3, --precision other than fp32 with --zero_stage=3 or with --tensor_parallel and
--zero_stage together (not tested). Pipeline fine-tuning: tfbig.distribute.finetune_pipeline.
"""
import dataclasses

from tfbig.config import field
from tfbig.errors import UsageError


@dataclasses.dataclass
class ParallelOptions:
    """How --strategy=horovod splits the fine-tuned model (tfbig-train's flag names)."""

    tensor_parallel: int = field(1, "--strategy=horovod: ranks that split each layer of the "
                                    "backbone (Megatron); the task head stays replicated.")
    sequence_parallel: bool = field(False, "With --tensor_parallel: split the LayerNorm/dropout "
                                           "regions along the sequence.")
    zero_stage: int = field(0, "--strategy=horovod: ZeRO sharding over a partition group: 1 "
                               "optimizer slots and master weights, 2 + gradients (the same "
                               "bytes as 1 when fine-tuning: one micro-batch per step), 3 + "
                               "parameters (gathered per layer; fp32 only).")
    shard_degree: int = field(0, "With --zero_stage: data-parallel ranks per partition group "
                                 "(MiCS); 0: all of them.")


def _asked(options):
    """{flag: value} of the parallel flags `options` sets away from their defaults."""
    defaults = ParallelOptions()
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(ParallelOptions)
            if getattr(options, f.name, getattr(defaults, f.name)) != getattr(defaults, f.name)}


def check(strategy, options, command):
    """Refuse (before any training) a layout fine-tuning does not run; errors name flags."""
    asked = _asked(options)
    if not asked:
        return
    flags = " ".join(f"--{k}={v}" for k, v in asked.items())
    if strategy != "horovod":
        raise UsageError(f"{flags} needs --strategy=horovod (got --strategy={strategy}): "
                         f"{command} splits or shards the model on Horovod only")
    tensor, stage = options.tensor_parallel, options.zero_stage
    if tensor < 1:
        raise UsageError(f"--tensor_parallel={tensor}: expected a positive number of ranks")
    if stage not in (0, 1, 2, 3):
        raise UsageError(f"--zero_stage={stage}: {command} takes 0 (none), 1 (optimizer "
                         "slots), 2 (+ gradients) or 3 (+ parameters)")
    if tensor > 1 and stage > 1:
        raise UsageError(f"--tensor_parallel={tensor} with --zero_stage={stage}: not built (as "
                         "for tfbig-train); use --zero_stage=1 with --tensor_parallel")
    if options.sequence_parallel and tensor < 2:
        raise UsageError("--sequence_parallel needs --tensor_parallel >= 2")
    if options.shard_degree and not stage:
        raise UsageError(f"--shard_degree={options.shard_degree} needs --zero_stage=1, 2 or 3")
    precision = getattr(options, "precision", "fp32")
    if precision != "fp32" and tensor > 1 and stage:
        raise UsageError(f"--precision={precision} with --tensor_parallel={tensor} --zero_stage="
                         f"{stage}: {command} runs that layout in fp32 only; mixed precision "
                         "splits or shards with one of the two flags")
    if precision != "fp32" and stage == 3:
        raise UsageError(f"--precision={precision} with --zero_stage=3: {command} shards the "
                         "parameters in fp32 only; mixed precision shards with --zero_stage=1 "
                         "or 2 (or splits with --tensor_parallel)")


def split_strategy(name, command, options, cfg):
    """The tensor-parallel or ZeRO fine-tuning backend (finetune_horovod) `options` ask for,
    built from ExperimentConfig `cfg`; None when they ask for neither (plain data parallelism)."""
    check(name, options, command)
    if not _asked(options):
        return None
    for flag in dataclasses.fields(ParallelOptions):
        setattr(cfg.parallel, flag.name, getattr(options, flag.name))
    from tfbig.distribute import finetune_horovod  # imports Horovod

    if options.tensor_parallel > 1 and options.zero_stage:
        return finetune_horovod.TensorZeroFineTune(cfg)
    if options.tensor_parallel > 1:
        return finetune_horovod.TensorParallelFineTune(cfg)
    return finetune_horovod.ZeroFineTune(cfg)


def build_model(strategy, build, seq_length, config, loss=None):
    """The fine-tuning model on `strategy`: `build()` makes the single-device model (its
    backbone restored from --init_checkpoint); a tensor-parallel strategy builds this rank's
    slice of it, the pipeline one its stages (computing `loss(outputs, batch)` on the last).
    Call it in `strategy.scope()`."""
    from tfbig.distribute.finetune_pipeline import FineTuneTask

    return strategy.build_model(FineTuneTask(build, seq_length, config, loss))


def compiled(strategy, xla):
    """Whether the command's forward/backward may be XLA-compiled on `strategy` (not with
    tensor parallelism: its collectives run inside the forward and backward)."""
    return xla and getattr(strategy, "compiles_forward_backward", True)


def assembled_model(strategy, model):
    """The fine-tuned model whole: on the chief of a tensor-parallel or ZeRO-3 run, a
    single-device model assembled from the tensor group's or partition group's slices (a
    collective: every rank calls this); else `model` (ZeRO stages 1-2 keep the full
    parameters on every rank)."""
    assemble = getattr(strategy, "assembled_model", None)
    return model if assemble is None else assemble(model)
