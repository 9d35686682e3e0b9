"""A pipeline stage: a contiguous slice of the model's layers run on one device.

Why it is built this way: docs/design/notes/pipeline.md (tfbig.pipeline.stages).
"""
import keras
import tensorflow as tf

from tfbig.pipeline.devices import same_device


def _float_leaves(nest):
    return [t for t in tf.nest.flatten(nest) if t.dtype.is_floating]


def _computed(tensors):
    """A scalar read from one element of each of `tensors`: it exists once they all do.

    A control dependency on the output of a stage function call is not enough: once the call
    is inlined into the step, such an edge waits only for the function's stateful ops, not for
    the math that makes the output; a data edge waits for it."""
    return tf.add_n([tf.reduce_sum(tf.cast(tf.reshape(_dense_part(t), [-1])[:1], tf.float32))
                     for t in tensors])


def _dense_part(t):
    return t.values if isinstance(t, tf.IndexedSlices) else t  # an embedding's gradient


def _after(tensors, nest):
    """`nest` (identities), once `tensors` are computed."""
    with tf.control_dependencies([_computed(tensors)]):
        return tf.nest.map_structure(tf.identity, nest)


def _add(a, b):
    """Sum of two gradient parts of one variable (None: no part)."""
    if a is None or b is None:
        return b if a is None else a
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


