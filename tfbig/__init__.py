"""tfbig: GPT and ALBERT training on TensorFlow/Keras 3, and your own Keras model.

The public surface (`__all__`): `tfbig.train`, `tfbig.evaluate`, `tfbig.predict`, `tfbig.Task`,
`tfbig.DataShard`, `tfbig.Run`, `tfbig.configure`, `tfbig.define_flags`,
`tfbig.config_from_flags`, `tfbig.consolidate_run`, `tfbig.device_mesh` (tfbig.api),
`tfbig.ExperimentConfig`.
`import tfbig` imports no TensorFlow: each name is loaded from tfbig.api when first used.

Layers. Imports inside tfbig/ point down the list below, never up, and never in a circle; an
import inside a function counts, and so does a "module:Name" string a registry imports
(tests/test_import_layers.py checks it with `ast`, importing nothing; docs/design/layers.md
says why each folder sits where it does). The map names folders (and the few modules at the
top of the package), never a module inside a folder: a folder is one layer. Lowest first:

    base:      tfbig.errors tfbig.config tfbig.compat tfbig.optim tfbig.checkpoints
               tfbig.profiling
    models:    tfbig.models
    layouts:   tfbig.layouts
    inputs:    tfbig.data tfbig.convert
    tasks:     tfbig.tasks
    plan:      tfbig.plan
    backends:  tfbig.distribute
    pipeline:  tfbig.pipeline
    training:  tfbig.training tfbig.doctor
    commands:  tfbig.commands
    api:       tfbig tfbig.api

Outside tfbig/ sit the leaves (launch, data_prep, notebooks, benchmarks, tests): tfbig imports
none. Old module names (tfbig.manifest, tfbig.trainer, ...) resolve through tfbig.compat.

`tfbig` itself (this file) sits in the top layer, api, beside tfbig.api: it re-exports the
public API, which stands on the Trainer. Every import of a submodule runs this file first, so
at its top it only installs the old names' finder (tfbig.compat, base layer, no TensorFlow);
`__getattr__` imports tfbig.api when a public name is first read, by then a complete module. Nothing inside tfbig imports the package `tfbig` for a
name of its own (only `from tfbig import module`), so the top layer makes no circle.
"""

from tfbig import compat

compat.install()

__all__ = ["DataShard", "ExperimentConfig", "Run", "Task", "config_from_flags", "configure",
           "consolidate_run", "define_flags", "device_mesh", "evaluate", "predict", "train"]


def __getattr__(name):
    """The public names, from tfbig.api (ExperimentConfig: tfbig.config), on first use."""
    if name == "ExperimentConfig":
        from tfbig.config import ExperimentConfig

        return ExperimentConfig
    if name in __all__:
        from tfbig import api

        return getattr(api, name)
    raise AttributeError(f"module 'tfbig' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
