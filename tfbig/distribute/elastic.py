"""Elastic Horovod (`--strategy=horovod --elastic`): ranks may die and join during a run.

Data parallelism and ZeRO over the whole world change worlds in the process (`with_elastic`:
roll back to the last commit, or sync the joining ranks). A layout with groups (tensor,
pipeline, context or expert parallelism, MiCS) changes worlds by restarting (`with_restarts`):
its groups are Horovod process sets, and Horovod's elastic mode does not survive a lost rank
while process sets exist (0.28.1: every rank aborts in Gloo, horovod/horovod#4021), so a lost
rank ends every process, and hosts the discovery script adds or removes make every rank save a
checkpoint and stop (exit 143); `tfbig-launch --max_restarts=N` then starts the job again in
the world the discovery script reports, resuming from the newest intact checkpoint (torchrun's
restart-on-membership-change).

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.elastic).
"""
import contextlib

import numpy as np
import tensorflow as tf
from horovod.common.elastic import State, notification_manager, run_fn
from horovod.common.exceptions import HorovodInternalError

from tfbig.distribute import horovod_keras
from tfbig.distribute.horovod import HorovodStrategy, build_mesh
from tfbig.distribute.horovod_keras import hvd
from tfbig.distribute.mesh import HorovodMesh
from tfbig.errors import UsageError
from tfbig.layouts import composition


def check_elastic(cfg):
    """Refuse --elastic with a layout or option that depends on the world size."""
    composition.check(composition.values_of(cfg))  # the layouts --elastic does not run
    if cfg.horovod.scale_lr:
        raise UsageError("--elastic cannot be combined with --scale_lr: the global batch stays "
                         "--batch_size when ranks come and go, so the learning rate must not "
                         "follow the number of processes")
    if cfg.horovod.elastic_commit_every < 1:
        raise UsageError(f"--elastic_commit_every={cfg.horovod.elastic_commit_every}: expected "
                         f"a positive number of steps")


class VariablesState(State):
    """Horovod elastic state kept on plain `tf.Variable`s (Keras 3 safe), as one device holds
    it: a ZeRO backend's slices (the optimizer slots; stage 3's parameters) whole
    (`whole_slices`), gathered at each commit.

    save: copy every variable (and the whole slices) to host memory; restore: assign the copies
    back (roll back to the last commit); sync: broadcast rank 0's values to every rank, cut the
    whole slices for this world (`lay_out_slices`), then save.
    """

    def __init__(self, strategy, variables):
        self.strategy = strategy
        self._sliced = hasattr(strategy, "whole_slices")  # ZeRO: laid out in each world
        skip = strategy.sliced_ids() if self._sliced else set()
        self.variables = horovod_keras.tf_variables([v for v in variables if id(v) not in skip])
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self._saved = self._whole = None
        if not self._sliced:
            self.save()  # no collective: a joining rank would deadlock before the first sync

    def save(self):
        whole = self.strategy.whole_slices() if self._sliced else None  # a collective
        self._saved, self._whole = [v.numpy() for v in self.variables], whole

    def restore(self):
        for variable, value in zip(self.variables, self._saved or ()):
            variable.assign(value)

    def sync(self):
        # Horovod: the new world starts from rank 0's committed state. run_fn calls this outside
        # the attempt: a peer lost during the broadcast (the first one: while the others still
        # build and compile) is a reset too, not the end of this rank.
        with _as_reset():
            whole = self._rank0_whole() if self._sliced else None
            if self._sliced and whole is None:  # the run's start: each rank's own slices
                self.strategy.check_one_step()
            horovod_keras.broadcast_variables(self.variables, root_rank=0,
                                              process_set=hvd.global_process_set)
            if self._sliced:
                self.strategy.lay_out_slices(whole)
            self.save()  # ZeRO: a collective too

    def _rank0_whole(self):
        """Rank 0's committed whole slices (None at the run's start: each rank's slices are
        its own, fresh or restored, already laid out)."""
        if not hvd.broadcast_object(self._whole is not None, root_rank=0):
            return None
        shapes = [v.shape for v in self.strategy.model_variables]
        whole = self._whole or [[np.zeros(s, np.float32) for s in shapes]
                                for _ in self.strategy._sliced_kinds()]
        return [[hvd.broadcast(tf.constant(x), root_rank=0).numpy() for x in kind]
                for kind in whole]


def _horovod_failure(error):
    """True for a TensorFlow error raised by a Horovod collective whose peer is gone."""
    text = str(getattr(error, "message", error))
    return isinstance(error, tf.errors.OpError) and "Horovod" in text


