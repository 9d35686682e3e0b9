"""The backend registry: `get_strategy(name, cfg)` picks one backend behind the one surface.

The top of the parallel-backends family (the layer map: tfbig/__init__.py): the one place that
knows every backend, the pipeline's included; the backends themselves never import it.
"""
import importlib

from tfbig.config import pipeline_stages
from tfbig.layouts import composition

# name -> "module:Class". Backends import their libraries (horovod, ...) only when chosen.
BACKENDS = {
    "single": "tfbig.distribute.base:SingleDevice",
    "pipeline": "tfbig.pipeline.strategy:PipelineStrategy",
    "horovod": "tfbig.training.registry:horovod_backend",  # HorovodStrategy, elastic, ZeRO, TP..
    "multiworker": "tfbig.distribute.multiworker:MultiWorker",
    "mirrored": "tfbig.distribute.multiworker:Mirrored",
}


def get_strategy(name, cfg=None):
    """The backend registered under `name` (the --strategy flag), built from `cfg`."""
    if name not in BACKENDS:
        raise ValueError(f"--strategy={name!r}: expected one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(cfg)


def horovod_backend(cfg=None):
    """--strategy=horovod: experts split over ranks with --expert_parallel > 1 (with ZeRO-1/2/3
    over the other weights if --zero_stage, the attention split with --tensor_parallel, with
    ZeRO-1/2 too, or inside pipeline stages with --pipeline_stages, ZeRO-1 there too),
    pipeline stages on ranks with --pipeline_stages > 1 (with ZeRO-1 if --zero_stage), elastic
    in the process with --elastic (ZeRO-sharded if --zero_stage), tensor-parallel with
    --tensor_parallel (with ZeRO-1/2/3 if --zero_stage), ZeRO-sharded with --zero_stage, else
    the fixed-world HorovodStrategy; with --context_parallel the chosen backend (a data backend,
    an expert backend or the pipeline) gets the context axis mixed in; with --elastic and a
    layout with groups (composition.GROUPED) the chosen backend restarts in a new world. The
    pairs that do not compose (tfbig.layouts.composition) are refused first, by name."""
    horovod = getattr(cfg, "horovod", None)
    parallel = getattr(cfg, "parallel", None)
    tensor = getattr(parallel, "tensor_parallel", 1)
    zero_stage = getattr(parallel, "zero_stage", 0)
    values = composition.values_of(cfg) if cfg is not None else {}
    composition.check(values)  # the pairs that do not compose
    expert = getattr(parallel, "expert_parallel", 1) > 1
    elastic = bool(getattr(horovod, "elastic", False))
    grouped = composition.grouped(values)
    if expert and cfg is not None and pipeline_stages(cfg) > 1:  # no TP: REFUSED
        from tfbig.pipeline import expert_stage

        backend = expert_stage.ExpertZeroPipeline if zero_stage else expert_stage.ExpertPipeline
    elif expert and tensor > 1 and zero_stage:  # ZeRO-1/2 (3: REFUSED)
        from tfbig.distribute.expert_tensor_zero import ExpertTensorZeroStrategy as backend
    elif expert and tensor > 1:
        from tfbig.distribute.expert_tensor import ExpertTensorStrategy as backend
    elif expert and zero_stage:
        from tfbig.distribute.expert_zero import ExpertZeroStrategy as backend
    elif expert:
        from tfbig.distribute.expert_parallel import ExpertParallelStrategy as backend
    elif cfg is not None and pipeline_stages(cfg) > 1:
        backend = _pipeline_backend(tensor, zero_stage)
    elif elastic and not grouped:  # in the process: data parallel, ZeRO over the world
        from tfbig.distribute.elastic import with_elastic

        return with_elastic(_data_backend(1, zero_stage))(cfg)
    else:
        backend = _data_backend(tensor, zero_stage)
    if getattr(parallel, "context_parallel", 1) > 1:
        from tfbig.distribute.context_parallel import with_context

        backend = with_context(backend)
    if elastic:  # a layout with groups: a new world by a restart
        from tfbig.distribute.elastic import with_restarts

        backend = with_restarts(backend)
    return backend(cfg)


def _pipeline_backend(tensor, zero_stage):
    """The class of the cross-rank pipeline for these flags (ZeRO-1 only: 2 and 3 are
    composition.REFUSED with stages)."""
    from tfbig.pipeline.cross_rank import CrossRankPipeline
    from tfbig.pipeline.tensor_stage import TensorPipeline

    pipeline = TensorPipeline if tensor > 1 else CrossRankPipeline
    if zero_stage:
        from tfbig.pipeline.zero_stage import with_zero

        pipeline = with_zero(pipeline)
    return pipeline


def _data_backend(tensor, zero_stage):
    """The class of the fixed-world Horovod backend for these flags."""
    if tensor > 1 and zero_stage:
        from tfbig.distribute.tensor_zero import TensorZeroStrategy

        return TensorZeroStrategy
    if tensor > 1:
        from tfbig.distribute.tensor_parallel import TensorParallelStrategy

        return TensorParallelStrategy
    if zero_stage:
        from tfbig.distribute.zero import ZeroStrategy

        return ZeroStrategy
    from tfbig.distribute.horovod import HorovodStrategy

    return HorovodStrategy
