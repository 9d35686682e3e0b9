"""Pipeline parallelism, written by hand: a model cut into stages on several devices.

    layers.py      the model as a sequence of cut-able layers (per family, or as a user task
                   declares them: tfbig.tasks.user_pipeline)
    devices.py     one device per stage: GPUs, else logical CPU devices
    stages.py      a stage: forward/backward of one micro-batch, gradients summed
    schedules.py   GPipe and 1F1B (same signature), their timeline, and the runner
    strategy.py    --strategy=pipeline on the one Strategy surface
    data_parallel.py  data parallel x pipeline under Horovod (every rank holds all stages)
    cross_rank.py  --strategy=horovod --pipeline_stages=K: one stage per Horovod rank
    transport.py   activations and gradients between stage ranks (hvd.alltoall on pairs)
    stage_model.py a model built holding one stage
    tensor_stage.py  + --tensor_parallel=T: each stage split over T ranks (the 3D layout)

Stage boundaries (tfbig.layouts.partition) and stage checkpoints (tfbig.layouts.stage_checkpoint)
are layouts: data below every backend.
"""
