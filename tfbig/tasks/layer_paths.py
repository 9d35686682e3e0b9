"""Layers named by attribute paths below a model, as a user task declares them
(checkpoint_layers, tensor_layout, pipeline_layers): "blocks.*" is each element of the list
model.blocks, "ffn.layers.0" the first element of model.ffn.layers.

Example:
    named_layers(model, ["embedding", "blocks.*"], "MyTask.pipeline_layers")
    # [("embedding", <layer>), ("blocks.0", <layer>), ("blocks.1", <layer>)]
"""
from tfbig.errors import UsageError


def named_layers(model, paths, what):
    """[(name, object)] at attribute paths below `model`, `what` naming the declaration in
    errors; "blocks.*" gives "blocks.0", "blocks.1", ... (the names --stage_boundaries
    accepts)."""
    found = []
    for path in paths:
        objects = [("", model)]
        for part in path.split("."):
            objects = [(f"{name}.{key}" if name else key, child) for name, obj in objects
                       for key, child in _children(obj, part, path, what, model)]
        found += objects
    return found


def _children(obj, part, path, what, model):
    if part == "*":
        if not isinstance(obj, (list, tuple)):
            raise UsageError(f"{what}: {path!r}: '*' follows a {type(obj).__name__}, not a "
                             "list of layers")
        return [(str(i), child) for i, child in enumerate(obj)]
    if part.isdigit() and isinstance(obj, (list, tuple)):
        child = obj[int(part)] if int(part) < len(obj) else None
    else:
        child = getattr(obj, part, None)
    if child is None:
        raise UsageError(f"{what}: {path!r} names no layer of {type(model).__name__} (no "
                         f"attribute {part!r})")
    return [(part, child)]
