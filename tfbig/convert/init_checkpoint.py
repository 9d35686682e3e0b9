"""`tfbig-train --init_checkpoint=DIR`: continue pretraining from another model's weights.

Why it is built this way: docs/design/notes/convert.md (tfbig.convert.init_checkpoint).
"""
import dataclasses
import json
import os

import numpy as np

from tfbig.convert import llama
from tfbig.errors import UsageError

HEADS = ("mlm_head/", "nsp_head/", "sop_head/")  # a backbone-only source leaves them fresh


def _check_flags(cfg, directory):
    from tfbig.config import TrainConfig

    if cfg.train.preset != TrainConfig.preset:
        raise UsageError(f"--preset={cfg.train.preset} has no effect with --init_checkpoint="
                         f"{directory}: the architecture is that directory's config.json; drop "
                         "--preset")


def _check_resume(cfg, directory):
    """Refuse a --model_dir checkpoint that was not started from this --init_checkpoint."""
    import tensorflow as tf

    model_dir = cfg.train.model_dir
    if not tf.train.latest_checkpoint(model_dir):
        return
    path = os.path.join(model_dir, "config.json")
    saved = ""
    if os.path.isfile(path):
        with open(path) as file:
            saved = json.load(file).get("train", {}).get("init_checkpoint", "")
    if not saved or os.path.abspath(saved) != os.path.abspath(directory):
        raise UsageError(
            f"--model_dir={model_dir} holds a checkpoint of a run started from "
            f"{'--init_checkpoint=' + saved if saved else 'scratch'} ({path}), not from "
            f"--init_checkpoint={directory}; a resume continues its own run: drop "
            "--init_checkpoint to resume it, or choose an empty --model_dir")


def task_inputs(train, cfg):
    """(TrainConfig, ExperimentConfig) to build the task with: unchanged without
    --init_checkpoint; with it the size flags are cleared and the preset is the family's
    smallest, since `apply` replaces the task's model config by the checkpoint's anyway (BERT
    has no preset of tfbig-train's default name)."""
    if not train.init_checkpoint:
        return train, cfg
    train = dataclasses.replace(train, preset="tiny", num_layers=0, hidden_size=0, num_heads=0)
    albert = dataclasses.replace(cfg.albert, embedding_size=0, num_groups=0)
    return train, dataclasses.replace(cfg, train=train, albert=albert)


def _source(directory):
    """(model config, family) of --init_checkpoint DIR: a tfbig run directory (tfbig-convert's
    output or a --model_dir) or a Hugging Face Llama-family directory, read in place (its names
    and shapes checked here, before anything is written)."""
    import tensorflow as tf

    from tfbig.convert import run_dir

    if llama.is_huggingface(directory):
        return llama.huggingface_weight_reader(directory)[0], "llama"
    config, saved = run_dir.read_config(directory,
                                         families=("gpt", "albert", "bert", "llama"))
    if not tf.train.latest_checkpoint(directory):
        raise UsageError(f"--init_checkpoint={directory}: no checkpoint in it (expected the "
                         "output of tfbig-convert, a tfbig-train --model_dir or a Hugging Face "
                         "Llama-family directory)")
    return config, saved["model_format"]


