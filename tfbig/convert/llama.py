"""Llama-class checkpoints in and out: Hugging Face LlamaForCausalLM / MistralForCausalLM /
Qwen2ForCausalLM / Qwen3ForCausalLM / MixtralForCausalLM / Qwen3MoeForCausalLM directories and
keras-hub Llama / Mistral / Qwen / Mixtral / Qwen3-MoE backbones into a tfbig Llama run
directory, and a tfbig Llama run back out to a Hugging Face directory.

    huggingface  config.json + model.safetensors, or model-0000i-of-0000n.safetensors with
                 model.safetensors.index.json (any float dtype, bf16 included, read as float32);
                 tokenizer files present (tokenizer.json, tokenizer.model, ...) are copied
    keras_hub    a backbone object, or a preset directory (config.json registered_name
                 keras_hub>LlamaBackbone, Llama3Backbone, MistralBackbone, QwenBackbone,
                 Qwen3Backbone, MixtralBackbone, Qwen3MoeBackbone + model.weights.h5), read
                 with keras-hub itself

The names and refusals are tfbig.convert.llama_names' one table. Everything is read and checked
before the output directory is created: a refusal writes nothing.

Example:
    write_run("runs/llama", *read_huggingface("Llama-3.2-1B/"))
    export("runs/llama", "hf-out/", max_shard_bytes=2 << 30)
"""
import json
import os
import shutil
import struct
import types

import numpy as np

from tfbig.convert import llama_names, moe_names
from tfbig.errors import UsageError
from tfbig.models.llama_config import LlamaConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")


def _json(path):
    if not os.path.isfile(path):
        raise UsageError(f"{path}: file not found")
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def _files(directory, flag="--source"):
    """(the index or file that lists the tensors, [safetensors file paths]) of a directory."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        names, where = sorted(set(_json(index).get("weight_map", {}).values())), index
    elif os.path.isfile(os.path.join(directory, SINGLE)):
        names, where = [SINGLE], os.path.join(directory, SINGLE)
    else:
        raise UsageError(f"{flag}={directory}: no {SINGLE} or {INDEX}; found "
                         f"{sorted(os.listdir(directory))}")
    for name in names:
        if not os.path.isfile(os.path.join(directory, name)):
            raise UsageError(f"{where} names {name}, which is not in {directory}")
    return where, [os.path.join(directory, name) for name in names]


def load_safetensors(directory):
    """(the file or index read, {name: np.ndarray}) of a single or sharded safetensors
    checkpoint; a shard the index names but the directory lacks is an error naming both."""
    from safetensors import safe_open

    where, paths = _files(directory)
    tensors = {}
    for path in paths:
        with safe_open(path, framework="np") as file:
            for key in file.keys():
                tensors[key] = file.get_tensor(key)
    return where, tensors


def _safetensors_places(path):
    """{name: (path, offset, numpy dtype, shape)} of a safetensors file, from its header (an
    8-byte length, then JSON: dtype, shape and the data's [start, end) after the header)."""
    import ml_dtypes

    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64}
    with open(path, "rb") as file:
        (size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(size))
    places = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in dtypes:
            raise UsageError(f"{path}: {name} is {entry['dtype']}; expected one of "
                             f"{sorted(dtypes)}")
        places[name] = (path, 8 + size + entry["data_offsets"][0], dtypes[entry["dtype"]],
                        tuple(entry["shape"]))
    return places


def huggingface_weight_reader(directory, flag="--init_checkpoint"):
    """(LlamaConfig, {tfbig key: shape}, read) of a Hugging Face directory, read in place:
    `read(key)` is the weight memory-mapped from its safetensors file in tfbig's layout (a
    kernel the transposed view), so a rank's cut reads its pieces' bytes. A mixture of
    experts' matrix (one tensor per expert there, one stacked weight in tfbig) is a
    bundle.Stacked of the experts' maps: an expert rank reads its own experts. Names and
    shapes are checked first."""
    from tfbig.checkpoints import bundle

    config_file = os.path.join(directory, "config.json")
    config = llama_names.config_from_hf(_json(config_file), config_file)
    where, paths = _files(directory, flag)
    places = {name: place for path in paths for name, place in _safetensors_places(path).items()}
    found = {n: types.SimpleNamespace(shape=p[3]) for n, p in places.items()}
    llama_names.check_hf(found, config, where)
    experts = moe_names.check_hf(found, config, where) if config.num_experts else {}
    names = {key: hf for key, hf, _ in llama_names.rows(config)}
    expected = llama_names.shapes(config)

    def read(key):
        if key in experts:  # each expert's Linear weight (out, in), transposed
            shape, parts = experts[key]
            return bundle.Stacked([lambda n=n: bundle.mapped(places[n]).T for n in parts],
                                  shape)
        return llama_names.hf_layout(key, bundle.mapped(places[names[key]]))

    return (config, {**{key: tuple(expected[key]) for key in names},
                     **{key: tuple(shape) for key, (shape, _) in experts.items()}}, read)


