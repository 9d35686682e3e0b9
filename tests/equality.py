"""One rule for "these weights equal the single-device run's" after Adam steps.

Two runs of the same math (one device; ranks, stages or slices of it) add float32 numbers in
other orders, so their gradients differ by noise: the suite holds first-step gradients to
GRADIENT_ATOL + GRADIENT_RTOL * |g| (tests/pipeline/test_cross_rank.py compares them).
Adam turns that noise into weight differences in a way that can be bounded, entry by entry.

The argument. Adam (bias-corrected, as Keras' AdamW) moves a weight at update t by
lr_t * m_t / (sqrt(v_t) + eps), where m_t = sum_s a_ts g_s and v_t = sum_s b_ts g_s^2 are
weighted means of the gradients so far (a_ts = (1 - beta_1) beta_1^(t-s) / (1 - beta_1^t), b_ts
likewise with beta_2). Then:

1. |m_t| / sqrt(v_t) <= R_t = sqrt(sum_s a_ts^2 / b_ts) (Cauchy-Schwarz; R_t ~ 1 for the
   defaults), so one update moves an entry by at most R_t * lr_t, and two runs that disagree
   on it can end up to 2 * R_t * lr_t apart per update. That happens when the gradient is
   float32 noise: its sign is then a coin toss (Adam's first update is lr * sign(g)).
2. If each gradient g_s differs by at most A + rho * |g_s| (A = GRADIENT_ATOL, rho =
   GRADIENT_RTOL), m_t differs by at most A + rho * R_t * sqrt(v_t) and sqrt(v_t) by at most
   A + rho * sqrt(v_t) (a weighted L2 norm), so m_t / sqrt(v_t) differs by at most
   (1 + R_t) * A / sqrt(v_t) + 2 * R_t * rho; and sqrt(v_t) >= sqrt(b_ts) * |g_s| for the
   gradient g_s of any update s <= t. An entry with a gradient well above A at some update
   therefore moves the same in both runs from then on, up to a tiny amount; only while all
   its gradients so far are noise-level may it differ by ~lr per update.

So entry i may differ by atol + rtol * |w_i| (the float32 rounding of the weights) plus
    sum over updates t of lr_t * min(2 R_t, (1 + R_t) A / F_ti + 2 R_t rho),
    F_ti = max over recorded updates s <= t of sqrt(b_ts) * (|g_si| (1 - rho) - A)
with g_s the reference run's gradients (RecordedGradients keeps every update's; the first
alone is enough to start) and no bound but 2 R_t while F_ti <= 0. Entries
with a clear gradient keep a tight tolerance (~1.5e-6 at the tests' learning rates); a
noise-level entry may differ by up to 2 * lr per update; a wrong gradient on an entry whose
true gradient is not noise is caught (tests/test_equality_rule.py shows both). Adam's eps and
AdamW's decoupled weight decay only shrink these bounds. LAMB multiplies each update by a
per-variable trust ratio the argument does not bound, so under LAMB RecordedGradients compares
at the flat atol + rtol * |w| (as before this rule); float16 has larger gradient noise: its tests
keep their own tolerances.
"""
import numpy as np

GRADIENT_ATOL = 1e-7  # what tests/pipeline/test_cross_rank.py holds first-step gradients to
GRADIENT_RTOL = 1e-5


def adam_weights(t, beta):
    """[the weight of update s's gradient in Adam's bias-corrected moving mean at update t,
    for s = 1..t] (they sum to 1)."""
    steps = np.arange(1, t + 1)
    return (1 - beta) * beta ** (t - steps) / (1 - beta ** t)


def entry_tolerance(reference, gradients, learning_rates, first_update=1, beta_1=0.9,
                    beta_2=0.95, rtol=1e-5, atol=1e-6):
    """The largest difference the rule allows each entry of `reference`: a weight after the
    updates first_update, first_update + 1, ... with the given `learning_rates`; `gradients`:
    the reference's gradients of the first one or more of those updates."""
    assert len(gradients) <= len(learning_rates), (len(gradients), len(learning_rates))
    assert gradients or not learning_rates, "the rule needs the first update's gradients"
    clear = [np.maximum(np.abs(np.asarray(g, np.float64)) * (1 - GRADIENT_RTOL)
                        - GRADIENT_ATOL, 0.0) for g in gradients]
    allowed = atol + rtol * np.abs(np.asarray(reference, np.float64))
    for i, lr in enumerate(learning_rates):
        t = first_update + i
        a, b = adam_weights(t, beta_1), adam_weights(t, beta_2)
        r = np.sqrt(np.sum(a * a / b))
        # sqrt(v_t) >= sqrt(b_ts) |g_s| for every recorded update s <= t
        floor = np.max([np.sqrt(b[first_update - 1 + j]) * c
                        for j, c in enumerate(clear[:i + 1])], axis=0)
        with np.errstate(divide="ignore"):
            sensitive = np.where(floor > 0, (1 + r) * GRADIENT_ATOL / floor
                                 + 2 * r * GRADIENT_RTOL, np.inf)
        allowed = allowed + float(lr) * np.minimum(2 * r, sensitive)
    return allowed