def apply(task, cfg):
    """Give `task` the model config of --init_checkpoint, after checking that the flags and the
    data agree with it; nothing without --init_checkpoint."""
    directory = cfg.train.init_checkpoint
    if not directory:
        return
    _check_flags(cfg, directory)
    _check_resume(cfg, directory)
    config, family = _source(directory)
    path = os.path.join(directory, "config.json")
    if family != cfg.train.model:
        key = "model_type" if llama.is_huggingface(directory) else "model_format"
        raise UsageError(f"--init_checkpoint={directory} holds a {family} model ({path}: "
                         f"{key}) but --model={cfg.train.model}; give --model={family}")
    t = cfg.train
    given = {"num_layers": t.num_layers, "hidden_size": t.hidden_size, "num_heads": t.num_heads}
    if t.model == "albert":
        given.update(embedding_size=cfg.albert.embedding_size, num_groups=cfg.albert.num_groups)
    for flag, value in given.items():
        if value and value != getattr(config, flag):
            raise UsageError(f"--{flag}={value} disagrees with --init_checkpoint={directory}: "
                             f"{path} has {flag}={getattr(config, flag)}; drop --{flag} (the "
                             "architecture is the checkpoint's)")
    if t.dropout >= 0:
        config = dataclasses.replace(config, dropout=t.dropout)
    # how attention is computed is this run's choice, not the checkpoint's
    config = dataclasses.replace(config, attention=t.attention,
                                 attention_block_size=t.attention_block_size)
    try:
        config.check_inputs(task.seq_length, task.manifest.vocab_size)
    except ValueError as error:
        raise UsageError(f"--data_dir={task.data_dir} does not fit --init_checkpoint="
                         f"{directory}: {error}; prepare the data with its tokenizer (tfbig-prep "
                         f"--tokenizer={directory}) and --seq_length at most {config.seq_length}"
                         ) from error
    task.model_config = config


def load(model, directory, pieces=None):
    """Assign the weights of run directory `directory` to the built `model`; returns the keys
    left at their fresh initialisation (pretraining heads a backbone-only source lacks).

    `pieces` (a backend's Strategy.weight_pieces of `model`; default: every weight whole) says
    which piece of each weight this rank holds: the weights are read one at a time, each
    memory-mapped and cut to its piece, so that a rank reads its slices' bytes of the file
    (tfbig.checkpoints.bundle); another rank's weights are not read. Every name and shape is
    checked before the first weight is read."""
    import tensorflow as tf

    from tfbig.checkpoints.checkpoint import model_variables
    from tfbig.convert import run_dir

    if pieces is None:
        pieces = {key: [v, None, tuple(v.shape)] for key, v in model_variables(model).items()}
    if llama.is_huggingface(directory):
        _, shapes, read = llama.huggingface_weight_reader(directory)
    else:
        shapes, read = run_dir.weight_reader(directory, mapped=True)
    unknown = sorted(set(shapes) - set(pieces))
    missing = sorted(set(pieces) - set(shapes))
    lacking = [key for key in missing if not key.startswith(HEADS)]
    if unknown or lacking:
        raise UsageError(
            f"--init_checkpoint={directory}: its checkpoint does not match the {model.name} "
            f"model of its config.json: {len(unknown)} weights the model lacks "
            f"{unknown[:3]}, {len(lacking)} it has not {lacking[:3]} (a run saved in per-rank "
            "pieces, --zero_stage=3/--tensor_parallel/pipeline, must be consolidated first)")
    for key, (_, _, shape) in sorted(pieces.items()):
        if key in shapes and shape is not None and shapes[key] != tuple(shape):
            raise UsageError(f"--init_checkpoint={directory}: {key} has shape {shapes[key]}, "
                             f"the model's is {tuple(shape)}")
    for key in sorted(set(pieces) & set(shapes)):
        holder, cut, _ = pieces[key]
        if holder is not None:
            value = read(key)  # a numpy map or (stacked experts) bundle.Stacked
            holder.assign(tf.cast(np.asarray(value) if cut is None else cut(value),
                                  holder.dtype))
    return missing


def initialise(trainer):
    """After the trainer's restore: a fresh run loads --init_checkpoint, a resumed one says that
    it did not (before the backend's broadcast of the chief's weights)."""
    t = trainer.cfg.train
    if not t.init_checkpoint:
        return
    if trainer.restored_from:
        trainer.logger.info(f"--init_checkpoint={t.init_checkpoint} not read: the run resumes "
                            f"from {trainer.restored_from}")
        return
    if not trainer.strategy.restores_checkpoint:  # it receives the chief's weights
        return
    fresh = load(trainer.model, t.init_checkpoint,
                 trainer.strategy.weight_pieces(trainer.model))
    trainer.logger.info(f"weights from --init_checkpoint={t.init_checkpoint} (optimizer fresh, "
                        f"step 0)" + (f"; freshly initialised: {fresh}" if fresh else ""))
