"""tfbig: GPT and ALBERT training on TensorFlow/Keras 3.

Layers. Imports inside tfbig/ point down the list below, never up, and never in a circle; an
import inside a function counts, and so does a "module:Name" string a registry imports
(tests/test_import_layers.py checks it with `ast`, importing nothing; docs/design/layers.md
says why each module sits where it does). A module belongs to the longest pattern naming it:
"a.b" is a.b and everything below it ("tfbig" only tfbig/__init__.py), "a.b.*" only what is
below it, "*" is a shell glob.
Modules in one layer may import each other (without a circle). Lowest first:

    base:      tfbig tfbig.errors tfbig.config tfbig.cli tfbig.integrity tfbig.checkpoint
               tfbig.optim tfbig.perf tfbig.wordpiece tfbig.profiling tfbig.evaluation
    models:    tfbig.models tfbig.plan.models
    inputs:    tfbig.data tfbig.squad tfbig.glue tfbig.convert.run_dir tfbig.init_checkpoint
    tasks:     tfbig.tasks
    layouts:   tfbig.plan tfbig.pipeline.partition tfbig.distribute.zero_checkpoint
               tfbig.distribute.tensor_layout tfbig.pipeline.stage_checkpoint
    backends:  tfbig.distribute tfbig.distribute.*
    pipeline:  tfbig.pipeline
    registry:  tfbig.distribute.registry
    trainer:   tfbig.trainer tfbig.budget tfbig.logs tfbig.preflight
    commands:  tfbig.train tfbig.recipes tfbig.generate tfbig.export tfbig.consolidate tfbig.doctor
               tfbig.convert tfbig.plan.cli tfbig.plan.__main__ tfbig.plan.local
               tfbig.plan.measure tfbig.squad.cli tfbig.classify tfbig.finetune

layouts .. registry are one family, the parallel backends, in that order: what a sharded run's
pieces hold (below every backend, so tfbig-generate reads them without one); the data, ZeRO and
tensor backends; the pipeline backends, built on them; the registry that picks one. Outside
tfbig/ sit the leaves (launch, data_prep, notebooks, benchmarks, tests): tfbig imports none.
"""