def assert_weights_equal(ours, theirs, gradients, learning_rates, first_update=1, beta_1=0.9,
                         beta_2=0.95, rtol=1e-5, atol=1e-6, names=None, err_msg=""):
    """Assert each array of `ours` equals the reference's `theirs` after Adam updates, entry by
    entry under the rule above. `gradients[k]`: the reference's gradients of update
    first_update + k, one array per weight (at least the first update's); `learning_rates`:
    of every update compared."""
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    assert all(len(step) == len(theirs) for step in gradients)
    names = names or [f"weight {i}" for i in range(len(ours))]
    for k, (name, a, b) in enumerate(zip(names, ours, theirs)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        g = [step[k] for step in gradients]
        assert a.shape == b.shape == (np.shape(g[0]) if g else b.shape), \
            f"{err_msg} {name}: {a.shape} {b.shape}"
        allowed = entry_tolerance(b, g, learning_rates, first_update, beta_1, beta_2, rtol, atol)
        bad = np.abs(a - b) > allowed
        if bad.any():
            i = np.unravel_index(np.argmax(np.where(bad, np.abs(a - b) - allowed, -np.inf)),
                                 a.shape)
            grad = f"{g[0][i]:.3g}" if g else "not used: flat tolerance"
            raise AssertionError(
                f"{err_msg} {name}: {int(bad.sum())} of {a.size} entries differ by more than "
                f"the Adam noise rule allows (tests/equality.py); worst at {tuple(map(int, i))}: "
                f"{a[i]:.9g} vs {b[i]:.9g} ({abs(a[i] - b[i]):.3g} apart, allowed "
                f"{allowed[i]:.3g}, reference gradient {grad})")


# ---- the reference run's side: its gradients and learning rates ----------------------------
class RecordedGradients:
    """Records, without changing the run, the gradients of the first `updates` updates a Trainer
    applies from now on (create it before `fit`); `assert_equal` then compares other weights
    with the trainer's under the rule above."""

    def __init__(self, trainer, updates=32):
        import tensorflow as tf

        variables = trainer.model.trainable_variables
        self.start = int(trainer.optimizer.iterations.numpy())  # updates applied before
        # the first `updates` are enough: sqrt(v_t) >= sqrt(b_ts)|g_s| for any s <= t
        count = self._count = max(min(trainer.cfg.train.max_steps - self.start, updates), 1)
        # a ZeRO strategy applies this rank's slices (strategy.shards) of each weight's gradient
        held = getattr(trainer.strategy, "shards", None) or variables
        self._store = [tf.Variable(tf.zeros((count, *v.shape), tf.float32), trainable=False)
                       for v in held]
        self.paths = [v.path for v in variables]
        self.trainer = trainer
        apply = trainer.strategy.apply_gradients

        def recording(optimizer, grads, variables):
            index = tf.cast(optimizer.iterations, tf.int32) - self.start

            def keep():
                for store, g in zip(self._store, grads):
                    store[index].assign(tf.cast(tf.convert_to_tensor(g), tf.float32))
                return tf.constant(True)

            tf.cond(index < count, keep, lambda: tf.constant(False))
            return apply(optimizer, grads, variables)

        trainer.strategy.apply_gradients = recording  # traced by the first step of `fit`

    def gradients(self):
        """[[gradient of each weight] for each update applied since]."""
        done = int(self.trainer.optimizer.iterations.numpy()) - self.start
        assert done > 0, "no update was recorded: create RecordedGradients before fit"
        if getattr(self, "_read", (None,))[0] != done:
            steps = [[s[k].numpy() for s in self._store] for k in range(min(done, self._count))]
            assert any(np.any(g) for g in steps[0]), "the recorded gradients are all zero"
            self._read = (done, steps)
        return self._read[1]

    def learning_rates(self):
        """The learning rates of the updates applied since."""
        from tfbig.optim import learning_rate

        done = int(self.trainer.optimizer.iterations.numpy())
        if getattr(self, "_rates", (None,))[0] != done:
            self._rates = (done, [float(learning_rate(self.trainer.optimizer, s))
                                  for s in range(self.start, done)])
        return self._rates[1]

    def _rule(self):
        """(gradients, learning rates) for the rule; none under LAMB: the flat tolerance."""
        if self.trainer.cfg.train.optimizer != "adamw":
            return [], []
        return self.gradients(), self.learning_rates()

    def assert_equal(self, ours, rtol=1e-5, atol=1e-6, err_msg=""):
        """Assert `ours` equals the trainer's weights: arrays in trainable-variable order, or
        {variable path: array} for some of them (a stage's)."""
        keep = [self.paths.index(path) for path in ours] if isinstance(ours, dict) \
            else range(len(self.paths))
        ours = list(ours.values()) if isinstance(ours, dict) else ours
        theirs = [v.numpy() for v in self.trainer.model.trainable_variables]
        t = self.trainer.cfg.train
        gradients, rates = self._rule()
        assert_weights_equal(ours, [theirs[k] for k in keep],
                             [[step[k] for k in keep] for step in gradients], rates,
                             self.start + 1, t.beta_1, t.beta_2, rtol, atol,
                             [self.paths[k] for k in keep], err_msg)

    def assert_equal_piece(self, path, ours, piece=lambda full: full, rtol=1e-5, atol=1e-6,
                           err_msg=""):
        """Assert `ours` equals piece(the trainer's weight `path`): a rank's slice of it, say
        (the same piece of each recorded gradient bounds it)."""
        k = self.paths.index(path)
        t = self.trainer.cfg.train
        gradients, rates = self._rule()
        assert_weights_equal([ours], [piece(self.trainer.model.trainable_variables[k].numpy())],
                             [[piece(step[k])] for step in gradients], rates, self.start + 1,
                             t.beta_1, t.beta_2, rtol, atol, [path], err_msg)
