"""How pipeline stages on different Horovod ranks hand each other activations and gradients.

Why it is built this way: docs/design/notes/pipeline.md (tfbig.pipeline.transport).
"""
import keras
import tensorflow as tf

from tfbig.distribute.horovod_keras import hvd


def _to_wire(tensor):
    # Gloo has no bfloat16: its bits travel as int16, unchanged.
    return tf.bitcast(tensor, tf.int16) if tensor.dtype == tf.bfloat16 else tensor


def _wire_dtype(dtype):
    return tf.int16 if dtype == tf.bfloat16 else dtype


def runtime_zero(nest):
    """A float32 0 computed from the data in `nest` (a micro-batch): Grappler cannot fold it.

    Horovod's ops are not marked stateful, so Grappler would merge two receives with equal
    constant inputs into one, and constant-fold a collective of constants by running it while
    it optimises the graph, out of schedule order (a deadlock). tf.timestamp would do, but
    --deterministic refuses it. Every collective input that could be constant adds this."""
    leaf = tf.cast(tf.nest.flatten(nest)[0], tf.float32)
    return tf.cast(tf.reduce_min(tf.abs(leaf)) < -1.0, tf.float32)


def unfoldable(tensor, zero, index=1):
    """`tensor` + `zero` x `index` (a distinct `index` keeps equal tensors distinct)."""
    return tensor + tf.cast(zero * float(index), tensor.dtype)


def _float_specs(nest):
    return [s for s in tf.nest.flatten(nest) if s.dtype.is_floating]


def boundary_specs(layers, plan, task, micro_batch, head=None):
    """([spec nest of stage s's output for s < K-1], spec nest of the task's metrics) for one
    micro-batch like `micro_batch`, from a trace of the whole model that never runs; `head`
    (model outputs, batch) -> nest replaces the metrics (e.g. task.validation_outputs)."""
    head = head or (lambda x, batch: task.loss_from_outputs(x, batch)[1])
    variables = list({id(v): v for layer in layers for v in layer.variables + layer.rng_state}
                     .values())

    def forward(batch):
        mapping = [(v, tf.zeros(v.shape, v.dtype)) for v in variables]
        with keras.StatelessScope(state_mapping=mapping):
            x, outputs = task.model_inputs(batch), []
            for stage in plan:
                for layer in layers[stage.start:stage.stop]:
                    x = layer.call(x, True)
                outputs.append(x)
            metrics = head(x, batch)
        return outputs[:-1], metrics

    spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), micro_batch)
    traced = tf.function(forward, autograph=False).get_concrete_function(spec)
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype),
                                 traced.structured_outputs)


