"""A converted model as a tfbig run directory, and back.

    OUTPUT_DIR/config.json   {"model_format": "bert", "model_config": {...BertConfig},
                              "tokenizer": {"vocab_file": "vocab.txt", "lowercase": ...},
                              "converted_from": "<format>:<path>"}
    OUTPUT_DIR/vocab.txt     the WordPiece vocabulary (ALBERT: tokenizer.model; GPT-2:
                             vocab.json + merges.txt, "tokenizer": {"kind": "byte_level_bpe"})
    OUTPUT_DIR/ckpt-0.*      tf.train.Checkpoint(model={tfbig key: variable}): the trainer's
                             layout, so `tf.train.latest_checkpoint(OUTPUT_DIR)` and
                             `--init_checkpoint=OUTPUT_DIR` find it

Only the weights the source had are written (a backbone-only source gives no pretraining heads).
"""
import dataclasses
import json
import os
import shutil
import sys

import numpy as np
import tensorflow as tf

from tfbig.checkpoints import bundle, integrity
from tfbig.checkpoints.checkpoint import model_key, model_variables
from tfbig.errors import UsageError
from tfbig.layouts import expert_checkpoint, stage_checkpoint, tensor_layout, zero_checkpoint
from tfbig.models.configs import AlbertConfig, BertConfig, GPTConfig
from tfbig.models.gpt import GPT
from tfbig.models.llama import Llama
from tfbig.models.llama_config import LlamaConfig


def write(output_dir, config, weights, vocab_file, lowercase, source, family="bert"):
    """Write the run directory; refuses one that already holds a checkpoint. An ALBERT run
    gets its SentencePiece model as tokenizer.model, where tfbig-train runs keep theirs."""
    tokenizer = {"bert": {"vocab_file": "vocab.txt", "lowercase": lowercase},
                 "albert": {"vocab_file": "tokenizer.model"}}[family]
    return write_run(output_dir, config, weights, tokenizer,
                     {tokenizer["vocab_file"]: vocab_file}, source, family)


def write_run(output_dir, config, weights, tokenizer, files, source, family):
    """The run directory of any family: the checkpoint, `files` ({name in the run: path to copy},
    the tokenizer's) and config.json with the `tokenizer` entry that says how to read them."""
    if tf.train.latest_checkpoint(output_dir):
        raise UsageError(f"--output_dir={output_dir} already holds a checkpoint; choose an "
                         "empty directory")
    os.makedirs(output_dir, exist_ok=True)
    variables = {key: tf.Variable(value) for key, value in weights.items()}
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=variables), output_dir,
                                         max_to_keep=1)
    path = manager.save(checkpoint_number=0)
    for name, original in files.items():
        shutil.copyfile(original, os.path.join(output_dir, name))
    with open(os.path.join(output_dir, "config.json"), "w") as file:
        json.dump({"model_format": family, "model_config": dataclasses.asdict(config),
                   "tokenizer": tokenizer, "converted_from": source}, file, indent=1)
    return path


def read_config(run_dir, families=("bert",)):
    """(BertConfig or AlbertConfig, the config.json dict) of a run directory of `families`."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"{path}: file not found; expected a tfbig run directory "
                         "(tfbig-convert --output_dir or tfbig-train --model_dir)")
    with open(path) as file:
        saved = json.load(file)
    if saved.get("model_format") not in families:
        raise UsageError(f"{path}: model_format={saved.get('model_format')!r}; expected one of "
                         f"{list(families)}")
    config_class = {"bert": BertConfig, "albert": AlbertConfig,
                    "gpt": GPTConfig, "llama": LlamaConfig}[saved["model_format"]]
    return config_class(**saved["model_config"]), saved


def weight_reader(run_dir, mapped=False):
    """({tfbig key: shape}, read) of the latest checkpoint in `run_dir` (or of the checkpoint
    path `run_dir`): the shapes from its index, `read(key)` the np.ndarray of one weight.
    `mapped`: the array is memory-mapped where the checkpoint allows
    (tfbig.checkpoints.bundle), so that slicing it reads only the slice's bytes."""
    path = tf.train.latest_checkpoint(run_dir) if os.path.isdir(run_dir) else run_dir
    if not path or not tf.io.gfile.glob(path + ".index"):
        raise UsageError(f"{run_dir}: no checkpoint in it (expected a tfbig run directory "
                         "or a checkpoint path)")
    reader = tf.train.load_checkpoint(path)
    suffix = "/.ATTRIBUTES/VARIABLE_VALUE"
    shapes = reader.get_variable_to_shape_map()
    names = {name[len("model/"):-len(suffix)].replace(".S", "/"): name for name in shapes
             if name.startswith("model/") and name.endswith(suffix)}
    local = os.path.isfile(path + ".index")  # a gs:// or hdfs:// checkpoint: TF's reader
    places = (bundle.tensors(path) if mapped and local else None) or {}

    def read(key):
        name = names[key]
        return bundle.mapped(places[name]) if name in places else reader.get_tensor(name)

    return {key: tuple(shapes[name]) for key, name in names.items()}, read


