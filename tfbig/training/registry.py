"""The backend registry: `get_strategy(name, cfg)` picks one backend behind the one surface.

The top of the parallel-backends family (the layer map: tfbig/__init__.py): the one place that
knows every backend, the pipeline's included; the backends themselves never import it.
"""
import importlib

from tfbig.config import pipeline_stages

# name -> "module:Class". Backends import their libraries (horovod, ...) only when chosen.
BACKENDS = {
    "single": "tfbig.distribute.base:SingleDevice",
    "pipeline": "tfbig.pipeline.strategy:PipelineStrategy",
    "horovod": "tfbig.training.registry:horovod_backend",  # HorovodStrategy, elastic, ZeRO, TP, PP
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
    """--strategy=horovod: experts split over ranks with --expert_parallel > 1 (with data
    parallelism only), pipeline stages on ranks with --pipeline_stages > 1, elastic with
    --elastic, tensor-parallel with --tensor_parallel (with ZeRO-1 if --zero_stage=1),
    ZeRO-sharded with --zero_stage, else the fixed-world HorovodStrategy; with
    --context_parallel the chosen data backend gets the context axis mixed in."""
    horovod = getattr(cfg, "horovod", None)
    parallel = getattr(cfg, "parallel", None)
    tensor = getattr(parallel, "tensor_parallel", 1)
    context = getattr(parallel, "context_parallel", 1)
    if getattr(parallel, "expert_parallel", 1) > 1:
        _check_expert(cfg, horovod)
        from tfbig.distribute.expert_parallel import ExpertParallelStrategy

        return ExpertParallelStrategy(cfg)
    if context > 1:
        _check_context(cfg, horovod)
    if cfg is not None and pipeline_stages(cfg) > 1:
        from tfbig.pipeline.cross_rank import CrossRankPipeline
        from tfbig.pipeline.tensor_stage import TensorPipeline

        # Both refuse what they do not combine with (--elastic...).
        return TensorPipeline(cfg) if tensor > 1 else CrossRankPipeline(cfg)
    if horovod is not None and horovod.elastic:
        from tfbig.distribute.elastic import ElasticHorovodStrategy

        return ElasticHorovodStrategy(cfg)  # refuses --tensor_parallel (check_elastic)
    backend = _data_backend(tensor, getattr(parallel, "zero_stage", 0))
    if context > 1:
        from tfbig.distribute.context_parallel import with_context

        backend = with_context(backend)
    return backend(cfg)


def _data_backend(tensor, zero_stage):
    """The class of the fixed-world Horovod backend for these flags."""
    if tensor > 1 and zero_stage:
        from tfbig.distribute.tensor_zero import TensorZeroStrategy

        return TensorZeroStrategy  # --zero_stage=1 (build_mesh refuses 2 and 3)
    if tensor > 1:
        from tfbig.distribute.tensor_parallel import TensorParallelStrategy

        return TensorParallelStrategy
    if zero_stage:
        from tfbig.distribute.zero import ZeroStrategy

        return ZeroStrategy
    from tfbig.distribute.horovod import HorovodStrategy

    return HorovodStrategy


def _check_expert(cfg, horovod):
    """Refuse, by name, what --expert_parallel is not built or tested with yet."""
    parallel, flag = cfg.parallel, f"--expert_parallel={cfg.parallel.expert_parallel}"
    for name, value in (("--pipeline_stages", pipeline_stages(cfg)),
                        ("--tensor_parallel", parallel.tensor_parallel),
                        ("--context_parallel", parallel.context_parallel),
                        ("--zero_stage", parallel.zero_stage + 1)):
        if value > 1:
            shown = value - 1 if name == "--zero_stage" else value
            raise ValueError(f"{flag} with {name}={shown} is not supported yet (expert "
                             f"parallelism is built and tested with data parallelism only); "
                             f"drop one of them")
    if horovod is not None and horovod.elastic:
        raise ValueError(f"{flag} with --elastic is not supported: an expert group cannot "
                         f"lose a rank; drop one of them")


def _check_context(cfg, horovod):
    """Refuse, by name, what --context_parallel is not built or tested with."""
    context = cfg.parallel.context_parallel
    if pipeline_stages(cfg) > 1:
        raise ValueError(f"--context_parallel={context} with --pipeline_stages="
                         f"{pipeline_stages(cfg)} is not supported: the pipeline's stages "
                         f"exchange whole-sequence activations and its schedules are not cut "
                         f"by chunk; use --context_parallel with data, tensor and ZeRO-1 "
                         f"layouts, or the pipeline without it")
    if horovod is not None and horovod.elastic:
        raise ValueError(f"--context_parallel={context} with --elastic is not supported: a "
                         f"context group cannot lose a rank; drop one of them")