class Stage:
    """Layers `layers` (PipeLayers) on `device`; see the module docstring."""

    def __init__(self, index, layers, device, task, is_first, is_last, checkpointing=False,
                 jit_compile=False):
        self.index = index
        self.layers = layers
        self.device = device
        self.task = task
        self.is_first = is_first
        self.is_last = is_last
        self.checkpointing = checkpointing
        unique = {id(v): v for layer in layers for v in layer.variables}
        self.own = [v for v in unique.values() if same_device(v.value.device, device)]
        self.shared = [v for v in unique.values() if not same_device(v.value.device, device)]
        self.variables = self.own + self.shared
        self.rng_state = list({id(v): v for layer in layers for v in layer.rng_state}.values())
        # The last stage's final layer runs with the loss (see the module docstring).
        self.head = layers[-1:] if is_last and len(layers) > 1 else []
        self.body = layers[:len(layers) - len(self.head)]
        # One function per stage (and the last stage's loss), traced once and called once per
        # micro-batch. Without XLA it is inlined into the step (function calls kept as calls do
        # not run concurrently).
        self._run = tf.function(self._call, jit_compile=jit_compile, autograph=False)
        self._run_loss = tf.function(self._call_loss, jit_compile=jit_compile, autograph=False)
        self._infer = tf.function(self._evaluate, jit_compile=jit_compile, autograph=False)
        self.peak_live = 0

    # ---- the computation (XLA-compiled with --xla) ------------------------------------------
    def _outputs(self, x, micro_batch, shared, rng, training, layers=None):
        """Output of `layers` (default: all the stage's) and the new seed states;
        `shared`/`rng` are the off-device values."""
        mapping = list(zip(self.shared, shared)) + list(zip(self.rng_state, rng))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            if self.is_first and layers is not self.head:
                x = self.task.model_inputs(micro_batch)
            for layer in self.layers if layers is None else layers:
                x = layer.call(x, training)
        return x, [scope.get_current_value(v) for v in self.rng_state]

    def _call(self, x, micro_batch, shared, rng):
        """(output of the stage's layers but the last stage's head, new seed states)."""
        return self._outputs(x, micro_batch, shared, rng, True, self.body)

    def _call_loss(self, x, micro_batch, shared, rng, loss_weight):
        """The last stage's head and loss: ((loss x loss_weight, loss, metrics), new seed
        states), loss_weight being the fp16 loss scale / M."""
        x, rng = self._outputs(x, micro_batch, shared, rng, True, self.head)
        loss, metrics = self.task.loss_from_outputs(x, micro_batch)
        return (loss * tf.cast(loss_weight, loss.dtype), loss, metrics), rng

    def _evaluate(self, x, micro_batch, shared, rng):
        """Inference output; the last stage's is (outputs, loss, metrics)."""
        x, _ = self._outputs(x, micro_batch, shared, rng, training=False)
        return (x, *self.task.loss_from_outputs(x, micro_batch)) if self.is_last else x

    def _read(self, variables):
        return [tf.identity(v.value) for v in variables]  # copied onto this stage's device

    def _loss_weight(self):
        """fp16 loss scale / M, read once per step outside the (maybe XLA) stage function:
        the loss-scale variable lives on another device. Loss scaling is linear."""
        if self._weight is None:
            one = tf.constant(1.0)
            self._weight = (tf.identity(self._scale_loss(one)) / self._num_microbatches
                            if self.is_last else one)
        return self._weight

    def _shared_values(self):
        """The off-device weights, read once per step: ops touching a variable run in program
        order inside a tf.function, so a read per micro-batch would serialise the stages."""
        if self._shared is None:
            self._shared = self._read(self.shared)
        return self._shared

    # ---- per step ---------------------------------------------------------------------------
    def begin_step(self, scale_loss, num_microbatches):
        """Forget the previous trace's state; called once at the start of every traced step."""
        self._scale_loss = scale_loss
        self._num_microbatches = num_microbatches
        self._stash = {}
        self._previous = []  # outputs of this stage's last op: the next op waits for them
        self._shared = self._weight = None
        self.gradient_sums = {}
        self.peak_live = 0

    def _after_previous(self, nest):
        """`nest` gated on this stage's previous op, so ops run in schedule order."""
        if not self._previous or nest is None:
            return nest
        return _after(self._previous, nest)

    def _taped_forward(self, x, micro_batch, rng):
        """(tapes, stage output, new seed states) of a forward recorded for the backward: one
        tape of the stage's layers, and on the last stage a second of its head and loss."""
        shared = self._shared_values()
        with tf.GradientTape() as tape:
            tape.watch(_float_leaves(x) + shared)
            out, rng = self._run(x, micro_batch, shared, rng)
        tapes = [(tape, x, out)]
        if self.is_last:
            with tf.GradientTape() as tape:
                tape.watch(_float_leaves(out) + shared)
                loss, rng = self._run_loss(out, micro_batch, shared, rng, self._loss_weight())
            tapes.append((tape, out, loss))
        return tapes, tapes[-1][2], rng

    def forward(self, microbatch, x, micro_batch):
        """Forward of micro-batch number `microbatch`; returns the output (or (loss, metrics))."""
        with tf.device(self.device):
            # Gate the micro-batch too: the first stage reads its inputs from it.
            x, micro_batch = self._after_previous((x, micro_batch))
            rng = self._read(self.rng_state)
            if self.checkpointing:
                shared = self._shared_values()
                out, new_rng = self._run(x, micro_batch, shared, rng)
                if self.is_last:
                    out, new_rng = self._run_loss(out, micro_batch, shared, new_rng,
                                                  self._loss_weight())
                self._stash[microbatch] = (x, micro_batch, rng)
            else:
                tapes, out, new_rng = self._taped_forward(x, micro_batch, rng)
                self._stash[microbatch] = tapes
            for v, value in zip(self.rng_state, new_rng):
                v.assign(value)
            self.peak_live = max(self.peak_live, len(self._stash))
            self._previous = tf.nest.flatten(out)
        return out[1:] if self.is_last else out

    def backward(self, microbatch, dy=None):
        """Backward of micro-batch `microbatch`. `dy`: d(loss)/d(float leaves of the output),
        None on the last stage; returns d(loss)/d(float leaves of the input) ([] on stage 0)."""
        with tf.device(self.device):
            if self.checkpointing:  # recompute, with the seed states the forward started from
                x, micro_batch, rng = self._stash.pop(microbatch)
                # in schedule order, not ahead of it
                x, micro_batch = self._after_previous((x, micro_batch))
                tapes, _, _ = self._taped_forward(x, micro_batch, rng)
            else:
                tapes = self._stash.pop(microbatch)
            if dy is None:  # the last stage seeds the backward: 1 = d(loss term)/d(itself)
                dy = [tf.ones_like(tapes[-1][2][0])]
            dy = self._after_previous(dy)  # the backward starts in schedule order
            shared = self._shared_values()
            grads = [None] * len(self.variables)
            for k, (tape, x, out) in enumerate(reversed(tapes)):
                if k:  # the stage's layers wait for the head's weight gradients
                    dy = _after([g for g in grads if g is not None] + dy, dy)
                inputs = _float_leaves(x)
                targets = [out[0]] if k == 0 and self.is_last else _float_leaves(out)
                parts = tape.gradient(targets, inputs + self.own + shared, output_gradients=dy)
                dy = [tf.zeros_like(t) if g is None else g for t, g in zip(inputs, parts)]
                grads = [_add(g, p) for g, p in zip(grads, parts[len(inputs):])]
            self._accumulate(grads)
            self._previous = dy + list(self.gradient_sums.values())
        return dy  # aligned with the float leaves of the previous stage's output

    def infer(self, x, micro_batch):
        """Inference forward (no stash, no dropout); the last stage: (outputs, loss, metrics)."""
        with tf.device(self.device):
            x, micro_batch = self._after_previous((x, micro_batch))
            out = self._infer(x, micro_batch, self._shared_values(), self._read(self.rng_state))
            self._previous = tf.nest.flatten(out)
        return out

    def _accumulate(self, grads):
        for v, g in zip(self.variables, grads):
            # Dense float32 sums: embedding gradients arrive as IndexedSlices.
            g = tf.zeros(v.shape, tf.float32) if g is None else tf.cast(tf.convert_to_tensor(g),
                                                                         tf.float32)
            key = id(v)
            self.gradient_sums[key] = g if key not in self.gradient_sums else (
                self.gradient_sums[key] + g)
