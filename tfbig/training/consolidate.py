"""Consolidation: a sharded run's newest checkpoint as one single-device checkpoint.

A ZeRO (zero.json), tensor-parallel (tensor.json) or cross-rank pipeline run (pipeline.json, with
or without --tensor_parallel) saves one piece per rank of its first replica. `consolidate` reads
the pieces and writes a single-device checkpoint (weights, optimizer slots, step, input
position) that resumes under any layout; the run's directory is only read.

    python -m tfbig.commands.consolidate MODEL_DIR OUT_DIR

Fine-tuning runs (tfbig-classify, tfbig-squad) are refused by name: their task is built from
the command's flags and data files, not from config.json. So is a run of a user's own model
(tfbig.train; config.json says "model_format": "user"): only the user's code builds it, so it
is consolidated from Python, `tfbig.consolidate_run(task_or_model_fn, MODEL_DIR, OUT_DIR)`,
which hands `consolidate` the task.

This is a command: it builds a Trainer to hold the full state, so it sits above the trainer.
The layouts themselves and the readers of their pieces (tfbig-generate and tfbig-export read
weights straight from the pieces) sit below the backends: tfbig.layouts.zero_checkpoint,
tfbig.layouts.tensor_layout and tfbig.layouts.stage_checkpoint.
"""
import json
import os

from tfbig.checkpoints import integrity
from tfbig.checkpoints.checkpoint import state_arrays, state_variables
from tfbig.distribute.base import Strategy
from tfbig.layouts import (expert_checkpoint, stage_checkpoint, tensor_layout, tensor_plan,
                           zero_checkpoint)
from tfbig.training.trainer import Trainer

COMMAND = "python -m tfbig.commands.consolidate MODEL_DIR OUT_DIR"
FINE_TUNING = {"classify": "tfbig-classify", "squad": "tfbig-squad"}  # --model: its command
USER_API = "tfbig.consolidate_run(task_or_model_fn, MODEL_DIR, OUT_DIR)"


def consolidation_input(model_dir, out_dir, filename, what, task=None):
    """The checks before consolidating run `model_dir` (layout `filename`, a run of `what`)
    into a single-device checkpoint in `out_dir` (`task`: the UserTask of a run of a user's
    own model); returns (layout, the run's config)."""
    import tensorflow as tf

    from tfbig import config as config_lib
    from tfbig.checkpoints.checkpoint import read_layout

    layout = read_layout(model_dir, filename)
    if layout is None:
        raise ValueError(f"{model_dir} has no {filename}: it is not {what}")
    if os.path.abspath(out_dir) == os.path.abspath(model_dir):
        raise ValueError("the output directory must differ from the run's (it is only read)")
    if tf.train.latest_checkpoint(out_dir):
        raise ValueError(f"{out_dir} already holds a checkpoint; choose an empty directory")
    with open(os.path.join(model_dir, "config.json")) as f:
        saved = json.load(f)
    _check_task(model_dir, saved, task)
    cfg = config_lib.from_dict(saved)
    if task is None and cfg.train.model in FINE_TUNING:
        command = FINE_TUNING[cfg.train.model]
        raise ValueError(
            f"{model_dir} is a {command} run: its model (the task's head on the "
            f"--init_checkpoint backbone) is built from the command's own flags and files, "
            f"which config.json does not hold, so it is not consolidated; predict from it with "
            f"{command} and the run's --strategy/--tensor_parallel/--zero_stage/"
            f"--pipeline_stages flags (a ZeRO run also re-shards on load to any rank count)")
    return layout, cfg


def _check_task(model_dir, saved, task):
    """Refuse a run of a user's own model without its `task` (this command cannot build it),
    a task of another name than the run's, and a task for a run of tfbig's own models."""
    user = saved.get("model_format") == "user"
    name = saved.get("model_config", {}).get("task")
    if user and task is None:
        raise ValueError(
            f"{model_dir} is a run of your own model (task {name!r}, trained with tfbig.train): "
            f"config.json names the task, not how to build it, so {COMMAND} cannot rebuild "
            f"it; consolidate it from Python with the Task (or model_fn, with its "
            f"tensor_layout) it was trained with: {USER_API}")
    if task is not None and not user:
        raise ValueError(f"{model_dir} is a run of tfbig's own --model="
                         f"{saved.get('train', {}).get('model')!r}, not of a task: consolidate "
                         f"it with {COMMAND}")
    if task is not None and task.model_config.task != name:
        raise ValueError(f"{model_dir} was trained as task {name!r}; the task given is named "
                         f"{task.model_config.task!r} (give it name={name!r})")


