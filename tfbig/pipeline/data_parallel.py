"""Data parallel × pipeline under Horovod: a grid of (data-parallel replica, stage).

Each Horovod process is one data-parallel replica holding a whole pipeline: its K stages run on
its own K devices (GPUs local_rank*K .. local_rank*K + K-1, or its own logical CPU devices).
The gradients of stage s are averaged among the processes holding stage s — here every
process, so each stage's process set is the global one — with one grouped allreduce per
stage, which can start as soon as that stage's backward is done. Each process reads the data of
its data-parallel rank (the trainer's input context), so all stages of a replica see the same
samples.

Stages spread over different processes (one stage per rank) are the other layout:
`--strategy=horovod --pipeline_stages=K` (tfbig.pipeline.cross_rank).

Example (2 replicas x 2 stages, 4 devices in all):
    horovodrun -np 2 -H localhost:2 --gloo tfbig-train --strategy=pipeline --pipeline_stages=2
"""
import os

from tfbig.distribute.mesh import RANK_VARIABLES


def launched_by_horovod():
    """Whether this process was started by horovodrun or mpirun (one of several ranks)."""
    return any(name in os.environ for name in RANK_VARIABLES)


class HorovodGrid:
    """The (data-parallel replica, stage) grid of this Horovod job; built once, passed around."""

    def __init__(self, num_stages, fp16_allreduce=False, thread_policy="auto"):
        import horovod.tensorflow as hvd

        from tfbig.distribute import horovod_keras

        if not hvd.is_initialized():
            # Horovod: initialise (no GPU pinning: this process uses K GPUs); its background
            # threads scheduled per --hvd_thread_policy
            horovod_keras.init(pin_gpu=False, thread_policy=thread_policy)
        self.hvd = hvd
        self.num_stages = num_stages
        self.fp16_allreduce = fp16_allreduce
        self.size = hvd.size()  # data-parallel replicas
        self.rank = hvd.rank()  # this process's data-parallel rank
        self.local_rank = hvd.local_rank()
        # Horovod: the processes holding each stage (all of them: every process holds all).
        self.stage_process_sets = [hvd.global_process_set] * num_stages

    def average_stage_gradients(self, stage, grads):
        """Average one stage's gradients over the replicas holding that stage."""
        from tfbig.distribute import horovod_keras

        # Horovod: one grouped allreduce per stage, over that stage's process set.
        return horovod_keras.average_gradients(grads, self.fp16_allreduce,
                                               self.stage_process_sets[stage])

    def average_values(self, values):
        from tfbig.distribute import horovod_keras

        return horovod_keras.average_values(values)  # Horovod: metrics over all replicas

    def gather_values(self, values):
        from tfbig.distribute import horovod_keras

        return horovod_keras.gather_values(values)  # Horovod: rows of all replicas, rank order

    def broadcast(self, variables):
        from tfbig.distribute import horovod_keras

        horovod_keras.broadcast_variables(variables, root_rank=0)  # Horovod: rank 0's state
