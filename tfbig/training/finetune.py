"""What the fine-tuning commands (tfbig-classify, tfbig-squad) share: their flags mapped onto
the one Trainer's ExperimentConfig, so every backend and Trainer feature applies to them.

    cfg = experiment(options, tensor_parallel=2)   # any ExperimentConfig field by name
    cfg.train.max_steps = steps_of(options, num_examples)
    trainer = Trainer(cfg, task=task, logger=LossRecorder(...))

The recipe is BERT's: AdamW (beta_2 0.999, epsilon 1e-6, weight decay off LayerNorm and
biases), linear warmup over --warmup_proportion of the steps, linear decay to zero, gradients
clipped at global norm 1. --output_dir is the run directory: checkpoints every
--checkpoint_every steps and at the end, and a rerun of the same command resumes there.
"""
import dataclasses
import json
import math
import os

from absl import flags

from tfbig.config import ExperimentConfig, field  # noqa: F401 - field: the commands'
from tfbig.errors import UsageError
from tfbig.training.logs import RunLogger


@dataclasses.dataclass
class FineTuneOptions:
    """The fine-tuning flags of both commands (BERT's names); the other Trainer flags
    (--strategy's sections, --checkpoint_every, --deterministic...) are tfbig-train's."""

    output_dir: str = field("runs/finetune", "Run directory: predictions, scores, config.json "
                                             "and checkpoints (a rerun resumes from them).")
    train_batch_size: int = field(32, "Global examples per training step.")
    learning_rate: float = field(2e-5, "Peak AdamW learning rate.")
    num_train_epochs: float = field(3.0, "Epochs over the training examples.")
    max_steps: int = field(0, "Training steps (0: from --num_train_epochs).")
    warmup_proportion: float = field(0.1, "Share of steps of linear warmup.")
    weight_decay: float = field(0.01, "AdamW weight decay (not on LayerNorm, biases).")
    seed: int = field(0, "Seed for the new head, dropout and data order.")
    xla: bool = field(True, "Compile the forward and backward pass (and prediction) with XLA.")
    strategy: str = field("single", "single | horovod (horovodrun) | multiworker (TF_CONFIG) | "
                                    "mirrored | pipeline; --train_batch_size is global.")
    precision: str = field("fp32", "fp32 | mixed_float16 (dynamic loss scaling; a step with "
                                   "non-finite gradients is skipped) | mixed_bfloat16.")
    log_every: int = field(1, "Log (and record in train_losses.json) the loss every N steps.")


# Command flag -> TrainConfig field where the names differ.
RENAMED = {"output_dir": "model_dir", "train_batch_size": "batch_size"}
# tfbig-train flags the commands refuse, and why (the others they refuse are the recipe's).
NOT_TAKEN = {"time_budget_minutes": (
    "train for --num_train_epochs or --max_steps: the recipe's warmup (--warmup_proportion) "
    "and linear decay to zero are shares of a step count known before the first step, which "
    "a time budget only fixes after timing the run; give --max_steps (with --checkpoint_every, "
    "a rerun of the command resumes)")}


def trainer_flags(options_class):
    """ExperimentConfig fields a command also takes as flags: all but its own names."""
    own = {f.name for f in dataclasses.fields(options_class)} | set(RENAMED.values()) | {
        "model", "preset", "data_dir", "init_checkpoint", "sample_tokens", "plan_only",
        "warmup_steps", "lr_schedule", "min_lr_ratio", "optimizer", "beta_1", "beta_2",
        "epsilon", "grad_clip_norm", "time_budget_minutes", "seq_length", "num_layers",
        "hidden_size", "num_heads"}
    from tfbig.config import SECTIONS

    return [f.name for section in SECTIONS.values() for f in dataclasses.fields(section)
            if f.name not in own]


