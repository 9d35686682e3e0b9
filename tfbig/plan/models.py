"""The model, as the planner sees it: tfbig's own architecture configs and presets, without Keras.

`tfbig.models.gpt` and `.albert` import Keras (and so TensorFlow, seconds to start); the planner
must answer in well under that. Their config dataclasses and preset tables are plain Python, so
`load_configs` compiles just those definitions out of the two source files: the planner counts
parameters and FLOPs with the very `num_params` / `flops_per_token` the trainer uses (a test checks
the result against the Keras-importing classes), never with a copy of the formulas.

Example:
    cfg = model_config("gpt", "175b", seq_length=2048)
    cfg.num_params()                                   # 174.6e9
"""
import ast
import dataclasses
import functools
import math
import os

from tfbig.models import common

_SOURCES = {"gpt": ("gpt.py", "GPTConfig", "GPT_PRESETS"),
            "albert": ("albert.py", "AlbertConfig", "ALBERT_PRESETS")}


@functools.lru_cache(maxsize=None)
def load_configs(family):
    """(config class, preset table) of `family` (gpt | albert), read without importing Keras."""
    if family not in _SOURCES:
        raise ValueError(f"--model={family!r}: expected one of {sorted(_SOURCES)}")
    filename, class_name, presets_name = _SOURCES[family]
    path = os.path.join(os.path.dirname(common.__file__), filename)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    wanted = [node for node in tree.body if _defines(node, (class_name, presets_name))]
    namespace = {"dataclasses": dataclasses, "math": math,
                 "ArchitectureConfig": common.ArchitectureConfig, "__name__": "tfbig.plan._models"}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), path, "exec"), namespace)  # noqa: S102
    return namespace[class_name], namespace[presets_name]


def _defines(node, names):
    """Whether a top-level statement defines one of `names` (a class or a plain assignment)."""
    if isinstance(node, ast.ClassDef):
        return node.name in names
    return (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names)


def model_config(family, preset, **overrides):
    """The architecture config of a preset with overrides applied (None keeps the preset's)."""
    cls, _ = load_configs(family)
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls.from_preset(preset, **{k: v for k, v in overrides.items() if k in fields})


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the estimates need from a model: sizes of the repeated layer and of the rest."""

    family: str
    num_layers: int  # layers run per token (ALBERT re-runs shared blocks)
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    seq_length: int  # the sequence length trained on
    dropout: bool  # dropout masks are kept for the backward pass
    params: int  # all weights (a shared block counts once)
    layer_params: int  # weights of one transformer layer
    block_params: int  # weights of all distinct transformer layers (ALBERT: its shared groups)
    flops_per_token: float  # model FLOPs (forward + backward), no recomputation

    @property
    def shared_layers(self):
        """ALBERT's layers share weights, so splitting them over pipeline stages saves none."""
        return self.family == "albert"


def shape_of(cfg, family, seq_length):
    """A Shape from a GPTConfig/AlbertConfig (from `model_config`) at `seq_length`."""
    c, f = cfg.hidden_size, cfg.intermediate_size
    layer = (3 * c * c + 3 * c) + (c * c + c) + (c * f + f) + (f * c + c) + 4 * c
    distinct = getattr(cfg, "num_groups", cfg.num_layers)
    return Shape(family, cfg.num_layers, c, cfg.num_heads, f, cfg.vocab_size, seq_length,
                 cfg.dropout > 0, cfg.num_params(), layer, distinct * layer,
                 cfg.flops_per_token(seq_length))