def read_huggingface(directory, raw=None):
    """(LlamaConfig, {tfbig key: array}, tokenizer files, source) of a Hugging Face directory."""
    config_file = os.path.join(directory, "config.json")
    raw = _json(config_file) if raw is None else raw
    config = llama_names.config_from_hf(raw, config_file)  # refusals before any tensor is read
    where, tensors = load_safetensors(directory)
    weights = llama_names.hf_to_tfbig(tensors, config, where)
    files = {name: os.path.join(directory, name) for name in TOKENIZER_FILES
             if os.path.isfile(os.path.join(directory, name))}
    return config, weights, files, f"huggingface:{directory}"


def from_keras_hub(backbone, where="the keras-hub backbone"):
    """(LlamaConfig, {tfbig key: array}) of a keras-hub Llama/Mistral/Qwen backbone object."""
    config = llama_names.config_from_keras_hub(backbone, where)
    weights = {moe_names.keras_hub_path(w.path): np.asarray(w.numpy()) for w in backbone.weights}
    return config, llama_names.keras_hub_to_tfbig(weights, config, where)


def read_keras_hub(directory, raw=None):
    """(LlamaConfig, weights, tokenizer files, source) of a keras-hub preset directory."""
    import keras_hub

    raw = _json(os.path.join(directory, "config.json")) if raw is None else raw
    name = raw.get("registered_name", "")
    if name not in llama_names.KERAS_HUB:
        raise UsageError(f"{directory}/config.json: a {name!r} preset; the Llama family reads "
                         f"{sorted(llama_names.KERAS_HUB)}")
    backbone = getattr(keras_hub.models, name.split(">")[-1]).from_preset(directory)
    config, weights = from_keras_hub(backbone, os.path.join(directory, "model.weights.h5"))
    assets = os.path.join(directory, "assets", "tokenizer")
    files = {f: os.path.join(assets, f) for f in sorted(os.listdir(assets))} \
        if os.path.isdir(assets) else {}
    return config, weights, files, f"keras_hub:{directory}"


def write_run(output_dir, config, weights, files, source):
    """The tfbig Llama run directory: checkpoint (ckpt-0), the tokenizer files as they came
    (config.json "tokenizer": {"kind": "huggingface_files", "files": [...]}), config.json."""
    from tfbig.convert import run_dir

    tokenizer = {"kind": "huggingface_files", "files": sorted(files)}
    return run_dir.write_run(output_dir, config, weights, tokenizer, files, source, "llama")


def read_run(run_dir):
    """(LlamaConfig, the run's config.json dict) of a tfbig Llama run directory."""
    path = os.path.join(run_dir, "config.json")
    saved = _json(path)
    if saved.get("model_format") != "llama":
        raise UsageError(f"{path}: model_format={saved.get('model_format')!r}; expected "
                         "'llama'")
    return LlamaConfig(**saved["model_config"]), saved


def write_huggingface(output_dir, config, weights, tokenizer_files=None, max_shard_bytes=0,
                      bos_id=None, eos_id=None):
    """A Hugging Face directory of a tfbig Llama: config.json and model.safetensors, or shards
    of at most `max_shard_bytes` (0: one file) with model.safetensors.index.json; tensors are
    converted and checked before the directory is created. Returns the weights file or index."""
    from safetensors.numpy import save_file

    tensors = llama_names.tfbig_to_hf(weights, config)
    hf = llama_names.hf_config(config, bos_id, eos_id)
    if os.path.exists(os.path.join(output_dir, "config.json")):
        raise UsageError(f"--output_dir={output_dir} already holds a config.json; choose an "
                         "empty directory")
    shards = _shards(tensors, max_shard_bytes)
    os.makedirs(output_dir, exist_ok=True)
    if len(shards) == 1:
        path = os.path.join(output_dir, SINGLE)
        save_file(tensors, path, metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in names}, os.path.join(output_dir, name),
                      metadata={"format": "pt"})
            weight_map.update({n: name for n in names})
        path = os.path.join(output_dir, INDEX)
        total = sum(t.nbytes for t in tensors.values())
        with open(path, "w") as file:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file,
                      indent=1)
    for name, original in (tokenizer_files or {}).items():
        shutil.copyfile(original, os.path.join(output_dir, name))
    with open(os.path.join(output_dir, "config.json"), "w") as file:
        json.dump(hf, file, indent=1)
    return path