def consolidate(model_dir, out_dir, warn=print, task=None):
    """Write the newest checkpoint of sharded run `model_dir` as a single-device checkpoint in
    `out_dir`, whichever layout wrote it. Returns the checkpoint path written. `task`: for a
    run of a user's own model, the tfbig.tasks.user_adapter.UserTask that builds it
    (tfbig.consolidate_run)."""
    if expert_checkpoint.read_layout(model_dir) is not None:
        raise ValueError(f"{model_dir} was written with --expert_parallel "
                         f"({expert_checkpoint.LAYOUT_FILE}): this consolidation does not join "
                         f"expert pieces; resume it with the same flags (tfbig-generate and "
                         f"tfbig-export read its weights)")
    if tensor_layout.read_layout(model_dir) is not None:
        return consolidate_tensor(model_dir, out_dir, warn, task)
    if stage_checkpoint.read_layout(model_dir) is not None:  # pipeline, or TP x PP
        return consolidate_pipeline(model_dir, out_dir, warn, task)
    if zero_checkpoint.read_layout(model_dir) is not None:
        return consolidate_zero(model_dir, out_dir, warn, task)
    raise ValueError(f"{model_dir} has none of {tensor_layout.LAYOUT_FILE}, "
                     f"{stage_checkpoint.LAYOUT_FILE}, {zero_checkpoint.LAYOUT_FILE}: it is not "
                     f"a sharded run (a single-device checkpoint needs no consolidation)")


# ---- ZeRO -----------------------------------------------------------------------------------
def consolidate_zero(model_dir, out_dir, warn=print, task=None):
    """The newest checkpoint of ZeRO run `model_dir`, re-sharded for one process (any stage)."""
    from tfbig.distribute.zero3 import Partition

    layout, cfg = consolidation_input(model_dir, out_dir, zero_checkpoint.LAYOUT_FILE,
                                      "a --zero_stage run", task)
    latest, _ = integrity.newest_intact(model_dir, warn, keep_damaged=True)
    if latest is None:
        raise FileNotFoundError(f"--model_dir={model_dir} has no checkpoint")
    cfg.train.strategy, cfg.train.model_dir = "single", out_dir
    cfg.parallel = type(cfg.parallel)()
    os.makedirs(out_dir, exist_ok=True)
    trainer = Trainer(cfg, strategy=Strategy(cfg), task=task, logger=_logger(out_dir, task))
    zero_checkpoint.restore_resharded(trainer.checkpoint, model_dir, layout, latest,
                                      trainer.model, trainer.model.trainable_variables,
                                      trainer.optimizer, Partition(None, 1, 0))
    return trainer.save()


# ---- tensor parallel ------------------------------------------------------------------------
class OfflineSlice(Strategy):
    """One tensor rank's piece of a run, built and restored in a plain process (no Horovod):
    what `consolidate_tensor` reads the optimizer state through."""

    def __init__(self, cfg, rank, size, restore_path):
        super().__init__(cfg)
        self.group = tensor_plan.TensorGroup(None, rank, size)
        self.restore_path = restore_path
        self.splits = {}

    @property
    def is_chief(self):
        return False

    def build_model(self, task):
        model, self.splits = tensor_layout.split_model(task, self.group)
        return model

    def restore_dir(self, model_dir):
        return os.path.dirname(self.restore_path)

    def checkpoint_dir(self, model_dir):
        return None


def consolidate_tensor(model_dir, out_dir, warn=print, task=None):
    """The newest checkpoint of tensor-parallel run `model_dir`, each split variable (weights
    and optimizer slots) joined from the ranks' slices."""
    layout, cfg = consolidation_input(model_dir, out_dir, tensor_layout.LAYOUT_FILE,
                                      "a tensor-parallel run", task)
    _refuse_sliced_slots(model_dir, "--tensor_parallel")
    layout = tensor_layout.read_layout(model_dir)
    paths = tensor_layout.rank_checkpoints(model_dir, layout, warn)
    cfg.train.strategy = "single"
    cfg.parallel = type(cfg.parallel)()
    size = layout["tensor_parallel"]
    pieces = []
    for rank, path in enumerate(paths):
        cfg.train.model_dir = model_dir
        trainer = Trainer(cfg, strategy=OfflineSlice(cfg, rank, size, path), task=task,
                          logger=_logger(model_dir, task))
        _check_restored(trainer, path)
        pieces.append(state_arrays(trainer, layout["splits"]))
    cfg.train.model_dir = out_dir
    os.makedirs(out_dir, exist_ok=True)
    full = Trainer(cfg, task=task, logger=_logger(out_dir, task))
    for name, variable in state_variables(full).items():
        piece = pieces[0][name][1]
        values = [p[name][0] for p in pieces]
        variable.assign(values[0] if piece is None else tensor_layout.join_slices(values, *piece))
    return full.save()


