"""Checkpoints written beside training (`--async_checkpoint`): the loop waits only for a copy.

`CheckpointWriter.save(number)` copies every tensor of the `tf.train.Checkpoint` to host memory
(numpy copies, taken in the calling thread, so a backend's reads run where they always did)
and returns; a background thread writes those copies as the same TensorFlow checkpoint a
synchronous save writes (same keys, same object graph: `tf.train.Checkpoint.restore` reads
either), records its sums and checks that the index and every data shard are there
(tfbig.checkpoints.integrity; the sums were just computed from the files, so checking them
again would read every byte a second time for nothing), and only then names it
in the directory's `checkpoint` state file and lets the manager rotate out the oldest one. Until
then the previous checkpoint is the newest one a resume sees, so a death during the write costs
the steps since that one, never the run.

One write is pending at a time: the next save (and `wait()`, which the final save and process
exit call) first waits for it; an error of the write is raised there.

    writer = CheckpointWriter(checkpoint, "/run", max_to_keep=3, finish=after_write)
    writer.save(200)   # returns "/run/ckpt-200" once the state is on host
    writer.wait()      # the write, its sums and the state file are done

TensorFlow's own `CheckpointOptions(experimental_enable_async_checkpoint=True)` is not used:
its CheckpointManager names the new checkpoint in the state file before its files are written,
may rotate out the previous one meanwhile, and has no hook to record the sums after the write.
The tensors are gathered with TrackableSaver's `_gather_serialized_tensors` and written with
`functional_saver.MultiDeviceSaver`, what `tf.train.Checkpoint.write` itself runs (TF 2.20).
"""
import atexit
import os
import threading
import time
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import functional_saver
from tensorflow.python.eager import context, executor
from tensorflow.python.training.saving import saveable_object
from tensorflow.python.util import object_identity

from tfbig.checkpoints import integrity

# Tests only: seconds the writer sleeps before it writes, while the loop trains on: the copy
# must hold the saved step's values, and a process killed then resumes from the previous one.
WRITE_SLEEP_ENV = "TFBIG_TEST_CHECKPOINT_WRITE_SLEEP"
_COPIERS = weakref.WeakKeyDictionary()  # {tf.train.Checkpoint: its HostCopier}


def _read(value):
    """The tensor of one serialized value (a SaveSpec's callable reads its variable)."""
    return value.tensor if isinstance(value, saveable_object.SaveSpec) else value


class HostCopier:
    """Copies everything a `tf.train.Checkpoint` saves to host memory.

    The first copy gathers what TensorFlow's saver would save (its object graph included, the
    None entry) and traces one function that reads every value: later copies are one call and
    one numpy copy per tensor (a variable read one by one costs ~1 ms of Python each). The
    checkpoint's objects must not change after the first copy (a Trainer's are built before).
    """

    def __init__(self, checkpoint):
        saver = checkpoint._saver  # noqa: SLF001 - what tf.train.Checkpoint.write gathers
        serialized, _, registered, _ = saver._gather_serialized_tensors(None)  # noqa: SLF001
        if registered:
            raise NotImplementedError("--async_checkpoint: a registered saver (e.g. DTensor) "
                                      "cannot be copied to host; use --async_checkpoint=off")
        self._places, values = [], []  # (trackable, key, slice spec) of each value read
        for trackable, tensors in serialized.items():
            for key, slices in tensors.items():
                for spec, value in (slices if isinstance(slices, dict) else {"": slices}).items():
                    self._places.append((trackable, key, spec))
                    values.append(value)
        self._read_all = tf.function(lambda: [_read(v) for v in values], autograph=False)

    def snapshot(self):
        """{trackable: {checkpoint key: {slice spec: numpy copy}}} (an identity dictionary):
        the bytes the write will see, whatever the steps do to the variables next."""
        snapshot = object_identity.ObjectIdentityDictionary()  # variables are unhashable
        for (trackable, key, spec), tensor in zip(self._places, self._read_all(), strict=True):
            keyed = snapshot.setdefault(trackable, {})
            keyed.setdefault(key, {})[spec] = np.array(tensor.numpy(), copy=True)
        return snapshot


