"""A Trainer's run directory: refuse one that holds another model (or a converted run whose
files would be overwritten), and write config.json (the flags, the model's config, what was
resolved, the time budget's decision) with the tokenizer files beside it."""
import dataclasses
import json
import os
import shutil

import tensorflow as tf

from tfbig import config as config_lib
from tfbig import data
from tfbig.models.common import COMPUTE_FIELDS


def check(trainer):
    """Refuse to resume a run directory whose model differs from the requested one."""
    path = os.path.join(trainer.cfg.train.model_dir, "config.json")
    model_config = dataclasses.asdict(trainer.task.model_config)
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if "converted_from" in saved:  # its config.json and tokenizer would be overwritten
            raise ValueError(
                f"--model_dir={trainer.cfg.train.model_dir} is a tfbig-convert run directory "
                f"({saved['converted_from']}); its config.json and tokenizer would be "
                "overwritten. Continue training it with --init_checkpoint="
                f"{trainer.cfg.train.model_dir} and another --model_dir.")
        saved = saved.get("model_config", {})
        diff = {k: (saved.get(k), v) for k, v in model_config.items()
                if saved.get(k) != v and k not in COMPUTE_FIELDS}
        if diff and tf.train.latest_checkpoint(trainer.cfg.train.model_dir):
            raise ValueError(
                f"--model_dir={trainer.cfg.train.model_dir} holds a checkpoint of a different "
                f"model; (saved, requested) per field: {diff}. Use another --model_dir.")
    if trainer.strategy.is_chief:
        save_config(trainer)
        tokenizer_path = trainer.task.manifest.tokenizer_path  # "": a user task has none
        files, _ = data.run_tokenizer_files(tokenizer_path) if tokenizer_path else ({}, None)
        for name, source in files.items():  # tokenizer.model, or GPT-2's BPE files
            target = os.path.join(trainer.cfg.train.model_dir, name)
            if not os.path.exists(target) or not os.path.samefile(source, target):
                shutil.copyfile(source, target)  # (tfbig-squad predicts from its own)

def save_config(trainer):
    """MODEL_DIR/config.json: the flags, the model's config and what was resolved."""
    extra = {"model_config": dataclasses.asdict(trainer.task.model_config),
             "resolved_data_dir": trainer.task.data_dir,
             "model_format": getattr(trainer.task, "model_format", trainer.task.format)}
    if trainer.budget:
        extra["budget"] = dataclasses.asdict(trainer.budget)
    tokenizer_path = trainer.task.manifest.tokenizer_path
    _, tokenizer = data.run_tokenizer_files(tokenizer_path) if tokenizer_path else ({}, None)
    if tokenizer:  # {"kind": "byte_level_bpe", ...}: what tfbig-generate and exports read
        extra["tokenizer"] = tokenizer
    config_lib.save_json(trainer.cfg, os.path.join(trainer.cfg.train.model_dir, "config.json"),
                         extra=extra)