def _refuse_sliced_slots(model_dir, flag):
    """Refuse a model-parallel run whose optimizer slots are ZeRO slices too (zero.json:
    tfbig.distribute.tensor_zero, tfbig.pipeline.zero_stage)."""
    zero = zero_checkpoint.read_layout(model_dir)
    if zero is not None:
        raise ValueError(f"{model_dir} was written with {flag} and --zero_stage="
                         f"{zero['zero_stage']} (zero.json): its optimizer slots are sliced "
                         f"over data ranks too, which this consolidation does not join; "
                         f"resume it with the same flags (tfbig-generate and tfbig-export "
                         f"read its weights)")


def _logger(model_dir, task):
    """A silent RunLogger for a user task's Trainers (their data is not read: it would say
    the run has no validation split), else None: the Trainer's own."""
    from tfbig.training.logs import RunLogger

    return RunLogger(model_dir, False, 0) if task is not None else None


def _check_restored(trainer, path):
    if trainer.restored_from is None or \
            os.path.basename(trainer.restored_from) != os.path.basename(path):
        raise ValueError(f"could not restore {path} (found {trainer.restored_from})")


# ---- cross-rank pipeline (with or without tensor parallelism) -------------------------------
class OfflineStage(Strategy):
    """One stage of a cross-rank pipeline run, built and restored in a plain process."""

    def __init__(self, cfg, pipeline, stage_index, num_stages, restore_path, tensor_rank=0,
                 tensor_parallel=1):
        super().__init__(cfg)
        self.pipeline = pipeline  # the run's PipelineConfig (its stage boundaries)
        self.stage_index, self.num_stages = stage_index, num_stages
        self.restore_path = restore_path
        self.group = tensor_plan.TensorGroup(None, tensor_rank, tensor_parallel)

    @property
    def is_chief(self):
        return False

    def build_model(self, task):
        from tfbig.pipeline.cross_rank import stage_plan
        from tfbig.pipeline.stage_model import build_stage_model
        from tfbig.pipeline.tensor_stage import build_tensor_stage

        specs, plan = stage_plan(task, self.pipeline, self.num_stages)
        if self.group.size > 1:  # this tensor rank's slices, no collectives
            return build_tensor_stage(task, plan, specs, self.stage_index, "/device:CPU:0",
                                      self.group)[0].model
        return build_stage_model(task, plan, specs, self.stage_index, "/device:CPU:0").model

    def restore_dir(self, model_dir):
        return os.path.dirname(self.restore_path)

    def checkpoint_dir(self, model_dir):
        return None


def consolidate_pipeline(model_dir, out_dir, warn=print, task=None):
    """The newest checkpoint of cross-rank pipeline run `model_dir`: each weight (and its
    optimizer slots) from the stage that owns it, a tensor-split one joined from that stage's
    tensor ranks."""
    from tfbig.checkpoints.checkpoint import slot_owners

    saved, cfg = consolidation_input(model_dir, out_dir, stage_checkpoint.LAYOUT_FILE,
                                     "a cross-rank pipeline run", task)
    _refuse_sliced_slots(model_dir, "--pipeline_stages")
    paths = stage_checkpoint.piece_paths(model_dir, saved, warn)
    pipeline, num_stages = cfg.pipeline, saved["pipeline_stages"]
    size = stage_checkpoint.tensor_degree(saved)
    cfg.train.strategy = "single"  # the Horovod/pipeline sections' flags do not apply
    cfg.pipeline, cfg.horovod, cfg.parallel = (type(cfg.pipeline)(), type(cfg.horovod)(),
                                               type(cfg.parallel)())
    states = [[_stage_state(cfg, model_dir, OfflineStage(
        cfg, pipeline, stage, num_stages, path, rank, size), task)
        for rank, path in enumerate(pieces)] for stage, pieces in enumerate(paths)]
    owner = stage_checkpoint.weight_owners(saved)
    splits = stage_checkpoint.saved_splits(saved)
    cfg.train.model_dir = out_dir
    os.makedirs(out_dir, exist_ok=True)
    full = Trainer(cfg, task=task, logger=_logger(out_dir, task))
    slots = slot_owners(full.optimizer)
    for name, variable in stage_checkpoint.named_variables(full).items():
        weight = slots.get(id(variable), name)  # an optimizer slot: the weight it belongs to
        stage, piece = states[owner.get(weight, 0)], splits.get(weight)
        variable.assign(stage[0][name] if piece is None else
                        tensor_layout.join_slices([ranks[name] for ranks in stage], *piece))
    return full.save()


def _stage_state(cfg, model_dir, offline, task=None):
    """The named state of one piece (stage, tensor rank) restored through `offline`."""
    cfg.train.model_dir = model_dir
    trainer = Trainer(cfg, strategy=offline, task=task, logger=_logger(model_dir, task))
    _check_restored(trainer, offline.restore_path)
    return stage_checkpoint.named_state(trainer)
