"""Hugging Face's TensorFlow weights files, `tf_model.h5` and a TF-named `model.safetensors`,
read as the tensors a PyTorch `model.safetensors` would hold (PyTorch names and layouts), so the
BERT, ALBERT and GPT-2 readers take any of them.

Why it is built this way: docs/design/notes/convert.md (tfbig.convert.hf_h5).
"""
import os
import re

import numpy as np

from tfbig.errors import UsageError

WEIGHTS_NAME = "tf_model.h5"
LAST_PART = {"kernel": "weight", "embeddings": "weight", "gamma": "weight", "beta": "bias"}


def _attribute(group, name):
    """A string-list attribute, joined from its numbered chunks when Keras had to split it."""
    if name in group.attrs:
        values = list(group.attrs[name])
    else:
        values, chunk = [], 0
        while f"{name}{chunk}" in group.attrs:
            values += list(group.attrs[f"{name}{chunk}"])
            chunk += 1
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


def pytorch_name(tf_name, model_scope=True):
    """(PyTorch name, whether the tensor is transposed) of a TF weight name in tf_model.h5
    (`model_scope`: it starts with the model's own name) or a TF model.safetensors (it does
    not)."""
    name = tf_name[:-2] if tf_name.endswith(":0") else tf_name
    name = re.sub(r"(^|/)[^/]*___([^/]*)(?=/)", r"\1\2", name)  # mlm___cls -> cls
    parts = [p for p in name.replace("_._", "/").split("/") if p]
    parts = parts[1:] if model_scope and len(parts) > 1 else parts  # the model's own name
    transposed = parts[-1] == "kernel"
    parts[-1] = LAST_PART.get(parts[-1], parts[-1])
    return ".".join(parts), transposed


def read(path):
    """{PyTorch name: np.ndarray} of a Hugging Face tf_model.h5; errors name the file."""
    import h5py

    try:
        handle = h5py.File(path, "r")
    except OSError as error:
        raise UsageError(f"{path}: not an HDF5 file ({error}); expected the tf_model.h5 of "
                         "transformers' TF save_pretrained") from error
    tensors = {}
    with handle:
        layers = _attribute(handle, "layer_names")
        if not layers:
            raise UsageError(f"{path}: no 'layer_names' attribute; expected the Keras weights "
                             "file of transformers' TF save_pretrained")
        for layer in layers:
            group = handle.get(layer)
            if not isinstance(group, h5py.Group):
                raise UsageError(f"{path}: layer {layer!r} listed in layer_names has no group")
            for weight in _attribute(group, "weight_names"):
                tensors.update([_as_pytorch(weight, np.asarray(group[weight]))])
    return tensors


def _as_pytorch(tf_name, value, model_scope=True):
    """(PyTorch name, value in PyTorch's layout) of one TF weight."""
    name, transposed = pytorch_name(tf_name, model_scope)
    if transposed and value.ndim == 2:
        value = value.T
    elif name.endswith(".bias") and value.ndim == 2 and value.shape[0] == 1:
        value = value.reshape(-1)  # GPT-2's Conv1D bias, stored (1, out)
    return name, value


def read_safetensors(path):
    """{PyTorch name: np.ndarray} of a model.safetensors: PyTorch's names as they are, or the TF
    names of transformers' TF save_pretrained (metadata format "tf") mapped as tf_model.h5's;
    errors name the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="np") as file:
            kind = (file.metadata() or {}).get("format", "pt")
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except (SafetensorError, OSError) as error:
        raise UsageError(f"{path}: not a safetensors file ({error})") from error
    if kind in ("flax", "jax", "mlx"):
        raise UsageError(f"{path}: a {kind} safetensors file (metadata format {kind!r}); "
                         "tfbig reads PyTorch's (\"pt\") or transformers' TensorFlow (\"tf\") "
                         "names: save it from transformers' PyTorch or TF model")
    if kind != "tf":
        return tensors
    return dict(_as_pytorch(name, value, model_scope=False) for name, value in tensors.items())


def load_weights(directory):
    """(the weights file, {PyTorch name: array}) of a Hugging Face directory: model.safetensors,
    else tf_model.h5; a PyTorch pickle or a sharded checkpoint alone is a clear error."""
    safetensors = os.path.join(directory, "model.safetensors")
    if os.path.isfile(safetensors):
        return safetensors, read_safetensors(safetensors)
    h5 = os.path.join(directory, WEIGHTS_NAME)
    if os.path.isfile(h5):
        return h5, read(h5)
    others = [f for f in ("pytorch_model.bin", "model.safetensors.index.json",
                          "tf_model.h5.index.json") if os.path.exists(os.path.join(directory, f))]
    hint = (f" (found {others}: tfbig reads a single model.safetensors or tf_model.h5, not a "
            "PyTorch pickle or a sharded checkpoint; convert it first, e.g. transformers' "
            "model.save_pretrained(dir, safe_serialization=True, max_shard_size='100GB'))"
            if others else f" and no {WEIGHTS_NAME}")
    raise UsageError(f"{safetensors}: file not found" + hint)