class StageLink:
    """This rank's exchanges with the ranks of the stages before and after it.

    Args:
      mesh: the HorovodMesh (its pipeline group gives the neighbours' global ranks).
      stage_index, num_stages: this rank's pipeline position and the pipeline's length.
      tag: a word in every collective's name, distinct per traced function (train, eval).
    """

    def __init__(self, mesh, stage_index, num_stages, tag):
        self.stage_index = stage_index
        self.tag = tag
        self.exchanged = []
        group = mesh.mesh.group("pipeline", mesh.rank)  # global ranks of stages 0..K-1
        self.ranks = group
        self.previous = self._pair(mesh, group, stage_index - 1) if stage_index > 0 else None
        self.next = (self._pair(mesh, group, stage_index)
                     if stage_index < num_stages - 1 else None)

    @staticmethod
    def _pair(mesh, group, boundary):
        """(process set, this rank's peer's position in it) of stages boundary, boundary+1."""
        a, b = group[boundary], group[boundary + 1]
        peer = b if mesh.rank == a else a
        return mesh.pair_process_set(a, b), sorted((a, b)).index(peer)

    def begin(self, zero):
        """Start a new trace: forget the sends of the previous one; `zero`: runtime_zero."""
        self.exchanged, self.zero, self._count = [], zero, 0

    def exchanges_done(self):
        """A float32 zero computed from every send and receive of this trace. Add it to an
        output: Grappler drops a Horovod op (not marked stateful) whose result nothing reads,
        and control dependencies on one. A send must feed the outputs with data, and so must
        a receive whose tensor the stage does not read (ALBERT's last stage receives the
        model inputs riding with the activation but reads its own copy of the batch): were it
        dropped, the matching send would wait for it forever."""
        return tf.add_n(self.exchanged) if self.exchanged else tf.constant(0.0)

    def _name(self, direction, boundary, microbatch, leaf):
        return f"pipeline.{self.tag}.{direction}.b{boundary}.m{microbatch}.{leaf}"

    def _send(self, pair, tensors, names):
        process_set, peer = pair
        for tensor, name in zip(tensors, names):
            tensor = tf.convert_to_tensor(tensor)
            if tensor.dtype.is_floating or tensor.dtype.is_integer:
                # a constant (a gradient of a loss term, which is coefficient x loss weight,
                # or a zero one) would be folded by Grappler, its send run out of order
                self._count += 1
                tensor = unfoldable(tensor, self.zero, self._count)
            # Horovod: all rows to the peer, none to this rank (a send on a two-rank set).
            row = tf.reshape(_to_wire(tensor), [1, -1])
            splits = tf.constant([0, 0], tf.int32) + tf.one_hot(peer, 2, dtype=tf.int32)
            sent, _ = hvd.alltoall(row, splits=splits, name=name, ignore_name_scope=True,
                                   process_set=process_set)
            self.exchanged.append(tf.cast(tf.size(sent), tf.float32))  # 0, known at run time

    def _receive(self, pair, specs, names):
        process_set, _ = pair
        out = []
        for spec, name in zip(specs, names):
            size = spec.shape.num_elements()
            self._count += 1  # each receive's input differs: no two are merged
            # rows = 0 known only at run time: an empty tensor of a known shape is made a
            # constant by Grappler, and the receive of a constant run while it optimises
            rows = tf.cast(self.zero, tf.int32)
            empty = unfoldable(tf.zeros(tf.stack([rows, size]), _wire_dtype(spec.dtype)),
                               self.zero, self._count)
            # Horovod: nothing sent; the peer's rows arrive (the matching send, by name).
            row, _ = hvd.alltoall(empty, splits=tf.constant([0, 0], tf.int32), name=name,
                                  ignore_name_scope=True, process_set=process_set)
            # a zero read from the received values: Grappler may know the size statically
            # (it is), fold it, and drop a receive whose tensor the stage does not read
            self.exchanged.append(runtime_zero(row))
            if spec.dtype == tf.bfloat16:
                row = tf.bitcast(row, tf.bfloat16)
            out.append(tf.reshape(row, spec.shape))
        return out

    def send_forward(self, microbatch, output):
        """This stage's output nest for `microbatch` to the next stage (every leaf)."""
        leaves = tf.nest.flatten(output)
        names = [self._name("activation", self.stage_index, microbatch, i)
                 for i in range(len(leaves))]
        self._send(self.next, leaves, names)

    def receive_forward(self, microbatch, spec):
        """The previous stage's output nest for `microbatch` (structure and shapes: `spec`)."""
        leaves = tf.nest.flatten(spec)
        names = [self._name("activation", self.stage_index - 1, microbatch, i)
                 for i in range(len(leaves))]
        return tf.nest.pack_sequence_as(spec, self._receive(self.previous, leaves, names))

    def send_backward(self, microbatch, grads):
        """d(loss)/d(float leaves of this stage's input) to the previous stage."""
        names = [self._name("gradient", self.stage_index - 1, microbatch, i)
                 for i in range(len(grads))]
        self._send(self.previous, grads, names)

    def receive_backward(self, microbatch, spec):
        """d(loss)/d(float leaves of this stage's output), `spec` being that output's."""
        floats = _float_specs(spec)
        names = [self._name("gradient", self.stage_index, microbatch, i)
                 for i in range(len(floats))]
        return self._receive(self.next, floats, names)
