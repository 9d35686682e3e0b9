"""A user model's declarations checked on the built model: the layers at attribute paths
(`checkpoint_layers`, `pipeline_layers`), the `tensor_layout` kinds (column, row, heads, vocab)
against the layers they name, and layer names that are the same in every process.
"""
import collections
import contextlib

from tfbig.errors import UsageError
from tfbig.tasks import layer_paths, layout_map


def resolve_layers(model, paths, what="checkpoint_layers"):
    """The layers at attribute paths below `model` ("blocks.*": each element of model.blocks;
    "ffn.layers.0": the first element of the list model.ffn.layers)."""
    return [layer for _, layer in layer_paths.named_layers(model, paths, what)]


@contextlib.contextmanager
def fresh_layer_names():
    """Keras names layers "dense", "dense_1", ... by a process-wide counter; within this the
    counter starts afresh, so a model's layer names, and with them its checkpoint keys
    (tfbig.checkpoints.checkpoint), are the same in every process and for every build (a resume, an
    evaluate after a train in one notebook)."""
    from keras.src.backend.common import global_state

    previous = global_state.get_global_attribute("object_name_uids")
    global_state.set_global_attribute("object_name_uids", collections.defaultdict(int))
    try:
        yield
    finally:
        global_state.set_global_attribute("object_name_uids", previous)


# kind -> the Keras layers it splits (tfbig.layouts.tensor_layout.split_declared_model)
LAYOUT_KINDS = {"column": ("Dense",), "row": ("Dense",), "vocab": ("Embedding", "Dense"),
                "heads": ("MultiHeadAttention",)}


_WEIGHTS = {"Dense": "kernel", "Embedding": "embeddings"}  # a layer's own weight, by type


def _splittable(model):
    """{layer path: (type name, layer)} of the built Dense, Embedding and MultiHeadAttention
    layers of `model` (subclasses count as their base)."""
    import keras

    types = {"Dense": keras.layers.Dense, "Embedding": keras.layers.Embedding,
             "MultiHeadAttention": keras.layers.MultiHeadAttention}
    return {layer.path: (name, layer) for layer in model._flatten_layers(include_self=False)
            for name, base in types.items() if isinstance(layer, base) and layer.built}


def declared_layout(model, layout, owner):
    """[(layer, kind, kernel axis)] of a task's `tensor_layout` on its built `model`.

    `layout` is {layer path pattern: kind}: "column" / "row" for a keras.layers.Dense,
    "heads" for a keras.layers.MultiHeadAttention, "vocab" for a keras.layers.Embedding (its
    rows) or the output Dense (its columns, the logits gathered); or a
    keras.distribution.LayoutMap (tfbig.tasks.layout_map: Dense and EinsumDense kernels
    split on an axis, Embedding tables on their vocabulary). Refused, naming the entry, when a
    kind is unknown or does not fit the layer it names, a pattern names no such layer, a layer
    is named twice, or a row or vocab Dense has an activation."""
    import fnmatch

    if layout and all(layout_map.is_layout_entry(v) for v in layout.values()):
        chosen = layout_map.translate(model, layout, owner)
        for layer, kind, _ in chosen:
            if kind == "row":
                _check_activation(f"{owner}.tensor_layout", layer.path, kind, layer)
        return chosen
    layers = _splittable(model)
    chosen = {}
    for pattern, kind in layout.items():
        where = f"{owner}.tensor_layout[{pattern!r}]"
        if kind not in LAYOUT_KINDS:
            raise UsageError(f"{where} = {kind!r}: the kinds are 'column' and 'row' (a Dense), "
                             "'heads' (a MultiHeadAttention) and 'vocab' (an Embedding or the "
                             "output Dense)")
        if "/" in pattern or any(fnmatch.fnmatchcase(path, pattern) for path in layers):
            # a layer's or weight's path (a functional model's layers: "dense_1")
            matched = [path for path, (name, _) in layers.items()
                       if fnmatch.fnmatchcase(path, pattern) or
                       fnmatch.fnmatchcase(f"{path}/{_WEIGHTS.get(name)}", pattern)]
            if not matched:
                raise UsageError(f"{where}: {_no_layer(model, pattern, layers)}")
        else:  # an attribute path, as checkpoint_layers
            found = resolve_layers(model, [pattern], where)
            paths = {id(layer): path for path, (_, layer) in layers.items()}
            strays = [layer for layer in found if id(layer) not in paths]
            if strays:
                raise UsageError(f"{where}: names {type(strays[0]).__name__} "
                                 f"{getattr(strays[0], 'name', '')!r}, not a built "
                                 "keras.layers.Dense, MultiHeadAttention or Embedding; only "
                                 "those are split")
            matched = [paths[id(layer)] for layer in found]
        for path in matched:
            if chosen.get(path, kind) != kind:
                raise UsageError(f"{where}: {path!r} is declared both {chosen[path]!r} and "
                                 f"{kind!r}")
            _check_kind(where, path, kind, *layers[path])
            chosen[path] = kind
    return [(layers[path][1], kind, None) for path, kind in chosen.items()]


def _check_kind(where, path, kind, type_name, layer):
    """Refuse a kind that does not fit the layer, and a row or vocab Dense's activation."""
    if type_name not in LAYOUT_KINDS[kind]:
        fits = [k for k, names in LAYOUT_KINDS.items() if type_name in names]
        raise UsageError(f"{where} = {kind!r}: {path!r} ({type_name}) is split by "
                         f"{_either([repr(k) for k in fits])}; {kind!r} splits "
                         f"{_either(LAYOUT_KINDS[kind])} layers")
    if type_name == "Dense" and kind in ("row", "vocab"):
        _check_activation(where, path, kind, layer)


def _check_activation(where, path, kind, layer):
    """Refuse a row or vocab split of a layer with an activation (it would act on partial
    sums or on a slice of the logits)."""
    activation = getattr(getattr(layer, "activation", None), "__name__", "")
    if activation not in ("linear", ""):
        what = "each rank's partial sum" if kind == "row" else "each rank's slice of the logits"
        raise UsageError(f"{where}: the {kind}-split {type(layer).__name__} {path!r} has "
                         f"activation {activation!r}, which would act on {what}; give it none and apply "
                         "it after the layer")


def _either(words):
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


def _no_layer(model, pattern, layers):
    """Why `pattern` names no layer tfbig splits in `model`."""
    import fnmatch

    weights = [v.path for v in model.variables if fnmatch.fnmatchcase(v.path, pattern)
               or fnmatch.fnmatchcase(v.path.rsplit("/", 1)[0], pattern)]
    if weights:
        return (f"names {weights[0]!r}, not the weights of a keras.layers.Dense, "
                "MultiHeadAttention or Embedding; only those are split (a MultiHeadAttention "
                "as a whole, by 'heads')")
    return (f"names no weight of {type(model).__name__}; the layers it could split are "
            f"{', '.join(sorted(layers)) or 'none'}")