def experiment(options, model, **overrides):
    """The ExperimentConfig of fine-tuning `options` (FineTuneOptions fields) for task
    `model`; `overrides` sets any other ExperimentConfig field by its flag name."""
    cfg = ExperimentConfig()
    t = cfg.train
    for f in dataclasses.fields(FineTuneOptions):
        if f.name not in ("num_train_epochs", "warmup_proportion"):
            setattr(t, RENAMED.get(f.name, f.name), getattr(options, f.name))
    t.model, t.optimizer, t.lr_schedule, t.min_lr_ratio = model, "adamw", "linear", 0.0
    t.beta_2, t.epsilon, t.grad_clip_norm = 0.999, 1e-6, 1.0
    t.sample_tokens, t.eval_steps = 0, 0  # score the whole eval set
    sections = [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]
    for name, value in overrides.items():
        section = next((s for s in sections if name in {f.name for f in
                                                        dataclasses.fields(s)}), None)
        if section is None:
            raise UsageError(f"--{name}: not a flag of the fine-tuning commands")
        setattr(section, name, value)
    return cfg


def strategy(cfg):
    """The backend of `cfg`, built before the task reads its examples (MultiWorkerMirrored
    must configure TensorFlow's collectives before any op runs)."""
    from tfbig.training.registry import get_strategy

    return get_strategy(cfg.train.strategy, cfg)


def set_steps(cfg, options, num_examples):
    """--max_steps, else --num_train_epochs over `num_examples`; warmup as its share."""
    steps = options.max_steps or max(1, math.ceil(
        options.num_train_epochs * num_examples / options.train_batch_size))
    cfg.train.max_steps = steps
    cfg.train.warmup_steps = int(options.warmup_proportion * steps)
    return steps


class LossRecorder(RunLogger):
    """The Trainer's logger, also keeping each logged step's loss (and fp16 loss scale)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses, self.loss_scales = [], []

    def progress(self, step, values):
        self.losses.append(float(values["loss"]))
        if "loss_scale" in values:
            self.loss_scales.append(float(values["loss_scale"]))
        super().progress(step, values)


def write_json(directory, name, content):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "w", encoding="utf-8") as file:
        json.dump(content, file, indent=1, ensure_ascii=False)


def write_losses(trainer, logger, options):
    """train_losses.json (each logged step's loss); loss_scales.json with mixed_float16."""
    write_json(options.output_dir, "train_losses.json", logger.losses)
    if options.precision == "mixed_float16":
        write_json(options.output_dir, "loss_scales.json", logger.loss_scales)


def define_flags(options_class):
    """absl flags of the command's own options, then the Trainer's others (tfbig-train's)."""
    from tfbig import config

    definers = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
                float: flags.DEFINE_float, str: flags.DEFINE_string}
    for f in dataclasses.fields(options_class):
        if f.name not in flags.FLAGS:
            definers[f.type](f.name, f.default, f.metadata["help"])
    config.define_flags()  # the names already defined above keep the command's defaults


def overrides_from_flags(options_class):
    """{flag: value} of the Trainer flags given on the command line; one of tfbig-train's
    that the command names otherwise (--model_dir: --output_dir) or sets itself is refused."""
    from tfbig.config import SECTIONS

    passed = {f.name: flags.FLAGS[f.name].value for s in SECTIONS.values()
              for f in dataclasses.fields(s) if not flags.FLAGS[f.name].using_default_value}
    own = {f.name for f in dataclasses.fields(options_class)}
    allowed = set(trainer_flags(options_class)) | own
    refused = sorted(set(passed) - allowed)
    if refused:
        renamed = {v: k for k, v in RENAMED.items()}
        raise UsageError(f"--{refused[0]} is tfbig-train's; the fine-tuning commands "
                         + (f"take --{renamed[refused[0]]}" if refused[0] in renamed else
                            NOT_TAKEN.get(refused[0], "set it from their own flags (the "
                                                      "BERT recipe)")))
    return {k: v for k, v in passed.items() if k not in own}