@contextlib.contextmanager
def _as_reset():
    """Raise a Horovod collective's failure (a peer is gone) as HorovodInternalError, which
    Horovod's elastic loop answers with a reset; other errors pass unchanged."""
    try:
        yield
    except tf.errors.OpError as error:
        if _horovod_failure(error):
            raise HorovodInternalError(error) from error
        raise


def with_elastic(backend):
    """`backend` (HorovodStrategy or ZeroStrategy) over a world that may shrink and grow (see
    module doc); a ZeRO backend's slices are laid out again in each world."""

    class Elastic(backend):
        name = "horovod"
        # ZeRO-3: a world changed before the first commit cuts the new run's slices again
        keeps_initial_values = True

        def __init__(self, cfg):
            check_elastic(cfg)
            # Horovod: the world size comes from the elastic rendezvous
            horovod_keras.init(thread_policy=cfg.horovod.hvd_thread_policy)
            super().__init__(cfg, mesh=HorovodMesh(build_mesh(cfg.parallel, hvd.size())))
            self.commit_every = cfg.horovod.elastic_commit_every
            # also for one rank: the same ops in every trace
            self.process_set = hvd.global_process_set
            self.state = None
            self.resets = []  # (world size before, after) of each reset, for logs and tests

        def broadcast_variables(self, variables):
            # Horovod elastic: no collective before the run starts (a joining rank would
            # deadlock); the state is broadcast by its first sync, inside run_training.
            self.state = VariablesState(self, variables)

        def run_training(self, loop):
            """Run `loop()` to completion across resets (rank lost: roll back; ranks added:
            sync); it runs again after each reset, in the new world."""
            def attempt(state):
                with _as_reset():
                    return loop()

            return run_fn(attempt, self._reset)(self.state)

        def _reset(self):
            before = self.num_replicas
            hvd.shutdown()
            # Horovod: the new world (smaller after a loss, larger after an addition), whose
            # new background threads get the policy again
            horovod_keras.init(pin_gpu=False, thread_policy=self.options.hvd_thread_policy)
            self.mesh = HorovodMesh(build_mesh(self.parallel, hvd.size()), pin_gpu=False)
            self.process_set = hvd.global_process_set
            self.resets.append((before, self.num_replicas))
            if self.is_chief:
                print(f"elastic: world {before} -> {self.num_replicas} ranks; resuming from the "
                      f"last commit", flush=True)

        def after_step(self, step):
            if step % self.commit_every == 0:
                self.state.commit()  # may raise HostsUpdatedInterrupt: ranks are joining

        def checkpoint_dir(self, model_dir):
            self.state.commit()  # every rank, always before a checkpoint
            return super().checkpoint_dir(model_dir)

    Elastic.__name__ = Elastic.__qualname__ = f"Elastic{backend.__name__}"
    return Elastic


ElasticHorovodStrategy = with_elastic(HorovodStrategy)


class HostWatch:
    """Horovod elastic's notice that the discovery script reports other hosts (a listener of
    its worker notification manager); `changed` once one came."""

    def __init__(self):
        self.changed = False
        notification_manager.init()  # this worker's address, for the driver's notices
        notification_manager.register_listener(self)

    def on_hosts_updated(self, timestamp, update_res):
        self.changed = True


def with_restarts(backend):
    """`backend` (a layout with groups) under --elastic: a fixed world that stops, a checkpoint
    saved, when the hosts change, for tfbig-launch --max_restarts to start it again in the new
    world (module doc)."""

    class Restarting(backend):
        def __init__(self, cfg):
            check_elastic(cfg)
            super().__init__(cfg)
            self.hosts = None

        def run_training(self, loop):
            # Listening starts here, not at __init__: its service draws from Python's random,
            # which Keras' unseeded initialisers read while the model is built.
            self.hosts = self.hosts or HostWatch()
            return super().run_training(loop)

        def should_stop(self):
            if self.hosts is not None and self.hosts.changed and not self._sigterm.is_set():
                if self.is_chief:
                    print("elastic: the discovery script reports other hosts; every rank "
                          "saves a checkpoint and stops (exit 143) for tfbig-launch "
                          "--max_restarts to start the job again in the new world", flush=True)
                self._sigterm.set()  # the preemption path: all ranks agree, save and stop
            return super().should_stop()

        def shutdown(self):
            if self.hosts is None or not self.hosts.changed:
                return super().shutdown()
            try:  # Horovod's loop may have ended at the driver's notice; the pieces are saved
                super().shutdown()
            except tf.errors.OpError as error:
                print(f"elastic: Horovod ended at the hosts' change ({type(error).__name__}); "
                      "this rank's checkpoint pieces are saved", flush=True)

    Restarting.__name__ = Restarting.__qualname__ = f"Restarting{backend.__name__}"
    return Restarting