def read_weights(run_dir):
    """{tfbig key: np.ndarray} of the latest checkpoint in `run_dir` (or of the checkpoint
    path `run_dir`)."""
    shapes, read = weight_reader(run_dir)
    return {key: read(key) for key in shapes}


def restore_backbone(model, run_dir, stored="backbone/"):
    """Load a run directory's (or checkpoint path's) backbone weights into a tfbig BERT, ALBERT
    or Llama model (any head): model key "backbone/x" reads checkpoint key `stored` + "x" (a
    Llama run's keys have no "backbone/": its model is the backbone).

    Assigned through the model's Keras variables, so that inside a `keras.StatelessScope`
    (ZeRO-3's deferred build, tfbig.distribute.zero3.build_unmaterialised) the values go to
    the scope, which the backend slices, instead of to variables that hold none; a weight
    another pipeline stage holds (an empty placeholder on this rank) is left as it is."""
    weights = read_weights(run_dir)
    backbone = {stored + model_key(model, v)[len("backbone/"):]: v for v in model.variables
                if model_key(model, v).startswith("backbone/") and "seed_generator" not in v.path}
    held = {key: v for key, v in backbone.items() if not _placeholder(v)}
    missing = sorted(set(backbone) - set(weights))
    if missing:
        raise UsageError(f"--init_checkpoint={run_dir}: its checkpoint lacks {len(missing)} "
                         f"backbone weights of {model.name}: {missing[:3]}")
    for key, variable in held.items():
        if tuple(weights[key].shape) != tuple(variable.shape):
            raise UsageError(f"--init_checkpoint={run_dir}: {key} has shape "
                             f"{tuple(weights[key].shape)}, the model's is {tuple(variable.shape)}")
        variable.assign(weights[key])
    return model


def _placeholder(variable):
    """True for a weight built empty on this rank (tfbig.pipeline.stage_model.hold_only);
    a deferred one (no value yet: ZeRO-3's build) is not."""
    value = getattr(variable, "_value", None)  # not `.value`: a deferred one would initialise
    return value is not None and tuple(value.shape) != tuple(variable.shape)


def assign(model, weights):
    """Set a built tfbig model's variables from {tfbig key: array} (keys it lacks are an error)."""
    variables = model_variables(model)
    unknown = sorted(set(weights) - set(variables))
    if unknown:
        raise ValueError(f"weights not in {model.name}: {unknown[:3]}")
    for key, value in weights.items():
        variables[key].assign(np.asarray(value, variables[key].dtype.name))


DECODERS = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}  # model_format -> classes


def load_model(model_dir):
    """The GPT or Llama in `model_dir` (config.json + latest checkpoint) and its tokenizer path."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--model_dir={model_dir} has no config.json; train a model "
                                f"there with tfbig-train first")
    with open(path) as f:
        saved = json.load(f)
    family = saved.get("model_format", "gpt")
    if family not in DECODERS:
        raise ValueError(f"--model_dir={model_dir} holds a {family} model; "
                         f"tfbig-generate needs a GPT or a Llama")
    warn = lambda m: print(m, file=sys.stderr)  # noqa: E731
    latest, _ = integrity.newest_intact(model_dir, warn=warn)
    if latest is None:
        raise FileNotFoundError(f"--model_dir={model_dir} has no checkpoint")
    model_class, config_class = DECODERS[family]
    model = model_class(config_class(**saved["model_config"]), name=family)
    model.build((None, None))
    pieces = next((m for m in (expert_checkpoint, tensor_layout,  # per-rank pieces
                               stage_checkpoint, zero_checkpoint)
                   if m.read_layout(model_dir) is not None), None)
    if pieces is not None:
        weights = pieces.assembled_weights(model_dir, model, warn)
        for v in model.variables:
            if v.path in weights:
                v.assign(weights[v.path])
        return model, os.path.join(model_dir, "tokenizer.model")
    status = tf.train.Checkpoint(model=model_variables(model)).restore(latest)
    status.assert_existing_objects_matched().expect_partial()  # every weight, not the optimizer
    return model, os.path.join(model_dir, "tokenizer.model")
