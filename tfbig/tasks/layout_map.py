"""keras.distribution.LayoutMap read as a declared tensor layout.

A LayoutMap maps a variable-path regex to a sharding spec over named mesh axes (what
keras-hub's `Backbone.get_layout_map(mesh)` returns for Llama, Gemma, Qwen and the MoE
backbones). Keras runs it only on JAX and PyTorch; here each entry that names the mesh's
tensor axis ("tensor", tfbig's name, or "model", keras-hub's default) becomes one of tfbig's
split kinds, by the axis it splits:

    Embedding table, vocabulary axis (0)            vocab
    Dense kernel (in, out): axis 1 / axis 0          column / row
    EinsumDense kernel, an axis of the output        column (on that axis)
    EinsumDense kernel, a contracted axis            row (on that axis)

Every split has its exact meaning through one collective pair: a column layer's input enters the
tensor region (identity forward, gradient summed backward), a row layer's partial products are
summed over the group (and a row layer whose input is whole takes its own slice of it first).
Spec entries on the other mesh axes ("batch", "data") shard a weight over data-parallel ranks:
tfbig does that for every weight with --zero_stage=3, so they are read and left to it. What has
no such meaning is refused by name (the entry, the variable path, its shape): an entry naming
no variable, a weight split on two axes, a split of a LayerNorm's scale or a bias, an
embedding split along its width.
"""
import re

from tfbig.errors import UsageError
from tfbig.layouts.tensor_layout import einsum_specs

TENSOR_AXES = ("tensor", "model")  # tfbig's name for the axis, keras-hub's default


def device_mesh(tensor_parallel=1, data_parallel=1):
    """The keras.distribution.DeviceMesh a LayoutMap is built on for tfbig: axes
    ("data", "tensor") of sizes (data_parallel, tensor_parallel). Its devices are names of
    tfbig's ranks, not devices this process must see (Keras does not place anything here).

        mesh = tfbig.device_mesh(tensor_parallel=2)
        layout = keras_hub.models.LlamaBackbone.get_layout_map(
            mesh, model_parallel_dim_name="tensor", data_parallel_dim_name="data")
        tfbig.train(model_fn, loss_fn, dataset_fn, tensor_layout=layout, tensor_parallel=2)
    """
    import keras
    import numpy as np

    ranks = np.array([f"rank:{r}" for r in range(data_parallel * tensor_parallel)])
    return keras.distribution.DeviceMesh((data_parallel, tensor_parallel), ("data", "tensor"),
                                         ranks.reshape(data_parallel, tensor_parallel))


def is_layout_entry(value):
    """True for a keras.distribution.TensorLayout (a LayoutMap's value)."""
    return hasattr(value, "axes") and hasattr(value, "device_mesh")


def tensor_axis(mesh, owner):
    """The name of `mesh`'s tensor axis ("tensor", else "model"); refused when it has none."""
    for name in TENSOR_AXES:
        if name in mesh.axis_names:
            return name
    raise UsageError(f"{owner}.tensor_layout: the LayoutMap's mesh has axes "
                     f"{tuple(mesh.axis_names)} and none named 'tensor' (tfbig.device_mesh) or "
                     "'model' (keras-hub's get_layout_map default): name its tensor axis so")


def mesh_degree(entries):
    """The size of the tensor axis of the mesh the LayoutMap entries are built on."""
    mesh = next(iter(entries.values())).device_mesh
    return dict(zip(mesh.axis_names, mesh.shape))[tensor_axis(mesh, "task")]


def translate(model, entries, owner):
    """[(layer, kind, kernel axis)] of LayoutMap `entries` ({regex: TensorLayout}) on the
    built `model`: kind "column" / "row" for a Dense or EinsumDense, "vocab" for an
    Embedding's table. A variable matched by two entries, an entry matching none, and a
    split without exact meaning are refused by name."""
    owners = _weight_owners(model)
    chosen, matched_by = {}, {}
    for pattern, entry in entries.items():
        where = f"{owner}.tensor_layout[{pattern!r}]"
        if not is_layout_entry(entry):
            raise UsageError(f"{where} = {entry!r}: a layout is either a LayoutMap or "
                             "{layer path: kind}; this one mixes the two")
        name = tensor_axis(entry.device_mesh, owner)
        variables = [v for v in model.variables if re.search(pattern, v.path)]
        if not variables:
            raise UsageError(f"{where}: matches no variable of {type(model).__name__} (its "
                             f"variables begin {', '.join(v.path for v in model.variables[:3])})")
        for variable in variables:
            if variable.path in matched_by:  # Keras refuses the same (LayoutMap.__getitem__)
                raise UsageError(f"{where}: {variable.path!r} is also matched by "
                                 f"{matched_by[variable.path]!r}; one entry per variable")
            matched_by[variable.path] = pattern
            axes = [i for i, axis in enumerate(entry.axes) if axis == name]
            if not axes:
                continue  # replicated over the tensor axis (data-axis entries: --zero_stage=3)
            split = _kind(where, variable, axes, owners.get(id(variable)))
            layer = split[0]
            if chosen.get(id(layer), split)[1:] != split[1:]:
                raise UsageError(f"{where}: {layer.path!r} is split two ways "
                                 f"({chosen[id(layer)][1]} and {split[1]})")
            chosen[id(layer)] = split
    return list(chosen.values())


def _weight_owners(model):
    """{id(variable): (layer, role)} of the weights LayoutMap entries may split."""
    import keras

    owners = {}
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)) and layer.built:
            owners[id(layer.kernel)] = (layer, "kernel")
        elif isinstance(layer, keras.layers.Embedding) and layer.built:
            owners[id(layer.embeddings)] = (layer, "embeddings")
    return owners


def _kind(where, variable, axes, owner):
    """(layer, kind, kernel axis) of one split variable, or refused by name."""
    import keras

    what = f"{variable.path!r} {tuple(variable.shape)}"
    if len(axes) > 1:
        raise UsageError(f"{where}: splits {what} on {len(axes)} axes over the tensor axis; "
                         "tensor parallelism splits a weight along one")
    if owner is None:
        raise UsageError(f"{where}: splits {what}, which is not the kernel of a Dense or "
                         "EinsumDense nor an Embedding's table: no collective pair completes "
                         "it; leave it replicated over the tensor axis (None)")
    layer, role = owner
    axis = axes[0]
    if role == "embeddings":
        if axis != 0:
            raise UsageError(f"{where}: splits the embedding {what} along its width (axis "
                             f"{axis}); split its vocabulary (axis 0) or leave it replicated")
        return layer, "vocab", 0
    if isinstance(layer, keras.layers.Dense):
        return layer, ("row" if axis == 0 else "column"), axis
    inputs, kernel, output = einsum_specs(layer.equation)
    letter = kernel[axis]
    if letter in output:
        return layer, "column", axis
    if letter in inputs:
        return layer, "row", axis
    raise UsageError(f"{where}: splits {what} on axis {axis} ({letter!r} of {layer.equation!r}),"
                     " which is summed within the kernel alone; no collective pair completes it")
