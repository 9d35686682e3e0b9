"""Training backends behind one surface (see base.Strategy); pick one with get_strategy."""
import importlib

# name -> "module:Class". Backends import their libraries (horovod, ...) only when chosen.
BACKENDS = {
    "single": "tfbig.distribute.base:SingleDevice",
    "pipeline": "tfbig.pipeline.strategy:PipelineStrategy",
    "horovod": "tfbig.distribute.elastic:horovod_backend",  # HorovodStrategy, or elastic
    "multiworker": "tfbig.distribute.multiworker:MultiWorker",
    "mirrored": "tfbig.distribute.multiworker:Mirrored",
}


def get_strategy(name, cfg=None):
    """The backend registered under `name` (the --strategy flag), built from `cfg`."""
    if name not in BACKENDS:
        raise ValueError(f"--strategy={name!r}: expected one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(cfg)
