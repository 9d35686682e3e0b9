"""Checkpoints of a pipeline whose stages live on different ranks: layout, assembly, consolidation.

Each stage rank of data replica 0 saves the variables it holds (stage 0 in MODEL_DIR, stage k in
MODEL_DIR/pipeline/stage-k, tfbig.checkpoint.piece_dir) and the chief writes
MODEL_DIR/pipeline.json: the number of stages and the layers and weights each stage owns. A
weight held by several stages (a tied or shared one) is read from its owner.

    assembled_weights(model_dir, model)   {path: array} of the single-device model
                                          (tfbig-generate and tfbig-export read it)
    consolidate(model_dir, out_dir)       a single-device checkpoint (weights, optimizer
                                          slots, step, input position): resumes anywhere

    python -m tfbig.pipeline.stage_checkpoint MODEL_DIR OUT_DIR   # consolidate
"""
import os
import re

import numpy as np
import tensorflow as tf

from tfbig.checkpoint import (consolidation_input, consolidation_main, piece_checkpoints,
                              reader_key, slot_owners)
from tfbig.checkpoint import read_layout as checkpoint_layout
from tfbig.distribute.base import Strategy

LAYOUT_FILE = "pipeline.json"


def layout(layers, plan):
    """The JSON layout: {"pipeline_stages": K, "stages": [{"layers", "weights"}, ...]}."""
    return {"pipeline_stages": len(plan), "stages": [
        {"layers": [layer.name for layer in layers[s.start:s.stop]],
         "weights": sorted(v.path for layer in layers[s.start:s.stop] for m in layer.modules
                           for v in m.trainable_variables)} for s in plan]}


def read_layout(model_dir):
    """MODEL_DIR/pipeline.json, or None when the run was not a cross-rank pipeline."""
    return checkpoint_layout(model_dir, LAYOUT_FILE)


def check_resume(model_dir, num_stages):
    """Refuse to resume a checkpoint of another layout (errors say what to do)."""
    saved = read_layout(model_dir)
    if saved is not None and saved["pipeline_stages"] != num_stages:
        raise ValueError(f"--model_dir={model_dir} was written with --pipeline_stages="
                         f"{saved['pipeline_stages']}; this run has {num_stages}. Resume with "
                         f"the same number, or write a single-device checkpoint first: "
                         f"python -m tfbig.pipeline.stage_checkpoint {model_dir} OUT_DIR")
    if saved is None and tf.train.latest_checkpoint(model_dir):
        raise ValueError(f"--model_dir={model_dir} holds a checkpoint without pipeline stages "
                         f"({LAYOUT_FILE} is missing); resume it without --pipeline_stages or "
                         f"start another --model_dir")


def stage_checkpoints(model_dir, saved, warn=print):
    """The newest intact checkpoint of stage 0 and the same-numbered one of every stage."""
    return piece_checkpoints(model_dir, "pipeline", saved["pipeline_stages"], warn)


def assembled_weights(model_dir, model, warn=print):
    """{variable path: array} of `model`'s weights from the newest checkpoint of a cross-rank
    pipeline run, each read from the stage that owns it."""
    saved = read_layout(model_dir)
    readers = [tf.train.load_checkpoint(p) for p in stage_checkpoints(model_dir, saved, warn)]
    owner = {path: s for s, stage in enumerate(saved["stages"]) for path in stage["weights"]}
    out = {}
    for v in model.variables:
        if "seed_generator" in v.path:
            continue
        out[v.path] = readers[owner.get(v.path, 0)].get_tensor(reader_key(model, v))
    return out


class OfflineStage(Strategy):
    """One stage of a cross-rank pipeline run, built and restored in a plain process."""

    def __init__(self, cfg, pipeline, stage_index, num_stages, restore_path):
        super().__init__(cfg)
        self.pipeline = pipeline  # the run's PipelineConfig (its stage boundaries)
        self.stage_index, self.num_stages = stage_index, num_stages
        self.restore_path = restore_path

    @property
    def is_chief(self):
        return False

    def build_model(self, task):
        from tfbig.pipeline.cross_rank import stage_plan
        from tfbig.pipeline.stage_model import build_stage_model

        specs, plan = stage_plan(task, self.pipeline, self.num_stages)
        return build_stage_model(task, plan, specs, self.stage_index, "/device:CPU:0").model

    def restore_dir(self, model_dir):
        return os.path.dirname(self.restore_path)

    def checkpoint_dir(self, model_dir):
        return None


def consolidate(model_dir, out_dir, warn=print):
    """Write the newest checkpoint of cross-rank pipeline run `model_dir` as a single-device
    checkpoint in `out_dir`; `model_dir` is only read. Returns the checkpoint path."""
    from tfbig.trainer import Trainer

    saved, cfg = consolidation_input(model_dir, out_dir, LAYOUT_FILE,
                                     "a cross-rank pipeline run")
    paths = stage_checkpoints(model_dir, saved, warn)
    pipeline, num_stages = cfg.pipeline, saved["pipeline_stages"]
    cfg.train.strategy = "single"  # the Horovod/pipeline sections' flags do not apply
    cfg.pipeline, cfg.horovod, cfg.parallel = (type(cfg.pipeline)(), type(cfg.horovod)(),
                                               type(cfg.parallel)())
    states = []
    for stage, path in enumerate(paths):
        cfg.train.model_dir = model_dir
        trainer = Trainer(cfg, strategy=OfflineStage(cfg, pipeline, stage, num_stages, path))
        if trainer.restored_from is None or \
                os.path.basename(trainer.restored_from) != os.path.basename(path):
            raise ValueError(f"could not restore {path} (found {trainer.restored_from})")
        states.append(_named_state(trainer))
    owner = {path: s for s, stage in enumerate(saved["stages"]) for path in stage["weights"]}
    cfg.train.model_dir = out_dir
    os.makedirs(out_dir, exist_ok=True)
    full = Trainer(cfg)
    slots = slot_owners(full.optimizer)
    for name, variable in _named_variables(full).items():
        stage = owner.get(slots.get(id(variable), name), 0)
        variable.assign(states[stage][name])
    return full.save()


def _named_variables(trainer):
    """{name: variable} of a checkpoint's content, named alike in every layout: weights and
    optimizer variables by path (slots carry their weight's path), counters by name."""
    named = {v.path: v for v in trainer.model.variables if "seed_generator" not in v.path}
    named.update({f"optimizer:{_optimizer_key(v.path)}": v for v in trainer.optimizer.variables})
    named.update({"step": trainer.step, "batches_consumed": trainer.batches_consumed,
                  "nonfinite_steps": trainer.nonfinite_steps})
    return named


def _optimizer_key(path):
    """'adam_w_2/iteration' -> 'adam_w/iteration': Keras numbers the optimizers of a process."""
    owner, _, rest = path.partition("/")
    return re.sub(r"_\d+$", "", owner) + "/" + rest


def _named_state(trainer):
    return {name: np.asarray(v.numpy()) for name, v in _named_variables(trainer).items()}


def main(argv=None):
    """python -m tfbig.pipeline.stage_checkpoint MODEL_DIR OUT_DIR"""
    return consolidation_main(
        argv, "tfbig.pipeline.stage_checkpoint", "a cross-rank pipeline run", consolidate,
        "a single-device checkpoint (resumes under any layout)")


if __name__ == "__main__":
    raise SystemExit(main())
