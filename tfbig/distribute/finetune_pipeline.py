"""Pipeline fine-tuning (tfbig-classify, tfbig-squad): `--strategy=pipeline`.

    tfbig-classify --strategy=pipeline --pipeline_stages=4 --num_microbatches=4 \\
        --schedule=gpipe ...
    tfbig-squad --strategy=pipeline --pipeline_stages=2 --schedule=1f1b ...

tfbig-train's in-process pipeline (tfbig.pipeline.strategy: one stage per device of this
process, GPUs or else logical CPU devices) driven by the command's own training step
(tfbig.distribute.finetune.train_step). The model is cut by pretraining's partitioner into
embedding | transformer layers (BERT's blocks; ALBERT's layers, which may read a shared block
owned by an earlier stage) | heads, where `heads` is the task head (tfbig.pipeline.layers:
BERT's classifier on the pooled [CLS], the span head) on the last stage, which also computes
the loss (`FineTuneTask.loss_from_outputs`). Each global batch of --train_batch_size is split
into --num_microbatches equal micro-batches run by --schedule (gpipe | 1f1b); the stages' summed
gradients go to the command's one optimizer update, clipping at the whole model's norm: the
run equals one device on the same global batches.

--init_checkpoint: the stages live in one process, so the command's own build runs as usual
(restoring the backbone into whole variables), each layer's variables created on its stage's
device. Output: the strategy's `assembled_model` copies the weights into a single-device
model, which the command predicts with and writes (the usual fine-tuned checkpoint:
tfbig-squad's predict-only runs and restore_model read it as any other).

Refused before training, naming the flags: these flags without --strategy=pipeline,
--strategy=horovod with --pipeline_stages (stages on different ranks: tfbig-train's
cross_rank pipeline is not wired to the commands), --strategy=pipeline under horovodrun
(data-parallel replicas of the pipeline), --precision other than fp32 (tested in fp32 only), a
--train_batch_size that --num_microbatches does not divide; --tensor_parallel and --zero_stage
need --strategy=horovod (finetune_parallel.check).
"""
import dataclasses
from typing import Callable

from tfbig.config import field
from tfbig.errors import UsageError

INPUTS = ("input_ids", "segment_ids", "input_mask")  # what the models read of a batch


@dataclasses.dataclass
class PipelineOptions:
    """How --strategy=pipeline cuts the fine-tuned model (tfbig-train's flag names)."""

    pipeline_stages: int = field(0, "--strategy=pipeline: stages the model is cut into, one "
                                    "device each (GPUs, else logical CPU devices); 0: 2.")
    num_microbatches: int = field(4, "--strategy=pipeline: micro-batches each "
                                     "--train_batch_size is split into; must divide it.")
    schedule: str = field("1f1b", "--strategy=pipeline: gpipe (all forwards, then all "
                                  "backwards) | 1f1b (at most K micro-batches alive per stage).")
    stage_boundaries: str = field("", "--strategy=pipeline: first layer of each stage after "
                                      "the first, by index or name (e.g. 'block_2' or '2,4'); "
                                      "empty: balanced automatically.")
    pipeline_balance: str = field("flops", "--strategy=pipeline: balance automatic stage "
                                           "boundaries by flops | params.")
    activation_checkpointing: bool = field(False, "--strategy=pipeline: keep only each stage's "
                                                  "input and recompute its forward in the "
                                                  "backward.")


@dataclasses.dataclass
class FineTuneTask:
    """A fine-tuning command seen as a task (the single-replica view a backend builds from):
    `build()` makes the single-device model (its backbone restored from --init_checkpoint);
    `loss(outputs, batch)` is the task's mean loss on the model's outputs, which the pipeline
    computes on its last stage (None: the command computes it itself)."""

    build: Callable
    seq_length: int
    model_config: object
    loss: Callable = None

    def build_model(self):
        return self.build()

    def model_inputs(self, batch):
        return {name: batch[name] for name in INPUTS}

    def loss_from_outputs(self, outputs, batch):
        """(mean loss, metrics: none) of the model's outputs on `batch`."""
        if self.loss is None:
            raise RuntimeError("the pipeline computes the loss on its last stage: pass the "
                               "task's loss(outputs, batch) to finetune_parallel.build_model")
        return self.loss(outputs, batch), {}

    def layer_specs(self):
        """The LayerSpecs the pipeline cuts the model by: the backbone's as tfbig-train's
        (tfbig.plan.models) and the fine-tuning head as the last layer, `heads`."""
        return fine_tune_specs(self.model_config, self.seq_length)


def fine_tune_specs(config, seq_length):
    """tfbig.plan.models.fine_tune_specs (kept here for tfbig-squad's loop)."""
    from tfbig.plan.models import fine_tune_specs as specs

    return specs(config, seq_length)


def _asked(options):
    """{flag: value} of the pipeline flags `options` sets away from their defaults."""
    defaults = PipelineOptions()
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(PipelineOptions)
            if getattr(options, f.name, getattr(defaults, f.name)) != getattr(defaults, f.name)}


def configure(name, options, cfg, command):
    """Check the pipeline flags of `options` (a command's options, or None) for --strategy=
    `name` of `command` (errors name the flags, before any training) and, for
    --strategy=pipeline, set them and the global batch in ExperimentConfig `cfg`, which the
    pipeline backend (tfbig.pipeline.strategy.PipelineStrategy) is built from."""
    if name != "pipeline":
        _refuse_pipeline_flags(name, options, command)
        return
    _check(options, command)
    cfg.train.strategy = "pipeline"
    cfg.train.batch_size = getattr(options, "train_batch_size", cfg.train.batch_size)
    for flag in dataclasses.fields(PipelineOptions):
        setattr(cfg.pipeline, flag.name,
                getattr(options, flag.name, getattr(PipelineOptions, flag.name)))


def _refuse_pipeline_flags(strategy, options, command):
    """The pipeline flags act with --strategy=pipeline only."""
    asked = _asked(options)
    if asked:
        flags = " ".join(f"--{k}={v}" for k, v in asked.items())
        cross_rank = (" (stages on different Horovod ranks are built for tfbig-train only)"
                      if strategy == "horovod" else "")
        raise UsageError(f"{flags} needs --strategy=pipeline (got --strategy={strategy})"
                         f"{cross_rank}: {command} pipelines the model over this process's "
                         "devices")


def _check(options, command):
    """What --strategy=pipeline does not run for `command`, refused by flag."""
    from tfbig.pipeline.data_parallel import launched_by_horovod

    if launched_by_horovod():
        raise UsageError(f"--strategy=pipeline under horovodrun: {command} runs the pipeline "
                         "in one process (data-parallel replicas of it are not built for "
                         "fine-tuning); run one process, or use --strategy=horovod")
    precision = getattr(options, "precision", "fp32")
    if precision != "fp32":
        raise UsageError(f"--precision={precision} with --strategy=pipeline: {command} "
                         "pipelines the model in fp32 only; drop --precision")
    stages = getattr(options, "pipeline_stages", PipelineOptions.pipeline_stages)
    micro = getattr(options, "num_microbatches", PipelineOptions.num_microbatches)
    if micro < 1 or stages < 0:
        raise UsageError(f"--pipeline_stages={stages} --num_microbatches={micro}: expected "
                         ">= 0 stages (0: 2) and >= 1 micro-batch")
    batch = getattr(options, "train_batch_size", None)
    if batch is not None and batch % micro:
        raise UsageError(f"--train_batch_size={batch} does not split into --num_microbatches="
                         f"{micro} equal micro-batches; choose a --num_microbatches that "
                         f"divides {batch}")