def write_snapshot(snapshot, prefix):
    """Write a host snapshot as TensorFlow checkpoint `prefix` (PREFIX.index, PREFIX.data-*)."""
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)  # as Checkpoint.write does (a
    # worker's temporary directory is removed after each save)
    with tf.device("/cpu:0"):
        tensors = object_identity.ObjectIdentityDictionary()
        for trackable, keyed in snapshot.items():
            tensors[trackable] = {key: {spec: tf.constant(a) for spec, a in slices.items()}
                                  for key, slices in keyed.items()}
        functional_saver.MultiDeviceSaver(tensors).save(prefix)
    return prefix


def host_copier(checkpoint, again=False):
    """The HostCopier of `checkpoint`, made and traced once (a few seconds: a Trainer makes it
    at start, so its first save takes as long as the next ones, which a time budget times);
    `again`: made anew (the checkpoint's variables changed: elastic ZeRO in a new world)."""
    if again or checkpoint not in _COPIERS:
        checkpoint.save_counter  # noqa: B018 - made on first use: before the graph is fixed
        copier = _COPIERS[checkpoint] = HostCopier(checkpoint)
        copier._read_all.get_concrete_function()  # noqa: SLF001 - trace, read nothing
    return _COPIERS[checkpoint]


class _HostCheckpoint:
    """What a tf.train.CheckpointManager saves through, in place of the checkpoint: `_write`
    copies the state to host and hands the write to the writer thread, with the manager's
    callbacks (the state file, the rotation) to run once the write is verified."""

    def __init__(self, checkpoint, writer):
        self._checkpoint = checkpoint
        self._writer = writer

    @property
    def save_counter(self):
        return self._checkpoint.save_counter

    def _write(self, prefix, options=None):
        callbacks = list(options.experimental_write_callbacks or []) if options else []
        snapshot = host_copier(self._checkpoint).snapshot()
        self._writer._start(prefix, snapshot, callbacks)  # noqa: SLF001
        return prefix


class CheckpointWriter:
    """Saves `checkpoint` into `directory` (keeping `max_to_keep`), synchronously or, with
    `asynchronous=True`, beside training. `finish(directory)` runs after each write is
    complete and checked, its sums recorded (e.g. a sharded layout's layout file)."""

    def __init__(self, checkpoint, directory, max_to_keep, asynchronous, finish=None):
        self.directory = directory
        self.asynchronous = asynchronous
        self._finish = finish
        self._thread = None
        self._error = None
        self.write_seconds = 0.0  # background seconds of the last write (not the loop's)
        target = _HostCheckpoint(checkpoint, self) if asynchronous else checkpoint
        self._manager = tf.train.CheckpointManager(target, directory, max_to_keep=max_to_keep)
        if asynchronous:
            atexit.register(self.wait)

    def save(self, number):
        """Save checkpoint `number`; returns its prefix. Asynchronous: once the state is on
        host (after the previous write is done)."""
        self.wait()
        path = self._manager.save(checkpoint_number=number)
        if not self.asynchronous:
            self._complete(path)
        return path

    def wait(self):
        """Until the pending write (if any) is complete; raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _start(self, prefix, snapshot, callbacks):
        self._thread = threading.Thread(target=self._write, args=(prefix, snapshot, callbacks),
                                        name="tfbig-checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self, prefix, snapshot, callbacks):
        begin = time.monotonic()
        try:  # its own synchronous executor: the training thread's queue is not shared
            time.sleep(float(os.environ.get(WRITE_SLEEP_ENV, 0) or 0))
            with context.executor_scope(executor.new_executor(enable_async=False)):
                write_snapshot(snapshot, prefix)
            del snapshot
            integrity.record_checkpoint(prefix)  # its sums, from the files as written
            problems = integrity.structure_problems(prefix)  # the index and every data shard
            if problems:
                raise OSError(f"checkpoint {prefix} failed its check after the write: "
                              f"{'; '.join(problems)}; the previous checkpoint is kept")
            for callback in callbacks:  # the state file names it; the oldest is rotated out
                callback(prefix)
            self._complete(prefix, record=False)
        except Exception as error:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = error
        finally:
            self.write_seconds = time.monotonic() - begin

    def _complete(self, prefix, record=True):
        if record:
            integrity.record_checkpoint(prefix)  # sizes and CRC-32s, checked before a restore
        integrity.prune_sums(self.directory)
        if self._finish:
            self._finish(self.directory)
