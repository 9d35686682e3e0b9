"""tfbig: GPT and ALBERT training on TensorFlow/Keras 3, and your own Keras model.

The public surface (`__all__`): `tfbig.train`, `tfbig.evaluate`, `tfbig.predict`, `tfbig.Task`,
`tfbig.DataShard`, `tfbig.Run`, `tfbig.configure`, `tfbig.define_flags`,
`tfbig.config_from_flags`, `tfbig.consolidate_run` (tfbig.api), `tfbig.ExperimentConfig`.
`import tfbig` imports nothing: each name is loaded from tfbig.api when first used.

Layers. Imports inside tfbig/ point down the list below, never up, and never in a circle; an
import inside a function counts, and so does a "module:Name" string a registry imports
(tests/test_import_layers.py checks it with `ast`, importing nothing; docs/design/layers.md
says why each module sits where it does). A module belongs to the longest pattern naming it:
"a.b" is a.b and everything below it ("tfbig" only tfbig/__init__.py), "a.b.*" only what is
below it, "*" is a shell glob.
Modules in one layer may import each other (without a circle). Lowest first:

    base:      tfbig.errors tfbig.config tfbig.cli tfbig.integrity tfbig.checkpoint
               tfbig.optim tfbig.perf tfbig.wordpiece tfbig.profiling tfbig.evaluation
               tfbig.deprecation
    models:    tfbig.models tfbig.plan.models
    inputs:    tfbig.data tfbig.squad tfbig.glue tfbig.convert.run_dir tfbig.init_checkpoint
               tfbig.albert_data tfbig.formats tfbig.manifest tfbig.prepare tfbig.shards
               tfbig.sources tfbig.tfrecord tfbig.tokenizer
    tasks:     tfbig.tasks
    layouts:   tfbig.plan tfbig.pipeline.partition tfbig.distribute.zero_checkpoint
               tfbig.distribute.tensor_layout tfbig.pipeline.stage_checkpoint
    backends:  tfbig.distribute tfbig.distribute.*
    pipeline:  tfbig.pipeline
    registry:  tfbig.distribute.registry
    trainer:   tfbig.trainer tfbig.budget tfbig.logs tfbig.preflight
    commands:  tfbig.train tfbig.train_command tfbig.recipes tfbig.generate tfbig.export tfbig.consolidate tfbig.doctor
               tfbig.convert tfbig.plan.cli tfbig.plan.__main__ tfbig.plan.local
               tfbig.plan.measure tfbig.squad.cli tfbig.classify tfbig.finetune
    api:       tfbig tfbig.api

layouts .. registry are one family, the parallel backends, in that order: what a sharded run's
pieces hold (below every backend, so tfbig-generate reads them without one); the data, ZeRO and
tensor backends; the pipeline backends, built on them; the registry that picks one. Outside
tfbig/ sit the leaves (launch, data_prep, notebooks, benchmarks, tests): tfbig imports none.

The old homes of modules that moved into tfbig.data (tfbig.manifest, ...: tfbig.deprecation)
sit in inputs beside their new ones: each is a shim that imports its new module and warns.

`tfbig` itself (this file) sits in the top layer, api, beside tfbig.api: it re-exports the
public API, which stands on the Trainer. Every import of a submodule runs this file first, so
it imports nothing at its top (the check that a package's top-level imports sit no higher
than its lowest module holds it to that); `__getattr__` imports tfbig.api when a public name is
first read, by then a complete module. Nothing inside tfbig imports the package `tfbig` for a
name of its own (only `from tfbig import module`), so the top layer makes no circle.
"""

__all__ = ["DataShard", "ExperimentConfig", "Run", "Task", "config_from_flags", "configure",
           "consolidate_run", "define_flags", "evaluate", "predict", "train"]


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