def _shards(tensors, max_bytes):
    """Tensor names in file order, cut into groups of at most `max_bytes` (0: one group)."""
    groups, size = [[]], 0
    for name, value in tensors.items():
        if max_bytes and groups[-1] and size + value.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += value.nbytes
    return groups


def export(source_dir, output_dir, max_shard_bytes=0):
    """A tfbig Llama run (converted, or trained with any strategy tfbig-generate reads) -> a
    Hugging Face directory; returns (path written, a note on the tokenizer)."""
    from tfbig.checkpoints.checkpoint import model_variables
    from tfbig.convert.run_dir import load_model

    config, saved = read_run(source_dir)
    model, _ = load_model(source_dir)
    weights = {k: np.asarray(v.numpy(), np.float32) for k, v in model_variables(model).items()}
    tokenizer = saved.get("tokenizer") or {}
    if tokenizer.get("kind") == "huggingface_files":
        files = {f: os.path.join(source_dir, f) for f in tokenizer["files"]}
        note = f"tokenizer: the source's files, copied ({', '.join(tokenizer['files'])})"
    elif tokenizer.get("kind") == "tokenizer_json":  # a run on data prepared with one
        files = {"tokenizer.json": os.path.join(source_dir, "tokenizer.json")}
        note = "tokenizer: the run's tokenizer.json, copied"
    else:  # a tfbig-train run: its SentencePiece model, which LlamaTokenizer reads
        files = {"tokenizer.model": os.path.join(source_dir, "tokenizer.model")}
        note = "tokenizer: tfbig's SentencePiece model as tokenizer.model"
    files = {name: path for name, path in files.items() if os.path.isfile(path)}
    path = write_huggingface(output_dir, config, weights, files, max_shard_bytes)
    return path, note


# tfbig-convert's hooks (tfbig.convert.convert): a source or run of this family comes here.
MAX_SHARD_BYTES = 5 * 10**9  # shards of an export, as transformers' save_pretrained ("5GB")


def _source_kind(directory):
    """"huggingface" or "keras_hub" for a Llama-family source directory, else None."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as file:
        raw = json.load(file)
    if not isinstance(raw, dict):
        return None
    if raw.get("model_type") in llama_names.FAMILIES:
        return "huggingface"
    if raw.get("registered_name") in llama_names.KERAS_HUB:
        return "keras_hub"
    return None


def is_huggingface(directory):
    """Whether `directory` is a Hugging Face Llama-family directory (config.json model_type)."""
    return os.path.isdir(directory) and _source_kind(directory) == "huggingface"


def is_source(directory, source_format="auto", lowercase=None):
    """Whether `directory` holds a Llama-family checkpoint (refusing flags that do not apply)."""
    kind = _source_kind(directory) if os.path.isdir(directory) else None
    if kind is None:
        return False
    if lowercase is not None:
        raise UsageError(f"--lowercase: applies to BERT's WordPiece vocabulary; {directory} is "
                         "a Llama-family model (its tokenizer files come as they are)")
    if source_format not in ("auto", kind):
        raise UsageError(f"--format={source_format}: {directory} holds a {kind} Llama-family "
                         f"checkpoint; give --format=auto or {kind}")
    return True


def convert_command(directory, output_dir):
    """tfbig-convert --source=DIRECTORY (Hugging Face or keras-hub) -> a tfbig run directory."""
    read = read_huggingface if _source_kind(directory) == "huggingface" else read_keras_hub
    return write_run(output_dir, *read(directory))


def is_run(run_dir):
    """Whether `run_dir` is a tfbig Llama run directory (config.json model_format "llama")."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as file:
        return json.load(file).get("model_format") == "llama"


def export_command(run_dir, output_dir):
    """tfbig-convert --to=huggingface for a Llama run: prints the tokenizer note."""
    path, note = export(run_dir, output_dir, MAX_SHARD_BYTES)
    print(note)
    return path
